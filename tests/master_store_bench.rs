//! `kvpool bench store --json` end to end at a tiny size: a real master, two real agents and two
//! client processes on 127.0.0.1 (plus Redis when Debian's redis-server is installed). Checks the
//! JSON report's shape, that every put and get succeeded and that every get returned exactly the
//! bytes that were put. No timing assertion: figures are for docs/benchmarks.md.

use std::process::Command;

use kvpool_harness::output_json;

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");

fn has(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn num(v: &serde_json::Value, path: &[&str]) -> f64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

#[test]
fn bench_store_reports_every_size_and_verifies_every_get() {
    let redis = has("redis-server") && has("redis-benchmark");
    if !redis {
        println!("SKIP: redis-server/redis-benchmark missing; running without the Redis baseline");
    }
    let mut cmd = Command::new(KVPOOL);
    cmd.args([
        "bench",
        "store",
        "--json",
        "--agents",
        "2",
        "--clients",
        "2",
    ])
    .args([
        "--depth",
        "2",
        "--sizes",
        "64KiB,1MiB",
        "--ops",
        "6",
        "--rounds",
        "2",
    ])
    .args(["--replicas", "2", "--agent-capacity", "64MiB"])
    .args(["--lookup-duration", "200ms", "--redis-requests", "20"]);
    if !redis {
        cmd.arg("--no-redis");
    }
    let r = output_json(&mut cmd).unwrap_or_else(|e| panic!("{e}"));

    assert_eq!(r["agents"], 2);
    assert_eq!(r["clients"], 2);
    assert_eq!(r["replicas"], 2);
    assert_eq!(r["transport"], "tcp");
    assert_eq!(r["api"], "registered");
    assert_eq!(r["all_gets_verified"], true, "{r}");
    let values = r["values"].as_array().expect("values");
    let sizes: Vec<u64> = values
        .iter()
        .map(|v| v["size_bytes"].as_u64().expect("size"))
        .collect();
    assert_eq!(sizes, [64 * 1024, 1 << 20]);
    for v in values {
        // 2 clients x 6 ops x 2 rounds, none failed, every get compared byte for byte.
        for phase in ["put", "get"] {
            assert_eq!(v[phase]["ops"], 24, "{phase} of {v}");
            assert_eq!(v[phase]["failures"], 0, "{phase} of {v}");
            assert!(num(v, &[phase, "ops_per_second"]) > 0.0);
            assert!(num(v, &[phase, "gb_per_second"]) > 0.0);
            assert!(num(v, &[phase, "p99_us"]) >= num(v, &[phase, "p50_us"]));
        }
        assert_eq!(v["get_verified"], 24, "{v}");
        assert_eq!(v["get_mismatches"], 0, "{v}");
    }
    let l = &r["lookups"];
    assert_eq!(l["batch"], 100);
    assert_eq!(l["mismatches"], 0, "every looked-up key was committed: {l}");
    assert_eq!(l["failures"], 0);
    for f in [
        "exists_key_lookups_per_second",
        "prefix_key_lookups_per_second",
    ] {
        assert!(num(l, &[f]) > 0.0, "{f}");
    }
    if redis {
        assert!(num(&r, &["redis", "set_ops_per_second"]) > 0.0);
        assert!(num(&r, &["redis", "get_ops_per_second"]) > 0.0);
        assert!(num(&r, &["ratio_1mib", "put_over_set"]) > 0.0);
        assert!(num(&r, &["ratio_1mib", "get_over_get"]) > 0.0);
    } else {
        assert!(r["redis"].is_null() && r["ratio_1mib"].is_null());
    }
}

/// `--api engine`: the clients go through the agents' engine API (each client a different
/// agent), one call in flight and several, and every get still comes back byte-exact.
#[test]
fn bench_store_through_the_engine_api_verifies_every_get() {
    for depth in ["1", "3"] {
        let r = output_json(
            Command::new(KVPOOL)
                .args(["bench", "store", "--json", "--api", "engine", "--no-redis"])
                .args(["--agents", "2", "--clients", "2", "--depth", depth])
                .args(["--sizes", "64KiB,1MiB", "--ops", "6", "--rounds", "1"])
                .args(["--agent-capacity", "64MiB", "--lookup-duration", "100ms"]),
        )
        .unwrap_or_else(|e| panic!("depth {depth}: {e}"));
        assert_eq!(r["api"], "engine");
        assert_eq!(r["all_gets_verified"], true, "{r}");
        for v in r["values"].as_array().expect("values") {
            for phase in ["put", "get"] {
                assert_eq!(v[phase]["ops"], 12, "{phase} of {v}");
                assert_eq!(v[phase]["failures"], 0, "{phase} of {v}");
            }
            assert_eq!(v["get_verified"], 12, "{v}");
        }
    }
}
