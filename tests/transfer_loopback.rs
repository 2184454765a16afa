//! In-process transfer engine tests over real loopback sockets: data integrity across lanes and
//! slices, bounds checks on both sides, authentication, notify, peer loss and shared memory.

#![allow(clippy::unwrap_used)] // test crate: helpers outside #[test] fns unwrap too

use std::sync::Arc;
use std::time::Duration;

use kvpool_transfer::*;

const MIB: usize = 1024 * 1024;

fn key() -> AuthKey {
    AuthKey::new(*b"test-key-0123456789abcdef").unwrap()
}

fn config(node: &str) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 3,
        slice_size: 256 * 1024,
        window: 4,
        timeout: Duration::from_secs(5),
        ..EngineConfig::default()
    }
}

struct Pair {
    target: TransferEngine,
    initiator: TransferEngine,
    dir: Arc<StaticDirectory>,
    server: Option<TcpServer>,
    remote_mem: LocalSegment,
    local_mem: LocalSegment,
}

impl Pair {
    /// Another segment of `size` bytes on the target, registered as `name` and listed in the
    /// directory at the target's server.
    fn serve_segment(&self, name: &str, size: usize) -> LocalSegment {
        let seg = host_segment(&self.target, name, size);
        let server = self.server.as_ref().unwrap().local_addr();
        self.dir
            .insert(self.target.describe(&seg, vec![Endpoint::Tcp(server)]));
        seg
    }
}

/// An engine with `config` and `key` that finds segments in `dir`, its metrics registered
/// nowhere.
fn try_engine(
    config: EngineConfig,
    key: AuthKey,
    dir: &Arc<StaticDirectory>,
) -> Result<TransferEngine, TransferError> {
    TransferEngine::new(
        config,
        key,
        dir.clone(),
        TransferMetrics::unregistered().unwrap(),
    )
}

fn engine(config: EngineConfig, key: AuthKey, dir: &Arc<StaticDirectory>) -> TransferEngine {
    try_engine(config, key, dir).unwrap()
}

/// The target side's engine (node "node-t"), over `dir`.
fn target_engine(dir: &Arc<StaticDirectory>) -> TransferEngine {
    engine(config("node-t"), key(), dir)
}

fn pair_with(initiator_key: AuthKey) -> Pair {
    pair_configured(initiator_key, config("node-t"))
}

/// A pair whose target runs with `target_config`.
fn pair_configured(initiator_key: AuthKey, target_config: EngineConfig) -> Pair {
    let dir = Arc::new(StaticDirectory::new());
    let target = engine(target_config, key(), &dir);
    let initiator = engine(config("node-i"), initiator_key, &dir);
    let remote_mem = host_segment(&target, "t/dram0", 8 * MIB);
    let server = target.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    dir.insert(target.describe(&remote_mem, vec![Endpoint::Tcp(server.local_addr())]));
    let local_mem = host_segment(&initiator, "i/buf", 8 * MIB);
    Pair {
        target,
        initiator,
        dir,
        server: Some(server),
        remote_mem,
        local_mem,
    }
}

/// A host segment of `size` bytes registered with `engine` as `name`.
fn host_segment(engine: &TransferEngine, name: &str, size: usize) -> LocalSegment {
    engine
        .register(
            name,
            Arc::new(Segment::host(size, HostOptions::default()).unwrap()),
        )
        .unwrap()
}

/// Submits `batch` and waits (up to 10 s) until every request of it succeeded.
fn submit_and_wait(engine: &TransferEngine, batch: Vec<TransferRequest>) {
    engine
        .submit(batch)
        .unwrap()
        .wait_ok(Duration::from_secs(10))
        .unwrap();
}

/// `len` bytes of `seg` from `offset`.
fn read_seg(seg: &LocalSegment, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    seg.segment().read_at(offset, &mut out).unwrap();
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
        .collect()
}

fn req(
    p: &Pair,
    remote: &RemoteSegment,
    op: TransferOp,
    lo: u64,
    ro: u64,
    len: u64,
) -> TransferRequest {
    TransferRequest {
        op,
        local: p.local_mem.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: ro,
        len,
    }
}

