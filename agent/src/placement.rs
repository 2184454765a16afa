//! DRAM tier placement: how much memory to take on which NUMA node, in which segments, with or
//! without huge pages. Pure: decides from a [`Topology`] and the configuration; `dram` maps what
//! this module plans.

use serde::{Deserialize, Serialize};

use crate::topology::Topology;

/// Granularity of segment sizes without huge pages.
pub const PAGE: u64 = 4096;

/// Where the DRAM tier's memory goes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NumaPolicy {
    /// On the NUMA nodes of the usable NICs, in proportion to their NIC count (falls back to
    /// the GPUs' nodes, then to all nodes).
    #[default]
    NicLocal,
    /// Evenly over all NUMA nodes.
    Interleave,
    /// Evenly over the listed nodes.
    Nodes(Vec<u32>),
}

/// What to place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRequest {
    pub capacity: u64,
    pub policy: NumaPolicy,
    /// Huge page size to use where enough free pages exist on the node.
    pub hugepage_size: Option<u64>,
    /// Largest single segment.
    pub max_segment: u64,
}

/// One segment to map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentPlan {
    pub numa_node: u32,
    pub bytes: u64,
    pub hugepage_size: Option<u64>,
}

/// The plan and the fallbacks it chose.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub segments: Vec<SegmentPlan>,
    pub warnings: Vec<String>,
}

/// Errors of placement.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("topology has no NUMA nodes")]
    NoNodes,
    #[error("NUMA node {0} named by the policy does not exist")]
    UnknownNode(u32),
    #[error("NUMA node {node} has {free} bytes free, the DRAM tier wants {wanted} there")]
    InsufficientMemory { node: u32, wanted: u64, free: u64 },
    #[error("capacity must be positive")]
    ZeroCapacity,
}

impl PlacementError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            PlacementError::NoNodes => "no_nodes",
            PlacementError::UnknownNode(_) => "unknown_node",
            PlacementError::InsufficientMemory { .. } => "insufficient_memory",
            PlacementError::ZeroCapacity => "zero_capacity",
        }
    }
}

