//! The per-node part of a `KVCachePool`'s status (`status.nodes`, `status.nodesOmitted`),
//! computed from the master's Stats: each node's tiers, NUMA split, transport and share of the
//! pool's Get lookups. Pure and deterministic (sorted by node name, capped at
//! [`MAX_STATUS_NODES`]). I/O boundary: none.

use std::collections::HashMap;

use kvpool_crd::quantity::format_bytes;
use kvpool_crd::{MAX_STATUS_NODES, NodeStatus, NodeTransportStatus, NumaStatus, TierStatus};

use crate::pool_usage::{NodeTransport, NodeUsage, PoolUsage};

/// `status.nodes` and `status.nodesOmitted` from the master's answer: the first
/// [`MAX_STATUS_NODES`] live nodes by name, and how many were left out (`None` when none was).
pub fn nodes_status(usage: &PoolUsage) -> (Vec<NodeStatus>, Option<i32>) {
    let transports: HashMap<&str, &NodeTransport> = usage
        .transport
        .iter()
        .map(|t| (t.node.as_str(), t))
        .collect();
    let lookups = usage.get_hits.saturating_add(usage.get_misses);
    let mut nodes: Vec<&NodeUsage> = usage.nodes.iter().collect();
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    let omitted = nodes.len().saturating_sub(MAX_STATUS_NODES);
    let list = nodes
        .into_iter()
        .take(MAX_STATUS_NODES)
        .map(|n| node_status(n, transports.get(n.node.as_str()).copied(), lookups))
        .collect();
    let omitted = (omitted > 0).then(|| i32::try_from(omitted).unwrap_or(i32::MAX));
    (list, omitted)
}

fn tier(used: u64, capacity: u64) -> Option<TierStatus> {
    (capacity > 0).then(|| TierStatus {
        capacity: format_bytes(capacity),
        used: format_bytes(used),
    })
}

fn node_status(n: &NodeUsage, transport: Option<&NodeTransport>, lookups: u64) -> NodeStatus {
    NodeStatus {
        name: n.node.clone(),
        dram: tier(n.dram_used, n.dram_capacity),
        ssd: tier(n.ssd_used, n.ssd_capacity),
        numa: n
            .numa
            .iter()
            .map(|r| NumaStatus {
                numa_node: r
                    .numa_node
                    .map_or_else(|| "unbound".to_owned(), |v| v.to_string()),
                tier: r.tier.as_str().to_owned(),
                capacity: format_bytes(r.capacity),
                used: format_bytes(r.used),
            })
            .collect(),
        transport: transport.map(transport_status),
        hit_ratio: (lookups > 0).then(|| format!("{:.3}", n.get_hits as f64 / lookups as f64)),
    }
}

/// `rdma` when the agent was asked for RDMA and did not fall back; `tcp` otherwise, with the
/// fallback's reason when it fell back.
fn transport_status(t: &NodeTransport) -> NodeTransportStatus {
    let rdma = t.rdma_requested && !t.fallback;
    NodeTransportStatus {
        protocol: if rdma { "rdma" } else { "tcp" }.to_owned(),
        fallback_reason: (t.rdma_requested && t.fallback).then(|| {
            if t.reason.is_empty() {
                "the agent gave no reason".to_owned()
            } else {
                t.reason.clone()
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool_usage::NumaUsage;
    use kvpool_core::master::types::Tier;

    const MIB: u64 = 1 << 20;

    fn node(name: &str, hits: u64) -> NodeUsage {
        NodeUsage {
            node: name.into(),
            dram_used: 3 * MIB,
            dram_capacity: 64 * MIB,
            numa: vec![
                NumaUsage {
                    numa_node: Some(0),
                    tier: Tier::Dram,
                    used: 3 * MIB,
                    capacity: 48 * MIB,
                },
                NumaUsage {
                    numa_node: None,
                    tier: Tier::Dram,
                    used: 0,
                    capacity: 16 * MIB,
                },
            ],
            get_hits: hits,
            ..NodeUsage::default()
        }
    }

    #[test]
    fn each_node_gets_its_tiers_numa_split_transport_and_share_of_gets() {
        let usage = PoolUsage {
            get_hits: 3,
            get_misses: 1,
            nodes: vec![node("gpu-1", 1), node("gpu-0", 2)],
            transport: vec![
                NodeTransport {
                    node: "gpu-0".into(),
                    rdma_requested: true,
                    devices: vec!["mlx5_0".into()],
                    ..NodeTransport::default()
                },
                NodeTransport {
                    node: "gpu-1".into(),
                    rdma_requested: true,
                    fallback: true,
                    reason: "no usable RDMA device on this host".into(),
                    devices: vec![],
                },
            ],
            ..PoolUsage::default()
        };
        let (nodes, omitted) = nodes_status(&usage);
        assert_eq!(omitted, None);
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-1"]);
        let gpu0 = &nodes[0];
        assert_eq!(
            gpu0.dram,
            Some(TierStatus {
                capacity: format_bytes(64 * MIB),
                used: format_bytes(3 * MIB),
            })
        );
        assert_eq!(gpu0.ssd, None, "no SSD segment, no SSD entry");
        let numa: Vec<(&str, &str, &str)> = gpu0
            .numa
            .iter()
            .map(|r| (r.numa_node.as_str(), r.tier.as_str(), r.capacity.0.as_str()))
            .collect();
        assert_eq!(numa, [("0", "dram", "48Mi"), ("unbound", "dram", "16Mi")]);
        assert_eq!(gpu0.hit_ratio.as_deref(), Some("0.500"));
        assert_eq!(nodes[1].hit_ratio.as_deref(), Some("0.250"));
        let transport = |i: usize| nodes[i].transport.clone().expect("transport");
        assert_eq!(transport(0).protocol, "rdma");
        assert_eq!(transport(0).fallback_reason, None);
        assert_eq!(transport(1).protocol, "tcp");
        assert_eq!(
            transport(1).fallback_reason.as_deref(),
            Some("no usable RDMA device on this host")
        );
    }

    #[test]
    fn tcp_by_choice_has_no_reason_and_no_gets_no_ratio() {
        let usage = PoolUsage {
            nodes: vec![node("a", 0), node("b", 0)],
            transport: vec![NodeTransport {
                node: "a".into(),
                ..NodeTransport::default()
            }],
            ..PoolUsage::default()
        };
        let (nodes, _) = nodes_status(&usage);
        assert_eq!(
            nodes[0].transport,
            Some(NodeTransportStatus {
                protocol: "tcp".into(),
                fallback_reason: None,
            })
        );
        assert_eq!(nodes[1].transport, None, "b never reported");
        assert!(nodes.iter().all(|n| n.hit_ratio.is_none()));
    }

    #[test]
    fn the_list_is_capped_by_name_and_the_rest_counted() {
        let usage = PoolUsage {
            nodes: (0..MAX_STATUS_NODES + 5)
                .rev()
                .map(|i| node(&format!("node-{i:04}"), 0))
                .collect(),
            ..PoolUsage::default()
        };
        let (nodes, omitted) = nodes_status(&usage);
        assert_eq!(nodes.len(), MAX_STATUS_NODES);
        assert_eq!(omitted, Some(5));
        assert_eq!(nodes[0].name, "node-0000");
        assert_eq!(
            nodes.last().map(|n| n.name.clone()),
            Some(format!("node-{:04}", MAX_STATUS_NODES - 1))
        );
        // The status stays small: well below etcd's object limit.
        let bytes = serde_json::to_vec(&nodes).expect("json").len();
        assert!(bytes < 64 * 1024, "{bytes} bytes");
    }
}
