//! `bench tier` end to end at a small size: every block size goes through the engine API and
//! comes back intact (the benchmark checks the bytes), the SSD part runs against dd in a temp
//! directory, and the report serialises. No speed is asserted here (see docs/benchmarks.md).

use bytesize::ByteSize;
use kvpool_agent::bench::{TierArgs, render_text, run_tier};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_tier_runs_small() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = TierArgs {
        json: true,
        dir: dir.path().to_owned(),
        dram_total: ByteSize::mib(8),
        ssd_total: ByteSize::mib(8),
        batch: ByteSize::mib(4),
        repeat: 1,
    };
    let report = run_tier(&args).await.expect("bench");
    let sizes: Vec<u64> = report.dram.iter().map(|d| d.block_bytes).collect();
    assert_eq!(sizes, vec![64 << 10, 1 << 20, 4 << 20]);
    assert_eq!(report.dram[0].blocks, 128);
    assert_eq!(report.ssd.bytes, 8 << 20);
    assert!(report.memcpy_gib_s > 0.0);
    let json = serde_json::to_value(&report).expect("json");
    assert!(json["ssd"]["dd_write_gib_s"].as_f64().is_some());
    assert!(render_text(&report).contains("SSD tier"));

    let bad = TierArgs {
        batch: ByteSize::kib(64),
        ..args
    };
    assert_eq!(
        run_tier(&bad).await.expect_err("small batch").category(),
        "args"
    );
}