#[test]
fn transfer_writes_and_reads_back_across_lanes_and_slices() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    assert_eq!(remote.len(), 8 * MIB as u64);
    assert_eq!(remote.protocol(), Protocol::Tcp);
    let data = pattern(3 * MIB + 12345, 7);
    p.local_mem.segment().write_at(100, &data).unwrap();
    // One large request (many slices over 3 lanes) plus several small ones in one batch.
    let mut reqs = vec![req(
        &p,
        &remote,
        TransferOp::Write,
        100,
        4096,
        data.len() as u64,
    )];
    for i in 0..8u64 {
        reqs.push(req(
            &p,
            &remote,
            TransferOp::Write,
            100 + i * 10,
            7 * MIB as u64 + i * 1000,
            10,
        ));
    }
    let batch = p.initiator.submit(reqs).unwrap();
    let st = batch.wait(Duration::from_secs(30)).unwrap();
    assert!(st.iter().all(|s| *s == RequestStatus::Done), "{st:?}");
    // The write completed, so the target's memory holds the bytes now.
    let got = read_seg(&p.remote_mem, 4096, data.len());
    assert!(got == data, "remote bytes differ after write");
    let mut small = [0u8; 10];
    p.remote_mem
        .segment()
        .read_at(7 * MIB as u64 + 3000, &mut small)
        .unwrap();
    assert_eq!(&small[..], &data[30..40]);

    // Read it back into another place of the local segment.
    p.initiator
        .transfer(vec![req(
            &p,
            &remote,
            TransferOp::Read,
            4 * MIB as u64,
            4096,
            data.len() as u64,
        )])
        .unwrap();
    let back = read_seg(&p.local_mem, 4 * MIB as u64, data.len());
    assert!(back == data, "bytes read back differ");
    let m = p.initiator.metrics();
    assert_eq!(
        m.bytes.with_label_values(&["tcp", "read"]).get(),
        data.len() as u64
    );
    assert!(m.connections.get() >= 1 && m.connections.get() <= 3);
    // The target counts what it served.
    let t = p.target.metrics();
    assert_eq!(
        t.served_bytes.with_label_values(&["read"]).get(),
        data.len() as u64
    );
    assert_eq!(
        t.served_bytes.with_label_values(&["write"]).get(),
        data.len() as u64 + 80
    );
    assert!(t.target_connections.get() >= 1);
}

#[test]
fn transfer_rejects_out_of_bounds_requests_before_sending() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let size = 8 * MIB as u64;
    for (lo, ro, len) in [(0, size - 10, 11), (size - 1, 0, 2), (0, u64::MAX, 2)] {
        let err = p
            .initiator
            .submit(vec![req(&p, &remote, TransferOp::Write, lo, ro, len)])
            .unwrap_err();
        assert_eq!(err.category(), "invalid_request", "{err}");
    }
    // Exactly at the end is fine.
    p.initiator
        .transfer(vec![req(&p, &remote, TransferOp::Read, 0, size - 10, 10)])
        .unwrap();
}

#[test]
fn transfer_with_a_wrong_key_can_do_nothing() {
    let p = pair_with(AuthKey::new(*b"some-other-key-0123456789").unwrap());
    p.remote_mem.segment().write_at(0, b"secret").unwrap();
    let err = p.initiator.open("t/dram0").unwrap_err();
    assert_eq!(err.category(), "handshake", "{err}");
    let msg = format!("{:?}", err);
    assert!(msg.contains("Auth"), "{msg}");
}

#[test]
fn transfer_notify_reaches_the_target_queue() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    p.initiator.notify(&remote, b"block 42 ready").unwrap();
    let n = p.target.recv_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.payload, b"block 42 ready");
    assert!(
        p.target
            .recv_notification(Duration::from_millis(10))
            .is_none()
    );
    let big = vec![0u8; 70 * 1024];
    assert_eq!(
        p.initiator.notify(&remote, &big).unwrap_err().category(),
        "notify"
    );
}

