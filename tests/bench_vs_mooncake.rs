//! `kvpool bench transfer --vs_mooncake` and `kvpool bench store --vs_mooncake` once each at a
//! tiny size against real Mooncake (its PyPI wheel in .tools/py, which scripts/test.sh installs
//! with `scripts/python-env.sh --tools`; the bench installs it there itself when it is missing).
//! Checks that both sides ran the same cell and that the JSON carries both figures and their
//! ratio. No ratio is asserted: figures are for docs/benchmarks.md. Also checks that the
//! versions of Mooncake and of sglang-router (tests/bench_conductor.rs) that the benches install
//! are the ones scripts/python-env.sh pins.

use std::path::Path;
use std::process::Command;

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");

fn venv() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".tools/py")
        .display()
        .to_string()
}

fn run_json(args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(KVPOOL);
    cmd.args(args).args(["--mooncake-venv", &venv(), "--json"]);
    kvpool_harness::output_json(&mut cmd).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

#[test]
fn bench_transfer_runs_mooncakes_transfer_engine_bench_on_the_same_cell() {
    let r = run_json(&[
        "bench",
        "transfer",
        "--vs-mooncake",
        "--rounds",
        "1",
        "--operation",
        "write",
        "--block-size",
        "64KiB",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--duration",
        "1",
        "--buffer-size",
        "16MiB",
        "--no-baselines",
    ]);
    let v = &r["vs_mooncake"];
    assert_eq!(
        v["kvpool_gb_per_s"].as_array().map(Vec::len),
        Some(1),
        "{r}"
    );
    let ours = v["kvpool_median_gb_per_s"].as_f64().expect("kvpool median");
    let theirs = v["mooncake_median_gb_per_s"]
        .as_f64()
        .expect("mooncake median");
    assert!(ours > 0.0 && theirs > 0.0, "{r}");
    let run = &v["mooncake_runs"][0];
    assert!(run["batches"].as_u64().unwrap_or(0) > 0, "{r}");
    assert!((r["ratio_vs_mooncake"].as_f64().expect("ratio") - ours / theirs).abs() < 1e-9);
    let cmd = v["mooncake_command"].as_str().expect("command");
    for flag in [
        "--operation=write",
        "--block_size=65536",
        "--batch_size=16",
        "--threads=1",
        "--duration=1",
        "--protocol=tcp",
    ] {
        assert!(cmd.contains(flag), "{flag} missing from {cmd}");
    }
    assert_eq!(r["transfer"]["requests_failed"], 0, "{r}");
}

#[test]
fn bench_transfer_refuses_vs_mooncake_outside_tcp_both_mode() {
    let out = Command::new(KVPOOL)
        .args(["bench", "transfer", "--vs_mooncake", "--protocol", "shm"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--vs-mooncake needs --mode both --protocol tcp"),
        "{stderr}"
    );
}

#[test]
fn bench_store_measures_mooncake_store_with_the_same_cells() {
    let r = run_json(&[
        "bench",
        "store",
        "--vs-mooncake",
        "--no-redis",
        "--agents",
        "1",
        "--replicas",
        "1",
        "--clients",
        "1",
        "--depth",
        "2",
        "--sizes",
        "64KiB,1MiB",
        "--ops",
        "8",
        "--rounds",
        "1",
        "--agent-capacity",
        "64MiB",
        "--lookup-duration",
        "100ms",
    ]);
    let m = &r["mooncake"];
    assert_eq!(m["depth"], 2, "{r}");
    assert_eq!(m["holders"], 1);
    let values = m["values"].as_array().expect("values");
    assert_eq!(values.len(), 2);
    for v in values {
        for phase in ["put", "get"] {
            assert_eq!(v[phase]["ops"], 8, "{v}");
            assert_eq!(v[phase]["failures"], 0, "{v}");
            assert!(v[phase]["ops_per_second"].as_f64().unwrap() > 0.0);
        }
        assert_eq!(
            v["get"]["verified"], 8,
            "every one of Mooncake's gets returned the bytes put: {v}"
        );
    }
    let ratios = r["ratio_vs_mooncake"].as_array().expect("ratios");
    let sizes: Vec<u64> = ratios
        .iter()
        .map(|q| q["size_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [64 * 1024, 1 << 20]);
    for q in ratios {
        assert!(q["get_ops"].as_f64().unwrap() > 0.0, "{q}");
    }
    assert_eq!(r["all_gets_verified"], true);
}

#[test]
fn the_versions_the_benches_install_are_the_ones_the_python_env_pins() {
    let script = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/python-env.sh"),
    )
    .unwrap();
    for (variable, installed) in [
        ("MOONCAKE_VERSION", kvpool_bench::mooncake::DEFAULT_VERSION),
        (
            "ROUTER_VERSION",
            kvpool_bench::conductor::router::DEFAULT_VERSION,
        ),
    ] {
        let pinned = script
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{variable}=")))
            .unwrap_or_else(|| panic!("{variable} in scripts/python-env.sh"));
        assert_eq!(pinned, installed, "{variable}");
    }
}
