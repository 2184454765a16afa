//! `PoolLink` against an in-process master on loopback gRPC (the real service and client):
//! mounting, the remount after the master declared the node dead, and unmount on stop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::master::Tier;
use kvpool::master::auth::AuthKey as MasterKey;
use kvpool::master::client::{ClientConfig, MasterClient};
use kvpool::master::cmd::{MasterArgs, start};
use kvpool::master::proto::StatsResponse;
use kvpool::transfer::{
    AuthKey, EngineConfig, HostOptions, Segment, StaticDirectory, TransferEngine, TransferMetrics,
};
use kvpool_agent::pool::{PoolLink, PoolRegistrar, segment_name};
use tokio_util::sync::CancellationToken;

const KEY: &str = "pool-link-test-key-0123456789abcdef";
/// Only a hang ever reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

async fn wait_stats(client: &MasterClient, what: &str, done: impl Fn(&StatsResponse) -> bool) {
    let started = Instant::now();
    loop {
        if let Ok(s) = client.stats().await
            && done(&s)
        {
            return;
        }
        assert!(started.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_mounts_remounts_after_death_and_unmounts_on_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, KEY).expect("key file");
    let args = MasterArgs {
        listen: "127.0.0.1:0".parse().expect("addr"),
        admin_addr: "127.0.0.1:0".parse().expect("addr"),
        auth_key_file: key_file,
        etcd_endpoints: vec![],
        etcd_prefix: "/kvpool/test".into(),
        advertise_addr: None,
        election_ttl: Duration::from_secs(2),
        // The test lets the node die by not heartbeating; long enough that a stalled test thread
        // on a loaded box is not taken for a death between two steps.
        heartbeat_timeout: Duration::from_secs(5),
        lease_ttl: Duration::from_secs(60),
        put_timeout: Duration::from_secs(60),
        task_timeout: Duration::from_secs(60),
        tick_interval: Duration::from_millis(50),
        eviction_policy: kvpool::master::PolicyKind::Lru,
        dram_high_watermark: 0.95,
        dram_low_watermark: 0.85,
        ssd_high_watermark: 0.95,
        ssd_low_watermark: 0.85,
        max_replicas: 8,
    };
    let stop_master = CancellationToken::new();
    let master = start(args.validate().expect("valid"), stop_master.clone())
        .await
        .expect("master");
    let client = MasterClient::new(
        vec![master.grpc_addr.to_string()],
        MasterKey::from_bytes(KEY.as_bytes()).expect("key"),
        ClientConfig::default(),
    )
    .expect("client");

    let engine = TransferEngine::new(
        EngineConfig {
            node: "node-1".into(),
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes().to_vec()).expect("key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine");
    let registrar = Arc::new(PoolRegistrar::new(
        engine,
        "node-1".into(),
        "tcp://127.0.0.1:9".into(),
    ));
    for index in 0..2 {
        registrar
            .register(
                &segment_name(index),
                Tier::Dram,
                index,
                Segment::host(1 << 20, HostOptions::default()).expect("memory"),
            )
            .expect("register");
    }
    let link = PoolLink::new(
        client.clone(),
        Arc::clone(&registrar),
        Duration::from_millis(100),
    );

    let healthy = link.healthy();
    assert!(!*healthy.borrow(), "not healthy before the first mount");
    // One pass mounts both segments.
    link.step().await;
    assert!(*healthy.borrow(), "mounted and heartbeat accepted");
    assert_eq!(registrar.mounted().len(), 2);
    assert!(registrar.unmounted().is_empty());
    let s = client.stats().await.expect("stats");
    assert_eq!((s.nodes_alive, s.segments), (1, 2));
    assert_eq!(
        s.capacity_bytes.first().copied(),
        Some(2 << 20),
        "DRAM capacity"
    );

    // Silence: the master declares the node dead and drops its segments.
    wait_stats(&client, "the node declared dead", |s| s.nodes_alive == 0).await;
    // The next pass learns it from the heartbeat answer, the one after mounts again.
    link.step().await;
    assert!(registrar.mounted().is_empty(), "mounts forgotten");
    assert!(
        !*healthy.borrow(),
        "not healthy while the remount is pending"
    );
    link.step().await;
    assert_eq!(registrar.mounted().len(), 2, "mounted again");
    assert!(*healthy.borrow(), "healthy again");
    let s = client.stats().await.expect("stats");
    assert_eq!((s.nodes_alive, s.segments), (1, 2));

    // Stop: everything is unmounted.
    let stop = CancellationToken::new();
    let running = tokio::spawn(link.clone().run(stop.clone()));
    stop.cancel();
    running.await.expect("link task");
    assert!(registrar.mounted().is_empty());
    assert!(!*healthy.borrow(), "not healthy once stopped");
    wait_stats(&client, "segments unmounted", |s| s.segments == 0).await;

    stop_master.cancel();
    let _ = master.join().await;
}