#[test]
fn transfer_unregistered_segment_cannot_be_opened_or_addressed() {
    let mut p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let name = p.remote_mem.name().to_owned();
    let seg = p.remote_mem.segment().clone();
    // Drop the only registration handle: the name and handle disappear from the target.
    let placeholder = host_segment(&p.target, "t/other", 4096);
    p.remote_mem = placeholder;
    let batch = p
        .initiator
        .submit(vec![req(&p, &remote, TransferOp::Read, 0, 0, 4096)])
        .unwrap();
    let st = batch.wait(Duration::from_secs(30)).unwrap();
    assert!(
        matches!(&st[0], RequestStatus::Failed(f) if f.category == "unknown_segment"),
        "{st:?}"
    );
    let err = p.initiator.open(&name).unwrap_err();
    assert!(
        err.to_string().contains("unknown_segment")
            || format!("{err:?}").contains("UnknownSegment")
            || format!("{err}").contains("no segment"),
        "{err}"
    );
    // The connection survived the error replies and the memory is still ours.
    assert_eq!(Arc::strong_count(&seg), 1);
    drop(p.dir);
}

#[test]
fn transfer_fails_pending_requests_when_the_target_goes_away() {
    let mut p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let local = p.local_mem.segment().clone();
    let reqs: Vec<_> = (0..64)
        .map(|i| {
            req(
                &p,
                &remote,
                TransferOp::Write,
                0,
                (i % 8) * MIB as u64,
                MIB as u64,
            )
        })
        .collect();
    let batch = p.initiator.submit(reqs).unwrap();
    // Drop the server while the batch is in flight: every connection is reset.
    drop(p.server.take());
    let st = batch.wait(Duration::from_secs(30)).unwrap();
    assert!(st.iter().all(|s| !s.is_pending()));
    // Later requests fail fast with a connection error and never hang.
    let batch = p
        .initiator
        .submit(vec![req(&p, &remote, TransferOp::Read, 0, 0, 4096)])
        .unwrap();
    let st = batch.wait(Duration::from_secs(30)).unwrap();
    match &st[0] {
        RequestStatus::Failed(f) => assert!(
            ["connect", "handshake", "peer_closed", "io", "lane_closed"].contains(&f.category),
            "{f}"
        ),
        other => panic!("expected a failure, got {other:?}"),
    }
    // No connection and no reference to our memory is left behind.
    assert_eq!(p.initiator.metrics().connections.get(), 0);
    assert_eq!(
        Arc::strong_count(&local),
        3,
        "registry + registration + this test only"
    );
}

/// Two engines of node `node-a` sharing a directory, the target's memfd segment `a/dram0` of
/// `size` bytes (registered, not yet described or served) and the socket path to serve it on.
struct ShmPair {
    _dir: tempfile::TempDir,
    sock: std::path::PathBuf,
    dir: Arc<StaticDirectory>,
    target: TransferEngine,
    initiator: TransferEngine,
    shared: LocalSegment,
}

fn shm_pair(size: usize) -> ShmPair {
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("xfer.sock");
    let dir = Arc::new(StaticDirectory::new());
    let target = engine(config("node-a"), key(), &dir);
    let initiator = engine(config("node-a"), key(), &dir);
    let shared = target
        .register(
            "a/dram0",
            Arc::new(Segment::memfd("a-dram0", size, HostOptions::default()).unwrap()),
        )
        .unwrap();
    ShmPair {
        _dir: tmp,
        sock,
        dir,
        target,
        initiator,
        shared,
    }
}

#[test]
fn transfer_same_node_uses_shared_memory() {
    let ShmPair {
        _dir: _dir_path,
        sock,
        dir,
        target,
        initiator,
        shared,
    } = shm_pair(2 * MIB);
    let heap_only = host_segment(&target, "a/heap", MIB);
    let server = target.listen_shm(&sock).unwrap();
    let tcp = target.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    let eps = vec![Endpoint::Shm(sock.clone()), Endpoint::Tcp(tcp.local_addr())];
    dir.insert(target.describe(&shared, eps.clone()));
    dir.insert(target.describe(&heap_only, eps));
    let local = host_segment(&initiator, "b/buf", 2 * MIB);
    let remote = initiator.open("a/dram0").unwrap();
    assert_eq!(remote.protocol(), Protocol::Shm);
    let data = pattern(MIB + 3, 9);
    local.segment().write_at(0, &data).unwrap();
    let mk = |op, lo, ro, len| TransferRequest {
        op,
        local: local.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: ro,
        len,
    };
    initiator
        .transfer(vec![mk(TransferOp::Write, 0, 500, data.len() as u64)])
        .unwrap();
    let got = read_seg(&shared, 500, data.len());
    assert!(got == data);
    initiator
        .transfer(vec![mk(TransferOp::Read, MIB as u64 / 2, 500, 1000)])
        .unwrap();
    let back = read_seg(&local, MIB as u64 / 2, 1000);
    assert_eq!(back, data[..1000]);
    // A heap segment cannot be shared: the engine falls back to TCP.
    let heap_remote = initiator.open("a/heap").unwrap();
    assert_eq!(heap_remote.protocol(), Protocol::Tcp);
    // A wrong key cannot map anything.
    let other = engine(
        config("node-a"),
        AuthKey::new(*b"another-key-0123456789").unwrap(),
        &dir,
    );
    let desc = dir.lookup("a/dram0").unwrap();
    assert_eq!(
        other
            .open_descriptor(&desc, Some(Protocol::Shm))
            .unwrap_err()
            .category(),
        "handshake"
    );
    drop(server);
    assert!(!sock.exists());
}

