//! The pool-mode SSD segment persists across agent restarts and is checked on every read, with
//! real processes on 127.0.0.1 (one `kvpool master`, one `kvpool agent run` with a 1 MiB DRAM tier
//! and an 8 MiB SSD segment). Blocks put through the engine API overflow DRAM and are demoted
//! into `ssd0`. A remote client (its own transfer engine) puts one value straight into `ssd0`
//! (tier SSD) and removes one demoted key; the master's segment-event feed tells the agent
//! (its index gains the first and loses the second). Once the agent's index is synced the agent
//! is stopped (SIGTERM in one test, SIGKILL in the other), one demoted block is corrupted on
//! disk while it is down, and the agent is started again on the same SSD path. After the
//! remount the master lists every other demoted object with an SSD replica on that node again,
//! the engine API returns each byte-exact, the remote value reads back byte-exact, the removed
//! key does not come back, and the corrupted block is dropped at start-up (counted in
//! `kvpool_agent_pool_ssd_blocks_dropped_total{reason="corrupt"}`), never served. A third test
//! corrupts a block while the agent runs: the read is refused, the block is dropped and
//! reported, and the master forgets the replica.
//!
//! Process helpers: `pool_support` (shared with `agent_pool_wiring.rs`) over `kvpool_harness`.

mod pool_support;

use kvpool_client::pool::PoolClient;
use kvpool_core::master::{PutOptions, Tier};
use pool_support::*;

/// A pool client on its own transfer engine, as another node's engine would be.
fn remote_client(grpc: std::net::SocketAddr) -> PoolClient {
    pool_client(grpc, KEY, "remote-client", |c| c.lanes = 1)
}

fn remote_value() -> Vec<u8> {
    (0..70_000u32).map(|j| (j % 241) as u8 ^ 0x3c).collect()
}

/// Flip one byte of the data file of `ssd_dir` at `at`.
fn corrupt(ssd_dir: &std::path::Path, at: u64) {
    flip_byte(&ssd_dir.join("pool-ssd.dat"), at, 0x5a);
}

fn block(i: usize) -> Vec<u8> {
    (0..100 * 1024 + i)
        .map(|j: usize| (j.wrapping_mul(13) ^ i.wrapping_mul(101)) as u8)
        .collect()
}

async fn restart_keeps_demoted_blocks(sig: nix::sys::signal::Signal) {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let logs = dir.path();
    let (ssd_dir, extra, mut a, addr_a) = start_ssd_agent(logs, grpc, &key_file);

    // 16 blocks of ~100 KiB into 1 MiB of DRAM: most are demoted to the SSD segment.
    let keys = numbered_keys("persist-block", 16);
    put_through(&addr_a, "engine-a", &keys, block).await;
    wait_stats(&client, "demotions done", &mut [&mut master, &mut a], |s| {
        s.tasks == 0 && s.used_bytes.get(1).copied().unwrap_or(0) > 0
    })
    .await;
    // (index in `keys`, offset in ssd0) of every block with an SSD replica.
    let mut on_ssd: Vec<(usize, u64)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let located = replicas(&client, key).await.expect("locate");
        if let Some(r) = located
            .iter()
            .find(|r| r.tier == Tier::Ssd && r.segment == "ssd0")
        {
            assert_eq!(r.node, "agent-a");
            on_ssd.push((i, r.offset));
        }
    }
    assert!(on_ssd.len() >= 3, "blocks were demoted: {on_ssd:?}");
    let n = on_ssd.len() as f64;
    // The index holds every demoted block durably before the agent goes down.
    wait_metric(
        &addr_a,
        &mut a,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v >= n,
    )
    .await;

    // A remote client writes straight into ssd0: the commit reaches the agent's index.
    let remote = remote_client(grpc);
    let ssd_only = PutOptions {
        replicas: 1,
        tier: Some(Tier::Ssd),
        ..PutOptions::default()
    };
    let placed = remote
        .put(b"remote-ssd-value", &remote_value(), &ssd_only)
        .await
        .expect("remote put");
    assert_eq!(placed.len(), 1);
    assert_eq!(
        (placed[0].node.as_str(), placed[0].segment.as_str()),
        ("agent-a", "ssd0")
    );
    let remote_offset = placed[0].offset;
    wait_metric(
        &addr_a,
        &mut a,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v == n + 1.0,
    )
    .await;
    // Removing a demoted key: the free reaches the index before the agent goes down.
    let (removed, _) = on_ssd[1];
    client.remove(&keys[removed]).await.expect("remove");
    wait_metric(
        &addr_a,
        &mut a,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v == n,
    )
    .await;

    a.signal(sig).expect("signal");
    wait_exit(&mut a);
    drop(a);

    // Corrupt the first demoted block on disk while the agent is down.
    let (bad, bad_offset) = on_ssd[0];
    corrupt(&ssd_dir, bad_offset + 100);

    let (mut a, addr_a) = spawn_ssd_agent(logs, grpc, &key_file, &extra);
    wait_ready(&addr_a, &mut a);
    let adopted = ssd_blocks_adopted(&addr_a, &mut a, |v| v >= n - 1.0).await;
    // Demoted blocks less the corrupted and the removed one, plus the remote value.
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
        if i == removed {
            // A removed key does not come back after a restart.
            assert_gone(&client, &mut engine_a, key, "the removed key").await;
            continue;
        }
        if i == bad {
            assert_gone(&client, &mut engine_a, key, "the corrupted block").await;
            continue;
        }
        let located = replicas(&client, key).await.expect("locate after restart");
        let r = located
            .iter()
            .find(|r| r.tier == Tier::Ssd)
            .expect("an SSD replica again");
        assert_eq!((r.node.as_str(), r.segment.as_str()), ("agent-a", "ssd0"));
        assert_eq!(r.offset, offset, "adopted where it was written");
        let got = engine_a.get(key).await.expect("get").expect("present");
        assert!(got == block(i), "object {i} differs after the restart");
    }
    let located = replicas(&client, b"remote-ssd-value")
        .await
        .expect("remote value");
    assert_eq!(located.len(), 1);
    assert_eq!(located[0].offset, remote_offset);
    let got = remote.get(b"remote-ssd-value").await.expect("remote get");
    assert!(
        got == remote_value(),
        "the remote value differs after the restart"
    );
    // A clean shutdown still works after the adoption.
    a.signal(nix::sys::signal::Signal::SIGTERM).expect("signal");
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

