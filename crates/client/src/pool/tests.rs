//! Unit tests of the pool client's data path against in-process transfer engines ("agents"
//! serving a segment over loopback TCP); the master is never called.

use std::sync::Arc;

use super::staging::{MIN_STAGING, StagingCache};
use super::*;
use kvpool_core::master::types::{ReplicaInfo, Tier};
use kvpool_transfer::{self as transfer, Endpoint, HostOptions, Segment, TransferOp};

fn replica(endpoints: &[&str]) -> ReplicaInfo {
    ReplicaInfo {
        node: "n1".into(),
        segment_id: 7,
        segment: "dram0".into(),
        tier: Tier::Dram,
        numa_node: 1,
        endpoints: endpoints.iter().map(|s| (*s).to_owned()).collect(),
        offset: 4096,
        length: 10,
    }
}

const KEY: &[u8] = b"data-module-test-key-0123456789";

fn engine(node: &str) -> TransferEngine {
    TransferEngine::new(
        transfer::EngineConfig {
            node: node.into(),
            lanes: 2,
            ..transfer::EngineConfig::default()
        },
        transfer::AuthKey::new(KEY.to_vec()).expect("key"),
        Arc::new(transfer::StaticDirectory::new()),
        transfer::TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

/// An in-process "agent": an engine with segment `<node>/dram0` served over TCP.
fn target(node: &str) -> (TransferEngine, transfer::LocalSegment, transfer::TcpServer) {
    let e = engine(node);
    let seg = Segment::host(1 << 20, HostOptions::default()).expect("segment");
    let local = e
        .register(&transfer_name(node, "dram0"), Arc::new(seg))
        .expect("register");
    let server = e
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listen");
    (e, local, server)
}

fn located(node: &str, server: &transfer::TcpServer, offset: u64, len: u64) -> ReplicaInfo {
    ReplicaInfo {
        node: node.into(),
        segment_id: 1,
        segment: "dram0".into(),
        tier: Tier::Dram,
        numa_node: 0,
        endpoints: vec![tcp_endpoint(server.local_addr())],
        offset,
        length: len,
    }
}

fn pool_client() -> PoolClient {
    // The master is never called by the data-path helpers tested here.
    let master = MasterClient::new(
        vec!["127.0.0.1:1".into()],
        kvpool_proto::auth::AuthKey::from_bytes(KEY).expect("master key"),
        crate::master::ClientConfig::default(),
    )
    .expect("client");
    PoolClient::new(master, engine("reader"), "reader".into(), None)
}

#[test]
fn writes_reach_every_replica_and_reads_fall_back() {
    let (_ea, seg_a, server_a) = target("a");
    let (_eb, seg_b, server_b) = target("b");
    let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let len = value.len() as u64;
    let ra = located("a", &server_a, 8192, len);
    let rb = located("b", &server_b, 4096, len);
    let pool = pool_client();
    pool.write_replicas(&value, &[ra.clone(), rb.clone()])
        .expect("write");
    for (seg, off) in [(&seg_a, 8192), (&seg_b, 4096)] {
        let mut got = vec![0u8; value.len()];
        seg.segment().read_at(off, &mut got).expect("read back");
        assert!(got == value, "replica at {off} holds the value");
    }
    // A replica whose owner is gone: the read moves on to the next one.
    let dead_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let mut dead = ra.clone();
    dead.endpoints = vec![tcp_endpoint(dead_addr)];
    let got = pool
        .read_vec(len, &[dead.clone(), rb])
        .expect("fallback read");
    assert!(got == value);
    // Nothing readable: the last failure is reported.
    let err = pool.read_vec(len, &[dead]).expect_err("no replica left");
    assert_eq!(err.category(), "open");
    assert_eq!(
        pool.read_vec(len, &[]).expect_err("empty").category(),
        "no_replica"
    );
}

#[test]
fn bad_locations_are_refused_before_any_transfer() {
    let (_e, seg, server) = target("a");
    let pool = pool_client();
    let value = vec![7u8; 4096];
    // Length differing from the value: refused, nothing written.
    let short = located("a", &server, 0, 100);
    assert_eq!(
        pool.write_replicas(&value, &[short])
            .expect_err("size mismatch")
            .category(),
        "size_mismatch"
    );
    let mut got = vec![1u8; 4096];
    seg.segment().read_at(0, &mut got).expect("read");
    assert!(got.iter().all(|b| *b == 0), "nothing was written");
    // Past the end of the remote segment: the engine refuses the request.
    let beyond = located("a", &server, (1 << 20) - 1024, 4096);
    assert_eq!(
        pool.write_replicas(&value, &[beyond])
            .expect_err("out of bounds")
            .category(),
        "transfer"
    );
    // Wrong segment name on the right endpoint.
    let mut wrong = located("a", &server, 0, 4096);
    wrong.segment = "dram9".into();
    assert_eq!(
        pool.read_vec(4096, &[wrong])
            .expect_err("unknown")
            .category(),
        "open"
    );
}

#[test]
fn staging_buffers_are_reused_and_never_leak_old_bytes() {
    let (_e, seg, server) = target("a");
    let pool = pool_client();
    let a: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    let b: Vec<u8> = (0..70_000u32).map(|i| (i % 7) as u8 + 1).collect();
    let ra = located("a", &server, 0, a.len() as u64);
    let rb = located("a", &server, 200_000, b.len() as u64);
    pool.write_replicas(&a, std::slice::from_ref(&ra))
        .expect("write a");
    // One 128 KiB buffer (the class of 100,000 bytes) is idle now and is reused below.
    assert_eq!(pool.staging_cache.idle_bytes(), 128 * 1024);
    pool.write_replicas(&b, std::slice::from_ref(&rb))
        .expect("write b");
    assert_eq!(pool.staging_cache.idle_bytes(), 128 * 1024);
    // The reused buffer still holds b's bytes: reads must see exactly what the replica holds.
    assert!(pool.read_vec(a.len() as u64, &[ra]).expect("read a") == a);
    assert!(pool.read_vec(b.len() as u64, &[rb]).expect("read b") == b);
    let mut stored = vec![0u8; b.len()];
    seg.segment()
        .read_at(200_000, &mut stored)
        .expect("replica");
    assert!(stored == b);
    // A failed transfer does not return its buffer (a late reply could land in it).
    let beyond = located("a", &server, (1 << 20) - 1024, a.len() as u64);
    pool.write_replicas(&a, &[beyond])
        .expect_err("out of bounds");
    assert_eq!(pool.staging_cache.idle_bytes(), 0);
    // With the cache disabled nothing is kept.
    let uncached = pool_client().with_staging_cache(0);
    let rc = located("a", &server, 0, a.len() as u64);
    uncached.write_replicas(&a, &[rc]).expect("write");
    assert_eq!(uncached.staging_cache.idle_bytes(), 0);
    assert_eq!(StagingCache::class(1), MIN_STAGING);
    assert_eq!(StagingCache::class(MIN_STAGING + 1), 2 * MIN_STAGING);
    assert_eq!(StagingCache::class(4 << 20), 4 << 20);
}

#[test]
fn replicas_in_local_segments_are_copied_without_a_transport() {
    let local = LocalSegments::default();
    let seg = Arc::new(Segment::host(1 << 16, HostOptions::default()).expect("segment"));
    local.insert("reader/dram0", Arc::clone(&seg));
    let pool = pool_client().with_local_segments(local.clone());
    let value: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
    let mut r = replica(&["tcp://127.0.0.1:1"]);
    r.node = "reader".into();
    r.length = value.len() as u64;
    // Nothing listens on the endpoint: only the in-process copy can succeed.
    pool.write_replicas(&value, std::slice::from_ref(&r))
        .expect("local write");
    let mut got = vec![0u8; value.len()];
    seg.read_at(r.offset, &mut got).expect("read back");
    assert!(got == value);
    assert!(
        pool.read_vec(r.length, std::slice::from_ref(&r))
            .expect("local read")
            == value
    );
    assert!(
        pool.write_all_local(&value, std::slice::from_ref(&r))
            .expect("direct")
    );
    // Past the end of the segment: refused with the local category, nothing written.
    r.offset = (1 << 16) - 4096;
    assert_eq!(
        pool.write_replicas(&value, std::slice::from_ref(&r))
            .expect_err("out of bounds")
            .category(),
        "local"
    );
    // Once withdrawn, the same replica needs the transport (and fails: nobody listens).
    local.remove("reader/dram0");
    assert!(
        !pool
            .write_all_local(&value, std::slice::from_ref(&r))
            .expect("not local")
    );
    assert_eq!(
        pool.read_vec(r.length, &[r])
            .expect_err("no transport")
            .category(),
        "open"
    );
}

#[test]
fn manifests_round_trip_and_only_match_their_own_key() {
    let m = Manifest::new(10 * 1024 + 5, 4096).expect("manifest");
    assert_eq!(m.parts, 3);
    assert_eq!(m.part(0), (0, 4096));
    assert_eq!(m.part(2), (8192, 2053), "the last part is short");
    let bytes = m.encode(b"big-object");
    assert_eq!(Manifest::decode(b"big-object", &bytes), Some(m));
    assert_eq!(
        Manifest::decode(b"other-key", &bytes),
        None,
        "another key's manifest"
    );
    assert_eq!(
        Manifest::decode(b"big-object", &bytes[..40]),
        None,
        "short value"
    );
    let mut bad = bytes;
    bad[0] ^= 1;
    assert_eq!(Manifest::decode(b"big-object", &bad), None, "no magic");
    let mut parts = bytes;
    parts[48] = 9;
    assert_eq!(
        Manifest::decode(b"big-object", &parts),
        None,
        "inconsistent part count"
    );
    let mut zero = bytes;
    zero[40..48].copy_from_slice(&0u64.to_le_bytes());
    assert_eq!(
        Manifest::decode(b"big-object", &zero),
        None,
        "zero part size"
    );
    assert!(Manifest::new(1 << 40, 1).is_none(), "too many parts");
    // Part keys: fixed length, distinct per part and per object.
    let k0 = stripe_part_key(b"big-object", 0);
    assert_eq!(k0.len(), 33);
    assert_ne!(k0, stripe_part_key(b"big-object", 1));
    assert_ne!(k0, stripe_part_key(b"other-key", 0));
}

#[test]
fn endpoints_parse_and_unknown_schemes_are_skipped() {
    let eps = parse_endpoints(&[
        "rdma://mlx5_0/1/3".into(),
        "tcp://127.0.0.1:7000".into(),
        "tcp://not-an-address".into(),
        "shm:///run/kvpool/transfer.sock".into(),
        "shm://relative".into(),
    ]);
    assert_eq!(
        eps,
        vec![
            Endpoint::Tcp("127.0.0.1:7000".parse().expect("addr")),
            Endpoint::Shm("/run/kvpool/transfer.sock".into()),
        ]
    );
    assert_eq!(
        tcp_endpoint("10.0.0.1:5".parse().expect("addr")),
        "tcp://10.0.0.1:5"
    );
}

#[test]
fn descriptor_names_the_agent_registration() {
    let d = descriptor(&replica(&["tcp://127.0.0.1:7000"])).expect("descriptor");
    assert_eq!(d.name, transfer_name("n1", "dram0"));
    assert_eq!(d.name, "n1/dram0");
    assert_eq!(d.node, "n1");
    assert_eq!(d.numa_node, Some(1));
    assert_eq!(
        d.tcp_endpoint(),
        Some("127.0.0.1:7000".parse().expect("addr"))
    );
    let e = descriptor(&replica(&["rdma://x"])).expect_err("no usable endpoint");
    assert_eq!(e.category(), "no_endpoint");
}

#[test]
fn only_failures_of_the_peer_move_a_put_elsewhere() {
    use kvpool_transfer::Failure;
    let peer = |c, r: &str| super::put::peer_unreachable(&Failure::new(c, r));
    assert!(peer(
        "connect",
        "connecting to 127.0.0.1:9 failed: Connection refused"
    ));
    assert!(peer("closed", "peer closed the connection"));
    assert!(peer(
        "io",
        "connection I/O failed: Connection reset by peer (os error 104)"
    ));
    assert!(peer("timeout", "batch did not complete within 5s"));
    // A caller buffer unmapped since it was registered: this side's fault (the transfer
    // engine's `local_memory`, from EFAULT, whatever the text says).
    assert!(!peer(
        "local_memory",
        "connection I/O failed: Bad address (os error 14)"
    ));
    let efault = std::io::Error::from_raw_os_error(libc::EFAULT);
    assert_eq!(kvpool_transfer::wire::io_category(&efault), "local_memory");
    let reset = std::io::Error::from_raw_os_error(libc::ECONNRESET);
    assert_eq!(kvpool_transfer::wire::io_category(&reset), "io");
    // Wrapped, as a sealed or TLS send wraps a segment's read error: still this side's.
    let wrapped = std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        kvpool_transfer::MemoryError::Fault(std::io::Error::from_raw_os_error(libc::EFAULT)),
    );
    assert_eq!(kvpool_transfer::wire::io_category(&wrapped), "local_memory");
    let wrapped_reset = std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        std::io::Error::from_raw_os_error(libc::ECONNRESET),
    );
    assert_eq!(kvpool_transfer::wire::io_category(&wrapped_reset), "io");
    // The peer answered: it is there.
    assert!(!peer(
        "remote",
        "peer answered with error out_of_bounds: ..."
    ));
}

