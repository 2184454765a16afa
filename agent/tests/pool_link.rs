//! `PoolLink` against an in-process master on loopback gRPC (the real service and client):
//! mounting, the remount after the master declared the node dead, and unmount on stop; the
//! announcement of the SSD segment's durable index after a mount, with a refused block; the
//! master's segment-event feed applied to the index with the COMMIT->FREE window forced (the
//! range reused between the heartbeat answer and its application).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_agent::pool::{PoolLink, PoolMetrics, PoolRegistrar, SSD_SEGMENT, segment_name};
use kvpool_agent::ssd::pool::PoolSsdIndex;
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_core::master::{SegmentSpec, Tier};
use kvpool_master::cmd::loopback_args as loopback_master_args;
use kvpool_master::cmd::{MasterArgs, RunningMaster, start};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_proto::master::StatsResponse;
use kvpool_transfer::{
    AuthKey, EngineConfig, HostOptions, Segment, StaticDirectory, TransferEngine, TransferMetrics,
};
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

/// An in-process master on loopback whose nodes die after `heartbeat_timeout` of silence, a
/// client of it, and the directory of its key (also the tests' scratch space).
struct Master {
    dir: tempfile::TempDir,
    stop: CancellationToken,
    running: RunningMaster,
    client: MasterClient,
}

impl Master {
    async fn start(heartbeat_timeout: Duration) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, KEY).expect("key file");
        let args = MasterArgs {
            heartbeat_timeout,
            max_replicas: 8,
            ..loopback_master_args(key_file)
        };
        let stop = CancellationToken::new();
        let running = start(args.validate().expect("valid"), stop.clone())
            .await
            .expect("master");
        let client = MasterClient::new(
            vec![running.grpc_addr.to_string()],
            MasterKey::from_bytes(KEY.as_bytes()).expect("key"),
            ClientConfig::default(),
        )
        .expect("client");
        Self {
            dir,
            stop,
            running,
            client,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.running.join().await;
    }
}

