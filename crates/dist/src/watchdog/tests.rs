//! The watchdog against peers that stop talking without closing their connection (a hung
//! process, a host gone from the network): a hand-made peer that joins and then says nothing.
//! A silent rank is declared after the timeout, not before, and relayed to the others; a
//! silent rank 0 is declared by the others.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;
use crate::rendezvous::tests::spec_with as spec;
use crate::rendezvous::{join, serve};
use crate::wire::Hello;

const SHORT: WatchOptions =
    WatchOptions { interval: Duration::from_millis(50), timeout: Duration::from_millis(400) };
const LONG: WatchOptions =
    WatchOptions { interval: Duration::from_millis(50), timeout: Duration::from_secs(20) };

/// Joins `addr` as `rank` by hand and returns the connection, which then says nothing.
fn silent_rank(addr: &str, rank: u32, world_size: u32) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let hello = Hello { rank, world_size, fingerprint: "job".into(), host: "hung".into() };
    write_msg(&mut s, &Msg::Hello(hello)).unwrap();
    s
}

#[test]
fn a_silent_rank_is_declared_after_the_timeout_and_every_rank_told() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rank0 = std::thread::spawn(move || serve(listener, &spec(0, 3, SHORT), Vec::new()));
    let a = addr.clone();
    let rank1 = std::thread::spawn(move || join(&a, &spec(1, 3, LONG)));
    let mut hung = silent_rank(&addr, 2, 3);
    let (rank0, rank1) = (rank0.join().unwrap().unwrap(), rank1.join().unwrap().unwrap());
    assert!(matches!(read_msg(&mut hung), Ok(Msg::Welcome { .. })));
    let t = Instant::now();
    let dead = Failure { rank: 2, host: "hung".into(), cause: Cause::Silent { after_ms: 400 } };
    for j in [&rank0, &rank1] {
        assert_eq!(
            j.watchdog.wait_for_failure(Duration::from_secs(5)),
            Some(dead.clone()),
            "rank {}",
            j.watchdog.rank()
        );
    }
    // Heartbeats alone do not keep a rank alive: only its own.
    assert!(t.elapsed() >= Duration::from_millis(300), "declared after {:?}", t.elapsed());
    assert_eq!(dead.to_string(), "rank 2 (host hung) stopped responding: no heartbeat for 0.4 s");
    // Rank 0 gave the hung rank up: it closed the connection after the heartbeats it had sent.
    let closed = loop {
        match read_msg(&mut hung) {
            Ok(Msg::Heartbeat) => continue,
            other => break other,
        }
    };
    assert!(closed.is_err(), "{closed:?}");
}

#[test]
fn a_silent_rank_0_is_declared_by_the_others() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rank1 = std::thread::spawn(move || join(&addr, &spec(1, 2, SHORT)));
    let (mut hung0, _) = listener.accept().unwrap();
    assert!(matches!(read_msg(&mut hung0), Ok(Msg::Hello(_))));
    write_msg(&mut hung0, &Msg::Welcome { blob: vec![], hosts: vec!["hung0".into(), "host1".into()] })
        .unwrap();
    let rank1 = rank1.join().unwrap().unwrap();
    let f = rank1.watchdog.wait_for_failure(Duration::from_secs(5));
    assert_eq!(f, Some(Failure { rank: 0, host: "hung0".into(), cause: Cause::Silent { after_ms: 400 } }));
}
