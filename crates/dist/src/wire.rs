//! The rendezvous's and the watchdog's messages on the wire: each a frame of a little-endian
//! `u32` length and a body whose first byte says what it is. A hello's first 16 bytes (magic,
//! protocol version, rank) never change, so a rank of another version is named and refused
//! rather than misread. Nothing here is a data path: the collectives are NCCL's.

use std::io::{self, Read, Write};

use crate::watchdog::{Cause, Failure};

/// What a hello starts with: a stranger on the port is told apart from a rank.
const MAGIC: [u8; 8] = *b"mtdist\0\x01";
/// The protocol's version; a hello of another is refused.
pub(crate) const VERSION: u32 = 1;
/// The largest frame read: a rendezvous ships a few hundred bytes; a length beyond this is a
/// stranger (an HTTP request's first bytes read as a length are ~1 GB) or a broken peer.
const MAX_FRAME: usize = 1 << 20;

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSED: u8 = 3;
const HEARTBEAT: u8 = 4;
const GOODBYE: u8 = 5;
const DEAD: u8 = 6;

/// A rank's hello to rank 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) fingerprint: String,
    pub(crate) host: String,
}

/// One message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    /// A rank joins (rank to rank 0).
    Hello(Hello),
    /// Every rank has joined: rank 0's blob and every rank's host, by rank (rank 0 to each).
    Welcome { blob: Vec<u8>, hosts: Vec<String> },
    /// The job was refused, and why (rank 0 to each).
    Refused { reason: String },
    /// Still here (both ways).
    Heartbeat,
    /// Finished normally: not to be reported dead (both ways).
    Goodbye,
    /// A rank was declared dead (rank 0 to each).
    Dead(Failure),
}

/// Why a message could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection failed, closed or timed out.
    Io(io::Error),
    /// The bytes are not this protocol (a phrase saying how).
    Garbled(String),
    /// A hello of another protocol version, from the rank it names.
    Version { rank: u32, version: u32 },
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl ReadError {
    /// Whether the read timed out (a read timeout shows as either kind, by platform).
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, ReadError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                f.write_str("the connection was closed")
            }
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Garbled(what) => write!(f, "not megatrain's rendezvous protocol: {what}"),
            ReadError::Version { rank, version } => {
                write!(f, "rank {rank} speaks rendezvous protocol {version}, this build {VERSION}")
            }
        }
    }
}

