//! The node's hardware topology as data: NUMA nodes, GPUs, RDMA NICs, SR-IOV functions, and the
//! views derived from them (PCIe locality, the GPU/NUMA -> NIC matrix for the transfer engine,
//! node labels). Pure: no I/O here; `discovery` fills these types from sysfs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Whether a string looks like a PCI bus id `DDDD:BB:DD.F` (hex digits): the transfer engine's
/// check, which ranks RDMA NICs by the same ids.
pub use kvpool_transfer::rdma::topology::is_pci_bus_id;

/// Label set on a node (and in the summary) when at least one usable RDMA NIC exists.
pub const LABEL_RDMA: &str = "kvpool.dev/rdma";
/// Number of usable RDMA NICs.
pub const LABEL_RDMA_NICS: &str = "kvpool.dev/rdma-nics";
/// Link layer of the usable NICs: `ethernet` (RoCE), `infiniband` or `mixed`.
pub const LABEL_LINK_LAYER: &str = "kvpool.dev/rdma-link-layer";
/// Number of NUMA nodes.
pub const LABEL_NUMA_NODES: &str = "kvpool.dev/numa-nodes";
/// Number of GPUs.
pub const LABEL_GPUS: &str = "kvpool.dev/gpus";
/// SR-IOV virtual functions enabled on the node's physical functions (`sriov_numvfs`).
pub const LABEL_SRIOV_VFS: &str = "kvpool.dev/sriov-vfs";
/// Annotation carrying the compact JSON [`TopologyMatrix`].
pub const ANNOTATION_MATRIX: &str = "kvpool.dev/topology-matrix";
/// Annotation carrying the number of discovery warnings.
pub const ANNOTATION_WARNINGS: &str = "kvpool.dev/discovery-warnings";
/// Annotation listing the SR-IOV VFs given to this pod.
pub const ANNOTATION_POD_VFS: &str = "kvpool.dev/pod-vfs";

/// Everything discovery found, plus what it could not read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    pub numa_nodes: Vec<NumaNode>,
    pub gpus: Vec<Gpu>,
    pub rdma_devices: Vec<RdmaDevice>,
    pub sriov: Vec<SriovPf>,
    /// VFs that the device plugin gave to this pod (from `PCIDEVICE_*` variables).
    pub pod_vfs: Vec<PodVf>,
    /// Nearest NICs per GPU and per NUMA node.
    pub matrix: TopologyMatrix,
    pub warnings: Vec<Warning>,
}

/// One NUMA node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNode {
    pub id: u32,
    pub cpus: Vec<u32>,
    pub mem_total_bytes: u64,
    /// Memory the node can give: free pages plus what the kernel reclaims on demand (file
    /// pages of the page cache, reclaimable slab), as the kernel's `MemAvailable` counts it;
    /// shared memory (tmpfs) is not reclaimable and not counted.
    pub mem_free_bytes: u64,
    /// Huge page pools, smallest page size first.
    pub hugepages: Vec<HugePagePool>,
}

impl NumaNode {
    /// Free huge pages of `page_size_bytes` on this node (0 when there is no such pool).
    pub fn free_hugepages(&self, page_size_bytes: u64) -> u64 {
        self.hugepages
            .iter()
            .find(|p| p.page_size_bytes == page_size_bytes)
            .map_or(0, |p| p.free)
    }
}

/// Huge pages of one size on one NUMA node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugePagePool {
    pub page_size_bytes: u64,
    pub total: u64,
    pub free: u64,
}

/// A GPU found on the PCI bus.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub pci_bus_id: String,
    pub vendor: String,
    pub device: String,
    pub class: String,
    pub numa_node: Option<u32>,
    /// Resolved PCI path below /sys/devices, root complex first.
    pub pci_path: Vec<String>,
    /// What the CUDA driver says about it (feature `cuda`, when a driver exists).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaDetails>,
}

/// GPU details from the CUDA driver.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaDetails {
    pub ordinal: u32,
    pub name: String,
    pub memory_bytes: u64,
}

/// An RDMA device from /sys/class/infiniband.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaDevice {
    pub name: String,
    pub pci_bus_id: Option<String>,
    pub numa_node: Option<u32>,
    pub netdevs: Vec<String>,
    pub ports: Vec<RdmaPort>,
    /// Bus id of the physical function when this device is an SR-IOV VF.
    pub pf_bus_id: Option<String>,
    pub pci_path: Vec<String>,
}

impl RdmaDevice {
    /// Whether any port reports ACTIVE.
    pub fn is_active(&self) -> bool {
        self.ports.iter().any(|p| p.state == "ACTIVE")
    }
}

/// One port of an RDMA device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaPort {
    pub port: u32,
    /// State name, e.g. `ACTIVE`, `DOWN`.
    pub state: String,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
    pub rate: Option<String>,
    /// Non-zero GID table entries.
    pub gids: Vec<GidEntry>,
}

/// One non-zero GID table entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GidEntry {
    pub index: u32,
    pub gid: String,
    /// `IB/RoCE v1` or `RoCE v2` when the kernel reports it.
    pub gid_type: Option<String>,
    pub netdev: Option<String>,
}

