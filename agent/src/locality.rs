//! Where an engine's session goes: the engine says (when its session opens) the NUMA node of its
//! memory or the PCI bus id of its GPU; this resolves that against the node's topology to a NUMA
//! node, and lists the RDMA NICs on it (the pool's allow-list applied). The engine API then
//! binds the session's staging area to that node and answers with the node and the NICs.
//! Pure: built from a discovered [`Topology`].

use std::collections::BTreeMap;

use crate::topology::{Topology, is_pci_bus_id, usable_nics};

/// What the engine API knows of the node's topology to place sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionLocality {
    numa_nodes: Vec<u32>,
    /// GPU PCI bus id (lower case) -> its NUMA node.
    gpus: BTreeMap<String, Option<u32>>,
    /// NUMA node -> usable RDMA NICs on it, by name.
    nics: BTreeMap<u32, Vec<String>>,
}

/// Why a session's locality was refused; the text names the request field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LocalityError {
    #[error("numa_node {asked} is not a NUMA node of this host (it has {have:?})")]
    UnknownNode { asked: u32, have: Vec<u32> },
    #[error("gpu_pci_bus_id {0:?} is not a PCI bus id such as 0000:18:00.0")]
    BadGpuId(String),
    #[error("gpu_pci_bus_id {asked} is not a GPU of this host (it has {have:?})")]
    UnknownGpu { asked: String, have: Vec<String> },
    #[error("numa_node {numa} and gpu_pci_bus_id {gpu} (on NUMA node {gpu_node}) disagree")]
    Disagree {
        numa: u32,
        gpu: String,
        gpu_node: u32,
    },
}

impl SessionLocality {
    /// From the discovered topology; only NICs named in `allow` count when it is not empty (the
    /// pool's `transport.devices`), and the pod's SR-IOV VFs replace the host's NICs when it has
    /// any (as the transfer engine chooses them).
    pub fn from_topology(topo: &Topology, allow: &[String]) -> Self {
        let mut nics: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for nic in usable_nics(&topo.rdma_devices, &topo.pod_vfs) {
            if !allow.is_empty() && !allow.contains(&nic.name) {
                continue;
            }
            if let Some(node) = nic.numa_node {
                nics.entry(node).or_default().push(nic.name.clone());
            }
        }
        SessionLocality {
            numa_nodes: topo.numa_nodes.iter().map(|n| n.id).collect(),
            gpus: topo
                .gpus
                .iter()
                .map(|g| (g.pci_bus_id.to_ascii_lowercase(), g.numa_node))
                .collect(),
            nics,
        }
    }

    /// The NUMA node for a session whose engine names `numa` and/or the GPU `gpu` (empty: none).
    /// `Ok(None)`: nothing was named, or the GPU's node is unknown.
    pub fn resolve(&self, numa: Option<u32>, gpu: &str) -> Result<Option<u32>, LocalityError> {
        if let Some(n) = numa
            && !self.numa_nodes.contains(&n)
        {
            return Err(LocalityError::UnknownNode {
                asked: n,
                have: self.numa_nodes.clone(),
            });
        }
        let gpu = gpu.trim();
        if gpu.is_empty() {
            return Ok(numa);
        }
        if !is_pci_bus_id(gpu) {
            return Err(LocalityError::BadGpuId(gpu.to_owned()));
        }
        let key = gpu.to_ascii_lowercase();
        let Some(gpu_node) = self.gpus.get(&key) else {
            return Err(LocalityError::UnknownGpu {
                asked: key,
                have: self.gpus.keys().cloned().collect(),
            });
        };
        match (numa, *gpu_node) {
            (Some(n), Some(g)) if n != g => Err(LocalityError::Disagree {
                numa: n,
                gpu: key,
                gpu_node: g,
            }),
            (Some(n), _) => Ok(Some(n)),
            (None, g) => Ok(g),
        }
    }

    /// RDMA NICs on `node`, by name (empty when none is there).
    pub fn nics_on(&self, node: u32) -> Vec<String> {
        self.nics.get(&node).cloned().unwrap_or_default()
    }
}
