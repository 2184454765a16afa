//! Discovery against the committed sysfs/procfs fixture trees (agent/tests/fixtures, made by
//! generate.py there). Each fixture's test asserts the key facts by hand, and one test compares
//! the whole document of every fixture against its golden JSON file next to the tree. Set
//! KVPOOL_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change, then review the
//! diff.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvpool_agent::discovery::{Roots, discover};
use kvpool_agent::placement::{NumaPolicy, Placement, PlacementRequest, plan};
use kvpool_agent::topology::{PcieDistance, Topology, summarize};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn discover_fixture(name: &str, env: &[(&str, &str)]) -> Topology {
    let root = fixture(name);
    let roots = Roots {
        sysfs: root.join("sys"),
        procfs: root.join("proc"),
    };
    let env: BTreeMap<String, String> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    discover(&roots, &env).expect("discover")
}

/// The environment of the malformed tree: one variable naming a bad bus id and a missing one.
const MALFORMED_ENV: &[(&str, &str)] = &[("PCIDEVICE_BROKEN", "0000:zz:00.0, 0000:99:00.1")];

#[test]
fn topologies_match_the_golden_files() {
    for (name, env) in [
        ("dgx-roce", &[][..]),
        ("tcp-single", &[][..]),
        ("malformed", MALFORMED_ENV),
    ] {
        let topo = discover_fixture(name, env);
        let file = format!("{name}.json");
        let path = fixture(&file);
        let actual = serde_json::to_string_pretty(&topo).expect("json") + "\n";
        if std::env::var_os("KVPOOL_UPDATE_GOLDEN").is_some() {
            std::fs::write(&path, &actual).expect("write golden");
        }
        let expected = std::fs::read_to_string(&path).expect("golden file exists");
        let expected: Topology = serde_json::from_str(&expected).expect("golden parses");
        assert_eq!(topo, expected, "topology differs from {file}");
    }
}