#[test]
fn a_large_shared_memory_batch_is_copied_by_two_threads_and_counted_once_per_request() {
    let ShmPair {
        _dir,
        sock,
        dir,
        target,
        initiator,
        shared,
    } = shm_pair(16 * MIB);
    let _server = target.listen_shm(&sock).unwrap();
    dir.insert(target.describe(&shared, vec![Endpoint::Shm(sock.clone())]));
    let local = host_segment(&initiator, "b/buf", 16 * MIB);
    let remote = initiator.open("a/dram0").unwrap();
    assert_eq!(remote.protocol(), Protocol::Shm);
    // Above the two-thread line (4 MiB): two requests large enough to be cut in halves, one
    // small one, at odd lengths and offsets.
    let lens = [3 * MIB + 5, 4097, 2 * MIB + 1];
    let mut at = 0u64;
    let mut reqs = Vec::new();
    let mut writes = Vec::new();
    for (i, len) in lens.into_iter().enumerate() {
        let data = pattern(len, i as u8 + 1);
        local.segment().write_at(at, &data).unwrap();
        reqs.push((at, at + 7, len as u64));
        writes.push(data);
        at += len as u64 + 4096;
    }
    let mk = |op, lo, ro, len| TransferRequest {
        op,
        local: local.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: ro,
        len,
    };
    initiator
        .transfer(
            reqs.iter()
                .map(|&(lo, ro, len)| mk(TransferOp::Write, lo, ro, len))
                .collect(),
        )
        .unwrap();
    for ((_, ro, _), data) in reqs.iter().zip(&writes) {
        assert!(
            read_seg(&shared, *ro, data.len()) == *data,
            "written at {ro}"
        );
    }
    // And back, into the upper half of the local buffer.
    let back = 8 * MIB as u64;
    initiator
        .transfer(
            reqs.iter()
                .map(|&(lo, ro, len)| mk(TransferOp::Read, back + lo, ro, len))
                .collect(),
        )
        .unwrap();
    for ((lo, _, _), data) in reqs.iter().zip(&writes) {
        assert!(
            read_seg(&local, back + lo, data.len()) == *data,
            "read to {lo}"
        );
    }
    let m = initiator.metrics();
    for op in ["write", "read"] {
        assert_eq!(
            m.requests.with_label_values(&["shm", op, "ok"]).get(),
            3,
            "{op}"
        );
        let bytes: u64 = lens.iter().map(|l| *l as u64).sum();
        assert_eq!(m.bytes.with_label_values(&["shm", op]).get(), bytes, "{op}");
    }
}

#[test]
fn transfer_rdma_request_falls_back_loudly_or_is_refused() {
    let p = pair_with(key());
    let desc = p.dir.lookup("t/dram0").unwrap();
    if kvpool_transfer::rdma::transport_available() {
        eprintln!("SKIP: an RDMA device is present; this test covers hosts without one");
        return;
    }
    assert_eq!(
        p.initiator
            .open_descriptor(&desc, Some(Protocol::Rdma))
            .unwrap_err()
            .category(),
        "unsupported"
    );
    let registry = prometheus::Registry::new();
    let wants = TransferEngine::new(
        EngineConfig {
            want_rdma: true,
            ..config("node-x")
        },
        key(),
        p.dir.clone(),
        TransferMetrics::new(&registry).unwrap(),
    )
    .unwrap();
    assert!(!wants.fallback_active());
    let remote = wants.open("t/dram0").unwrap();
    assert_eq!(remote.protocol(), Protocol::Tcp);
    assert!(wants.fallback_active());
    let text = {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    };
    assert_eq!(
        kvpool_harness::scrape::metric_sum(&text, "kvpool_transfer_fallback_total"),
        1.0,
        "{text}"
    );
    let _ = &p.target;
}

