//! Two agent failures in a row, with real processes on 127.0.0.1: one `kvpool master` and four
//! `kvpool agent run` processes in pool mode; this test is the client (its own transfer
//! engine). Objects are put with two replicas. One agent is SIGKILLed: the master declares it
//! dead after its heartbeat timeout and repairs every object that lost a replica onto another
//! agent, back to two replicas (asserted from the master's `Stats` and from each object's
//! replica list). Then a second agent is SIGKILLed: every object still had two replicas, so none
//! is lost; the master repairs again onto the two agents left, and every object reads back
//! byte-exact. The time from each kill to full replication is printed as a `figure:` line
//! (docs/reliability.md).

mod pool_support;

use std::time::{Duration, Instant};

use kvpool_client::master::MasterClient;
use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use kvpool_harness::ChildProcess;
use pool_support::load::Objects;
use pool_support::*;

const OBJECTS: u64 = 60;

/// Values of 16 KiB to ~60 KiB.
const LOAD: Objects = Objects::new("agent-kill-repair", 0x2e9a).lengths(16 * 1024, 12, 4096, 7);

/// The nodes holding each object's replicas, asking the master (leases released at once).
async fn replica_nodes(client: &MasterClient) -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for id in 0..OBJECTS {
        let nodes = pool_support::replica_nodes(client, &LOAD.key(id)).await;
        all.push(nodes.unwrap_or_else(|e| panic!("object {id} lost: {e:#}")));
    }
    all
}

/// Kill `victim` (named `name`), then wait until the master has declared it dead and every
/// object is back to two replicas on the agents left. Returns (time to the death being
/// noticed, time to full replication), both from the kill.
async fn kill_and_repair(
    client: &MasterClient,
    victim: &mut ChildProcess,
    name: &str,
    alive_after: u64,
    others: &mut [&mut ChildProcess],
) -> (Duration, Duration) {
    let killed = Instant::now();
    victim.kill().expect("SIGKILL");
    wait_stats(client, "the death noticed", others, |s| {
        s.nodes_alive == alive_after
    })
    .await;
    let noticed = killed.elapsed();
    let stats = wait_stats(client, "repaired to two replicas", others, |s| {
        s.under_replicated == 0 && s.tasks == 0
    })
    .await;
    let repaired = killed.elapsed();
    assert_eq!(stats.objects, OBJECTS, "no object lost");
    // The master's per-object view agrees with its counters.
    for (id, nodes) in replica_nodes(client).await.iter().enumerate() {
        assert_eq!(nodes.len(), 2, "object {id} has replicas on {nodes:?}");
        assert_ne!(nodes[0], nodes[1], "object {id}: both replicas on one node");
        assert!(
            nodes.iter().all(|n| n != name),
            "object {id} still on the dead {name}"
        );
    }
    (noticed, repaired)
}

async fn read_all(pool: &PoolClient) {
    for id in 0..OBJECTS {
        let got = pool
            .get(&LOAD.key(id))
            .await
            .unwrap_or_else(|e| panic!("object {id} unreadable: {e:#}"));
        assert!(got == LOAD.value(id), "object {id} bytes differ");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_recovers_after_a_second_agent_failure() {
    let (dir, key_file, mut master, grpc, client) = test_pool("2s");
    let [mut a, mut b, mut c, mut d] = start_agents(dir.path(), grpc, &key_file, "32MiB");
    wait_mounted(
        &client,
        4,
        &mut [&mut master, &mut a, &mut b, &mut c, &mut d],
    )
    .await;
    let pool = pool_client(grpc, KEY, "test-client", |c| c.prefer_shm = false);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    for id in 0..OBJECTS {
        pool.put(&LOAD.key(id), &LOAD.value(id), &opts)
            .await
            .expect("put");
    }
    let before = replica_nodes(&client).await;
    assert!(before.iter().all(|n| n.len() == 2), "{before:?}");
    let on = |nodes: &[Vec<String>], name: &str| {
        nodes.iter().filter(|n| n.iter().any(|x| x == name)).count()
    };
    let hit_b = on(&before, "agent-b");
    assert!(hit_b > 0, "agent-b holds replicas: {before:?}");

    let (noticed_1, repaired_1) = kill_and_repair(
        &client,
        &mut b,
        "agent-b",
        3,
        &mut [&mut master, &mut a, &mut c, &mut d],
    )
    .await;
    read_all(&pool).await;
    let after_1 = replica_nodes(&client).await;
    let hit_c = on(&after_1, "agent-c");
    assert!(
        hit_c > 0,
        "agent-c holds replicas after the repair: {after_1:?}"
    );

    let (noticed_2, repaired_2) = kill_and_repair(
        &client,
        &mut c,
        "agent-c",
        2,
        &mut [&mut master, &mut a, &mut d],
    )
    .await;
    read_all(&pool).await;
    println!(
        "figure: {OBJECTS} objects with 2 replicas on 4 agents (heartbeat timeout 2 s): agent-b \
         killed ({hit_b} objects lost a replica), noticed after {noticed_1:?}, 2 replicas again \
         after {repaired_1:?}; then agent-c killed ({hit_c} objects lost a replica), noticed \
         after {noticed_2:?}, 2 replicas again after {repaired_2:?}; 0 objects lost, 0 wrong \
         bytes"
    );
}
