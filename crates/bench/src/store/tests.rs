//! Unit tests of `kvpool bench store`'s pure parts: the plan, the flags, value stamping, the
//! Redis CSV parser, aggregation and the report.

use super::plan::{Phase, plan};
use super::redis::parse_redis_csv;
use super::report::{PhaseResult, RedisFigures, aggregate, report};
use super::values::{stamp_into, template, verify};
use super::*;
use clap::Parser;

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: StoreBenchArgs,
}

fn args(extra: &[&str]) -> StoreBenchArgs {
    let mut v = vec!["x"];
    v.extend_from_slice(extra);
    Wrap::parse_from(v).args
}

/// 1 MiB values, 2 operations, 2 clients, `rounds` rounds.
fn two_clients(rounds: &str) -> StoreBenchArgs {
    args(&[
        "--sizes",
        "1MiB",
        "--ops",
        "2",
        "--clients",
        "2",
        "--rounds",
        rounds,
    ])
}

#[test]
fn plan_puts_gets_then_looks_up_the_first_size_and_removes_each() {
    let p = plan(&[10, 20], 1);
    assert_eq!(
        p,
        vec![
            Phase::Put(10),
            Phase::Get(10),
            Phase::Exists,
            Phase::Prefix,
            Phase::Remove(10),
            Phase::Put(20),
            Phase::Get(20),
            Phase::Remove(20),
        ]
    );
    assert_eq!(Phase::Put(65536).name(), "put:65536");
    assert!(plan(&[], 3).is_empty());
    let two = plan(&[10], 2);
    assert_eq!(two.len(), 8, "{two:?}");
    assert_eq!(
        two.iter().filter(|p| **p == Phase::Exists).count(),
        1,
        "lookups run once"
    );
}

#[test]
fn ops_follow_the_byte_budget_with_a_floor_of_depth() {
    let a = args(&[
        "--bytes-per-size",
        "64MiB",
        "--clients",
        "2",
        "--depth",
        "3",
    ]);
    assert_eq!(a.ops_for(1 << 20), 32);
    assert_eq!(a.ops_for(64 << 20), 3, "at least one op per task");
    let b = args(&["--ops", "5"]);
    assert_eq!(b.ops_for(1 << 20), 5);
    assert_eq!(a.sizes, vec![64 << 10, 1 << 20, 4 << 20]);
}

#[test]
fn bad_arguments_are_named() {
    let msg = |a: StoreBenchArgs| match a.validate() {
        Err(StoreBenchError::Args(m)) => m,
        other => panic!("expected an argument error, got {other:?}"),
    };
    assert!(msg(args(&["--replicas", "3", "--agents", "2"])).contains("--replicas"));
    assert!(msg(args(&["--clients", "0"])).contains("--clients"));
    assert!(msg(args(&["--batch", "0"])).contains("--batch"));
    // More than the agents hold.
    let m = msg(args(&[
        "--bytes-per-size",
        "4GiB",
        "--agent-capacity",
        "1GiB",
    ]));
    assert!(m.contains("--agent-capacity"), "{m}");
    assert!(args(&[]).validate().is_ok(), "defaults are valid");
}

#[test]
fn redis_csv_rows_are_parsed_and_the_header_skipped() {
    let out = "\"test\",\"rps\",\"avg_latency_ms\"\n\"SET\",\"1422.48\",\"2.053\"\n\
               \"GET\",\"1501.50\",\"1.500\"\n";
    assert_eq!(
        parse_redis_csv(out),
        vec![("SET".to_owned(), 1422.48), ("GET".to_owned(), 1501.5)]
    );
    // Redis 6 style rows without a header.
    assert_eq!(
        parse_redis_csv("\"SET\",\"10.5\"\n"),
        vec![("SET".to_owned(), 10.5)]
    );
    assert!(parse_redis_csv("garbage\n\"SET\",\"x\"\n").is_empty());
}

