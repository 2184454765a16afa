//! Simulator tests on real Mooncake trace data: committed excerpts, the full conversation trace
//! when it sits beside the repository, and the `kvpool simulate` binary as a child process.

mod skip_support;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvpool::simulate::{SimulateArgs, sim_config};
use kvpool_core::sched::{Policy, Rejection};
use kvpool_core::sim::{SimConfig, TraceRecord, simulate, trace};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// The simulator's defaults, as `kvpool simulate` builds them, plus `extra` flags.
fn cli_config(extra: &[&str]) -> SimConfig {
    use clap::Parser;
    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: SimulateArgs,
    }
    let mut argv = vec!["t", "--trace", "unused"];
    argv.extend_from_slice(extra);
    let args = T::try_parse_from(argv).expect("flags parse");
    sim_config(&args.a).expect("flags validate")
}

fn seen_before_ratio(records: &[TraceRecord]) -> f64 {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for r in records {
        for id in &r.hash_ids {
            total += 1;
            hits += u64::from(seen.contains(id));
        }
        seen.extend(r.hash_ids.iter().copied());
    }
    hits as f64 / total as f64
}

#[test]
fn excerpts_parse_with_expected_shape() {
    let conv = trace::load(&data("conversation_excerpt.jsonl"), 512).unwrap();
    assert_eq!(conv.len(), 400);
    assert_eq!(conv[0].hash_ids.len(), 14);
    assert_eq!(conv[0].input_length, 6758);
    let syn = trace::load(&data("synthetic_excerpt.jsonl"), 512).unwrap();
    assert_eq!(syn.len(), 300);
}

#[test]
fn unlimited_global_cache_hits_blocks_seen_before_on_both_excerpts() {
    for name in ["conversation_excerpt.jsonl", "synthetic_excerpt.jsonl"] {
        let records = trace::load(&data(name), 512).unwrap();
        let cfg = cli_config(&["--pool-blocks", "unlimited"]);
        let r = simulate(&records, &cfg).unwrap();
        assert_eq!(r.served, records.len());
        assert!(
            (r.block_hit_ratio - seen_before_ratio(&records)).abs() < 1e-12,
            "{name}: {} vs {}",
            r.block_hit_ratio,
            seen_before_ratio(&records)
        );
        assert!(r.block_hit_ratio > 0.0);
    }
}

#[test]
fn global_pool_beats_local_caches_on_the_conversation_excerpt() {
    let records = trace::load(&data("conversation_excerpt.jsonl"), 512).unwrap();
    // Small local caches (200 blocks per instance) versus the same plus a pool of 4000 blocks.
    let local = simulate(
        &records,
        &cli_config(&["--policy", "local-only", "--local-cache-blocks", "200"]),
    )
    .unwrap();
    let global = simulate(
        &records,
        &cli_config(&[
            "--policy",
            "conductor",
            "--local-cache-blocks",
            "200",
            "--pool-blocks",
            "4000",
        ]),
    )
    .unwrap();
    assert_eq!(local.pool_hit_ratio, 0.0);
    assert!(global.pool_hit_ratio > 0.0);
    assert!(
        global.block_hit_ratio > local.block_hit_ratio,
        "global {} local {}",
        global.block_hit_ratio,
        local.block_hit_ratio
    );
    assert!(global.totals.prefill_busy_s < local.totals.prefill_busy_s);
}

#[test]
fn overload_is_rejected_early_and_rejection_protects_the_slo() {
    let records = trace::load(&data("conversation_excerpt.jsonl"), 512).unwrap();
    // Replay 20x faster on 2 prefill and 2 decode instances: far beyond capacity.
    let base = ["--prefill", "2", "--decode", "2", "--time-scale", "20"];
    let run = |rejection: &str| {
        let mut flags = base.to_vec();
        flags.extend_from_slice(&["--rejection", rejection]);
        simulate(&records, &cli_config(&flags)).unwrap()
    };
    let none = run("none");
    let early = run("early");
    let predicted = run("predicted");
    assert_eq!(none.rejected, 0);
    assert!(
        none.ttft_s.p90 > 30.0,
        "overload must break the TTFT SLO: {:?}",
        none.ttft_s
    );
    for r in [&early, &predicted] {
        assert!(r.rejected > 0, "{:?}", r.rejection);
        assert_eq!(r.served + r.rejected, records.len());
        // What is admitted meets the TTFT SLO (the estimate is exact in the simulator).
        assert_eq!(r.met_ttft, r.served, "{:?}", r.rejection);
        assert!(
            r.met_both > none.met_both,
            "{:?}: {} vs {}",
            r.rejection,
            r.met_both,
            none.met_both
        );
    }
    assert_eq!(early.policy, Policy::Conductor);
    assert_eq!(predicted.rejection, Rejection::Predicted);
}

#[test]
fn full_conversation_trace_if_present() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/data/mooncake-traces/conversation_trace.jsonl");
    if !path.exists() {
        skip_support::skip(&format!("{} not present", path.display()));
        return;
    }
    let records = trace::load(&path, 512).unwrap();
    assert_eq!(records.len(), 12_031);
    let blocks: usize = records.iter().map(|r| r.hash_ids.len()).sum();
    assert_eq!(blocks, 288_500);
    let r = simulate(&records, &cli_config(&["--pool-blocks", "unlimited"])).unwrap();
    // 182,790 distinct ids among 288,500 blocks: the rest were seen before.
    let expected = (288_500.0 - 182_790.0) / 288_500.0;
    assert!(
        (r.block_hit_ratio - expected).abs() < 1e-12,
        "{}",
        r.block_hit_ratio
    );
}

#[test]
fn simulate_binary_prints_json_and_names_bad_lines() {
    let bin = env!("CARGO_BIN_EXE_kvpool");
    let v = kvpool_harness::output_json(
        Command::new(bin)
            .args(["simulate", "--json", "--trace"])
            .arg(data("synthetic_excerpt.jsonl"))
            .args(["--pool-blocks", "unlimited"]),
    )
    .expect("the command succeeds and prints JSON");
    assert_eq!(v["requests"], 300);
    assert_eq!(v["policy"], "conductor");
    assert!(v["ttft_s"]["p99"].as_f64().unwrap() > 0.0);

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1}\n",
    )
    .unwrap();
    let out = Command::new(bin)
        .args(["simulate", "--trace"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("trace line 2: field `hash_ids` is missing"),
        "{err}"
    );
}