#[test]
fn a_batch_item_takes_a_value_that_fits_its_ranges() {
    let pool = pool_client();
    let buf = pool.register_buffer(4096).expect("buffer");
    let one = BatchItem::one(b"k", &buf, 100, 50);
    assert!(one.fits(50).is_ok() && one.fits(10).is_ok());
    assert!(matches!(
        one.fits(51),
        Err(DataError::BufferTooSmall { size: 51, have: 50 })
    ));
    // Near the end of the buffer, the room is what is left of it.
    let tail = BatchItem::one(b"k", &buf, 4096 - 8, 50);
    assert!(matches!(
        tail.fits(9),
        Err(DataError::BufferTooSmall { have: 8, .. })
    ));
    // Several ranges: the value must fill them exactly.
    let two = BatchItem {
        key: b"k",
        ranges: vec![(&buf, 0, 10), (&buf, 64, 20)],
        part: None,
    };
    assert!(two.fits(30).is_ok());
    assert!(matches!(
        two.fits(31),
        Err(DataError::BufferTooSmall { .. })
    ));
    assert!(matches!(
        two.fits(29),
        Err(DataError::SizeMismatch { got: 29, want: 30 })
    ));
    // A part of a value: the value must hold the ranges' bytes from the offset on.
    let part = BatchItem {
        key: b"k",
        ranges: vec![(&buf, 0, 10), (&buf, 64, 20)],
        part: Some(100),
    };
    assert!(part.fits(130).is_ok() && part.fits(4000).is_ok());
    assert_eq!(part.read_len(4000), 30);
    assert!(matches!(
        part.fits(129),
        Err(DataError::OutsideValue {
            offset: 100,
            len: 30,
            size: 129
        })
    ));
    // One range with a part: exactly its bytes, not the rest of the value.
    let one_part = BatchItem {
        part: Some(0),
        ..BatchItem::one(b"k", &buf, 0, 50)
    };
    assert!(one_part.fits(5000).is_ok() && one_part.fits(49).is_err());
    assert_eq!(one_part.read_len(5000), 50);
}