/// Plan the DRAM tier's segments.
pub fn plan(topo: &Topology, req: &PlacementRequest) -> Result<Placement, PlacementError> {
    if req.capacity == 0 {
        return Err(PlacementError::ZeroCapacity);
    }
    if topo.numa_nodes.is_empty() {
        return Err(PlacementError::NoNodes);
    }
    let mut warnings = Vec::new();
    // (node, weight)
    let weighted: Vec<(u32, u64)> = match &req.policy {
        NumaPolicy::Interleave => topo.numa_nodes.iter().map(|n| (n.id, 1)).collect(),
        NumaPolicy::Nodes(ids) => {
            let mut out = Vec::new();
            for id in ids {
                if !topo.numa_nodes.iter().any(|n| n.id == *id) {
                    return Err(PlacementError::UnknownNode(*id));
                }
                if !out.iter().any(|(n, _)| n == id) {
                    out.push((*id, 1));
                }
            }
            out
        }
        NumaPolicy::NicLocal => {
            let nic_nodes: Vec<(u32, u64)> = topo
                .matrix
                .numa
                .iter()
                .filter(|n| n.local)
                .map(|n| (n.numa_node, n.nics.len() as u64))
                .collect();
            if !nic_nodes.is_empty() {
                nic_nodes
            } else {
                let mut gpu_nodes: Vec<u32> =
                    topo.gpus.iter().filter_map(|g| g.numa_node).collect();
                gpu_nodes.sort_unstable();
                gpu_nodes.dedup();
                if gpu_nodes.is_empty() {
                    if topo.numa_nodes.len() > 1 {
                        warnings.push(
                            "no NIC or GPU locality known; spreading DRAM over all NUMA nodes"
                                .to_owned(),
                        );
                    }
                    topo.numa_nodes.iter().map(|n| (n.id, 1)).collect()
                } else {
                    warnings.push(
                        "no usable RDMA NIC; placing DRAM on the GPUs' NUMA nodes".to_owned(),
                    );
                    gpu_nodes.into_iter().map(|n| (n, 1)).collect()
                }
            }
        }
    };
    let total_weight: u64 = weighted.iter().map(|(_, w)| *w).sum::<u64>().max(1);
    let unit = req.hugepage_size.unwrap_or(PAGE).max(PAGE);
    let capacity_units = req.capacity.div_ceil(unit);
    let mut shares: Vec<(u32, u64)> = weighted
        .iter()
        .map(|(node, w)| (*node, capacity_units * w / total_weight))
        .collect();
    let assigned: u64 = shares.iter().map(|(_, s)| *s).sum();
    if let Some(first) = shares.first_mut() {
        first.1 += capacity_units - assigned;
    }

    let mut segments = Vec::new();
    for (node_id, units) in shares {
        if units == 0 {
            continue;
        }
        let bytes = units * unit;
        let Some(node) = topo.numa_nodes.iter().find(|n| n.id == node_id) else {
            return Err(PlacementError::UnknownNode(node_id));
        };
        if node.mem_free_bytes < bytes {
            return Err(PlacementError::InsufficientMemory {
                node: node_id,
                wanted: bytes,
                free: node.mem_free_bytes,
            });
        }
        let hugepage_size = match req.hugepage_size {
            Some(size) if node.free_hugepages(size).saturating_mul(size) >= bytes => Some(size),
            Some(size) => {
                warnings.push(format!(
                    "NUMA node {node_id}: {} free huge pages of {size} bytes cannot hold \
                     {bytes} bytes; using normal pages",
                    node.free_hugepages(size)
                ));
                None
            }
            None => None,
        };
        let max_segment = (req.max_segment / unit).max(1) * unit;
        let mut left = bytes;
        while left > 0 {
            let take = left.min(max_segment);
            segments.push(SegmentPlan {
                numa_node: node_id,
                bytes: take,
                hugepage_size,
            });
            left -= take;
        }
    }
    Ok(Placement { segments, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{NumaNics, NumaNode, TopologyMatrix};

    fn two_nodes(nics0: usize, nics1: usize) -> Topology {
        let node = |id| NumaNode {
            id,
            mem_total_bytes: 64 << 30,
            mem_free_bytes: 32 << 30,
            ..NumaNode::default()
        };
        let mut numa = Vec::new();
        for (id, n) in [(0, nics0), (1, nics1)] {
            numa.push(NumaNics {
                numa_node: id,
                local: n > 0,
                nics: (0..n).map(|i| format!("nic{id}{i}")).collect(),
            });
        }
        Topology {
            numa_nodes: vec![node(0), node(1)],
            matrix: TopologyMatrix { gpus: vec![], numa },
            ..Topology::default()
        }
    }

    fn req(capacity: u64, policy: NumaPolicy) -> PlacementRequest {
        PlacementRequest {
            capacity,
            policy,
            hugepage_size: None,
            max_segment: 1 << 30,
        }
    }

    #[test]
    fn nic_local_weights_by_nic_count_and_splits_segments() {
        let topo = two_nodes(3, 1);
        let p = plan(&topo, &req(4 << 30, NumaPolicy::NicLocal)).expect("plan");
        let per_node = |n| {
            p.segments
                .iter()
                .filter(|s| s.numa_node == n)
                .map(|s| s.bytes)
                .sum::<u64>()
        };
        assert_eq!(per_node(0), 3 << 30);
        assert_eq!(per_node(1), 1 << 30);
        assert_eq!(p.segments.len(), 4);
        assert!(p.segments.iter().all(|s| s.bytes <= 1 << 30));
    }

    #[test]
    fn explicit_nodes_must_exist_and_memory_must_fit() {
        let topo = two_nodes(1, 1);
        assert_eq!(
            plan(&topo, &req(1 << 20, NumaPolicy::Nodes(vec![7]))),
            Err(PlacementError::UnknownNode(7))
        );
        assert_eq!(
            plan(&topo, &req(40 << 30, NumaPolicy::Nodes(vec![1]))),
            Err(PlacementError::InsufficientMemory {
                node: 1,
                wanted: 40 << 30,
                free: 32 << 30
            })
        );
        assert_eq!(
            plan(&topo, &req(0, NumaPolicy::Interleave)),
            Err(PlacementError::ZeroCapacity)
        );
    }

    #[test]
    fn odd_sizes_round_to_pages_and_remainder_goes_first() {
        let topo = two_nodes(0, 0);
        let p = plan(&topo, &req(3 * PAGE + 1, NumaPolicy::Interleave)).expect("plan");
        assert_eq!(
            p.segments,
            vec![
                SegmentPlan {
                    numa_node: 0,
                    bytes: 2 * PAGE,
                    hugepage_size: None
                },
                SegmentPlan {
                    numa_node: 1,
                    bytes: 2 * PAGE,
                    hugepage_size: None
                },
            ]
        );
        // No NICs and no GPUs: spread, with a warning.
        let p = plan(&topo, &req(8 * PAGE, NumaPolicy::NicLocal)).expect("plan");
        assert_eq!(p.segments.len(), 2);
        assert_eq!(p.warnings.len(), 1);
    }
}
