//! The watchdog across ranks as threads: a rank whose connection drops without a goodbye is
//! reported by every other rank (rank 0 among them, and rank 0 itself by the others), at once,
//! not after the timeout; a rank that says goodbye is never reported; the callback runs once.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::joined;
use mt_dist::{Cause, Failure, WatchOptions};

/// Heartbeats often, a timeout far longer than any test waits: what is reported here is seen
/// by the connection closing, never by a timeout (the silent rank has its own test, in the crate).
const WATCH: WatchOptions =
    WatchOptions { interval: Duration::from_millis(50), timeout: Duration::from_secs(20) };
const REPORTED_WITHIN: Duration = Duration::from_secs(5);

#[test]
fn a_rank_dropped_mid_run_is_reported_by_every_other_rank() {
    let mut ranks = joined(4, WATCH);
    std::thread::sleep(Duration::from_millis(200)); // a few heartbeats: the job is running
    let t = Instant::now();
    drop(ranks.remove(2)); // no goodbye: as if the process were killed
    let dead = Failure { rank: 2, host: "host2".into(), cause: Cause::Exited };
    for j in &ranks {
        let rank = j.watchdog.rank();
        assert_eq!(j.watchdog.wait_for_failure(REPORTED_WITHIN), Some(dead.clone()), "rank {rank}");
        assert_eq!(
            j.watchdog.check().unwrap_err().to_string(),
            "rank 2 (host host2) exited or lost its connection without finishing; stopping this rank"
        );
    }
    assert!(t.elapsed() < REPORTED_WITHIN, "reported after {:?}", t.elapsed());
}

#[test]
fn rank_0_dropped_is_reported_by_the_others() {
    let mut ranks = joined(3, WATCH);
    drop(ranks.remove(0));
    for j in &ranks {
        let f = j.watchdog.wait_for_failure(REPORTED_WITHIN);
        assert_eq!(
            f,
            Some(Failure { rank: 0, host: "host0".into(), cause: Cause::Exited }),
            "rank {}",
            j.watchdog.rank()
        );
    }
}

#[test]
fn a_rank_that_says_goodbye_is_not_reported() {
    let mut ranks = joined(3, WATCH);
    ranks.remove(2).watchdog.goodbye();
    // Dropped without a goodbye, rank 2 is reported within milliseconds (the test above).
    std::thread::sleep(Duration::from_millis(500));
    for j in &ranks {
        assert_eq!(j.watchdog.failure(), None, "rank {}", j.watchdog.rank());
    }
    // Rank 0 finishing first is not reported either.
    let rank1 = ranks.pop().unwrap();
    ranks.pop().unwrap().watchdog.goodbye();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rank1.watchdog.failure(), None);
    rank1.watchdog.goodbye();
}

#[test]
fn the_callback_runs_once_with_the_first_failure_even_if_set_after_it() {
    let mut ranks = joined(3, WATCH);
    let (tx, rx) = mpsc::channel();
    let tx1 = tx.clone();
    ranks[0].watchdog.on_failure(move |f| tx.send((0, f.clone())).unwrap());
    drop(ranks.remove(1));
    let (rank, f) = rx.recv_timeout(REPORTED_WITHIN).expect("rank 0's callback");
    assert_eq!((rank, f.rank), (0, 1));
    // Rank 2 has learnt of it already (wait for that), then sets its callback: it runs at once.
    assert!(ranks[1].watchdog.wait_for_failure(REPORTED_WITHIN).is_some());
    ranks[1].watchdog.on_failure(move |f| tx1.send((2, f.clone())).unwrap());
    let (rank, f) = rx.recv_timeout(Duration::from_millis(100)).expect("rank 2's callback");
    assert_eq!((rank, f.rank, f.host.as_str()), (2, 1, "host1"));
    // Rank 2 goes next: rank 0 learns of it but its callback has run and does not run again.
    drop(ranks.pop());
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "a callback ran twice");
    assert_eq!(ranks[0].watchdog.failure().map(|f| f.rank), Some(1), "the first failure is kept");
}
