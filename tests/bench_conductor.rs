//! `kvpool bench conductor --vs_sglang_router` once at a tiny size against real sglang-router
//! (its PyPI package in .tools/router, which scripts/test.sh installs with
//! `scripts/python-env.sh --tools`; the bench installs it there itself when it is missing).
//! Checks that every target ran both phases in every round, that every request succeeded and
//! that the JSON carries the figures and their ratios. No ratio is asserted: figures are for
//! docs/benchmarks.md.

use std::path::Path;
use std::process::Command;

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");

fn venv() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".tools/router")
        .display()
        .to_string()
}

#[test]
fn bench_conductor_measures_direct_conductor_and_sglang_router_in_the_same_rounds() {
    let mut cmd = Command::new(KVPOOL);
    cmd.args(["bench", "conductor", "--vs-sglang-router", "--json"])
        .args(["--router-venv", &venv()])
        .args(["--rounds", "2", "--requests", "20", "--concurrency", "4"])
        .args(["--duration", "500ms"]);
    let r = kvpool_harness::output_json(&mut cmd).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r["all_succeeded"], true, "{r}");
    assert!(
        r["sglang_router_version"]
            .as_str()
            .is_some_and(|v| !v.is_empty()),
        "{r}"
    );
    assert!(
        r["sglang_router_command"]
            .as_str()
            .is_some_and(|c| c.contains("--pd-disaggregation")),
        "{r}"
    );
    for name in ["direct", "conductor", "sglang_router"] {
        let t = &r["targets"][name];
        assert_eq!(t["failed"], 0, "{name}: {t}");
        let rounds = t["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 2, "{name}");
        for round in rounds {
            let one = &round["one_in_flight"];
            assert_eq!(one["ok"], 20, "{name}: {one}");
            assert!(one["p50_ms"].as_f64().unwrap() > 0.0, "{name}: {one}");
            assert!(
                one["p99_ms"].as_f64().unwrap() >= one["p50_ms"].as_f64().unwrap(),
                "{name}: {one}"
            );
            let closed = &round["closed_loop"];
            assert!(closed["ok"].as_u64().unwrap() > 0, "{name}: {closed}");
            assert!(closed["requests_per_second"].as_f64().unwrap() > 0.0);
        }
        assert!(t["max_requests_per_second"].as_f64().unwrap() > 0.0);
        if name == "direct" {
            assert!(t["added_p50_ms"].is_null());
        } else {
            assert!(t["added_p50_ms"].is_number(), "{name}: {t}");
            assert!(t["added_p99_ms"].is_number(), "{name}: {t}");
        }
    }
    assert_eq!(
        r["orders"],
        serde_json::json!([
            ["direct", "conductor", "sglang_router"],
            ["direct", "sglang_router", "conductor"]
        ]),
        "the front doors alternate"
    );
    let q = &r["ratio_vs_sglang_router"];
    for k in ["added_p50", "added_p99", "max_requests_per_second"] {
        assert!(q.get(k).is_some(), "{k} missing: {r}");
    }
    for k in [
        "added_p50_at_most_routers",
        "higher_max_requests_per_second",
    ] {
        assert!(r["targets_met"][k].is_boolean(), "{k} missing: {r}");
    }
    let c = r["targets"]["conductor"]["max_requests_per_second"]
        .as_f64()
        .unwrap();
    let s = r["targets"]["sglang_router"]["max_requests_per_second"]
        .as_f64()
        .unwrap();
    assert!((q["max_requests_per_second"].as_f64().unwrap() - c / s).abs() < 1e-9);
}
