//! An agent SIGKILLed in the middle of a stream of puts with two replicas, with real processes
//! on 127.0.0.1: one `kvpool master` (heartbeat timeout 10 s, so the death is not noticed that
//! way during the test), three `kvpool agent run` processes, and this test as the writer (its
//! own transfer engine). A put whose replica holder is gone is placed again without it, and the
//! master stops placing anyone's replicas there at once (`node_suspected`): fewer than 1% of
//! the puts fail, every acknowledged value reads back byte-exact, and none is lost.

mod pool_support;

use std::time::Instant;

use kvpool_core::master::PutOptions;
use pool_support::load::Objects;
use pool_support::*;

const PUTS: u64 = 300;
const KILL_AT: u64 = 60;

/// Values of 8 KiB to ~40 KiB.
const LOAD: Objects = Objects::new("agent-kill-put-stream", 0x51c3).lengths(8 * 1024, 8, 4096, 5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_ride_out_a_replica_holders_death() {
    let (dir, key_file, m, client) = test_pool_with("10s", &[]);
    let (grpc, admin, mut master) = (m.grpc, m.admin, m.process);
    let [mut a, mut b, mut c] = start_agents(dir.path(), grpc, &key_file, "32MiB");
    wait_mounted(&client, 3, &mut [&mut master, &mut a, &mut b, &mut c]).await;
    let pool = pool_client(grpc, KEY, "writer", |c| c.prefer_shm = false);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let mut acked = Vec::new();
    let mut failed = Vec::new();
    let mut killed_at = None;
    for id in 0..PUTS {
        if id == KILL_AT {
            b.kill().expect("SIGKILL agent-b");
            killed_at = Some(Instant::now());
        }
        match pool.put(&LOAD.key(id), &LOAD.value(id), &opts).await {
            Ok(_) => acked.push(id),
            Err(e) => failed.push((id, format!("{e:#}"))),
        }
    }
    let stream_after_kill = killed_at.map(|t| t.elapsed()).unwrap_or_default();
    assert!(
        (failed.len() as u64) * 100 < PUTS,
        "{} of {PUTS} puts failed: {failed:?}",
        failed.len()
    );
    for &id in &acked {
        let got = pool
            .get(&LOAD.key(id))
            .await
            .unwrap_or_else(|e| panic!("acknowledged object {id} lost: {e:#}"));
        assert!(got == LOAD.value(id), "object {id} reads back wrong bytes");
    }
    let (_, metrics) = http_get(admin, "/metrics").await.expect("metrics");
    let suspected = metric(
        &metrics,
        "kvpool_master_events_total",
        &["event=\"node_suspected\""],
    )
    .unwrap_or(0.0);
    assert!(
        suspected >= 1.0,
        "the master learned of the dead agent from the writer"
    );
    for p in [&mut master, &mut a, &mut c] {
        p.assert_running().expect("running");
    }
    println!(
        "figure: agent-b SIGKILLed after {KILL_AT} of {PUTS} puts with 2 replicas on 3 agents \
         (heartbeat timeout 10 s): {} puts failed, {} acknowledged, all read back byte-exact; \
         the {} puts after the kill took {stream_after_kill:?}",
        failed.len(),
        acked.len(),
        PUTS - KILL_AT
    );
}