/// A block corrupted on disk while the agent runs is never served: the checked read fails,
/// the block leaves the index, the agent reports it and the master forgets the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_corrupted_while_running_is_refused_dropped_and_reported() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let (ssd_dir, _, mut a, addr_a) = start_ssd_agent(dir.path(), grpc, &key_file);

    // Two values written straight into ssd0 by a remote client.
    let remote = remote_client(grpc);
    let ssd_only = PutOptions {
        replicas: 1,
        tier: Some(Tier::Ssd),
        ..PutOptions::default()
    };
    let value = remote_value();
    let bad = remote
        .put(b"to-be-corrupted", &value, &ssd_only)
        .await
        .expect("put");
    remote
        .put(b"stays-intact", &value, &ssd_only)
        .await
        .expect("put");
    wait_metric(
        &addr_a,
        &mut a,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v == 2.0,
    )
    .await;
    assert!(remote.get(b"to-be-corrupted").await.expect("get") == value);

    corrupt(&ssd_dir, bad[0].offset + 4000);
    // Through the engine API of the agent itself and through a remote peer: refused.
    let mut engine_a = engine(&addr_a, "engine-a").await;
    assert!(
        engine_a
            .get(b"to-be-corrupted")
            .await
            .expect("get")
            .is_none(),
        "the corrupt block is never served to the node's engine"
    );
    assert!(
        remote.get(b"to-be-corrupted").await.is_err(),
        "nor to a remote reader"
    );
    let dropped = wait_metric(
        &addr_a,
        &mut a,
        "kvpool_agent_pool_ssd_blocks_dropped_total",
        &["reason=\"corrupt\""],
        |v| v >= 1.0,
    )
    .await;
    assert_eq!(dropped, 1.0);
    // The report reaches the master: its only replica is gone, so the object is.
    wait_stats(
        &client,
        "corrupt replica dropped",
        &mut [&mut master, &mut a],
        |s| s.objects == 1,
    )
    .await;
    assert!(
        !client
            .exists(&[b"to-be-corrupted".as_slice()])
            .await
            .expect("exists")[0]
    );
    assert!(
        engine_a
            .get(b"stays-intact")
            .await
            .expect("get")
            .expect("present")
            == value
    );
    let (_, text) = http_get(addr_a.admin, "/metrics").await.expect("metrics");
    assert!(
        metric(
            &text,
            "kvpool_agent_pool_ssd_reads_checked_total",
            &["outcome=\"ok\""]
        )
        .unwrap_or(0.0)
            >= 2.0,
        "{text}"
    );
    a.signal(nix::sys::signal::Signal::SIGTERM).expect("signal");
    wait_exit(&mut a);
}
