//! The launch environment as tables: torchrun's, Slurm's, the overrides, and every refusal,
//! each checked for the sentence it gives; Slurm's host lists and their first hosts.

use super::nodelist::first_host;
use super::*;

fn vars(pairs: &[(&str, &str)]) -> Vars {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

const TORCHRUN_RANK1: [(&str, &str); 6] = [
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "node0.cluster"),
    ("MASTER_PORT", "29400"),
];

const SLURM_RANK5: [(&str, &str); 5] = [
    ("SLURM_PROCID", "5"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_LOCALID", "1"),
    ("SLURM_STEP_NODELIST", "gpu[03-04,07],login1"),
    ("SLURM_NODELIST", "gpu[01-04,07],login1"),
];

#[test]
fn no_launcher_is_one_process() {
    let l = Launch::from_vars(&vars(&[("HOME", "/root"), ("SLURM_JOB_ID", "17")])).unwrap();
    assert_eq!(l, Launch::single());
    assert!(!l.is_distributed());
    assert_eq!(l.to_string(), "one process alone (no torchrun or Slurm variables)");
}

#[test]
fn torchrun_gives_every_field() {
    let l = Launch::from_vars(&vars(&TORCHRUN_RANK1)).unwrap();
    let master = Master {
        host: "node0.cluster".into(),
        port: 29400,
        host_from: "MASTER_ADDR",
        port_from: "MASTER_PORT",
    };
    assert_eq!(
        l,
        Launch {
            launcher: Launcher::Torchrun,
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: Some(4),
            master: Some(master)
        }
    );
    assert!(l.is_distributed());
    assert_eq!(
        l.to_string(),
        "torchrun: rank 5 of 8, local rank 1 of 4; rank 0 at node0.cluster:29400 (host from MASTER_ADDR, port from MASTER_PORT)"
    );
}

#[test]
fn torchrun_without_local_world_size_and_one_process_jobs() {
    let mut v = vars(&TORCHRUN_RANK1);
    v.remove("LOCAL_WORLD_SIZE");
    assert_eq!(Launch::from_vars(&v).unwrap().local_world_size, None);
    let one = vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ]);
    let l = Launch::from_vars(&one).unwrap();
    assert_eq!((l.launcher, l.world_size, l.is_distributed()), (Launcher::Torchrun, 1, false));
}

#[test]
fn torchrun_wins_over_slurm_when_srun_starts_torchrun() {
    let mut v = vars(&SLURM_RANK5);
    v.extend(vars(&TORCHRUN_RANK1));
    v.insert("SLURM_PROCID".into(), "1".into());
    let l = Launch::from_vars(&v).unwrap();
    assert_eq!((l.launcher, l.rank, l.world_size), (Launcher::Torchrun, 5, 8));
}

#[test]
fn slurm_takes_rank_0_from_the_steps_first_host_and_the_default_port() {
    let l = Launch::from_vars(&vars(&SLURM_RANK5)).unwrap();
    assert_eq!(
        (l.launcher, l.rank, l.world_size, l.local_rank, l.local_world_size),
        (Launcher::Slurm, 5, 8, 1, None)
    );
    let m = l.master.unwrap();
    assert_eq!(
        (m.host.as_str(), m.port, m.host_from, m.port_from),
        ("gpu03", DEFAULT_PORT, "SLURM_STEP_NODELIST", "the default")
    );
    // Without the step's list, the allocation's.
    let mut v = vars(&SLURM_RANK5);
    v.remove("SLURM_STEP_NODELIST");
    let m = Launch::from_vars(&v).unwrap().master.unwrap();
    assert_eq!((m.host.as_str(), m.host_from), ("gpu01", "SLURM_NODELIST"));
}

#[test]
fn master_addr_and_port_override_slurms_host_list_and_the_default() {
    let mut v = vars(&SLURM_RANK5);
    v.insert("MASTER_ADDR".into(), "10.0.0.9".into());
    v.insert("MASTER_PORT".into(), "12345".into());
    // An override makes the host list unused: even a broken one is not read.
    v.insert("SLURM_STEP_NODELIST".into(), "gpu[01".into());
    let m = Launch::from_vars(&v).unwrap().master.unwrap();
    assert_eq!(
        (m.host.as_str(), m.port, m.host_from, m.port_from),
        ("10.0.0.9", 12345, "MASTER_ADDR", "MASTER_PORT")
    );
    let mut v = vars(&SLURM_RANK5);
    v.insert("MASTER_PORT".into(), "2000".into());
    let m = Launch::from_vars(&v).unwrap().master.unwrap();
    assert_eq!((m.host.as_str(), m.port), ("gpu03", 2000));
}