/// Writes one message as one frame, in one write.
pub(crate) fn write_msg(w: &mut impl Write, msg: &Msg) -> io::Result<()> {
    let mut body = Vec::with_capacity(64);
    match msg {
        Msg::Hello(h) => {
            body.push(HELLO);
            body.extend_from_slice(&MAGIC);
            put_u32(&mut body, VERSION);
            put_u32(&mut body, h.rank);
            put_u32(&mut body, h.world_size);
            put_bytes(&mut body, h.fingerprint.as_bytes());
            put_bytes(&mut body, h.host.as_bytes());
        }
        Msg::Welcome { blob, hosts } => {
            body.push(WELCOME);
            put_bytes(&mut body, blob);
            put_u32(&mut body, hosts.len() as u32);
            for h in hosts {
                put_bytes(&mut body, h.as_bytes());
            }
        }
        Msg::Refused { reason } => {
            body.push(REFUSED);
            put_bytes(&mut body, reason.as_bytes());
        }
        Msg::Heartbeat => body.push(HEARTBEAT),
        Msg::Goodbye => body.push(GOODBYE),
        Msg::Dead(f) => {
            body.push(DEAD);
            put_u32(&mut body, f.rank as u32);
            put_bytes(&mut body, f.host.as_bytes());
            match f.cause {
                Cause::Exited => body.push(0),
                Cause::Silent { after_ms } => {
                    body.push(1);
                    body.extend_from_slice(&after_ms.to_le_bytes());
                }
            }
        }
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    put_u32(&mut frame, body.len() as u32);
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one message.
pub(crate) fn read_msg(r: &mut impl Read) -> Result<Msg, ReadError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(ReadError::Garbled(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    let mut b = Body { bytes: &body[1..] };
    let msg = match body[0] {
        HELLO => {
            if b.take(MAGIC.len())? != MAGIC {
                return Err(ReadError::Garbled("a hello without megatrain's magic bytes".into()));
            }
            let version = b.u32()?;
            let rank = b.u32()?;
            if version != VERSION {
                return Err(ReadError::Version { rank, version });
            }
            Msg::Hello(Hello { rank, world_size: b.u32()?, fingerprint: b.string()?, host: b.string()? })
        }
        WELCOME => {
            let blob = b.bytes()?.to_vec();
            let n = b.u32()? as usize;
            let hosts = (0..n).map(|_| b.string()).collect::<Result<_, _>>()?;
            Msg::Welcome { blob, hosts }
        }
        REFUSED => Msg::Refused { reason: b.string()? },
        HEARTBEAT => Msg::Heartbeat,
        GOODBYE => Msg::Goodbye,
        DEAD => {
            let rank = b.u32()? as usize;
            let host = b.string()?;
            let cause = match b.take(1)?[0] {
                0 => Cause::Exited,
                1 => Cause::Silent { after_ms: u64::from_le_bytes(b.take(8)?.try_into().expect("8 bytes")) },
                c => return Err(ReadError::Garbled(format!("a failure of unknown cause {c}"))),
            };
            Msg::Dead(Failure { rank, host, cause })
        }
        t => return Err(ReadError::Garbled(format!("a message of unknown type {t}"))),
    };
    if !b.bytes.is_empty() {
        return Err(ReadError::Garbled(format!("{} bytes after a message's end", b.bytes.len())));
    }
    Ok(msg)
}

fn put_u32(out: &mut Vec<u8>, x: u32) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u32(out, bytes.len() as u32);
    out.extend_from_slice(bytes);
}

/// The unread rest of a frame's body.
struct Body<'a> {
    bytes: &'a [u8],
}

impl<'a> Body<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        if n > self.bytes.len() {
            return Err(ReadError::Garbled(format!(
                "a message cut short ({n} bytes wanted, {} left)",
                self.bytes.len()
            )));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, ReadError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn bytes(&mut self) -> Result<&'a [u8], ReadError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, ReadError> {
        let bytes = self.bytes()?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ReadError::Garbled("a string that is not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(msg: Msg) {
        let mut buf = Vec::new();
        write_msg(&mut buf, &msg).unwrap();
        assert_eq!(read_msg(&mut buf.as_slice()).unwrap(), msg);
    }

    #[test]
    fn every_message_round_trips() {
        round_trip(Msg::Hello(Hello {
            rank: 3,
            world_size: 8,
            fingerprint: "megatrain 0.1.0 abc".into(),
            host: "gpu07".into(),
        }));
        round_trip(Msg::Welcome { blob: (0..128).collect(), hosts: vec!["a".into(), "bé".into()] });
        round_trip(Msg::Welcome { blob: vec![], hosts: vec![] });
        round_trip(Msg::Refused { reason: "rank 2 runs another job".into() });
        round_trip(Msg::Heartbeat);
        round_trip(Msg::Goodbye);
        round_trip(Msg::Dead(Failure { rank: 5, host: "h".into(), cause: Cause::Exited }));
        round_trip(Msg::Dead(Failure {
            rank: 5,
            host: "h".into(),
            cause: Cause::Silent { after_ms: 30_000 },
        }));
    }

    fn read(bytes: &[u8]) -> String {
        match read_msg(&mut &bytes[..]) {
            Ok(m) => panic!("{bytes:?} read as {m:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn strangers_and_broken_frames_are_refused_not_misread() {
        assert_eq!(
            read(b"GET / HTTP/1.1\r\n"),
            "not megatrain's rendezvous protocol: a frame of 542393671 bytes"
        );
        assert_eq!(read(&[0, 0, 0, 0]), "not megatrain's rendezvous protocol: a frame of 0 bytes");
        assert_eq!(
            read(&[1, 0, 0, 0, 9]),
            "not megatrain's rendezvous protocol: a message of unknown type 9"
        );
        assert_eq!(
            read(&[2, 0, 0, 0, 4, 0]),
            "not megatrain's rendezvous protocol: 1 bytes after a message's end"
        );
        assert_eq!(
            read(&[3, 0, 0, 0, 2, 1, 0]),
            "not megatrain's rendezvous protocol: a message cut short (4 bytes wanted, 2 left)"
        );
        assert_eq!(read(&[2, 0, 0, 0, 1]), "the connection was closed");
        let mut hello = Vec::new();
        write_msg(
            &mut hello,
            &Msg::Hello(Hello { rank: 1, world_size: 2, fingerprint: String::new(), host: String::new() }),
        )
        .unwrap();
        let mut foreign = hello.clone();
        foreign[5] ^= 0xff;
        assert_eq!(
            read(&foreign),
            "not megatrain's rendezvous protocol: a hello without megatrain's magic bytes"
        );
        // A later version's hello: its rank is still read, and named.
        let mut later = hello.clone();
        later[13] = 2;
        assert_eq!(read(&later), format!("rank 1 speaks rendezvous protocol 2, this build {VERSION}"));
    }
}