#[test]
fn transfer_concurrent_submitters_keep_their_bytes_apart() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let region = MIB as u64;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (p, remote) = (&p, remote.clone());
            s.spawn(move || {
                let data = pattern(region as usize, t as u8 * 40 + 1);
                p.local_mem.segment().write_at(t * region, &data).unwrap();
                for round in 0..3u64 {
                    // Write this thread's region in 64 KiB requests, read it back elsewhere.
                    let reqs: Vec<_> = (0..16)
                        .map(|i| {
                            req(
                                p,
                                &remote,
                                TransferOp::Write,
                                t * region + i * 65536,
                                t * region + i * 65536,
                                65536,
                            )
                        })
                        .collect();
                    p.initiator.transfer(reqs).unwrap();
                    let back = 4 * region + t * region;
                    p.initiator
                        .transfer(vec![req(
                            p,
                            &remote,
                            TransferOp::Read,
                            back,
                            t * region,
                            region,
                        )])
                        .unwrap();
                    let got = read_seg(&p.local_mem, back, region as usize);
                    assert!(got == data, "thread {t} round {round}: bytes mixed up");
                }
            });
        }
    });
}

#[test]
fn transfer_config_is_validated() {
    let dir = Arc::new(StaticDirectory::new());
    let bad = [
        EngineConfig {
            lanes: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            slice_size: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            slice_size: 64 << 20,
            max_slice: 16 << 20,
            ..EngineConfig::default()
        },
        EngineConfig {
            window: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            timeout: Duration::ZERO,
            ..EngineConfig::default()
        },
    ];
    for cfg in bad {
        let err = try_engine(cfg, key(), &dir).unwrap_err();
        assert_eq!(err.category(), "config", "{err}");
    }
    let registry = prometheus::Registry::new();
    let m = TransferMetrics::new(&registry).unwrap();
    assert!(
        TransferMetrics::new(&registry).is_err(),
        "double registration is reported"
    );
    let engine = TransferEngine::new(EngineConfig::default(), key(), dir, m).unwrap();
    let seg = Arc::new(Segment::host(4096, HostOptions::default()).unwrap());
    let _a = engine.register("same", seg.clone()).unwrap();
    assert_eq!(
        engine.register("same", seg).unwrap_err().category(),
        "duplicate"
    );
}

#[test]
fn small_batches_run_inline_in_both_directions_and_report_each_failure() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let a = pattern(70_000, 1);
    let b = pattern(5_000, 2);
    p.local_mem.segment().write_at(0, &a).unwrap();
    p.remote_mem.segment().write_at(MIB as u64, &b).unwrap();
    // One WRITE and one READ in one small batch: run by this thread, one at a time.
    p.initiator
        .transfer(vec![
            req(&p, &remote, TransferOp::Write, 0, 0, a.len() as u64),
            req(
                &p,
                &remote,
                TransferOp::Read,
                2 * MIB as u64,
                MIB as u64,
                b.len() as u64,
            ),
        ])
        .unwrap();
    let got = read_seg(&p.remote_mem, 0, a.len());
    assert!(got == a, "written bytes differ");
    let got = read_seg(&p.local_mem, 2 * MIB as u64, b.len());
    assert!(got == b, "read bytes differ");
    // Several slices of one request (slice size 256 KiB), pipelined on the one connection.
    let big = pattern(3 * MIB, 3);
    p.local_mem.segment().write_at(0, &big).unwrap();
    p.initiator
        .transfer(vec![req(
            &p,
            &remote,
            TransferOp::Write,
            0,
            4096,
            big.len() as u64,
        )])
        .unwrap();
    let got = read_seg(&p.remote_mem, 4096, big.len());
    assert!(got == big, "sliced write differs");
    // A segment the target no longer has fails its request by name, and the connection is
    // still good for the next batch.
    let gone = p.serve_segment("t/gone", MIB);
    let gone_remote = p.initiator.open("t/gone").unwrap();
    drop(gone);
    let err = p
        .initiator
        .transfer(vec![req(&p, &gone_remote, TransferOp::Read, 0, 0, 10)])
        .unwrap_err();
    assert_eq!(err.failure.category, "unknown_segment", "{err:?}");
    p.initiator
        .transfer(vec![req(&p, &remote, TransferOp::Read, 0, 0, 10)])
        .unwrap();
    let m = p.initiator.metrics();
    assert!(m.direct_connections.get() >= 1, "kept for the next batch");
    // Lane 0 carried the OPENs; the bytes needed no other lane.
    assert_eq!(m.connections.get(), 1);
}

