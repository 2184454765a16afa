//! NUMA-tagged segments and the NICs in their descriptors, against the agent's sysfs fixture
//! trees of real machines (a DGX-class RoCE host with 8 GPUs and 8 PFs on two NUMA nodes, and a
//! malformed tree) and the in-process fake verbs fabric with NICs on two NUMA nodes: a GPU
//! segment takes its NUMA node from sysfs, its descriptor lists the NICs on that node, and the
//! target's queue pairs for it sit on those NICs while the initiator posts from NICs on its own
//! memory's node. The RDMA handshake runs over real TCP on 127.0.0.1.

#![allow(clippy::unwrap_used)] // test crate

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvpool_transfer::rdma::fake::{FakeFabric, FakePort};
use kvpool_transfer::rdma::{select, topology};
use kvpool_transfer::*;

mod support;

use support::key;

const SEG: usize = 4 << 20;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../agent/tests/fixtures")
        .join(name)
        .join("sys")
}

fn config(node: &str) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 1,
        slice_size: 256 << 10,
        timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        want_rdma: true,
        ..EngineConfig::default()
    }
}

/// The NICs the engine would open on the DGX fixture (its PFs, every port ACTIVE), as fake
/// RoCE devices on their NUMA nodes.
fn dgx_nics() -> Vec<FakePort> {
    let devices = topology::scan(&fixture("dgx-roce")).unwrap();
    let chosen = select::select(&devices, &NicPolicy::default()).unwrap();
    chosen
        .nics
        .iter()
        .map(|n| {
            let p = FakePort::roce(&n.device);
            match n.numa_node {
                Some(node) => p.on_numa(node),
                None => p,
            }
        })
        .collect()
}

fn names(nics: &[NicDescriptor]) -> Vec<&str> {
    nics.iter().map(|n| n.device.as_str()).collect()
}

const NODE0: [&str; 4] = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"];
const NODE1: [&str; 4] = ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"];

#[test]
fn pci_numa_node_reads_the_fixture_trees_and_names_what_is_wrong() {
    let dgx = fixture("dgx-roce");
    assert_eq!(pci_numa_node(&dgx, "0000:18:00.0").unwrap(), Some(0));
    assert_eq!(pci_numa_node(&dgx, "0000:9A:00.0").unwrap(), Some(1));
    assert_eq!(
        pci_numa_node(&dgx, "0000:9b:00.0").unwrap(),
        Some(1),
        "a NIC"
    );
    let bad = fixture("malformed");
    assert_eq!(pci_numa_node(&bad, "0000:07:00.0").unwrap(), Some(1));
    // The malformed tree's GPU has no numa_node file.
    let e = pci_numa_node(&bad, "0000:05:00.0").unwrap_err();
    assert_eq!(e.category(), "read");
    assert!(
        e.to_string()
            .contains("bus/pci/devices/0000:05:00.0/numa_node"),
        "{e}"
    );
    assert!(
        pci_numa_node(&dgx, "0000:ff:00.0").is_err(),
        "no such device"
    );
}

#[test]
fn gpu_segments_take_the_numa_node_of_their_gpu_or_are_unbound() {
    let dgx = fixture("dgx-roce");
    let seg = Segment::host(4096, HostOptions::default())
        .unwrap()
        .on_gpu(4, "0000:9a:00.0", &dgx);
    assert_eq!((seg.gpu_device(), seg.numa_node()), (Some(4), Some(1)));
    let seg = Segment::host(4096, HostOptions::default())
        .unwrap()
        .on_gpu(0, "0000:18:00.0", &dgx);
    assert_eq!((seg.gpu_device(), seg.numa_node()), (Some(0), Some(0)));
    // No numa_node file: unbound, still a GPU's memory.
    let seg = Segment::host(4096, HostOptions::default()).unwrap().on_gpu(
        0,
        "0000:05:00.0",
        &fixture("malformed"),
    );
    assert_eq!((seg.gpu_device(), seg.numa_node()), (Some(0), None));
    assert_eq!(
        Segment::host(4096, HostOptions::default())
            .unwrap()
            .gpu_device(),
        None
    );
}

struct Pair {
    fabric: FakeFabric,
    target: TransferEngine,
    initiator: TransferEngine,
    _server: TcpServer,
    addr: std::net::SocketAddr,
    local: LocalSegment,
}

/// A target with the DGX fixture's NICs and an initiator with one NIC on each NUMA node, on one
/// fake fabric; the initiator's buffer is on NUMA node 0.
fn pair() -> Pair {
    let fabric = FakeFabric::new();
    let dir = Arc::new(StaticDirectory::new());
    let target = TransferEngine::new_with_rdma(
        config("node-t"),
        key(),
        dir.clone(),
        TransferMetrics::unregistered().unwrap(),
        Some(fabric.provider_with_ports(&dgx_nics())),
    )
    .unwrap();
    let initiator = TransferEngine::new_with_rdma(
        config("node-i"),
        key(),
        dir,
        TransferMetrics::unregistered().unwrap(),
        Some(fabric.provider_with_ports(&[
            FakePort::roce("i-n0").on_numa(0),
            FakePort::roce("i-n1").on_numa(1),
        ])),
    )
    .unwrap();
    let server = target.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    let local = initiator
        .register(
            "i/buf",
            Arc::new(
                Segment::host(SEG, HostOptions::default())
                    .unwrap()
                    .on_numa_node(Some(0)),
            ),
        )
        .unwrap();
    Pair {
        fabric,
        addr: server.local_addr(),
        _server: server,
        target,
        initiator,
        local,
    }
}

