//! Same-node shared memory in pool mode, on a real `kvpool master` and `kvpool agent run`
//! processes on 127.0.0.1 (docs/transfer.md "Same-node shared memory in pool mode").
//! - `a_client_on_the_agents_node_copies_through_its_shared_memory`: an agent shares its DRAM
//!   segment by default; a pool client that opted in puts and gets every value through the
//!   mapping (its transfer metrics count shared-memory bytes, none over TCP, and the agent's
//!   TCP target serves nothing), a client that did not goes through TCP and reads the same
//!   bytes. The agent restarts: its memory is new, the master gives the segment a new id, and
//!   the opted-in client maps the new memfd (what it writes now, the TCP client reads back
//!   byte-exact; a stale mapping of the old memory would lose it).
//! - `an_agent_told_not_to_share_is_reached_over_tcp`: `pool.same_node_shm: false` announces
//!   no `shm://` endpoint and the opted-in client goes through TCP.

mod pool_support;

use std::sync::Arc;

use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use kvpool_transfer::{AuthKey, EngineConfig, StaticDirectory, TransferEngine, TransferMetrics};
use pool_support::*;
use prometheus::{Registry, TextEncoder};

fn value(i: usize, round: u8) -> Vec<u8> {
    let len = [1, 4096, 65_536, 300_001][i % 4] + i;
    (0..len)
        .map(|j| (j.wrapping_mul(13) ^ i.wrapping_mul(7)) as u8 ^ round)
        .collect()
}

/// A pool client of node `node` whose transfer metrics land in the returned registry.
fn observed_client(
    grpc: std::net::SocketAddr,
    node: &str,
    same_node_shm: bool,
) -> (PoolClient, Registry) {
    let registry = Registry::new();
    let engine = TransferEngine::new(
        EngineConfig {
            node: node.into(),
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes().to_vec()).expect("transfer key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::new(&registry).expect("metrics"),
    )
    .expect("engine");
    let pool = PoolClient::new(master_client(grpc, KEY), engine, node.into(), None)
        .with_same_node_shm(same_node_shm);
    (pool, registry)
}

/// Bytes the client moved over `protocol` (both directions).
fn moved(registry: &Registry, protocol: &str) -> f64 {
    let text = TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("encode");
    kvpool_harness::scrape::metric_sum_labelled(
        &text,
        "kvpool_transfer_bytes_total",
        "protocol",
        protocol,
    )
}

/// Bytes the agent's TCP target served to peers.
async fn served(agent: &AgentAddrs) -> f64 {
    let (_, text) = http_get(agent.admin, "/metrics").await.expect("metrics");
    kvpool_harness::scrape::metric_sum(&text, "kvpool_transfer_served_bytes_total")
}

async fn put_all(pool: &PoolClient, keys: &[Vec<u8>], round: u8) -> u32 {
    let mut ids = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let replicas = pool
            .put(key, &value(i, round), &PutOptions::default())
            .await
            .expect("put");
        ids.extend(replicas.iter().map(|r| r.segment_id));
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one segment holds every value: {ids:?}");
    ids[0]
}

async fn check_all(pool: &PoolClient, keys: &[Vec<u8>], round: u8, how: &str) {
    for (i, key) in keys.iter().enumerate() {
        let got = pool.get(key).await.expect("get");
        assert!(got == value(i, round), "value {i} read {how} differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_the_agents_node_copies_through_its_shared_memory() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let (mut agent, addrs) = start_agent(dir.path(), "agent-a", grpc, &key_file, "8MiB");
    wait_mounted(&client, 1, &mut [&mut master, &mut agent]).await;

    let (shm, shm_metrics) = observed_client(grpc, "engine-shm", true);
    let (tcp, tcp_metrics) = observed_client(grpc, "engine-tcp", false);
    let keys = numbered_keys("shm", 12);
    let bytes: usize = (0..keys.len()).map(|i| value(i, 0).len()).sum();
    let first_id = put_all(&shm, &keys, 0).await;
    check_all(&shm, &keys, 0, "through shared memory").await;
    assert_eq!(
        moved(&shm_metrics, "shm"),
        (2 * bytes) as f64,
        "every byte both ways"
    );
    assert_eq!(moved(&shm_metrics, "tcp"), 0.0);
    assert_eq!(served(&addrs).await, 0.0, "the TCP target served nothing");
    check_all(&tcp, &keys, 0, "over TCP").await;
    assert_eq!(moved(&tcp_metrics, "tcp"), bytes as f64);
    assert_eq!(served(&addrs).await, bytes as f64);

    // A restart gives the agent new memory; the master mounts it under a new id.
    agent
        .signal(nix::sys::signal::Signal::SIGTERM)
        .expect("signal");
    wait_exit(&mut agent);
    let (mut agent, addrs) = start_agent(dir.path(), "agent-a", grpc, &key_file, "8MiB");
    wait_ready(&addrs, &mut agent);
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut probe = 0;
    let second_id = loop {
        // The agent is ready before the master has its new mount: until then a put fails.
        probe += 1;
        let key = format!("probe-{probe}");
        if let Ok(r) = shm
            .put(key.as_bytes(), &[1u8; 10], &PutOptions::default())
            .await
            && let Some(id) = r.first().map(|r| r.segment_id)
            && id != first_id
        {
            break id;
        }
        assert!(std::time::Instant::now() < deadline, "no remount");
        agent.assert_running().expect("agent runs");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let keys = numbered_keys("after", 8);
    assert_eq!(put_all(&shm, &keys, 1).await, second_id);
    check_all(&tcp, &keys, 1, "over TCP after the restart").await;
    check_all(&shm, &keys, 1, "through the new mapping").await;
    assert_eq!(moved(&shm_metrics, "tcp"), 0.0, "still no TCP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_not_to_share_is_reached_over_tcp() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let (mut agent, addrs) = start_agent_with(
        dir.path(),
        "agent-a",
        grpc,
        &key_file,
        "8MiB",
        "  same_node_shm: false\n",
    );
    wait_mounted(&client, 1, &mut [&mut master, &mut agent]).await;
    let (shm, metrics) = observed_client(grpc, "engine-shm", true);
    let keys = numbered_keys("plain", 4);
    let replicas = shm
        .put(&keys[0], &value(0, 0), &PutOptions::default())
        .await
        .expect("put");
    assert!(
        replicas[0]
            .endpoints
            .iter()
            .all(|e| e.starts_with("tcp://")),
        "{:?}",
        replicas[0].endpoints
    );
    put_all(&shm, &keys, 0).await;
    check_all(&shm, &keys, 0, "over TCP").await;
    assert_eq!(moved(&metrics, "shm"), 0.0);
    assert!(moved(&metrics, "tcp") > 0.0);
    assert!(served(&addrs).await > 0.0);
}
