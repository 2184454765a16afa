//! The store client's batching against an in-process master and an in-process "agent" (a
//! transfer engine serving one DRAM segment over TCP on 127.0.0.1): concurrent gets and puts
//! share master calls (counted through the master's own request metrics), lease releases go
//! in background batches and leave no lease behind, a read that outlives its lease is refused
//! rather than returned, and `get_to` lands values straight in a caller-registered buffer.

mod pool_support;

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use kvpool_client::master::MasterClient;
use kvpool_client::pool::{DataError, PoolClient, tcp_endpoint, transfer_name};
use kvpool_core::master::{PutOptions, SegmentSpec};
use kvpool_harness::scrape::metric_sum_labelled;
use kvpool_transfer::{
    AuthKey, EngineConfig, HostOptions, LocalSegment, Segment, StaticDirectory, TcpServer,
    TransferEngine, TransferMetrics,
};
use pool_support::{InProcessMaster, dram_segment, http_get, in_process_master};

const KEY: &[u8] = b"coalescing-test-pool-key-0123456789";
const MIB: u64 = 1 << 20;

fn engine(node: &str) -> TransferEngine {
    TransferEngine::new(
        EngineConfig {
            node: node.into(),
            prefer_shm: false,
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.to_vec()).expect("transfer key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

struct Fixture {
    m: InProcessMaster,
    client: MasterClient,
    pool: PoolClient,
    _agent: (TransferEngine, LocalSegment, TcpServer),
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.m.shutdown.cancel();
    }
}

/// A master, one agent segment of 16 MiB mounted with it, and a remote reader's pool client.
async fn fixture(lease_ttl: Duration) -> Fixture {
    let m = in_process_master(KEY, |a| a.lease_ttl = lease_ttl).await;
    let client = m.client.clone();
    let agent = engine("agent-a");
    let seg = Segment::host((16 * MIB) as usize, HostOptions::default()).expect("segment");
    let local = agent
        .register(&transfer_name("agent-a", "dram0"), Arc::new(seg))
        .expect("register");
    let server = agent
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listen");
    client
        .mount_segment(&SegmentSpec {
            endpoints: vec![tcp_endpoint(server.local_addr())],
            ..dram_segment("agent-a", 16 * MIB)
        })
        .await
        .expect("mount");
    let pool = PoolClient::new(client.clone(), engine("reader"), "reader".into(), None);
    Fixture {
        m,
        client,
        pool,
        _agent: (agent, local, server),
    }
}

/// Calls of `method` the master answered, from its `kvpool_master_requests_total` counter.
async fn master_calls(f: &Fixture, method: &str) -> u64 {
    let (_, body) = http_get(f.m.master.admin_addr, "/metrics")
        .await
        .expect("metrics");
    metric_sum_labelled(&body, "kvpool_master_requests_total", "method", method) as u64
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u64).wrapping_mul(31).wrapping_add(i * 7919) as u8)
        .collect()
}

fn key(i: u64) -> Vec<u8> {
    format!("coalesce/{i}").into_bytes()
}

// A current-thread runtime: every future of a `join_all` queues its item before the batch
// sender task first runs, so the call counts below are exact, not likely.
#[tokio::test]
async fn concurrent_puts_and_gets_share_master_calls_and_release_every_lease() {
    let f = fixture(Duration::from_secs(60)).await;
    const N: u64 = 32;
    let opts = PutOptions::default();
    let values: Vec<Vec<u8>> = (0..N).map(|i| value(i, 4096 + i as usize * 100)).collect();
    let puts = join_all((0..N).map(|i| {
        let (pool, opts, v) = (f.pool.clone(), opts.clone(), &values[i as usize]);
        async move { pool.put(&key(i), v, &opts).await }
    }))
    .await;
    for (i, p) in puts.into_iter().enumerate() {
        assert_eq!(p.expect("put").len(), 1, "put {i} wrote one replica");
    }
    assert_eq!(
        master_calls(&f, "put_start").await,
        1,
        "one put_start for {N} puts"
    );
    let put_ends = master_calls(&f, "put_end").await;
    assert!(
        (1..N).contains(&put_ends),
        "{put_ends} put_end calls for {N} puts"
    );

    let gets = join_all((0..N).map(|i| {
        let pool = f.pool.clone();
        async move { pool.get(&key(i)).await }
    }))
    .await;
    for (i, g) in gets.into_iter().enumerate() {
        assert!(g.expect("get") == values[i], "value {i} read back");
    }
    assert_eq!(
        master_calls(&f, "get").await,
        1,
        "one get call for {N} gets"
    );
    f.pool.flush_releases().await;
    let releases = master_calls(&f, "release_leases").await;
    assert!(
        (1..N).contains(&releases),
        "{releases} release calls for {N} gets"
    );
    let stats = f.client.stats().await.expect("stats");
    assert_eq!(stats.leases, 0, "every lease released, none left to expire");
    let sent = f.client.batched_calls();
    assert_eq!((sent.get, sent.put_start), (1, 1));
    assert_eq!(sent.release_leases, releases);

    // The objects were read and released: a remove right after is not refused as leased.
    let refs: Vec<Vec<u8>> = (0..N).map(key).collect();
    let refs: Vec<&[u8]> = refs.iter().map(Vec::as_slice).collect();
    let removed = f.client.remove_batch(&refs).await.expect("remove");
    assert!(removed.iter().all(Result::is_ok), "{removed:?}");
}