#[test]
fn a_batch_item_of_several_ranges_moves_them_in_order_with_no_copy() {
    let (_e, seg, server) = target("a");
    let pool = pool_client();
    let src = pool.register_buffer(4096).expect("source");
    let dst = pool.register_buffer(4096).expect("destination");
    let value: Vec<u8> = (0..3000u32).map(|i| (i % 241) as u8).collect();
    // The value's two parts live apart in the source (1000 bytes at 0, 2000 at 1500).
    src.segment().write_at(0, &value[..1000]).expect("part 1");
    src.segment()
        .write_at(1500, &value[1000..])
        .expect("part 2");
    let r = located("a", &server, 8192, 3000);
    let put = BatchItem {
        key: b"k",
        ranges: vec![(&src, 0, 1000), (&src, 1500, 2000)],
        part: None,
    };
    let reqs = put
        .requests(&pool, TransferOp::Write, &r, 3000)
        .expect("write requests");
    assert_eq!(
        reqs.iter()
            .map(|q| (q.local_offset, q.remote_offset, q.len))
            .collect::<Vec<_>>(),
        [(0, 8192, 1000), (1500, 9192, 2000)]
    );
    pool.engine.transfer(reqs).expect("write");
    let mut held = vec![0u8; 3000];
    seg.segment().read_at(8192, &mut held).expect("replica");
    assert!(held == value, "the replica holds the parts in order");
    // Read back split differently: 2500 bytes at 100, 500 at 3000.
    let get = BatchItem {
        key: b"k",
        ranges: vec![(&dst, 100, 2500), (&dst, 3000, 500)],
        part: None,
    };
    let reqs = get
        .requests(&pool, TransferOp::Read, &r, 3000)
        .expect("read requests");
    pool.engine.transfer(reqs).expect("read");
    let (mut a, mut b) = (vec![0u8; 2500], vec![0u8; 500]);
    dst.segment().read_at(100, &mut a).expect("range 1");
    dst.segment().read_at(3000, &mut b).expect("range 2");
    assert!(a == value[..2500] && b == value[2500..]);
    // A part: 1200 bytes from offset 1000 of the value, into two ranges.
    let part = BatchItem {
        key: b"k",
        ranges: vec![(&dst, 0, 700), (&dst, 2000, 500)],
        part: Some(1000),
    };
    let reqs = part
        .requests(&pool, TransferOp::Read, &r, 3000)
        .expect("part requests");
    assert_eq!(
        reqs.iter()
            .map(|q| (q.local_offset, q.remote_offset, q.len))
            .collect::<Vec<_>>(),
        [(0, 9192, 700), (2000, 9892, 500)]
    );
    pool.engine.transfer(reqs).expect("read part");
    let (mut a, mut b) = (vec![0u8; 700], vec![0u8; 500]);
    dst.segment().read_at(0, &mut a).expect("part 1");
    dst.segment().read_at(2000, &mut b).expect("part 2");
    assert!(a == value[1000..1700] && b == value[1700..2200]);
    // A replica of another length is refused before any transfer.
    let short = located("a", &server, 8192, 2999);
    assert!(matches!(
        get.requests(&pool, TransferOp::Read, &short, 3000),
        Err(DataError::SizeMismatch { .. })
    ));
}
