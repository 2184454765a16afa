//! Per-node figures for the master's Stats and the KVCachePool status: each live node's bytes
//! per tier, their split over the NUMA nodes its segments are bound to, and the `get` hits
//! served from it. Pure; read from the state under the service's lock.

use std::collections::BTreeMap;

use super::MasterState;
use crate::master::types::Tier;

/// The NUMA node an agent announces for a segment it could not bind (or verify the binding
/// of): a number no machine has. Such segments are reported apart, as unbound.
pub const UNBOUND_NUMA_NODE: u32 = u32::MAX;

/// Bytes of one tier on one NUMA node of a node, over the segments announced on it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NumaUsage {
    /// `None` for segments announced unbound ([`UNBOUND_NUMA_NODE`]).
    pub numa_node: Option<u32>,
    pub tier: Tier,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

/// One live node as Stats reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NodeReport {
    pub node: String,
    /// Per tier (indexed by [`Tier::index`]): allocated and mounted bytes over its segments.
    pub used_bytes: [u64; 2],
    pub capacity_bytes: [u64; 2],
    /// Per NUMA node and tier with a segment mounted, NUMA nodes ascending, unbound last.
    pub numa: Vec<NumaUsage>,
    /// Per tier: keys whose `get` was served from this node (see [`MasterState::get`]).
    pub get_hits: [u64; 2],
}

impl MasterState {
    /// Every live node, sorted by name: bytes per tier and per NUMA node, and the `get` hits
    /// counted on it. A node's used bytes add up to its NUMA rows', and over all nodes to
    /// [`Stats::used_bytes`](super::Stats::used_bytes) (capacity likewise).
    pub fn node_reports(&self) -> Vec<NodeReport> {
        let mut out: Vec<NodeReport> = self
            .nodes
            .iter()
            .filter(|ns| ns.alive)
            .map(|ns| {
                // Key: (unbound, numa node, tier): bound nodes ascending, then unbound.
                let mut numa: BTreeMap<(bool, u32, usize), (u64, u64)> = BTreeMap::new();
                let mut used = [0u64; 2];
                let mut capacity = [0u64; 2];
                for seg in ns.segments.iter().filter_map(|s| self.segments.get(s)) {
                    let t = seg.spec.tier.index();
                    let (u, c) = (seg.alloc.used_bytes(), seg.alloc.capacity_bytes());
                    used[t] += u;
                    capacity[t] += c;
                    let n = seg.spec.numa_node;
                    let e = numa.entry((n == UNBOUND_NUMA_NODE, n, t)).or_default();
                    e.0 += u;
                    e.1 += c;
                }
                NodeReport {
                    node: ns.name.clone(),
                    used_bytes: used,
                    capacity_bytes: capacity,
                    numa: numa
                        .into_iter()
                        .filter_map(|((unbound, n, t), (u, c))| {
                            Some(NumaUsage {
                                numa_node: (!unbound).then_some(n),
                                tier: Tier::ALL.get(t).copied()?,
                                used_bytes: u,
                                capacity_bytes: c,
                            })
                        })
                        .collect(),
                    get_hits: ns.get_hits,
                }
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }
}