#[test]
fn dgx_roce_node() {
    let topo = discover_fixture("dgx-roce", &[]);
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);

    assert_eq!(topo.numa_nodes.len(), 2);
    let n0 = &topo.numa_nodes[0];
    assert_eq!(n0.cpus.len(), 112);
    assert_eq!(n0.cpus[56], 112);
    assert_eq!(n0.mem_total_bytes, 1_056_561_152 * 1024);
    assert_eq!(n0.free_hugepages(2 << 20), 1000);
    assert_eq!(n0.free_hugepages(1 << 30), 0);

    // Eight H100s; the BMC's VGA controller is not a GPU.
    assert_eq!(topo.gpus.len(), 8);
    assert!(topo.gpus.iter().all(|g| g.vendor == "0x10de"));
    assert_eq!(topo.gpus[0].pci_bus_id, "0000:18:00.0");
    assert_eq!(topo.gpus[0].numa_node, Some(0));
    assert_eq!(topo.gpus[7].pci_bus_id, "0000:dc:00.0");
    assert_eq!(topo.gpus[7].numa_node, Some(1));

    // 8 PFs + 4 VFs with RDMA devices.
    assert_eq!(topo.rdma_devices.len(), 12);
    let mlx0 = &topo.rdma_devices[0];
    assert_eq!(mlx0.name, "mlx5_0");
    assert_eq!(mlx0.pci_bus_id.as_deref(), Some("0000:19:00.0"));
    assert_eq!(mlx0.netdevs, vec!["eth0"]);
    assert_eq!(mlx0.ports[0].state, "ACTIVE");
    assert_eq!(mlx0.ports[0].link_layer, "Ethernet");
    assert_eq!(mlx0.ports[0].gids.len(), 4, "the zero GID is skipped");
    assert_eq!(mlx0.ports[0].gids[3].gid_type.as_deref(), Some("RoCE v2"));
    assert_eq!(
        mlx0.ports[0].gids[3].gid,
        "0000:0000:0000:0000:0000:ffff:0a00:0001"
    );
    let vf = topo
        .rdma_devices
        .iter()
        .find(|d| d.name == "mlx5_8")
        .expect("VF device");
    assert_eq!(vf.pf_bus_id.as_deref(), Some("0000:19:00.0"));

    // SR-IOV: two PFs with two VFs each.
    assert_eq!(topo.sriov.len(), 2);
    assert_eq!(topo.sriov[0].pf_bus_id, "0000:19:00.0");
    assert_eq!(topo.sriov[0].rdma_device.as_deref(), Some("mlx5_0"));
    assert_eq!((topo.sriov[0].total_vfs, topo.sriov[0].num_vfs), (8, 2));
    let vfs: Vec<(&str, Option<&str>)> = topo.sriov[1]
        .vfs
        .iter()
        .map(|v| (v.bus_id.as_str(), v.rdma_device.as_deref()))
        .collect();
    assert_eq!(
        vfs,
        vec![
            ("0000:9b:00.2", Some("mlx5_10")),
            ("0000:9b:00.3", Some("mlx5_11"))
        ]
    );
    assert!(topo.pod_vfs.is_empty());

    // Each GPU shares a PCIe switch with exactly one NIC.
    assert_eq!(topo.matrix.gpus.len(), 8);
    for (i, g) in topo.matrix.gpus.iter().enumerate() {
        assert_eq!(g.distance, PcieDistance::Pix, "{g:?}");
        assert_eq!(g.nics, vec![format!("mlx5_{i}")]);
    }
    assert_eq!(topo.matrix.numa.len(), 2);
    assert_eq!(
        topo.matrix.numa[0].nics,
        vec!["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    );
    assert_eq!(
        topo.matrix.numa[1].nics,
        vec!["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    );

    let summary = summarize(&topo);
    let labels: Vec<(&str, &str)> = summary
        .labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        labels,
        vec![
            ("kvpool.dev/gpus", "8"),
            ("kvpool.dev/numa-nodes", "2"),
            ("kvpool.dev/rdma", "true"),
            ("kvpool.dev/rdma-link-layer", "ethernet"),
            ("kvpool.dev/rdma-nics", "8"),
            ("kvpool.dev/sriov-vfs", "4"),
        ]
    );
}

#[test]
fn dgx_roce_pod_with_vfs_uses_only_its_vfs() {
    let topo = discover_fixture(
        "dgx-roce",
        &[("PCIDEVICE_NVIDIA_COM_MLX5_VF", "0000:19:00.2,0000:9b:00.3")],
    );
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);
    let vfs: Vec<(&str, Option<&str>, Option<&str>)> = topo
        .pod_vfs
        .iter()
        .map(|v| {
            (
                v.bus_id.as_str(),
                v.rdma_device.as_deref(),
                v.pf_rdma_device.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        vfs,
        vec![
            ("0000:19:00.2", Some("mlx5_8"), Some("mlx5_0")),
            ("0000:9b:00.3", Some("mlx5_11"), Some("mlx5_4")),
        ]
    );
    // GPU 0 sits under the switch of mlx5_0, whose VF mlx5_8 the pod has.
    assert_eq!(topo.matrix.gpus[0].nics, vec!["mlx5_8"]);
    assert_eq!(topo.matrix.gpus[0].distance, PcieDistance::Pix);
    // GPU 1 has no VF under its switch: the same-node VF is next best.
    assert_eq!(topo.matrix.gpus[1].nics, vec!["mlx5_8"]);
    assert_eq!(topo.matrix.gpus[1].distance, PcieDistance::Node);
    assert_eq!(topo.matrix.gpus[5].nics, vec!["mlx5_11"]);
    assert_eq!(topo.matrix.numa[0].nics, vec!["mlx5_8"]);
    assert_eq!(topo.matrix.numa[1].nics, vec!["mlx5_11"]);
    let summary = summarize(&topo);
    assert_eq!(summary.labels["kvpool.dev/rdma-nics"], "2");
    assert_eq!(
        summary.annotations["kvpool.dev/pod-vfs"],
        "0000:19:00.2,0000:9b:00.3"
    );
}

#[test]
fn tcp_only_single_numa_node() {
    let topo = discover_fixture("tcp-single", &[]);
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);
    assert_eq!(topo.numa_nodes.len(), 1);
    assert_eq!(topo.numa_nodes[0].cpus, (0..16).collect::<Vec<u32>>());
    assert_eq!(topo.gpus.len(), 1);
    // numa_node -1 on a single-node machine means node 0.
    assert_eq!(topo.gpus[0].numa_node, Some(0));
    assert!(topo.rdma_devices.is_empty());
    assert_eq!(topo.matrix, Default::default());
    let summary = summarize(&topo);
    assert_eq!(summary.labels["kvpool.dev/rdma"], "false");
    assert_eq!(summary.labels["kvpool.dev/rdma-nics"], "0");
    assert!(!summary.labels.contains_key("kvpool.dev/rdma-link-layer"));
    assert_eq!(summary.labels["kvpool.dev/sriov-vfs"], "0");
}

#[test]
fn malformed_tree_warns_instead_of_failing() {
    let topo = discover_fixture("malformed", MALFORMED_ENV);
    let warnings: Vec<String> = topo
        .warnings
        .iter()
        .map(|w| format!("{}: {}", w.path, w.message))
        .collect();
    for needle in [
        "node0/cpulist: malformed cpulist",
        "node0/meminfo: cannot read",
        "free_hugepages: not an unsigned integer",
        "0000:05:00.0/numa_node: cannot read",
        "0000:06:00.0/class: missing",
        "sriov_numvfs is 4 but 1 virtfn links exist",
        "rxe0/device: cannot resolve device link",
        "rxe0/ports: cannot list",
        "env/PCIDEVICE_BROKEN: not a PCI bus id",
        "PCI device 0000:99:00.1 does not exist",
    ] {
        assert!(
            warnings.iter().any(|w| w.contains(needle)),
            "no warning with {needle:?}: {warnings:#?}"
        );
    }

    // What could be read is still there.
    assert_eq!(topo.numa_nodes.len(), 2);
    assert_eq!(topo.numa_nodes[1].cpus, vec![4, 5, 6, 7]);
    assert_eq!(topo.gpus.len(), 1);
    assert_eq!(topo.gpus[0].numa_node, None);
    // The only NIC is down: no usable NIC, no matrix.
    assert_eq!(topo.rdma_devices.len(), 2);
    assert!(topo.matrix.gpus.is_empty());
    assert_eq!(summarize(&topo).labels["kvpool.dev/rdma"], "false");
}

/// A request for `capacity` bytes placed by `policy` on normal pages, in segments of at most
/// 16 GiB.
fn request(capacity: u64, policy: NumaPolicy) -> PlacementRequest {
    PlacementRequest {
        capacity,
        policy,
        hugepage_size: None,
        max_segment: 16 << 30,
    }
}

/// Each planned segment as (NUMA node, bytes, huge page size).
fn layout(p: &Placement) -> Vec<(Option<u32>, u64, Option<u64>)> {
    p.segments
        .iter()
        .map(|s| (s.numa_node, s.bytes, s.hugepage_size))
        .collect()
}

#[test]
fn dram_placement_on_the_dgx_follows_the_nics() {
    let topo = discover_fixture("dgx-roce", &[]);
    let req = PlacementRequest {
        hugepage_size: Some(2 << 20),
        ..request(64 << 30, NumaPolicy::NicLocal)
    };
    let p = plan(&topo, &req).expect("plan");
    let nodes = layout(&p);
    // 1000 free 2 MiB pages on node 0 and 1024 on node 1 cannot hold 32 GiB each.
    assert_eq!(
        nodes,
        vec![
            (Some(0), 16 << 30, None),
            (Some(0), 16 << 30, None),
            (Some(1), 16 << 30, None),
            (Some(1), 16 << 30, None)
        ]
    );
    assert_eq!(p.warnings.len(), 2, "{:?}", p.warnings);

    // Small enough for the huge pages: 1 GiB per node.
    let small = PlacementRequest {
        capacity: 2 << 30,
        ..req.clone()
    };
    let p = plan(&topo, &small).expect("plan");
    assert!(p.segments.iter().all(|s| s.hugepage_size == Some(2 << 20)));
    assert!(p.warnings.is_empty());

    // A pod whose only VF sits on node 1 puts all DRAM there.
    let topo = discover_fixture("dgx-roce", &[("PCIDEVICE_X", "0000:9b:00.2")]);
    let p = plan(&topo, &small).expect("plan");
    assert!(
        p.segments.iter().all(|s| s.numa_node == Some(1)),
        "{:?}",
        p.segments
    );

    // Interleave ignores the NICs.
    let topo = discover_fixture("tcp-single", &[]);
    let p = plan(
        &topo,
        &PlacementRequest {
            max_segment: 1 << 30,
            ..request(1 << 30, NumaPolicy::Interleave)
        },
    )
    .expect("plan");
    assert_eq!(p.segments.len(), 1);
    assert_eq!(p.segments[0].numa_node, Some(0));
}

#[test]
fn dram_placement_none_on_the_dgx_binds_nothing() {
    let topo = discover_fixture("dgx-roce", &[]);
    assert_eq!(
        topo.numa_nodes.len(),
        2,
        "the fixture is a 2-socket machine"
    );
    let req = request(40 << 30, NumaPolicy::None);
    let p = plan(&topo, &req).expect("plan");
    // No per-node split (NIC-local would put 20 GiB on each node): one run of unbound
    // segments, cut only by the segment size limit.
    let segs = layout(&p);
    assert_eq!(
        segs,
        vec![
            (None, 16 << 30, None),
            (None, 16 << 30, None),
            (None, 8 << 30, None)
        ]
    );
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);

    // Huge pages count over all nodes: 1000 + 1024 free 2 MiB pages hold 3 GiB together,
    // though neither node holds it alone.
    let huge = PlacementRequest {
        capacity: 3 << 30,
        hugepage_size: Some(2 << 20),
        ..req.clone()
    };
    let p = plan(&topo, &huge).expect("plan");
    assert!(
        p.segments
            .iter()
            .all(|s| s.numa_node.is_none() && s.hugepage_size == Some(2 << 20)),
        "{:?}",
        p.segments
    );
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    // More than all free huge pages: normal pages, with one warning.
    let p = plan(
        &topo,
        &PlacementRequest {
            capacity: 8 << 30,
            ..huge.clone()
        },
    )
    .expect("plan");
    assert!(p.segments.iter().all(|s| s.hugepage_size.is_none()));
    assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);

    // The memory check is against the machine's total free memory, named in the error.
    let free: u64 = topo.numa_nodes.iter().map(|n| n.mem_free_bytes).sum();
    let err = plan(
        &topo,
        &PlacementRequest {
            capacity: free + (1 << 30),
            ..req
        },
    )
    .expect_err("more than the machine has");
    assert_eq!(err.category(), "insufficient_memory");
    assert!(err.to_string().contains("unbound"), "{err}");
}
