//! The RDMA data path end to end between two engines in one process: the queue-pair handshake
//! runs over a real authenticated TCP control connection on 127.0.0.1, and the one-sided
//! WRITE/READ work requests run on the in-process fake fabric (`rdma::fake`), since this machine
//! has no RDMA device. Covers striping, out-of-order completions, a failing NIC, queue pairs in
//! the error state, targets that cannot or do not answer the handshake, peer loss and cleanup.
//! Hardware runs: see docs/transfer.md ("RDMA: verified here vs. on hardware").

#![allow(clippy::unwrap_used)] // test crate: helpers outside #[test] fns unwrap too

mod serve_support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_transfer::rdma::fake::{FakeFabric, Faults};
use kvpool_transfer::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const SEG: u64 = 8 * MIB;

fn key() -> AuthKey {
    AuthKey::new(*b"rdma-test-key-0123456789").unwrap()
}

fn config(node: &str, timeout: Duration) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 2,
        slice_size: 256 * KIB,
        window: 4,
        timeout,
        connect_timeout: Duration::from_secs(2),
        want_rdma: true,
        ..EngineConfig::default()
    }
}

struct Setup {
    fabric: FakeFabric,
    initiator: TransferEngine,
    initiator_registry: prometheus::Registry,
    server: Option<TcpServer>,
    target: TransferEngine,
    remote_mem: LocalSegment,
    local_mem: LocalSegment,
    desc: SegmentDescriptor,
}

impl Setup {
    /// The target's segment, opened over RDMA.
    fn open_rdma(&self) -> RemoteSegment {
        self.initiator
            .open_descriptor(&self.desc, Some(Protocol::Rdma))
            .expect("open over RDMA")
    }

    /// An unlabelled counter of the initiator.
    fn initiator_counter(&self, name: &str) -> u64 {
        counter(&self.initiator_registry, name, None)
    }
}

fn setup(
    target_devices: Option<&[&str]>,
    initiator_devices: &[&str],
    faults: Faults,
    timeout: Duration,
) -> Setup {
    let fabric = FakeFabric::new();
    fabric.set_faults(faults);
    let target = target_devices.map(|d| fabric.provider(d));
    let initiator = fabric.provider(initiator_devices);
    setup_with(fabric, target, initiator, timeout)
}