#[test]
fn cached_opens_are_refused_by_a_restarted_target_and_opened_again() {
    let mut p = pair_with(key());
    let addr = p.server.as_ref().unwrap().local_addr();
    let desc = p.dir.lookup("t/dram0").unwrap();
    let first = p.initiator.open_cached(&desc).unwrap();
    p.remote_mem.segment().write_at(0, b"first run").unwrap();
    p.initiator
        .transfer(vec![req(&p, &first, TransferOp::Read, 0, 0, 9)])
        .unwrap();
    let again = p.initiator.open_cached(&desc).unwrap();
    assert_eq!(
        format!("{again:?}"),
        format!("{first:?}"),
        "served from the cache"
    );

    // The target restarts on the same port: a new registry, whose handles start over.
    p.server = None;
    let target = target_engine(&p.dir);
    // Another segment first, so that the old handle names it in the new registry.
    let decoy = host_segment(&target, "t/decoy", 8 * MIB);
    decoy.segment().write_at(0, b"WRONG BYTES").unwrap();
    let mem = host_segment(&target, "t/dram0", 8 * MIB);
    mem.segment().write_at(0, b"second run").unwrap();
    let _server = target.listen_tcp(addr).unwrap();
    // The cached handle is refused (not served from the decoy); the transfer opens the
    // segment again by name and reads the new run's bytes.
    let cached = p.initiator.open_cached(&desc).unwrap();
    p.initiator
        .transfer(vec![req(
            &p,
            &cached,
            TransferOp::Read,
            4 * MIB as u64,
            0,
            10,
        )])
        .unwrap();
    let mut got = [0u8; 10];
    p.local_mem
        .segment()
        .read_at(4 * MIB as u64, &mut got)
        .unwrap();
    assert_eq!(&got, b"second run");
    // The stale entry was dropped: the next open is a fresh one.
    let fresh = p.initiator.open_cached(&desc).unwrap();
    assert_ne!(format!("{fresh:?}"), format!("{first:?}"));
}

/// `count` requests of 1 byte to 40 KiB at scattered, non-overlapping places of both segments
/// (the remote ranges in another order than the local ones).
fn scattered(
    p: &Pair,
    remote: &RemoteSegment,
    op: TransferOp,
    count: usize,
    local_base: u64,
) -> Vec<TransferRequest> {
    let stride = 48 * 1024u64;
    (0..count)
        .map(|i| {
            let len = 1 + (i as u64 * 7919) % (40 * 1024);
            let remote_slot = (i * 37) % count; // a permutation: 37 is prime to the counts used
            req(
                p,
                remote,
                op,
                local_base + i as u64 * stride,
                remote_slot as u64 * stride,
                len,
            )
        })
        .collect()
}

/// READs of the ranges `writes` wrote, into local memory 4 MiB further on.
fn reads_back(writes: &[TransferRequest]) -> Vec<TransferRequest> {
    writes
        .iter()
        .map(|w| TransferRequest {
            op: TransferOp::Read,
            local_offset: w.local_offset + 4 * MIB as u64,
            ..w.clone()
        })
        .collect()
}

/// Check that each of `reads` brought back the bytes its `writes` counterpart sent.
fn check_scattered(p: &Pair, writes: &[TransferRequest], reads: &[TransferRequest]) {
    for (w, r) in writes.iter().zip(reads) {
        let sent = read_seg(&p.local_mem, w.local_offset, w.len as usize);
        let back = read_seg(&p.local_mem, r.local_offset, r.len as usize);
        assert!(
            sent == back,
            "request at {} came back different",
            w.local_offset
        );
    }
}

