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
    /// No binding: segments are mapped without mbind, so the kernel's default policy places
    /// each page on the node of the CPU that first touches it. Segments have no NUMA node.
    None,
}

/// Metric label and log text of a segment's NUMA node: the number, or `none` when unbound.
pub fn numa_label(node: Option<u32>) -> String {
    node.map_or_else(|| "none".to_owned(), |n| n.to_string())
}

/// The NUMA node the master is told for an unbound segment. The master's segment spec carries
/// a plain node number, so "unknown" travels as a number no machine has: it never equals an
/// engine's NUMA hint, which is exactly how an unbound segment should rank.
pub const MASTER_UNBOUND_NUMA_NODE: u32 = u32::MAX;

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
    /// The node to bind the segment to; `None`: not bound (policy [`NumaPolicy::None`]).
    pub numa_node: Option<u32>,
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
    #[error("the NUMA nodes have {free} bytes free in all, the unbound DRAM tier wants {wanted}")]
    InsufficientTotalMemory { wanted: u64, free: u64 },
    #[error("capacity must be positive")]
    ZeroCapacity,
}

impl PlacementError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            PlacementError::NoNodes => "no_nodes",
            PlacementError::UnknownNode(_) => "unknown_node",
            PlacementError::InsufficientMemory { .. }
            | PlacementError::InsufficientTotalMemory { .. } => "insufficient_memory",
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
        NumaPolicy::None => return plan_unbound(topo, req),
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
        split(
            &mut segments,
            Some(node_id),
            bytes,
            hugepage_size,
            req.max_segment,
            unit,
        );
    }
    Ok(Placement { segments, warnings })
}

/// Cut `bytes` on `numa_node` into segments of at most `max_segment` (rounded down to `unit`).
fn split(
    segments: &mut Vec<SegmentPlan>,
    numa_node: Option<u32>,
    bytes: u64,
    hugepage_size: Option<u64>,
    max_segment: u64,
    unit: u64,
) {
    let max_segment = (max_segment / unit).max(1) * unit;
    let mut left = bytes;
    while left > 0 {
        let take = left.min(max_segment);
        segments.push(SegmentPlan {
            numa_node,
            bytes: take,
            hugepage_size,
        });
        left -= take;
    }
}

/// Policy `none`: one run of unbound segments, no per-node split. The kernel decides where each
/// page lands (first touch), so the memory check is against the machine's total; huge pages are
/// used when the free pages of all nodes together hold the capacity.
fn plan_unbound(topo: &Topology, req: &PlacementRequest) -> Result<Placement, PlacementError> {
    let unit = req.hugepage_size.unwrap_or(PAGE).max(PAGE);
    let bytes = req.capacity.div_ceil(unit).saturating_mul(unit);
    let free: u64 = topo
        .numa_nodes
        .iter()
        .map(|n| n.mem_free_bytes)
        .fold(0, u64::saturating_add);
    if free < bytes {
        return Err(PlacementError::InsufficientTotalMemory {
            wanted: bytes,
            free,
        });
    }
    let mut warnings = Vec::new();
    let hugepage_size = match req.hugepage_size {
        Some(size) => {
            let pages: u64 = topo
                .numa_nodes
                .iter()
                .map(|n| n.free_hugepages(size))
                .fold(0, u64::saturating_add);
            if pages.saturating_mul(size) >= bytes {
                Some(size)
            } else {
                warnings.push(format!(
                    "{pages} free huge pages of {size} bytes on all NUMA nodes cannot hold \
                     {bytes} bytes; using normal pages"
                ));
                None
            }
        }
        None => None,
    };
    let mut segments = Vec::new();
    split(
        &mut segments,
        None,
        bytes,
        hugepage_size,
        req.max_segment,
        unit,
    );
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
                .filter(|s| s.numa_node == Some(n))
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
                    numa_node: Some(0),
                    bytes: 2 * PAGE,
                    hugepage_size: None
                },
                SegmentPlan {
                    numa_node: Some(1),
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

    #[test]
    fn none_plans_unbound_segments_without_a_node_split() {
        // Two nodes, NIC-weighted 3:1: `none` ignores the weights and the nodes.
        let topo = two_nodes(3, 1);
        let p = plan(&topo, &req(3 * (1 << 30) + PAGE + 1, NumaPolicy::None)).expect("plan");
        assert_eq!(
            p.segments
                .iter()
                .map(|s| (s.numa_node, s.bytes))
                .collect::<Vec<_>>(),
            vec![
                (None, 1 << 30),
                (None, 1 << 30),
                (None, 1 << 30),
                (None, 2 * PAGE)
            ]
        );
        assert!(p.warnings.is_empty());
        // 40 GiB exceeds each node's 32 GiB free but not the 64 GiB of both together.
        let p = plan(&topo, &req(40 << 30, NumaPolicy::None)).expect("plan");
        assert_eq!(p.segments.iter().map(|s| s.bytes).sum::<u64>(), 40 << 30);
        assert_eq!(
            plan(&topo, &req(65 << 30, NumaPolicy::None)),
            Err(PlacementError::InsufficientTotalMemory {
                wanted: 65 << 30,
                free: 64 << 30
            })
        );
        assert_eq!(
            plan(&topo, &req(0, NumaPolicy::None)),
            Err(PlacementError::ZeroCapacity)
        );
        // Without nodes there is nothing to place on, bound or not.
        let empty = Topology::default();
        assert_eq!(
            plan(&empty, &req(PAGE, NumaPolicy::None)),
            Err(PlacementError::NoNodes)
        );
    }

    #[test]
    fn numa_labels_name_unbound_segments_none() {
        assert_eq!(numa_label(Some(3)), "3");
        assert_eq!(numa_label(None), "none");
    }
}