/// The transfer engine of `node`, with the pool's key.
fn node_engine(node: &str) -> TransferEngine {
    TransferEngine::new(
        EngineConfig {
            node: node.into(),
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes().to_vec()).expect("key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

fn memory(len: usize) -> Segment {
    Segment::host(len, HostOptions::default()).expect("memory")
}

/// A 1 MiB segment `name` of `tier` on `node`, listed at an address nothing serves (the master
/// only books it).
fn unreachable_segment(node: &str, name: &str, tier: Tier) -> SegmentSpec {
    SegmentSpec {
        node: node.into(),
        name: name.into(),
        tier,
        capacity_bytes: 1 << 20,
        numa_node: 0,
        failure_domain: String::new(),
        endpoints: vec!["tcp://127.0.0.1:9".into()],
        persistent: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_mounts_remounts_after_death_and_unmounts_on_stop() {
    // The test lets the node die by not heartbeating; long enough that a stalled test thread
    // on a loaded box is not taken for a death between two steps.
    let master = Master::start(Duration::from_secs(5)).await;
    let client = master.client.clone();

    let engine = node_engine("node-1");
    let registrar = Arc::new(PoolRegistrar::new(
        engine,
        "node-1".into(),
        "tcp://127.0.0.1:9".into(),
    ));
    for index in 0..2 {
        registrar
            .register(&segment_name(index), Tier::Dram, index, memory(1 << 20))
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

    master.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_announces_the_ssd_index_and_forgets_refused_blocks() {
    use kvpool_core::master::{ObjectKey, PutOptions, PutStarted};
    use std::os::unix::fs::FileExt;

    let master = Master::start(Duration::from_secs(30)).await;
    let client = master.client.clone();
    let dir = &master.dir;

    // Another node already holds key "b" with another size: adopting our "b" is refused.
    client
        .mount_segment(&unreachable_segment("node-2", "dram0", Tier::Dram))
        .await
        .expect("mount node-2");
    let PutStarted::Allocated { put_id, .. } = client
        .put_start(b"b", 300, &PutOptions::default())
        .await
        .expect("put_start")
    else {
        panic!("new key");
    };
    client.put_end(b"b", put_id).await.expect("put_end");

    // The SSD segment's file holds "a" (5000 bytes at 0) and "b" (100 bytes at 8192), indexed.
    let data_path = dir.path().join("pool-ssd.dat");
    let (a, b) = (vec![7u8; 5000], vec![8u8; 100]);
    {
        let (mut index, _) = PoolSsdIndex::open(dir.path(), &data_path, 1 << 20).expect("index");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&data_path)
            .expect("data");
        f.set_len(1 << 20).expect("size");
        f.write_all_at(&a, 0).expect("a");
        f.write_all_at(&b, 8192).expect("b");
        index
            .record(ObjectKey::from_bytes(b"a"), 0, 5000, crc32c::crc32c(&a))
            .expect("record a");
        index
            .record(ObjectKey::from_bytes(b"b"), 8192, 100, crc32c::crc32c(&b))
            .expect("record b");
        index.sync().expect("sync");
    }
    let (index, recovery) = PoolSsdIndex::open(dir.path(), &data_path, 1 << 20).expect("reopen");
    assert_eq!(recovery.blocks.len(), 2);

    let engine = node_engine("node-1");
    let registrar = Arc::new(PoolRegistrar::new(
        engine.clone(),
        "node-1".into(),
        "tcp://127.0.0.1:9".into(),
    ));
    registrar
        .register(SSD_SEGMENT, Tier::Ssd, 0, memory(1 << 20))
        .expect("register");
    registrar.set_ssd_index(index);
    let registry = prometheus::Registry::new();
    let metrics = PoolMetrics::new(&registry).expect("metrics");
    let link = PoolLink::new(
        client.clone(),
        Arc::clone(&registrar),
        Duration::from_millis(100),
    )
    .with_metrics(metrics.clone(), engine);
    link.step().await;
    assert_eq!(registrar.mounted().len(), 1);

    // "a" is adopted on node-1's ssd0 where it was written; "b" keeps its one DRAM replica.
    let got = client.get(b"a").await.expect("a adopted");
    assert_eq!(got.size, 5000);
    assert_eq!(got.replicas.len(), 1);
    let r = &got.replicas[0];
    assert_eq!(
        (r.node.as_str(), r.segment.as_str(), r.tier, r.offset),
        ("node-1", "ssd0", Tier::Ssd, 0)
    );
    let got = client.get(b"b").await.expect("b");
    assert_eq!((got.size, got.replicas.len()), (300, 1));
    assert_eq!(got.replicas[0].node, "node-2");
    assert_eq!(metrics.ssd_blocks_adopted.get(), 1);
    assert_eq!(
        metrics
            .ssd_blocks_dropped
            .with_label_values(&["refused"])
            .get(),
        1
    );
    // The refused block is gone from the index; the gauge counts the synced remainder.
    let index = registrar.ssd_index().expect("index");
    let keys: Vec<ObjectKey> = index.lock().blocks().iter().map(|b| b.key).collect();
    assert_eq!(keys, vec![ObjectKey::from_bytes(b"a")]);
    assert_eq!(metrics.ssd_index_blocks.get(), 1);
    // A second pass announces nothing again.
    link.step().await;
    assert_eq!(metrics.ssd_blocks_adopted.get(), 1);

    master.stop().await;
}

/// The COMMIT->FREE window against the real master's allocator and feed: the heartbeat answer
/// carrying the commit of `k1` is held back while `k1` is removed and its range handed to `k2`,
/// whose writer overwrites it; only then does the agent apply the answer (checksumming `k2`'s
/// bytes under `k1`). A SIGKILL at that point (the index reopened from its files) must not
/// bring `k1` back; the following answers drop `k1` and make `k2` durable with its own bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_reused_before_its_commit_is_applied_never_returns_under_the_old_key() {
    use kvpool_agent::pool::feed::{FeedState, apply_events};
    use kvpool_core::master::state::SegmentEventKind;
    use kvpool_core::master::{ObjectKey, PutOptions, PutStarted};
    use std::os::unix::fs::FileExt;

    let master = Master::start(Duration::from_secs(30)).await;
    let client = master.client.clone();
    let dir = master.dir.path();
    let data_path = dir.join("pool-ssd.dat");
    let (index, _) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("index");
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&data_path)
        .expect("data");
    data.set_len(1 << 20).expect("size");
    let registrar = PoolRegistrar::new(
        node_engine("node-1"),
        "node-1".into(),
        "tcp://127.0.0.1:9".into(),
    );
    registrar.set_ssd_index(index);
    let index = registrar.ssd_index().expect("index");
    let seg = client
        .mount_segment(&unreachable_segment("node-1", SSD_SEGMENT, Tier::Ssd))
        .await
        .expect("mount ssd0");
    // A remote writer: allocate, write the bytes into the segment's file, commit.
    let put = |key: &'static [u8], value: Vec<u8>| {
        let (client, data) = (client.clone(), &data);
        async move {
            let opts = PutOptions {
                tier: Some(Tier::Ssd),
                ..PutOptions::default()
            };
            let PutStarted::Allocated { put_id, replicas } = client
                .put_start(key, value.len() as u64, &opts)
                .await
                .expect("put_start")
            else {
                panic!("a new key");
            };
            data.write_all_at(&value, replicas[0].offset)
                .expect("write");
            client.put_end(key, put_id).await.expect("put_end");
            replicas[0].offset
        }
    };
    let old: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    let new: Vec<u8> = (0..5000u32).map(|i| (i % 241) as u8 ^ 0x5a).collect();
    let (k1, k2) = (ObjectKey::from_bytes(b"k1"), ObjectKey::from_bytes(b"k2"));

    let offset = put(b"k1", old.clone()).await;
    let r1 = client
        .heartbeat_feed("node-1", 0, 0, &[], None)
        .await
        .expect("heartbeat 1");
    assert!(
        r1.events
            .iter()
            .any(|e| e.kind == SegmentEventKind::Commit && e.key == k1),
        "{:?}",
        r1.events
    );
    // Before the agent applies that answer: k1 removed, its range reused by k2.
    client.remove(b"k1").await.expect("remove k1");
    assert_eq!(
        put(b"k2", new.clone()).await,
        offset,
        "first fit reuses the range"
    );
    let targets = [(seg, index.clone())];
    let st = apply_events(
        &targets,
        r1.feed_epoch,
        &r1.events,
        FeedState::default(),
        None,
    )
    .expect("apply 1");
    let b = index.lock().block_at(offset).expect("indexed in memory");
    assert_eq!(
        (b.key, b.crc),
        (k1, crc32c::crc32c(&new)),
        "k2's checksum under k1"
    );

    // SIGKILL now: the restart replays the files.
    let (reopened, recovery) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("reopen");
    assert!(
        recovery.blocks.iter().all(|b| b.key != k1),
        "k1 came back with k2's bytes: {:?}",
        recovery.blocks
    );
    *index.lock() = reopened;

    // Without the kill the feed goes on: FREE k1 and COMMIT k2, then an answer that confirms.
    let r2 = client
        .heartbeat_feed("node-1", st.epoch, st.acked, &[], None)
        .await
        .expect("heartbeat 2");
    let st = apply_events(&targets, r2.feed_epoch, &r2.events, st, None).expect("apply 2");
    assert_eq!(index.lock().blocks(), Vec::new(), "k2 not confirmed yet");
    let r3 = client
        .heartbeat_feed("node-1", st.epoch, st.acked, &[], None)
        .await
        .expect("heartbeat 3");
    apply_events(&targets, r3.feed_epoch, &r3.events, st, None).expect("apply 3");
    let durable = index.lock().blocks();
    assert_eq!(durable.len(), 1);
    assert_eq!((durable[0].key, durable[0].crc), (k2, crc32c::crc32c(&new)));
    let (_, recovery) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("reopen");
    assert_eq!(
        recovery.blocks, durable,
        "k2 survives a restart, k1 does not"
    );

    master.stop().await;
}