#[test]
fn ipv6_master_is_bracketed() {
    let m = Master { host: "fe80::1".into(), port: 7, host_from: "MASTER_ADDR", port_from: "MASTER_PORT" };
    assert_eq!(m.addr(), "[fe80::1]:7");
}

/// `base` with each change made: a value set, or the variable removed (`None`).
fn changed(base: &[(&str, &str)], changes: &[(&str, Option<&str>)]) -> Vars {
    let mut v = vars(base);
    for (k, val) in changes {
        match val {
            Some(x) => v.insert(k.to_string(), x.to_string()),
            None => v.remove(*k),
        };
    }
    v
}

/// Each broken environment, with the sentence it must give.
#[test]
fn every_inconsistency_is_a_sentence_naming_the_variable() {
    let torchrun_with = |changes: &[(&str, Option<&str>)]| changed(&TORCHRUN_RANK1, changes);
    let slurm_with = |changes: &[(&str, Option<&str>)]| changed(&SLURM_RANK5, changes);
    let cases: Vec<(Vars, &str)> = vec![
        (
            torchrun_with(&[("LOCAL_RANK", None)]),
            "LOCAL_RANK is not set, but RANK=5, WORLD_SIZE=8, MASTER_ADDR=node0.cluster and MASTER_PORT=29400 are set: \
             torchrun sets all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
        ),
        (
            vars(&[("RANK", "1")]),
            "WORLD_SIZE is not set, but RANK=1 is set: torchrun sets all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
        ),
        (torchrun_with(&[("MASTER_PORT", None)]), "MASTER_PORT is not set, but RANK=5"),
        (torchrun_with(&[("MASTER_ADDR", None)]), "MASTER_ADDR is not set, but RANK=5"),
        (torchrun_with(&[("RANK", Some("8"))]), "RANK=8 is not below WORLD_SIZE=8"),
        (torchrun_with(&[("RANK", Some("one"))]), "RANK=\"one\" is not a whole number (0, 1, 2, ...)"),
        (torchrun_with(&[("RANK", Some("-1"))]), "RANK=\"-1\" is not a whole number"),
        (torchrun_with(&[("RANK", Some("+1"))]), "RANK=\"+1\" is not a whole number"),
        (torchrun_with(&[("RANK", Some(""))]), "RANK=\"\" is not a whole number"),
        (torchrun_with(&[("WORLD_SIZE", Some("0"))]), "WORLD_SIZE=\"0\" is not a count of processes, at least 1"),
        (torchrun_with(&[("LOCAL_RANK", Some("4"))]), "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
        (torchrun_with(&[("LOCAL_WORLD_SIZE", Some("9"))]), "LOCAL_WORLD_SIZE=9 is more than WORLD_SIZE=8"),
        (
            torchrun_with(&[("RANK", Some("1")), ("LOCAL_RANK", Some("3"))]),
            "LOCAL_RANK=3 is above RANK=1: a rank has at most RANK ranks before it on its host (are the two swapped?)",
        ),
        (torchrun_with(&[("MASTER_PORT", Some("70000"))]), "MASTER_PORT=\"70000\" is not a TCP port (1 to 65535)"),
        (torchrun_with(&[("MASTER_PORT", Some("0"))]), "MASTER_PORT=\"0\" is not a TCP port"),
        (torchrun_with(&[("MASTER_ADDR", Some(""))]), "MASTER_ADDR=\"\" is not a host name or address"),
        (torchrun_with(&[("MASTER_ADDR", Some("node 0"))]), "MASTER_ADDR=\"node 0\" is not a host name or address"),
        (
            vars(&[("MASTER_ADDR", "node0")]),
            "MASTER_ADDR=\"node0\" is set, but no rank is: set RANK, WORLD_SIZE and LOCAL_RANK too (torchrun sets them), \
             start every rank with srun, or unset MASTER_ADDR to run one process alone",
        ),
        (vars(&[("MASTER_PORT", "29500")]), "MASTER_PORT=\"29500\" is set, but no rank is"),
        (
            slurm_with(&[("SLURM_NTASKS", None)]),
            "SLURM_NTASKS is not set, but SLURM_PROCID=5 and SLURM_LOCALID=1 are set: srun sets all of SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID",
        ),
        (slurm_with(&[("SLURM_LOCALID", None)]), "SLURM_LOCALID is not set, but SLURM_PROCID=5 and SLURM_NTASKS=8 are set"),
        (slurm_with(&[("SLURM_PROCID", Some("8"))]), "SLURM_PROCID=8 is not below SLURM_NTASKS=8"),
        (slurm_with(&[("SLURM_NTASKS", Some("x"))]), "SLURM_NTASKS=\"x\" is not a whole number"),
        (slurm_with(&[("SLURM_LOCALID", Some("6"))]), "SLURM_LOCALID=6 is above SLURM_PROCID=5"),
        (
            slurm_with(&[("SLURM_STEP_NODELIST", None), ("SLURM_NODELIST", None)]),
            "SLURM_STEP_NODELIST is not set, but SLURM_PROCID=5, SLURM_NTASKS=8 and SLURM_LOCALID=1 are set: srun sets all of \
             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_STEP_NODELIST (or set MASTER_ADDR to rank 0's host)",
        ),
        (
            slurm_with(&[("SLURM_STEP_NODELIST", Some("gpu[01-04"))]),
            "SLURM_STEP_NODELIST=\"gpu[01-04\" is not a Slurm host list: a `[` is never closed",
        ),
        (
            slurm_with(&[("SLURM_STEP_NODELIST", None), ("SLURM_NODELIST", Some("gpu[04-01]"))]),
            "SLURM_NODELIST=\"gpu[04-01]\" is not a Slurm host list: `[04-01]` in `gpu[04-01]` holds the range `04-01`, which runs backwards",
        ),
        (slurm_with(&[("MASTER_PORT", Some("http"))]), "MASTER_PORT=\"http\" is not a TCP port"),
        (slurm_with(&[("MASTER_ADDR", Some("a\tb"))]), "MASTER_ADDR=\"a\\tb\" is not a host name or address"),
    ];
    for (v, want) in cases {
        match Launch::from_vars(&v) {
            Ok(l) => panic!("{v:?} was accepted as {l}; expected: {want}"),
            Err(e) => assert!(e.to_string().starts_with(want), "{v:?}\n  gave: {e}\n  want: {want}"),
        }
    }
}

#[test]
fn first_hosts_of_slurm_host_lists() {
    let cases = [
        ("gpu01", "gpu01"),
        ("gpu[01-04,07]", "gpu01"),
        ("gpu[07,01-04]", "gpu07"),
        ("a,b,c", "a"),
        ("gpu[003-010],cpu[1-2]", "gpu003"),
        ("rack[2-3]-node[01-04]", "rack2-node01"),
        ("node-[9-12]-ib", "node-9-ib"),
        ("login1,gpu[1-2]", "login1"),
        ("gpu[5]", "gpu5"),
    ];
    for (list, first) in cases {
        assert_eq!(first_host(list).as_deref(), Ok(first), "{list}");
    }
}

#[test]
fn broken_slurm_host_lists_are_refused_with_what_is_wrong() {
    let cases = [
        ("", "it is empty"),
        ("  ", "it is empty"),
        ("gpu[01-04", "a `[` is never closed"),
        ("gpu01]", "a `]` with no `[` before it at byte 5"),
        ("gpu[[01]]", "a `[` inside brackets at byte 4"),
        ("gpu[]", "`gpu[]` has an empty `[]`"),
        ("gpu[a-b]", "`[a-b]` in `gpu[a-b]` holds `a-b`, not a number or a range lo-hi"),
        ("gpu[1-]", "`[1-]` in `gpu[1-]` holds `1-`"),
        ("gpu[1,,2]", "`[1,,2]` in `gpu[1,,2]` holds ``"),
        ("gpu[9-1]", "holds the range `9-1`, which runs backwards"),
        ("a,,b", "it has an empty element"),
        ("a,", "it has an empty element"),
        // Every element is checked, not only the first.
        ("gpu01,gpu[2-1]", "holds the range `2-1`"),
        ("gpu 01", "host `gpu 01` holds the character ' '"),
    ];
    for (list, want) in cases {
        match first_host(list) {
            Ok(h) => panic!("{list:?} gave {h}; expected: {want}"),
            Err(e) => assert!(e.contains(want), "{list:?}\n  gave: {e}\n  want: {want}"),
        }
    }
}