/// Like [`setup`] with the providers (ports of any link layer) made by the caller on `fabric`.
fn setup_with(
    fabric: FakeFabric,
    target_provider: Option<Arc<dyn RdmaProvider>>,
    initiator_provider: Arc<dyn RdmaProvider>,
    timeout: Duration,
) -> Setup {
    let dir = Arc::new(StaticDirectory::new());
    let target = TransferEngine::new_with_rdma(
        config("node-t", timeout),
        key(),
        dir.clone(),
        TransferMetrics::unregistered().unwrap(),
        target_provider,
    )
    .unwrap();
    let initiator_registry = prometheus::Registry::new();
    let initiator = TransferEngine::new_with_rdma(
        config("node-i", timeout),
        key(),
        dir.clone(),
        TransferMetrics::new(&initiator_registry).unwrap(),
        Some(initiator_provider),
    )
    .unwrap();
    let seg = |n: &str, e: &TransferEngine| {
        e.register(
            n,
            Arc::new(Segment::host(SEG as usize, HostOptions::default()).unwrap()),
        )
        .unwrap()
    };
    let remote_mem = seg("t/dram0", &target);
    let local_mem = seg("i/buf0", &initiator);
    let server = target.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    let desc = target.describe(&remote_mem, vec![Endpoint::Tcp(server.local_addr())]);
    dir.insert(desc.clone());
    Setup {
        fabric,
        initiator,
        initiator_registry,
        server: Some(server),
        target,
        remote_mem,
        local_mem,
        desc,
    }
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn req(
    op: TransferOp,
    s: &Setup,
    remote: &RemoteSegment,
    local_offset: u64,
    remote_offset: u64,
    len: u64,
) -> TransferRequest {
    TransferRequest {
        op,
        local: s.local_mem.clone(),
        local_offset,
        remote: remote.clone(),
        remote_offset,
        len,
    }
}

/// WRITE `len` bytes from local offset 0 to remote offset 4096, READ them back to local offset
/// 4 MiB, and check both copies byte for byte.
fn write_then_read(s: &Setup, remote: &RemoteSegment, len: u64, seed: u8) {
    let data = pattern(len, seed);
    s.local_mem.segment().write_at(0, &data).unwrap();
    s.initiator
        .transfer(vec![req(TransferOp::Write, s, remote, 0, 4096, len)])
        .unwrap();
    let mut got = vec![0u8; len as usize];
    s.remote_mem.segment().read_at(4096, &mut got).unwrap();
    assert!(got == data, "remote bytes differ after RDMA WRITE");
    s.initiator
        .transfer(vec![req(TransferOp::Read, s, remote, 4 * MIB, 4096, len)])
        .unwrap();
    let mut back = vec![0u8; len as usize];
    s.local_mem.segment().read_at(4 * MIB, &mut back).unwrap();
    assert!(back == data, "local bytes differ after RDMA READ");
}

fn counter(registry: &prometheus::Registry, name: &str, label: Option<(&str, &str)>) -> u64 {
    let v = match label {
        None => serve_support::metric(registry, name),
        Some((k, v)) => serve_support::labelled(registry, name, k, v),
    };
    v as u64
}

fn set(names: &[&str]) -> HashSet<String> {
    names.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn rdma_batches_stripe_over_both_nics_and_arrive_intact_even_out_of_order() {
    let s = setup(
        Some(&["t-nic0", "t-nic1"]),
        &["i-nic0", "i-nic1"],
        Faults {
            reverse_completions: true,
            ..Faults::default()
        },
        Duration::from_secs(5),
    );
    let remote = s.open_rdma();
    assert_eq!(remote.protocol(), Protocol::Rdma);
    assert_eq!(remote.rdma_devices(), vec!["i-nic0", "i-nic1"]);
    // 3 MiB + 5 bytes: 13 slices of at most 256 KiB, the last one short.
    let len = 3 * MIB + 5;
    write_then_read(&s, &remote, len, 7);
    let (a, b) = (
        s.fabric.bytes_moved("i-nic0"),
        s.fabric.bytes_moved("i-nic1"),
    );
    assert!(a > 0 && b > 0, "both NICs carry slices: {a} / {b}");
    assert_eq!(a + b, 2 * len, "every byte moved exactly once over RDMA");
    // A batch of many small requests, polled until done.
    let batch = s
        .initiator
        .submit(
            (0..32)
                .map(|i| req(TransferOp::Write, &s, &remote, i * 1000, i * 7000, 1000))
                .collect(),
        )
        .unwrap();
    let statuses = batch.wait(Duration::from_secs(10)).unwrap();
    assert!(statuses.iter().all(|st| *st == RequestStatus::Done));
    assert!(!s.initiator.fallback_active());
    assert_eq!(s.initiator_counter("kvpool_transfer_fallback_total"), 0);
    assert_eq!(
        counter(
            &s.initiator_registry,
            "kvpool_transfer_bytes_total",
            Some(("protocol", "rdma"))
        ),
        2 * len + 32 * 1000
    );
    // Notify still works on an RDMA route (over its TCP lanes).
    s.initiator.notify(&remote, b"over rdma").unwrap();
    let n = s.target.recv_notification(Duration::from_secs(5)).unwrap();
    assert_eq!(n.payload, b"over rdma");
}

#[test]
fn rdma_failed_completions_on_one_nic_are_retried_on_the_other() {
    let s = setup(
        Some(&["t-nic0"]),
        &["i-nic0", "i-nic1"],
        Faults {
            failing_completions: set(&["i-nic1"]),
            ..Faults::default()
        },
        Duration::from_secs(5),
    );
    let remote = s.open_rdma();
    write_then_read(&s, &remote, 2 * MIB, 3);
    assert!(remote.rdma_retries() >= 1, "the failed slice was retried");
    assert_eq!(
        s.initiator_counter("kvpool_transfer_rdma_retries_total"),
        remote.rdma_retries()
    );
    assert_eq!(s.fabric.bytes_moved("i-nic1"), 0);
    assert_eq!(s.fabric.bytes_moved("i-nic0"), 4 * MIB);
    assert!(
        !s.initiator.fallback_active(),
        "one healthy NIC is enough: no TCP fallback"
    );
}

#[test]
fn rdma_lost_completions_time_out_and_the_slices_move_to_another_nic() {
    let s = setup(
        Some(&["t-nic0"]),
        &["i-nic0", "i-nic1"],
        Faults {
            silent: set(&["i-nic0"]),
            ..Faults::default()
        },
        Duration::from_secs(1),
    );
    let remote = s.open_rdma();
    write_then_read(&s, &remote, MIB, 4);
    assert!(remote.rdma_retries() >= 1);
    assert_eq!(s.fabric.bytes_moved("i-nic0"), 0);
    assert!(!s.initiator.fallback_active());
}

#[test]
fn rdma_queue_pairs_in_error_on_every_nic_fall_back_to_tcp_loudly() {
    let s = setup(
        Some(&["t-nic0"]),
        &["i-nic0", "i-nic1"],
        Faults {
            qp_error: set(&["i-nic0", "i-nic1"]),
            ..Faults::default()
        },
        Duration::from_secs(5),
    );
    let remote = s.open_rdma();
    assert!(!s.initiator.fallback_active());
    write_then_read(&s, &remote, MIB + 17, 9);
    assert_eq!(
        s.fabric.bytes_moved("i-nic0") + s.fabric.bytes_moved("i-nic1"),
        0
    );
    assert!(s.initiator.fallback_active());
    assert!(s.initiator.rdma_fallback());
    assert!(s.initiator_counter("kvpool_transfer_fallback_total") >= 1);
}

#[test]
fn rdma_target_without_devices_answers_unsupported_and_the_initiator_uses_tcp() {
    let s = setup(None, &["i-nic0"], Faults::default(), Duration::from_secs(5));
    // want_rdma, no forced protocol: the engine tries RDMA, is told no, and says so.
    let remote = s.initiator.open(&s.desc.name).unwrap();
    assert_eq!(remote.protocol(), Protocol::Tcp);
    assert!(s.initiator.fallback_active());
    assert_eq!(s.initiator_counter("kvpool_transfer_fallback_total"), 1);
    write_then_read(&s, &remote, 600 * KIB, 1);
}

#[test]
fn rdma_target_that_never_answers_the_handshake_times_out_into_tcp() {
    let s = setup(
        Some(&["t-nic0"]),
        &["i-nic0"],
        Faults {
            slow_connect: set(&["t-nic0"]),
            connect_delay: Duration::from_millis(2500),
            ..Faults::default()
        },
        Duration::from_secs(1),
    );
    let remote = s.initiator.open(&s.desc.name).unwrap();
    assert_eq!(remote.protocol(), Protocol::Tcp);
    assert!(s.initiator.fallback_active());
    write_then_read(&s, &remote, 300 * KIB, 5);
}

#[test]
fn rdma_engine_without_devices_refuses_a_forced_rdma_open() {
    let dir = Arc::new(StaticDirectory::new());
    let e = TransferEngine::new_with_rdma(
        config("n", Duration::from_secs(1)),
        key(),
        dir,
        TransferMetrics::unregistered().unwrap(),
        None,
    )
    .unwrap();
    let desc = SegmentDescriptor {
        name: "x".into(),
        node: "other".into(),
        size: 1,
        numa_node: None,
        memory: MemoryKind::Host,
        gpu_device: None,
        endpoints: vec![Endpoint::Tcp("127.0.0.1:9".parse().unwrap())],
        nics: vec![],
    };
    assert!(matches!(
        e.open_descriptor(&desc, Some(Protocol::Rdma)),
        Err(TransferError::Unsupported(Protocol::Rdma))
    ));
}

#[test]
fn rdma_peer_loss_fails_requests_without_hanging_and_releases_queue_pairs() {
    let mut s = setup(
        Some(&["t-nic0"]),
        &["i-nic0", "i-nic1"],
        Faults::default(),
        Duration::from_secs(2),
    );
    let remote = s.open_rdma();
    write_then_read(&s, &remote, 512 * KIB, 2);
    assert!(s.fabric.live_queue_pairs() >= 4);
    // The target goes away: its connections close, its queue pairs are destroyed.
    drop(s.server.take());
    let started = Instant::now();
    let batch = s
        .initiator
        .submit(vec![req(TransferOp::Write, &s, &remote, 0, 0, MIB)])
        .unwrap();
    let statuses = batch.wait(Duration::from_secs(30)).unwrap();
    assert!(
        matches!(&statuses[0], RequestStatus::Failed(_)),
        "{statuses:?}"
    );
    tracing::info!(elapsed = ?started.elapsed(), "peer loss settled");
    // Everything is released once the handles go.
    drop(remote);
    let deadline = Instant::now() + Duration::from_secs(20);
    while (s.fabric.live_queue_pairs() > 0 || s.fabric.registered_regions() > 0)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(s.fabric.live_queue_pairs(), 0, "queue pairs leaked");
    assert_eq!(s.fabric.registered_regions(), 0, "registrations leaked");
}

/// Fault mode of one initiator NIC in the property test.
#[derive(Clone, Copy, Debug)]
enum NicFault {
    Healthy,
    FailingCompletions,
    QpError,
}

fn nic_fault() -> impl proptest::strategy::Strategy<Value = NicFault> {
    use proptest::prelude::*;
    prop_oneof![
        2 => Just(NicFault::Healthy),
        1 => Just(NicFault::FailingCompletions),
        1 => Just(NicFault::QpError),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

    /// Whatever mix of NIC faults, sizes and completion order: the bytes arrive intact, every
    /// request settles, RDMA carries everything while one NIC is healthy, and TCP takes over
    /// (flagged) only when none is.
    #[test]
    fn rdma_any_fault_mix_keeps_bytes_intact_and_falls_back_only_without_a_healthy_nic(
        faults in proptest::collection::vec(nic_fault(), 1..6),
        len in 1u64..(3 * MIB),
        reverse: bool,
        seed: u8,
    ) {
        let names: Vec<String> = (0..faults.len()).map(|i| format!("i-nic{i}")).collect();
        let pick = |want: fn(&NicFault) -> bool| -> HashSet<String> {
            names.iter().zip(&faults).filter(|(_, f)| want(f)).map(|(n, _)| n.clone()).collect()
        };
        let injected = Faults {
            failing_completions: pick(|f| matches!(f, NicFault::FailingCompletions)),
            qp_error: pick(|f| matches!(f, NicFault::QpError)),
            reverse_completions: reverse,
            ..Faults::default()
        };
        let healthy = faults.iter().any(|f| matches!(f, NicFault::Healthy));
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let s = setup(Some(&["t-nic0", "t-nic1"]), &refs, injected, Duration::from_secs(5));
        let remote = s.open_rdma();
        write_then_read(&s, &remote, len, seed);
        let moved: u64 = names.iter().map(|n| s.fabric.bytes_moved(n)).sum();
        if healthy {
            proptest::prop_assert_eq!(moved, 2 * len);
            proptest::prop_assert!(!s.initiator.fallback_active());
        } else {
            proptest::prop_assert_eq!(moved, 0);
            proptest::prop_assert!(s.initiator.fallback_active());
        }
    }
}

/// InfiniBand: queue pairs announce their port's LID in the handshake and address the peer by
/// it (no GRH inside the subnet); the fake fabric routes by LID, so a wrong or missing LID would
/// not connect.
#[test]
fn rdma_over_infiniband_addresses_peers_by_lid_and_moves_bytes() {
    let fabric = FakeFabric::new();
    let target = fabric.provider_ib(&[("t-ib0", 11)]);
    let initiator = fabric.provider_ib(&[("i-ib0", 21), ("i-ib1", 22)]);
    let s = setup_with(fabric, Some(target), initiator, Duration::from_secs(5));
    let remote = s.open_rdma();
    assert_eq!(remote.protocol(), Protocol::Rdma);
    write_then_read(&s, &remote, 2 * MIB + 5, 3);
    assert!(s.fabric.bytes_moved("i-ib0") > 0 && s.fabric.bytes_moved("i-ib1") > 0);
    assert!(!s.initiator.fallback_active());
    let status = s.initiator.transport_status();
    assert!(!status.fallback, "{status:?}");
    assert_eq!(status.devices, ["i-ib0", "i-ib1"]);
}

/// An InfiniBand target and an initiator whose port has no LID (a RoCE port, which announces
/// LID 0): the target refuses with a clear reason and the initiator falls back to TCP, loudly,
/// naming it.
#[test]
fn rdma_infiniband_target_refuses_a_peer_with_lid_0_and_the_initiator_says_why() {
    let fabric = FakeFabric::new();
    let target = fabric.provider_ib(&[("t-ib0", 11)]);
    let initiator = fabric.provider(&["i-roce0"]);
    let s = setup_with(fabric, Some(target), initiator, Duration::from_secs(5));
    let remote = s.initiator.open(&s.desc.name).unwrap();
    assert_eq!(remote.protocol(), Protocol::Tcp);
    let status = s.initiator.transport_status();
    assert!(status.fallback, "{status:?}");
    let reason = status.reason.unwrap_or_default();
    assert!(
        reason.contains("sent LID 0") && reason.contains("InfiniBand"),
        "{reason}"
    );
    assert_eq!(s.initiator_counter("kvpool_transfer_fallback_total"), 1);
    write_then_read(&s, &remote, 300 * KIB, 4);
}

/// An InfiniBand port that no subnet manager configured (LID 0) cannot take part: the target
/// says so and the initiator uses TCP.
#[test]
fn rdma_infiniband_port_without_a_subnet_manager_is_reported() {
    let fabric = FakeFabric::new();
    let target = fabric.provider_ib(&[("t-ib0", 0)]);
    let initiator = fabric.provider_ib(&[("i-ib0", 21)]);
    let s = setup_with(fabric, Some(target), initiator, Duration::from_secs(5));
    let remote = s.initiator.open(&s.desc.name).unwrap();
    assert_eq!(remote.protocol(), Protocol::Tcp);
    let reason = s.initiator.transport_status().reason.unwrap_or_default();
    assert!(reason.contains("subnet manager"), "{reason}");
}

/// Initiator NICs on two NUMA nodes: a transfer of memory on node N goes out through the NIC
/// on N only; memory of unknown placement stripes over both; when the local NIC fails, its
/// slices move to the other node's NIC instead of leaving RDMA.
#[test]
fn rdma_transfers_leave_through_the_nic_on_their_memorys_numa_node() {
    use kvpool_transfer::rdma::fake::FakePort;
    let fabric = FakeFabric::new();
    let target = fabric.provider(&["t-nic0", "t-nic1"]);
    let initiator = fabric.provider_with_ports(&[
        FakePort::roce("i-numa0").on_numa(0),
        FakePort::roce("i-numa1").on_numa(1),
    ]);
    let s = setup_with(fabric, Some(target), initiator, Duration::from_secs(5));
    let remote = s.open_rdma();
    let on_node = |name: &str, node: u32| {
        let seg = Segment::host(SEG as usize, HostOptions::default())
            .unwrap()
            .on_numa_node(Some(node));
        s.initiator.register(name, Arc::new(seg)).unwrap()
    };
    let (node0, node1) = (on_node("i/numa0", 0), on_node("i/numa1", 1));
    assert_eq!(
        s.initiator.describe(&node1, Vec::new()).numa_node,
        Some(1),
        "the descriptor announces the segment's node"
    );
    let moved = |s: &Setup| {
        (
            s.fabric.bytes_moved("i-numa0"),
            s.fabric.bytes_moved("i-numa1"),
        )
    };
    let write = |local: &LocalSegment, len: u64| {
        let data = pattern(len, 5);
        local.segment().write_at(0, &data).unwrap();
        s.initiator
            .transfer(vec![TransferRequest {
                op: TransferOp::Write,
                local: local.clone(),
                local_offset: 0,
                remote: remote.clone(),
                remote_offset: 0,
                len,
            }])
            .unwrap();
        let mut got = vec![0u8; len as usize];
        s.remote_mem.segment().read_at(0, &mut got).unwrap();
        assert!(got == data, "remote bytes differ");
    };
    let len = 2 * MIB + 3;
    write(&node1, len);
    assert_eq!(moved(&s), (0, len), "node-1 memory uses node 1's NIC only");
    write(&node0, len);
    assert_eq!(
        moved(&s),
        (len, len),
        "node-0 memory uses node 0's NIC only"
    );
    // Unknown placement (the setup's own buffer): striped over both.
    write(&s.local_mem, len);
    let (a, b) = moved(&s);
    assert!(a > len && b > len, "both NICs carry slices: {a} / {b}");
    assert_eq!(a + b, 3 * len);
    // Node 1's NIC fails: its slices go to node 0's NIC, still over RDMA.
    s.fabric.set_faults(Faults {
        failing_completions: set(&["i-numa1"]),
        ..Faults::default()
    });
    write(&node1, len);
    assert_eq!(moved(&s).1, b, "nothing more moved on the failed NIC");
    assert_eq!(moved(&s).0, a + len);
    assert!(remote.rdma_retries() >= 1);
    assert!(!s.initiator.fallback_active());
}
