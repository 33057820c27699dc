//! The rendezvous against hand-made peers that speak the wire format directly: a stranger on the
//! port is dropped and the job still starts; a rank of another protocol version is refused,
//! named, and told why.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use super::*;

/// Rank `rank`'s spec in a job of `world_size` (fingerprint `job`, host `host{rank}`), for the
/// crate's tests against hand-made peers.
pub(crate) fn spec_with(rank: usize, world_size: usize, watch: WatchOptions) -> JobSpec {
    JobSpec {
        rank,
        world_size,
        fingerprint: "job".into(),
        host: format!("host{rank}"),
        timeout: Duration::from_secs(10),
        watch,
    }
}

fn spec(rank: usize, world_size: usize) -> JobSpec {
    spec_with(
        rank,
        world_size,
        WatchOptions { interval: Duration::from_millis(50), timeout: Duration::from_secs(10) },
    )
}

#[test]
fn a_stranger_on_the_port_is_dropped_and_the_job_still_starts() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rank0 = std::thread::spawn(move || serve(listener, &spec(0, 2), vec![1, 2, 3]));
    let mut stranger = TcpStream::connect(&addr).unwrap();
    stranger.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let silent = TcpStream::connect(&addr).unwrap(); // connects and says nothing at all
    drop(silent);
    let rank1 = join(&addr, &spec(1, 2)).unwrap();
    let rank0 = rank0.join().unwrap().unwrap();
    assert_eq!((rank1.blob, rank0.hosts), (vec![1, 2, 3], vec!["host0".to_string(), "host1".into()]));
    rank1.watchdog.goodbye();
    rank0.watchdog.goodbye();
}

#[test]
fn a_rank_of_another_protocol_version_is_refused_naming_it() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rank0 = std::thread::spawn(move || serve(listener, &spec(0, 2), Vec::new()));
    let mut hello = Vec::new();
    let h = Hello { rank: 1, world_size: 2, fingerprint: "job".into(), host: "host1".into() };
    write_msg(&mut hello, &Msg::Hello(h)).unwrap();
    hello[13] = VERSION as u8 + 1; // the version's low byte, after length, type and magic
    let mut later = TcpStream::connect(&addr).unwrap();
    later.write_all(&hello).unwrap();
    let e = rank0.join().unwrap().unwrap_err().to_string();
    let sentence = format!(
        "rank 1 (host 127.0.0.1) speaks rendezvous protocol {}, but rank 0 speaks {VERSION}: every rank must run \
         the same build with the same configuration",
        VERSION + 1
    );
    assert_eq!(e, sentence);
    assert_eq!(read_msg(&mut later).unwrap(), Msg::Refused { reason: sentence });
}