#[test]
fn values_verify_only_against_their_own_stamp_and_template() {
    let t = template(100, 7);
    assert_ne!(t, template(100, 8));
    let mut v = t.clone();
    stamp_into(&mut v, 3, 42);
    assert!(verify(&v, &t, 3, 42));
    assert!(!verify(&v, &t, 3, 43), "another object's stamp");
    assert!(!verify(&v, &t, 2, 42), "another worker's stamp");
    let mut bad = v.clone();
    bad[99] ^= 1;
    assert!(!verify(&bad, &t, 3, 42), "a flipped byte past the stamp");
    assert!(!verify(&v[..99], &t, 3, 42), "a short read");
    // Values shorter than the stamp still verify.
    let t4 = template(4, 1);
    let mut v4 = t4.clone();
    stamp_into(&mut v4, 1, 2);
    assert!(verify(&v4, &t4, 1, 2));
}

#[test]
fn aggregate_sums_workers_and_merges_latencies() {
    let a = PhaseResult {
        ops: 10,
        bytes: 10_000,
        latency_us: vec![(100, 9), (1000, 1)],
        ..PhaseResult::default()
    };
    let b = PhaseResult {
        ops: 10,
        bytes: 10_000,
        failures: 1,
        first_error: Some("boom".into()),
        latency_us: vec![(100, 10)],
        ..PhaseResult::default()
    };
    let f = aggregate(&[a, b], 2.0);
    assert_eq!(f.ops, 20);
    assert_eq!(f.failures, 1);
    assert!((f.ops_per_second - 10.0).abs() < 1e-9);
    assert!((f.gb_per_second - 10_000.0 / 1e9).abs() < 1e-15);
    assert_eq!(f.first_error.as_deref(), Some("boom"));
    assert!((100..=101).contains(&f.p50_us), "p50 {}", f.p50_us);
    assert!(f.p99_us >= 999, "p99 {}", f.p99_us);
    // Time a lone worker spent checking bytes is not phase time (the longest worker's counts).
    let checked = |check_us| PhaseResult {
        ops: 10,
        check_us,
        ..PhaseResult::default()
    };
    let f = aggregate(&[checked(500_000), checked(1_000_000)], 2.0);
    assert!((f.seconds - 1.0).abs() < 1e-9, "{}", f.seconds);
    assert!((f.ops_per_second - 20.0).abs() < 1e-9);
}

#[test]
fn report_counts_verified_gets_and_computes_the_redis_ratio() {
    let a = two_clients("1");
    let ok = |verified| PhaseResult {
        ops: 2,
        bytes: 2 << 20,
        verified,
        ..PhaseResult::default()
    };
    let phases = vec![
        (Phase::Put(1 << 20), vec![ok(0), ok(0)], 1.0),
        (Phase::Get(1 << 20), vec![ok(2), ok(2)], 0.5),
        (Phase::Exists, vec![ok(0)], 1.0),
        (Phase::Prefix, vec![ok(0)], 2.0),
    ];
    let redis = RedisFigures {
        value_bytes: 1 << 20,
        connections: 4,
        requests: 10,
        set_ops_per_second: 2.0,
        get_ops_per_second: 4.0,
        set_gb_per_second: 0.0,
        get_gb_per_second: 0.0,
    };
    let r = report(&a, &phases, Some(redis));
    assert!(r.all_gets_verified);
    let q = r.ratio_1mib.expect("ratio");
    assert!((q.put_over_set - 2.0).abs() < 1e-9);
    assert!((q.get_over_get - 2.0).abs() < 1e-9);
    let l = r.lookups.expect("lookups");
    assert!((l.exists_key_lookups_per_second - 200.0).abs() < 1e-9);
    assert!((l.prefix_key_lookups_per_second - 100.0).abs() < 1e-9);
    // Two rounds: the figures cover both, and both must be verified.
    let a2 = two_clients("2");
    let mut twice = phases.clone();
    twice.push((Phase::Put(1 << 20), vec![ok(0), ok(0)], 1.0));
    twice.push((Phase::Get(1 << 20), vec![ok(2), ok(2)], 0.5));
    let r2 = report(&a2, &twice, None);
    assert!(r2.all_gets_verified);
    assert_eq!(r2.values[0].put.ops, 8);
    assert!((r2.values[0].put.ops_per_second - 4.0).abs() < 1e-9);
    assert!(
        !report(&a2, &phases, None).all_gets_verified,
        "a missing round"
    );
    // One get fewer verified: the run is not fully verified.
    let mut short = phases.clone();
    short[1].1[1].verified = 1;
    assert!(!report(&a, &short, None).all_gets_verified);
}