impl Pair {
    fn serve(&self, name: &str, seg: Segment) -> (LocalSegment, SegmentDescriptor) {
        let local = self.target.register(name, Arc::new(seg)).unwrap();
        let desc = self.target.describe(&local, vec![Endpoint::Tcp(self.addr)]);
        (local, desc)
    }

    /// WRITE then READ back 1 MiB over RDMA; checks the bytes at both ends.
    fn round_trip(&self, remote_mem: &LocalSegment, desc: &SegmentDescriptor, seed: u8) {
        let remote = self
            .initiator
            .open_descriptor(desc, Some(Protocol::Rdma))
            .unwrap();
        assert_eq!(remote.protocol(), Protocol::Rdma);
        let len = 1u64 << 20;
        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect();
        self.local.segment().write_at(0, &data).unwrap();
        let req = |op, local_offset| TransferRequest {
            op,
            local: self.local.clone(),
            local_offset,
            remote: remote.clone(),
            remote_offset: 8192,
            len,
        };
        self.initiator
            .transfer(vec![req(TransferOp::Write, 0)])
            .unwrap();
        let mut got = vec![0u8; len as usize];
        remote_mem.segment().read_at(8192, &mut got).unwrap();
        assert!(got == data, "remote bytes differ after the RDMA WRITE");
        self.initiator
            .transfer(vec![req(TransferOp::Read, 2 << 20)])
            .unwrap();
        self.local.segment().read_at(2 << 20, &mut got).unwrap();
        assert!(got == data, "local bytes differ after the RDMA READ");
    }

    fn served(&self, nics: &[&str]) -> u64 {
        nics.iter().map(|n| self.fabric.bytes_served(n)).sum()
    }
}

#[test]
fn a_gpu_segment_is_served_through_the_nics_on_its_gpus_numa_node() {
    let p = pair();
    let gpu = Segment::host(SEG, HostOptions::default()).unwrap().on_gpu(
        5,
        "0000:ba:00.0",
        &fixture("dgx-roce"),
    );
    let (mem, desc) = p.serve("t/gpu5", gpu);
    assert_eq!(desc.memory, MemoryKind::Gpu);
    assert_eq!((desc.gpu_device, desc.numa_node), (Some(5), Some(1)));
    assert_eq!(names(&desc.nics), NODE1);
    assert!(
        desc.nics
            .iter()
            .all(|n| n.numa_node == Some(1) && n.port == 1 && n.gid_index == 3),
        "{:?}",
        desc.nics
    );
    p.round_trip(&mem, &desc, 3);
    // 1 MiB written and 1 MiB read, all through the target's NICs on node 1, and all posted
    // from the initiator's NIC on its buffer's node 0.
    assert_eq!(p.served(&NODE1), 2 << 20);
    assert_eq!(p.served(&NODE0), 0);
    assert_eq!(p.fabric.bytes_moved("i-n0"), 2 << 20);
    assert_eq!(p.fabric.bytes_moved("i-n1"), 0);
}

#[test]
fn host_memory_on_node_zero_is_served_there_and_unbound_memory_by_every_nic() {
    let p = pair();
    let dram = Segment::host(SEG, HostOptions::default())
        .unwrap()
        .on_numa_node(Some(0));
    let (mem, desc) = p.serve("t/dram0", dram);
    assert_eq!((desc.memory, desc.gpu_device), (MemoryKind::Host, None));
    assert_eq!(names(&desc.nics), NODE0);
    p.round_trip(&mem, &desc, 5);
    assert_eq!((p.served(&NODE0), p.served(&NODE1)), (2 << 20, 0));

    // A GPU whose NUMA node sysfs does not give (the malformed tree): unbound, so every NIC
    // serves it, and the target's queue pairs land on both nodes.
    let p = pair();
    let gpu = Segment::host(SEG, HostOptions::default()).unwrap().on_gpu(
        0,
        "0000:05:00.0",
        &fixture("malformed"),
    );
    let (mem, desc) = p.serve("t/gpu0", gpu);
    assert_eq!((desc.memory, desc.numa_node), (MemoryKind::Gpu, None));
    let mut all: Vec<&str> = NODE0.iter().chain(&NODE1).copied().collect();
    all.sort_unstable();
    assert_eq!(names(&desc.nics), all);
    p.round_trip(&mem, &desc, 9);
    assert_eq!(p.served(&NODE0) + p.served(&NODE1), 2 << 20);
}

#[test]
fn a_numa_node_without_nics_is_served_by_all_and_no_rdma_means_no_nics() {
    let p = pair();
    let (_, desc) = p.serve(
        "t/far",
        Segment::host(4096, HostOptions::default())
            .unwrap()
            .on_numa_node(Some(7)),
    );
    assert_eq!(desc.nics.len(), 8, "{:?}", desc.nics);
    let tcp_only = TransferEngine::new_with_rdma(
        config("node-x"),
        key(),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().unwrap(),
        None,
    )
    .unwrap();
    let local = tcp_only
        .register(
            "x/dram",
            Arc::new(
                Segment::host(4096, HostOptions::default())
                    .unwrap()
                    .on_numa_node(Some(0)),
            ),
        )
        .unwrap();
    let desc = tcp_only.describe(&local, vec![]);
    assert!(desc.nics.is_empty());
    assert_eq!(desc.numa_node, Some(0));
}