#[tokio::test]
async fn leases_released_later_go_in_one_batch_and_a_stale_one_is_refused() {
    let f = fixture(Duration::from_secs(60)).await;
    let opts = PutOptions::default();
    f.pool
        .put(b"one", &value(1, 1000), &opts)
        .await
        .expect("put");
    let leases = join_all((0..10).map(|_| f.client.get(b"one"))).await;
    let ids: Vec<u64> = leases
        .into_iter()
        .map(|l| l.expect("located").lease_id)
        .collect();
    assert_eq!(f.client.stats().await.expect("stats").leases, 10);
    let before = master_calls(&f, "release_leases").await;
    for id in &ids {
        f.client.release_lease_later(*id);
    }
    f.client.flush_releases().await;
    assert_eq!(master_calls(&f, "release_leases").await, before + 1);
    assert_eq!(f.client.stats().await.expect("stats").leases, 0);
    // Coalesced single releases still answer per lease.
    let stale = f.client.release_lease(ids[0]).await.expect_err("released");
    assert_eq!(
        stale.code(),
        Some(kvpool_proto::master::ErrorCode::StaleLease)
    );
}

#[tokio::test]
async fn a_read_that_outlives_its_lease_is_refused() {
    // A lease shorter than the client's safety margin has surely run out by the time any
    // read completes: the bytes must not be handed out.
    let f = fixture(Duration::from_millis(1)).await;
    let opts = PutOptions::default();
    let v = value(7, 64 * 1024);
    f.pool.put(b"short", &v, &opts).await.expect("put");
    let e = f.pool.get(b"short").await.expect_err("lease ran out");
    assert!(matches!(e, DataError::LeaseExpired { .. }), "{e}");
    assert_eq!(e.category(), "lease_expired");
    let buf = f.pool.register_buffer(v.len() as u64).expect("buffer");
    let e = f
        .pool
        .get_to(b"short", &buf, 0)
        .await
        .expect_err("lease ran out");
    assert!(matches!(e, DataError::LeaseExpired { .. }), "{e}");
    // The object itself is intact; a reader with a longer lease gets it (next test).
    assert_eq!(
        f.client.exists(&[b"short"]).await.expect("exists"),
        vec![true]
    );
}

#[tokio::test]
async fn get_to_lands_in_the_registered_buffer_and_refuses_a_short_one() {
    let f = fixture(Duration::from_secs(60)).await;
    let opts = PutOptions::default();
    let v = value(9, (MIB + 123) as usize);
    f.pool.put(b"big", &v, &opts).await.expect("put");
    let buf = f.pool.register_buffer(2 * MIB).expect("buffer");
    buf.segment()
        .fill(0, (2 * MIB) as usize, 0xAA)
        .expect("fill");
    let n = f.pool.get_to(b"big", &buf, 4096).await.expect("get_to");
    assert_eq!(n, v.len() as u64);
    let mut got = vec![0u8; v.len() + 2];
    buf.segment().read_at(4095, &mut got).expect("read");
    assert_eq!(got[0], 0xAA, "nothing written before the offset");
    assert!(got[1..=v.len()] == v[..], "value at the offset");
    assert_eq!(got[v.len() + 1], 0xAA, "nothing written after the value");

    let small = f.pool.register_buffer(MIB).expect("small buffer");
    let e = f
        .pool
        .get_to(b"big", &small, 0)
        .await
        .expect_err("too small");
    assert!(
        matches!(e, DataError::BufferTooSmall { size, have } if size == v.len() as u64 && have == MIB),
        "{e}"
    );
    let e = f
        .pool
        .get_to(b"big", &buf, MIB)
        .await
        .expect_err("offset leaves too little room");
    assert!(matches!(e, DataError::BufferTooSmall { .. }), "{e}");
    // Refused reads give their leases back too.
    f.pool.flush_releases().await;
    assert_eq!(f.client.stats().await.expect("stats").leases, 0);
    f.pool.remove(b"big").await.expect("remove");
}