/// An SR-IOV physical function.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SriovPf {
    pub pf_bus_id: String,
    pub rdma_device: Option<String>,
    pub total_vfs: u32,
    pub num_vfs: u32,
    pub vfs: Vec<SriovVf>,
}

/// A virtual function of an SR-IOV PF.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SriovVf {
    pub index: u32,
    pub bus_id: String,
    pub rdma_device: Option<String>,
}

/// A VF given to this pod by a device plugin.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodVf {
    /// The environment variable that named it.
    pub env: String,
    pub bus_id: String,
    pub pf_bus_id: Option<String>,
    pub rdma_device: Option<String>,
    pub pf_rdma_device: Option<String>,
}

/// Something discovery could not read or understand.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Warning {
    /// Path relative to the sysfs/procfs root (or the variable name).
    pub path: String,
    pub message: String,
}

/// PCIe distance between two devices, named as `nvidia-smi topo -m` names them.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PcieDistance {
    /// Behind the same PCIe switch (at most one switch between them).
    Pix,
    /// Behind a chain of PCIe switches without crossing the host bridge.
    Pxb,
    /// Under the same host bridge (root complex).
    Phb,
    /// Different host bridges on the same NUMA node.
    Node,
    /// Different NUMA nodes (or unknown).
    #[default]
    Sys,
}

/// Preferred NICs for one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuNics {
    pub gpu: String,
    pub numa_node: Option<u32>,
    pub distance: PcieDistance,
    pub nics: Vec<String>,
}

/// Preferred NICs for one NUMA node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaNics {
    pub numa_node: u32,
    /// true when the NICs sit on this node; false when none does and all NICs are listed.
    pub local: bool,
    pub nics: Vec<String>,
}

/// The per-node matrix the transfer engine uses to pick NICs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyMatrix {
    pub gpus: Vec<GpuNics>,
    pub numa: Vec<NumaNics>,
}