#[test]
fn small_requests_share_vectored_frames_through_lanes_and_inline() {
    let p = pair_with(key());
    let remote = p.initiator.open("t/dram0").unwrap();
    let m = p.initiator.metrics();
    let n = 160; // 160 x 48 KiB fits in 8 MiB
    p.local_mem
        .segment()
        .write_at(0, &pattern(4 * MIB, 9))
        .unwrap();
    // Through the lanes: submit and wait.
    let writes = scattered(&p, &remote, TransferOp::Write, n / 2, 0);
    submit_and_wait(&p.initiator, writes.clone());
    let reads = reads_back(&writes);
    submit_and_wait(&p.initiator, reads.clone());
    check_scattered(&p, &writes, &reads);
    let frames = m.vectored_frames.get();
    assert!(
        frames >= 2,
        "writes and reads went vectored: {frames} frames"
    );
    assert_eq!(
        m.vectored_requests.get(),
        n as u64,
        "every request rode a vectored frame"
    );
    // Inline: one batch of under 4 MiB, run by this thread.
    let writes = scattered(&p, &remote, TransferOp::Write, n / 2, 24 * 1024);
    p.initiator.transfer(writes.clone()).unwrap();
    let reads = reads_back(&writes);
    p.initiator.transfer(reads.clone()).unwrap();
    check_scattered(&p, &writes, &reads);
    assert!(m.vectored_frames.get() >= frames + 2);
    assert_eq!(m.vectored_requests.get(), 2 * n as u64);
    // Slices of 256 KiB, requests up to 40 KiB: far fewer frames than requests.
    assert!(m.vectored_frames.get() * 4 <= m.vectored_requests.get());
}

#[test]
fn vectored_batches_mix_with_large_requests_and_other_segments() {
    let p = pair_with(key());
    let other = p.serve_segment("t/other", MIB);
    let remote = p.initiator.open("t/dram0").unwrap();
    let remote_other = p.initiator.open("t/other").unwrap();
    let data = pattern(8 * MIB, 4);
    p.local_mem.segment().write_at(0, &data).unwrap();
    // small, small, large (sliced), small to another segment, small, small.
    let batch = vec![
        req(&p, &remote, TransferOp::Write, 0, 0, 1000),
        req(&p, &remote, TransferOp::Write, 1000, 5000, 2000),
        req(
            &p,
            &remote,
            TransferOp::Write,
            MIB as u64,
            MIB as u64,
            3 * MIB as u64,
        ),
        req(&p, &remote_other, TransferOp::Write, 3000, 0, 4000),
        req(&p, &remote, TransferOp::Write, 7000, 9000, 100),
        req(&p, &remote, TransferOp::Write, 7100, 20_000, 50_000),
    ];
    submit_and_wait(&p.initiator, batch.clone());
    for r in &batch {
        let seg = if r.remote.name() == "t/other" {
            other.segment()
        } else {
            p.remote_mem.segment()
        };
        let mut got = vec![0u8; r.len as usize];
        seg.read_at(r.remote_offset, &mut got).unwrap();
        let lo = r.local_offset as usize;
        assert!(got == data[lo..lo + r.len as usize], "{r:?}");
    }
    assert!(p.initiator.metrics().vectored_frames.get() >= 2);
}

#[test]
fn a_target_without_vectored_frames_is_served_one_frame_per_request() {
    let p = pair_configured(
        key(),
        EngineConfig {
            vectored: false,
            ..config("node-t")
        },
    );
    let remote = p.initiator.open("t/dram0").unwrap();
    p.local_mem
        .segment()
        .write_at(0, &pattern(4 * MIB, 5))
        .unwrap();
    let writes = scattered(&p, &remote, TransferOp::Write, 40, 0);
    submit_and_wait(&p.initiator, writes.clone());
    let reads = reads_back(&writes);
    p.initiator.transfer(reads.clone()).unwrap();
    check_scattered(&p, &writes, &reads);
    assert_eq!(p.initiator.metrics().vectored_frames.get(), 0);
}
