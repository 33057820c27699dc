//! The rendezvous of 1, 2 and 4 ranks as threads on 127.0.0.1; every refusal (another job's
//! fingerprint, another world size, a rank claimed twice) and every timeout (a rank that never
//! comes, a rank 0 that never listens) as the sentence each rank gets.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::{blob, job, spec};
use mt_dist::{join, rendezvous, DistError, JobSpec, Launch};

#[test]
fn one_two_and_four_ranks_join_and_each_gets_rank_0s_blob_and_every_host() {
    for world in [1, 2, 4] {
        let joined = job((0..world).map(|r| spec(r, world)).collect());
        assert_eq!(joined.len(), world);
        let hosts: Vec<String> = (0..world).map(|r| format!("host{r}")).collect();
        for (rank, j) in joined.into_iter().enumerate() {
            let j = j.unwrap_or_else(|e| panic!("world {world}, rank {rank}: {e}"));
            assert_eq!(j.blob, blob(), "world {world}, rank {rank}");
            assert_eq!(j.hosts, hosts, "world {world}, rank {rank}");
            assert_eq!(j.watchdog.rank(), rank);
            assert_eq!(j.watchdog.failure(), None);
            j.watchdog.goodbye();
        }
    }
}

#[test]
fn a_process_alone_needs_no_rendezvous() {
    let launch = Launch::single();
    let spec = JobSpec::new(&launch, "job");
    let j = rendezvous(&launch, &spec, || vec![7; 3]).unwrap();
    assert_eq!((j.blob, j.hosts.len()), (vec![7; 3], 1));
    assert!(j.watchdog.check().is_ok());
}

#[test]
fn a_rank_started_before_rank_0_retries_until_it_listens() {
    // A port that was free a moment ago; rank 0 takes it only after rank 1 has started trying.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rank1 = std::thread::spawn(move || join(&format!("127.0.0.1:{port}"), &spec(1, 2)));
    std::thread::sleep(Duration::from_millis(400));
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let rank0 = mt_dist::serve(listener, &spec(0, 2), blob()).unwrap();
    let rank1 = rank1.join().unwrap().unwrap();
    assert_eq!(rank1.blob, blob());
    rank1.watchdog.goodbye();
    rank0.watchdog.goodbye();
}

/// Runs a job of three whose rank 2 has `spec2`, and returns rank 0's and rank 2's errors.
fn refused(spec2: JobSpec) -> (String, String) {
    let short = |s: JobSpec| JobSpec { timeout: Duration::from_secs(2), ..s };
    let mut out = job(vec![short(spec(0, 3)), short(spec(1, 3)), short(spec2)]).into_iter();
    let rank0 = out.next().unwrap().expect_err("rank 0 must refuse the job").to_string();
    // Rank 1 fails too: told of the refusal if it had joined, unable to reach rank 0 if not.
    assert!(out.next().unwrap().is_err(), "rank 1 must not start a refused job");
    let rank2 = out.next().unwrap().expect_err("rank 2 must be refused").to_string();
    (rank0, rank2)
}

#[test]
fn a_rank_of_another_job_is_refused_naming_it_and_both_fingerprints() {
    let other = JobSpec { fingerprint: "megatrain other job".into(), ..spec(2, 3) };
    let (rank0, rank2) = refused(other);
    let sentence =
        "rank 2 (host host2) runs job \"megatrain other job\", but rank 0 runs \"megatrain test job\": \
                    every rank must run the same build with the same configuration";
    assert_eq!(rank0, sentence);
    assert!(
        rank2.starts_with("rank 0 at 127.0.0.1:") && rank2.ends_with(&format!("refused the job: {sentence}")),
        "{rank2}"
    );
}

#[test]
fn a_rank_of_another_world_size_or_a_rank_claimed_twice_is_refused() {
    let (rank0, _) = refused(JobSpec { world_size: 4, ..spec(2, 4) });
    assert_eq!(
        rank0,
        "rank 2 (host host2) says the job has 4 ranks, but rank 0 says 3: every rank must run the same build with the same configuration"
    );
    let (rank0, _) = refused(JobSpec { host: "host9".into(), ..spec(0, 3) });
    assert_eq!(rank0, "two processes claim rank 0 (hosts host0 and host9): each process needs its own rank");
}

#[test]
fn a_rank_that_never_comes_times_out_rank_0_naming_it() {
    let short = |s: JobSpec| JobSpec { timeout: Duration::from_millis(600), ..s };
    let t = Instant::now();
    let mut out = job(vec![short(spec(0, 4)), short(spec(1, 4)), short(spec(3, 4))]).into_iter();
    let rank0 = out.next().unwrap().unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert!(rank0.starts_with("rank 0 waited 0.6 s at 127.0.0.1:"), "{rank0}");
    assert!(
        rank0.ends_with(
            "for rank(s) 2 of a job of 4 (joined: 0, 1, 3): start every rank, with the same world size and MASTER_ADDR/MASTER_PORT"
        ),
        "{rank0}"
    );
    // The ranks that came are not left waiting: rank 0 closed their connections.
    for r in out {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("waiting for the job's start from rank 0 at 127.0.0.1:"), "{e}");
    }
}

#[test]
fn a_rank_that_cannot_reach_rank_0_times_out_naming_the_address() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let s = JobSpec { timeout: Duration::from_millis(500), ..spec(3, 4) };
    let t = Instant::now();
    let e = join(&format!("127.0.0.1:{port}"), &s).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    assert!(matches!(e, DistError::Unreachable { rank: 3, .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.starts_with(&format!("rank 3 could not reach rank 0 at 127.0.0.1:{port} within 0.5 s (last: ")),
        "{e}"
    );
    assert!(
        e.ends_with("is rank 0 running, and are MASTER_ADDR and MASTER_PORT the same for every rank?"),
        "{e}"
    );
}

#[test]
fn rank_0_says_why_it_cannot_listen() {
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let vars = [("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")];
    let mut vars: std::collections::BTreeMap<String, String> =
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    vars.insert("MASTER_PORT".into(), port.to_string());
    let launch = Launch::from_vars(&vars).unwrap();
    let e = rendezvous(&launch, &spec(0, 2), Vec::new).unwrap_err().to_string();
    assert!(e.starts_with(&format!("rank 0 could not listen on 0.0.0.0:{port}: ")), "{e}");
    assert!(e.ends_with("(is another job using the port? set MASTER_PORT to a free one)"), "{e}");
}