/// Parse a Linux cpulist (`0-3,8,10-11`). Returns None on malformed input.
pub fn parse_cpulist(text: &str) -> Option<Vec<u32>> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Some(cpus);
    }
    for part in text.split(',') {
        let part = part.trim();
        match part.split_once('-') {
            Some((a, b)) => {
                let a: u32 = a.trim().parse().ok()?;
                let b: u32 = b.trim().parse().ok()?;
                if b < a || b - a > 65_536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// PCIe distance between two devices given their resolved paths and NUMA nodes.
pub fn pcie_distance(
    a_path: &[String],
    a_numa: Option<u32>,
    b_path: &[String],
    b_numa: Option<u32>,
) -> PcieDistance {
    let common = a_path
        .iter()
        .zip(b_path)
        .take_while(|(x, y)| x == y)
        .count();
    let below_a = a_path.len().saturating_sub(common);
    let below_b = b_path.len().saturating_sub(common);
    match common {
        0 => match (a_numa, b_numa) {
            (Some(x), Some(y)) if x == y => PcieDistance::Node,
            _ => PcieDistance::Sys,
        },
        1 => PcieDistance::Phb,
        // Sharing the host bridge and its root port only: still a host-bridge hop.
        2 => PcieDistance::Phb,
        _ if below_a <= 2 && below_b <= 2 => PcieDistance::Pix,
        _ => PcieDistance::Pxb,
    }
}

/// The NICs data may use: the pod's VFs when it has any, else every non-VF RDMA device; only
/// devices with an ACTIVE port count.
pub fn usable_nics<'a>(devices: &'a [RdmaDevice], pod_vfs: &[PodVf]) -> Vec<&'a RdmaDevice> {
    let mut out: Vec<&RdmaDevice> = if pod_vfs.is_empty() {
        devices.iter().filter(|d| d.pf_bus_id.is_none()).collect()
    } else {
        devices
            .iter()
            .filter(|d| {
                pod_vfs
                    .iter()
                    .any(|vf| vf.rdma_device.as_deref() == Some(d.name.as_str()))
            })
            .collect()
    };
    out.retain(|d| d.is_active());
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Compute the GPU/NUMA -> NIC matrix.
pub fn compute_matrix(topo: &Topology) -> TopologyMatrix {
    let nics = usable_nics(&topo.rdma_devices, &topo.pod_vfs);
    let mut matrix = TopologyMatrix::default();
    for gpu in &topo.gpus {
        let mut best: Option<(PcieDistance, usize)> = None;
        let mut chosen: Vec<String> = Vec::new();
        for nic in &nics {
            let d = pcie_distance(&gpu.pci_path, gpu.numa_node, &nic.pci_path, nic.numa_node);
            let common = gpu
                .pci_path
                .iter()
                .zip(&nic.pci_path)
                .take_while(|(x, y)| x == y)
                .count();
            // Lower class first, then the deeper shared ancestor.
            let key = (d, usize::MAX - common);
            match best {
                Some(b) if key > b => {}
                Some(b) if key == b => chosen.push(nic.name.clone()),
                _ => {
                    best = Some(key);
                    chosen = vec![nic.name.clone()];
                }
            }
        }
        if let Some((distance, _)) = best {
            matrix.gpus.push(GpuNics {
                gpu: gpu.pci_bus_id.clone(),
                numa_node: gpu.numa_node,
                distance,
                nics: chosen,
            });
        }
    }
    if !nics.is_empty() {
        for node in &topo.numa_nodes {
            let local: Vec<String> = nics
                .iter()
                .filter(|n| n.numa_node == Some(node.id))
                .map(|n| n.name.clone())
                .collect();
            let (local_flag, list) = if local.is_empty() {
                (false, nics.iter().map(|n| n.name.clone()).collect())
            } else {
                (true, local)
            };
            matrix.numa.push(NumaNics {
                numa_node: node.id,
                local: local_flag,
                nics: list,
            });
        }
    }
    matrix
}

/// Node labels and annotations that summarise the topology for scheduling.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSummary {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// Build the label/annotation summary.
pub fn summarize(topo: &Topology) -> NodeSummary {
    let nics = usable_nics(&topo.rdma_devices, &topo.pod_vfs);
    let mut labels = BTreeMap::new();
    labels.insert(LABEL_RDMA.to_owned(), (!nics.is_empty()).to_string());
    labels.insert(LABEL_RDMA_NICS.to_owned(), nics.len().to_string());
    labels.insert(
        LABEL_NUMA_NODES.to_owned(),
        topo.numa_nodes.len().to_string(),
    );
    labels.insert(LABEL_GPUS.to_owned(), topo.gpus.len().to_string());
    let vfs: u64 = topo.sriov.iter().map(|pf| u64::from(pf.num_vfs)).sum();
    labels.insert(LABEL_SRIOV_VFS.to_owned(), vfs.to_string());
    if !nics.is_empty() {
        let mut layers: Vec<String> = nics
            .iter()
            .flat_map(|n| n.ports.iter().filter(|p| p.state == "ACTIVE"))
            .map(|p| p.link_layer.to_ascii_lowercase())
            .collect();
        layers.sort();
        layers.dedup();
        let layer = match layers.as_slice() {
            [one] => one.clone(),
            _ => "mixed".to_owned(),
        };
        labels.insert(LABEL_LINK_LAYER.to_owned(), layer);
    }
    let mut annotations = BTreeMap::new();
    annotations.insert(
        ANNOTATION_MATRIX.to_owned(),
        serde_json::to_string(&topo.matrix).unwrap_or_default(),
    );
    annotations.insert(
        ANNOTATION_WARNINGS.to_owned(),
        topo.warnings.len().to_string(),
    );
    if !topo.pod_vfs.is_empty() {
        let vfs: Vec<&str> = topo.pod_vfs.iter().map(|v| v.bus_id.as_str()).collect();
        annotations.insert(ANNOTATION_POD_VFS.to_owned(), vfs.join(","));
    }
    NodeSummary {
        labels,
        annotations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(parts: &[&str]) -> Vec<String> {
        parts.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn cpulist_parses_ranges_and_rejects_garbage() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a-b"), None);
        assert_eq!(parse_cpulist("0-1,,2"), None);
    }

    #[test]
    fn bus_id_shape() {
        assert!(is_pci_bus_id("0000:3b:00.1"));
        assert!(!is_pci_bus_id("0000:3b:00"));
        assert!(!is_pci_bus_id("0000x3b:00.1"));
        assert!(!is_pci_bus_id("zzzz:3b:00.1"));
    }

    #[test]
    fn distance_classes() {
        let gpu = path(&[
            "pci0000:16",
            "0000:16:02.0",
            "0000:17:00.0",
            "0000:18:00.0",
            "0000:19:00.0",
        ]);
        let nic_same_switch = path(&[
            "pci0000:16",
            "0000:16:02.0",
            "0000:17:00.0",
            "0000:18:01.0",
            "0000:1a:00.0",
        ]);
        let nic_same_rc = path(&["pci0000:16", "0000:16:03.0", "0000:1b:00.0"]);
        let nic_other_rc = path(&["pci0000:30", "0000:30:02.0", "0000:31:00.0"]);
        assert_eq!(
            pcie_distance(&gpu, Some(0), &nic_same_switch, Some(0)),
            PcieDistance::Pix
        );
        assert_eq!(
            pcie_distance(&gpu, Some(0), &nic_same_rc, Some(0)),
            PcieDistance::Phb
        );
        assert_eq!(
            pcie_distance(&gpu, Some(0), &nic_other_rc, Some(0)),
            PcieDistance::Node
        );
        assert_eq!(
            pcie_distance(&gpu, Some(0), &nic_other_rc, Some(1)),
            PcieDistance::Sys
        );
        assert_eq!(
            pcie_distance(&gpu, None, &nic_other_rc, None),
            PcieDistance::Sys
        );
        let deep = path(&[
            "pci0000:16",
            "0000:16:02.0",
            "0000:17:00.0",
            "0000:18:00.0",
            "0000:20:00.0",
            "0000:21:00.0",
            "0000:22:00.0",
        ]);
        assert_eq!(
            pcie_distance(&deep, Some(0), &nic_same_switch, Some(0)),
            PcieDistance::Pxb
        );
    }
}
