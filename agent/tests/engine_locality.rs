//! Engines tell the agent where they run when their session opens (NUMA node, or GPU PCI bus
//! id): through a real Unix socket, against the DGX RoCE fixture's topology, the agent binds the
//! staging area to that node on this machine (read back, or left unbound when this machine
//! lacks the node), names the NICs on it, and refuses nodes and GPUs the host does not have.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use kvpool_agent::api::BlockStore;
use kvpool_agent::api::client::{EngineClient, Locality};
use kvpool_agent::api::server::{self, ApiLimits, EngineService};
use kvpool_agent::discovery::{Roots, discover};
use kvpool_agent::dram::DramTier;
use kvpool_agent::locality::SessionLocality;
use kvpool_agent::metrics::AgentMetrics;
use kvpool_agent::placement::SegmentPlan;
use kvpool_agent::store::TieredStore;
use tokio_util::sync::CancellationToken;

fn dgx_locality(allow: &[&str]) -> SessionLocality {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dgx-roce");
    let roots = Roots {
        sysfs: root.join("sys"),
        procfs: root.join("proc"),
    };
    let topo = discover(&roots, &BTreeMap::new()).expect("discover");
    let allow: Vec<String> = allow.iter().map(|s| (*s).to_owned()).collect();
    SessionLocality::from_topology(&topo, &allow)
}

/// Whether this machine has NUMA node `n`.
fn machine_has_node(n: u32) -> bool {
    PathBuf::from(format!("/sys/devices/system/node/node{n}")).exists()
}

#[tokio::test]
async fn sessions_get_a_staging_area_and_nics_on_their_engines_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plans = [SegmentPlan {
        numa_node: None,
        bytes: 1 << 20,
        hugepage_size: None,
    }];
    let (dram, _) = DramTier::new(&plans, false).expect("dram");
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(AgentMetrics::new(&registry).expect("metrics"));
    let store = Arc::new(TieredStore::new(dram, None, Arc::clone(&metrics)));
    let shm_dir = dir.path().join("shm");
    std::fs::create_dir_all(&shm_dir).expect("shm dir");
    let service = EngineService::new(
        store as Arc<dyn BlockStore>,
        Arc::clone(&metrics),
        shm_dir,
        ApiLimits {
            max_sessions: 8,
            max_staging_bytes: 4 << 20,
        },
    )
    .with_locality(dgx_locality(&["mlx5_0", "mlx5_1", "mlx5_4"]));
    let (listener, socket) = server::bind(&dir.path().join("run")).expect("bind");
    let stop = CancellationToken::new();
    let task = tokio::spawn(server::serve(listener, service, stop.clone()));
    let open = |locality: Locality| {
        let socket = socket.clone();
        async move { EngineClient::connect_near(&socket, 1 << 20, "near", &locality).await }
    };

    // An old client says nothing: unbound, no NICs.
    let plain = open(Locality::default()).await.expect("plain");
    assert_eq!(plain.placement().numa_node, None);
    assert!(plain.placement().nics.is_empty());

    // Node 0 exists on the fixture and on every machine: bound, verified, node 0's allowed NICs.
    let mut near = open(Locality {
        numa_node: Some(0),
        ..Locality::default()
    })
    .await
    .expect("node 0");
    assert_eq!(near.placement().numa_node, Some(0));
    assert_eq!(near.placement().nics, ["mlx5_0", "mlx5_1"]);
    // The bound staging area works as any other.
    assert_eq!(
        near.put(b"k", b"near bytes").await.expect("put"),
        kvpool_agent::proto::Status::Ok
    );
    assert_eq!(
        near.get(b"k").await.expect("get").as_deref(),
        Some(&b"near bytes"[..])
    );

    // A GPU of the fixture's node 1: that node, when this machine has it; else left unbound
    // (warned and counted), never claimed.
    let gpu = open(Locality {
        gpu_pci_bus_id: Some("0000:DC:00.0".into()),
        ..Locality::default()
    })
    .await
    .expect("gpu on node 1");
    if machine_has_node(1) {
        assert_eq!(gpu.placement().numa_node, Some(1));
        assert_eq!(gpu.placement().nics, ["mlx5_4"]);
    } else {
        assert_eq!(gpu.placement().numa_node, None);
        assert!(gpu.placement().nics.is_empty());
        assert_eq!(metrics.numa_binding_failures.get(), 1);
    }

    // What the host does not have is refused, naming the field.
    for (locality, field) in [
        (
            Locality {
                numa_node: Some(7),
                ..Locality::default()
            },
            "numa_node 7",
        ),
        (
            Locality {
                gpu_pci_bus_id: Some("0000:77:00.0".into()),
                ..Locality::default()
            },
            "gpu_pci_bus_id 0000:77:00.0",
        ),
        (
            Locality {
                gpu_pci_bus_id: Some("gpu0".into()),
                ..Locality::default()
            },
            "is not a PCI bus id",
        ),
        (
            Locality {
                numa_node: Some(1),
                gpu_pci_bus_id: Some("0000:18:00.0".into()),
            },
            "disagree",
        ),
    ] {
        let err = open(locality).await.expect_err(field);
        let text = format!(
            "{err}: {}",
            std::error::Error::source(&err)
                .map(ToString::to_string)
                .unwrap_or_default()
        );
        assert!(text.contains(field), "{text}");
    }
    stop.cancel();
    task.await.expect("join").expect("serve");
}
