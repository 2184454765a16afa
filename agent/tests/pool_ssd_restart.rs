//! The pool-mode SSD segment persists across agent restarts, with real processes on
//! 127.0.0.1 (one `kvpool master`, one `kvpool-agent` with a 1 MiB DRAM tier and an 8 MiB SSD
//! segment). Blocks put through the engine API overflow DRAM and are demoted into `ssd0`; once
//! the agent's index is synced the agent is stopped (SIGTERM in one test, SIGKILL in the
//! other), one demoted block is corrupted on disk while it is down, and the agent is started
//! again on the same SSD path. After the remount the master lists every other demoted object
//! with an SSD replica on that node again, the engine API returns each byte-exact, and the
//! corrupted block is dropped at start-up (counted in
//! `kvpool_agent_pool_ssd_blocks_dropped_total{reason="corrupt"}`), never served.
//!
//! Process helpers: `pool_support` (shared with `pool_wiring.rs`).

mod pool_support;

use kvpool::master::Tier;
use kvpool_agent::proto::Status;
use pool_support::*;

fn block(i: usize) -> Vec<u8> {
    (0..100 * 1024 + i)
        .map(|j: usize| (j.wrapping_mul(13) ^ i.wrapping_mul(101)) as u8)
        .collect()
}

async fn restart_keeps_demoted_blocks(sig: nix::sys::signal::Signal) {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path();
    let key_file = dir.path().join("pool.key");
    std::fs::write(&key_file, KEY).expect("key file");
    let (mut master, grpc) = start_master(logs, &key_file);
    let ssd_dir = dir.path().join("ssd");
    let extra = format!("ssd:\n  path: {}\n  capacity: 8MiB\n", ssd_dir.display());
    let (mut a, addr_a) = start_agent_with(logs, "agent-a", grpc, &key_file, "1MiB", &extra);
    let client = master_client(grpc);
    wait_ready(&addr_a, &mut a, logs).await;

    // 16 blocks of ~100 KiB into 1 MiB of DRAM: most are demoted to the SSD segment.
    let mut engine_a = engine(&addr_a, "engine-a").await;
    let keys: Vec<Vec<u8>> = (0..16)
        .map(|i| format!("persist-block-{i}").into_bytes())
        .collect();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(
            engine_a.put(key, &block(i)).await.expect("put"),
            Status::Ok,
            "put {i}"
        );
    }
    drop(engine_a);
    wait_stats(
        &client,
        "demotions done",
        &mut [&mut master, &mut a],
        logs,
        |s| s.tasks == 0 && s.used_bytes.get(1).copied().unwrap_or(0) > 0,
    )
    .await;
    // (index in `keys`, offset in ssd0) of every block with an SSD replica.
    let mut on_ssd: Vec<(usize, u64)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let located = client.get(key).await.expect("locate");
        if let Some(r) = located
            .replicas
            .iter()
            .find(|r| r.tier == Tier::Ssd && r.segment == "ssd0")
        {
            assert_eq!(r.node, "agent-a");
            on_ssd.push((i, r.offset));
        }
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
    }
    assert!(on_ssd.len() >= 2, "blocks were demoted: {on_ssd:?}");
    let n = on_ssd.len() as f64;
    // The index holds every demoted block durably before the agent goes down.
    wait_metric(
        &addr_a,
        &mut a,
        logs,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v >= n,
    )
    .await;

    a.signal(sig);
    wait_exit(&mut a);
    drop(a);

    // Corrupt the first demoted block on disk while the agent is down.
    let (bad, bad_offset) = on_ssd[0];
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(ssd_dir.join("pool-ssd.dat"))
            .expect("data file");
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, bad_offset + 100).expect("read");
        f.write_all_at(&[byte[0] ^ 0x5a], bad_offset + 100)
            .expect("corrupt");
    }

    let (mut a, addr_a) = start_agent_with(logs, "agent-a", grpc, &key_file, "1MiB", &extra);
    wait_ready(&addr_a, &mut a, logs).await;
    let adopted = wait_metric(
        &addr_a,
        &mut a,
        logs,
        "kvpool_agent_pool_ssd_blocks_adopted_total",
        &[],
        |v| v >= n - 1.0,
    )
    .await;
    assert_eq!(adopted, n - 1.0, "every intact block adopted");
    let (_, text) = http_get(addr_a.admin, "/metrics").await.expect("metrics");
    assert_eq!(
        metric(
            &text,
            "kvpool_agent_pool_ssd_blocks_dropped_total",
            &["reason=\"corrupt\""],
        ),
        Some(1.0),
        "the corrupted block is dropped and counted:\n{text}"
    );

    let mut engine_a = engine(&addr_a, "engine-a2").await;
    for &(i, offset) in &on_ssd {
        let key = &keys[i];
        if i == bad {
            assert!(
                !client.exists(&[key.as_slice()]).await.expect("exists")[0],
                "the corrupted block is not announced"
            );
            assert!(
                engine_a.get(key).await.expect("get").is_none(),
                "the corrupted block is never served"
            );
            continue;
        }
        let located = client.get(key).await.expect("locate after restart");
        let r = located
            .replicas
            .iter()
            .find(|r| r.tier == Tier::Ssd)
            .expect("an SSD replica again");
        assert_eq!((r.node.as_str(), r.segment.as_str()), ("agent-a", "ssd0"));
        assert_eq!(r.offset, offset, "adopted where it was written");
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
        let got = engine_a.get(key).await.expect("get").expect("present");
        assert!(got == block(i), "object {i} differs after the restart");
    }
    // A clean shutdown still works after the adoption.
    a.signal(nix::sys::signal::Signal::SIGTERM);
    wait_exit(&mut a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demoted_blocks_survive_a_sigterm_restart() {
    restart_keeps_demoted_blocks(nix::sys::signal::Signal::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demoted_blocks_survive_a_sigkill_after_the_index_sync() {
    restart_keeps_demoted_blocks(nix::sys::signal::Signal::SIGKILL).await;
}
