//! A single master (no etcd) SIGKILLed and started again on the same address, with real
//! processes on 127.0.0.1: one `kvpool agent run` with its DRAM tier kept in a tmpfs file
//! (`--dram-persistence-path`) and an SSD tier, blocks put through its engine API and durably
//! indexed before the kill. The restarted master knows nothing; the agent finds itself unknown,
//! mounts its segments again and announces what its persistent tiers hold, and the master
//! adopts them: every acknowledged block reads back byte-exact. Puts made while no master
//! runs fail as `Unavailable`, never as `NoSpace`.

mod pool_support;
mod skip_support;

use kvpool_harness::{Launcher, MasterSpec};
use pool_support::*;

fn block(i: usize) -> Vec<u8> {
    (0..40 * 1024 + i * 13)
        .map(|j: usize| (j.wrapping_mul(17) ^ i.wrapping_mul(104_729)) as u8)
        .collect()
}

fn key(i: usize) -> Vec<u8> {
    format!("master-restart-{i}").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_master_adopts_every_block_of_the_persistent_tiers() {
    let ok = std::fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split(' ').nth(1) == Some("/dev/shm") && l.contains(" tmpfs "))
    });
    if !ok {
        return skip_support::skip("/dev/shm is not a tmpfs mount");
    }
    let shm = tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm");
    let dir = tempfile::tempdir().expect("tempdir");
    let key_file = write_key(dir.path(), KEY);
    let spec = MasterSpec::new(KVPOOL, &key_file).expect("ports").args([
        "--heartbeat-timeout",
        "5s",
        "--tick-interval",
        "100ms",
    ]);
    let launcher = Launcher::new(dir.path());
    let mut master = spec.start(&launcher, "master", DEADLINE).expect("master");
    let grpc = spec.grpc;
    let client = master_client(grpc, KEY);
    // No agent has joined yet: a put is refused as retryable (the master has no segment),
    // not as a full pool.
    let early = pool_client(grpc, KEY, "early-client", |c| c.prefer_shm = false);
    match early
        .put(
            b"too-early",
            &[1u8; 1000],
            &kvpool_core::master::PutOptions::default(),
        )
        .await
    {
        Err(kvpool_client::pool::DataError::Master(e)) => {
            assert!(e.is_unavailable(), "a put with no segment mounted: {e}");
        }
        other => panic!("a put with no segment mounted answered {other:?}"),
    }
    let (ssd_dir, ssd) = ssd_tier(dir.path());
    let args = [
        "--dram-persistence-path".to_owned(),
        shm.path().join("tier").display().to_string(),
    ];
    let (mut a, addr) =
        start_agent_args(dir.path(), "agent-a", grpc, &key_file, "4MiB", &ssd, &args);
    wait_ready(&addr, &mut a);
    wait_mounted(&client, 1, &mut [&mut master.process, &mut a]).await;

    // Half through the agent's engine API, half by a remote client over TCP (written into the
    // agent's segments by the client; the agent indexes them from the master's feed).
    let n = 40usize;
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    put_through(&addr, "engine-a", &keys[..n / 2], block).await;
    let remote = pool_client(grpc, KEY, "test-client", |c| c.prefer_shm = false);
    for (i, k) in keys.iter().enumerate().skip(n / 2) {
        remote
            .put(k, &block(i), &kvpool_core::master::PutOptions::default())
            .await
            .expect("remote put");
    }
    // Durably indexed (DRAM index, and the SSD index for what was demoted): what a restart
    // of the agent would find, so what it can announce.
    let indexed = |text: &str| {
        metric(text, "kvpool_agent_pool_dram_index_blocks", &[]).unwrap_or(0.0)
            + metric(text, "kvpool_agent_pool_ssd_index_blocks", &[]).unwrap_or(0.0)
    };
    let started = std::time::Instant::now();
    loop {
        let (_, text) = http_get(addr.admin, "/metrics").await.expect("metrics");
        if indexed(&text) >= n as f64 {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "blocks never indexed: {}",
            indexed(&text)
        );
        a.assert_running().expect("agent");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    master.process.kill().expect("SIGKILL the master");
    drop(master);
    let mut master = spec
        .start(&launcher, "master-2", DEADLINE)
        .expect("master again");
    let stats = wait_stats(
        &client,
        "every block adopted",
        &mut [&mut master.process, &mut a],
        |s| s.nodes_alive == 1 && s.objects >= n as u64,
    )
    .await;
    assert_eq!(stats.objects, n as u64, "{stats:?}");
    let mut engine = engine(&addr, "engine-b").await;
    for (i, k) in keys.iter().enumerate() {
        let got = engine
            .get(k)
            .await
            .unwrap_or_else(|e| panic!("block {i}: {e:#}"));
        assert!(
            got.as_deref() == Some(&block(i)[..]),
            "block {i} reads back wrong or missing"
        );
    }
    drop(ssd_dir);
}
