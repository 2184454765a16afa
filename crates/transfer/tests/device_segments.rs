//! Device memory segments over real loopback TCP: an initiator whose buffer is device memory
//! (a fake device: host bytes that no host address leads to, every copy counted) writes to
//! and reads from a target's host segment, and a target serves its own device segment, with
//! large transfers (several staged chunks, overlapped) and small ones that share a vectored
//! frame, with per-frame integrity off and required. Every byte is checked, and the fake
//! device's counters show that the bytes moved through its staging copies.

#![allow(clippy::unwrap_used)] // test crate: helpers outside #[test] fns unwrap too

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvpool_transfer::memory::device::{FakeDevice, FakeDeviceMemory, STAGING_CHUNK};
use kvpool_transfer::*;

mod support;

use support::MIB;

fn config(node: &str, integrity: Integrity) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 2,
        slice_size: MIB as u64,
        window: 4,
        integrity,
        timeout: Duration::from_secs(10),
        ..EngineConfig::default()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn device_segment(engine: &TransferEngine, name: &str, dev: &Arc<FakeDevice>) -> LocalSegment {
    let seg = Segment::device(
        Arc::new(FakeDeviceMemory(dev.clone())),
        Path::new("/nonexistent"),
    )
    .unwrap();
    assert_eq!(seg.gpu_device(), Some(3));
    engine.register(name, Arc::new(seg)).unwrap()
}

fn req(
    op: TransferOp,
    local: &LocalSegment,
    lo: u64,
    remote: &RemoteSegment,
    ro: u64,
    len: usize,
) -> TransferRequest {
    TransferRequest {
        op,
        local: local.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: ro,
        len: len as u64,
    }
}

/// A target with a 16 MiB host segment `t/dram0` and a 16 MiB device segment `t/gpu0`, and an
/// initiator with a 16 MiB device buffer `i/gpu0`, on one directory.
struct Setup {
    _server: TcpServer,
    target: TransferEngine,
    initiator: TransferEngine,
    host: LocalSegment,
    _target_gpu: LocalSegment,
    target_dev: Arc<FakeDevice>,
    local: LocalSegment,
    local_dev: Arc<FakeDevice>,
}

fn setup(integrity: Integrity) -> Setup {
    let dir = Arc::new(StaticDirectory::new());
    let target = support::engine(config("node-t", Integrity::Allow), &dir);
    let host = support::host_segment(&target, "t/dram0", 16 * MIB);
    let target_dev = FakeDevice::new(16 * MIB, 3);
    let tseg = device_segment(&target, "t/gpu0", &target_dev);
    let server = target.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    let at = vec![Endpoint::Tcp(server.local_addr())];
    dir.insert(target.describe(&host, at.clone()));
    dir.insert(target.describe(&tseg, at));
    let initiator = support::engine(config("node-i", integrity), &dir);
    let local_dev = FakeDevice::new(16 * MIB, 3);
    let local = device_segment(&initiator, "i/gpu0", &local_dev);
    Setup {
        _server: server,
        target,
        initiator,
        host,
        _target_gpu: tseg,
        target_dev,
        local,
        local_dev,
    }
}

/// One large request (more than two staging chunks) and eight small ones of 1000 bytes.
fn large_and_small(
    op: TransferOp,
    local: &LocalSegment,
    remote: &RemoteSegment,
    large: usize,
) -> Vec<TransferRequest> {
    std::iter::once(req(op, local, 0, remote, 100, large))
        .chain((0..8u64).map(|k| {
            req(
                op,
                local,
                14 * MIB as u64 + k * 1000,
                remote,
                15 * MIB as u64 + k * 2000,
                1000,
            )
        }))
        .collect()
}

fn round_trips(integrity: Integrity) {
    let s = setup(integrity);
    let large = 2 * STAGING_CHUNK + 54_321;
    let data = pattern(14 * MIB + 8000, 7);
    s.local_dev.poke(0, &data);

    // Device buffer -> target host segment, and back into a cleared device buffer.
    let host = s.initiator.open("t/dram0").unwrap();
    s.initiator
        .transfer(large_and_small(TransferOp::Write, &s.local, &host, large))
        .unwrap();
    let mut got = vec![0u8; large];
    s.host.segment().read_at(100, &mut got).unwrap();
    assert!(got == data[..large], "device -> host WRITE bytes differ");
    let mut small = vec![0u8; 1000];
    s.host
        .segment()
        .read_at(15 * MIB as u64 + 2000 * 5, &mut small)
        .unwrap();
    assert!(small == data[14 * MIB + 5000..14 * MIB + 6000]);
    let before = s.local_dev.counts();
    assert!(before.bytes_down >= (large + 8000) as u64, "{before:?}");

    s.local_dev.poke(0, &vec![0u8; 16 * MIB]);
    s.initiator
        .transfer(large_and_small(TransferOp::Read, &s.local, &host, large))
        .unwrap();
    assert!(
        s.local_dev.snapshot(0, large) == data[..large],
        "host -> device READ"
    );
    assert!(s.local_dev.snapshot(14 * MIB + 7000, 1000) == data[14 * MIB + 7000..14 * MIB + 8000]);
    let after = s.local_dev.counts();
    assert!(
        after.bytes_up - before.bytes_up >= (large + 8000) as u64,
        "{after:?}"
    );

    // Target-side device segment: the server stages too.
    let gpu = s.initiator.open("t/gpu0").unwrap();
    s.initiator
        .transfer(large_and_small(TransferOp::Write, &s.local, &gpu, large))
        .unwrap();
    assert!(
        s.target_dev.snapshot(100, large) == data[..large],
        "into target device"
    );
    s.local_dev.poke(0, &vec![0u8; large]);
    s.initiator
        .transfer(vec![req(TransferOp::Read, &s.local, 0, &gpu, 100, large)])
        .unwrap();
    assert!(
        s.local_dev.snapshot(0, large) == data[..large],
        "device -> device"
    );
    let t = s.target_dev.counts();
    assert!(
        t.bytes_up >= (large + 8000) as u64 && t.bytes_down >= large as u64,
        "{t:?}"
    );
    // Staging buffers are a handful per stream, not one per chunk or request.
    assert!(t.staging_allocated < 64, "{t:?}");
    drop(s.target);
}

#[test]
fn device_segments_round_trip_over_tcp() {
    round_trips(Integrity::Off);
}

#[test]
fn device_segments_round_trip_with_integrity_required() {
    round_trips(Integrity::Require);
}

#[test]
fn a_request_outside_a_device_segment_fails_cleanly() {
    let s = setup(Integrity::Off);
    let host = s.initiator.open("t/dram0").unwrap();
    let r = s.initiator.transfer(vec![req(
        TransferOp::Write,
        &s.local,
        16 * MIB as u64 - 10,
        &host,
        0,
        100,
    )]);
    assert!(r.is_err(), "out-of-range local device range accepted");
    // The engine still works afterwards.
    s.local_dev.poke(0, b"still fine");
    s.initiator
        .transfer(vec![req(TransferOp::Write, &s.local, 0, &host, 0, 10)])
        .unwrap();
    let mut got = [0u8; 10];
    s.host.segment().read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"still fine");
}
