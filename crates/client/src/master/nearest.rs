//! Nearest-replica choice for reads: same node and NUMA node first, then DRAM before SSD.
//! Pure.

use kvpool_core::master::types::{ReplicaInfo, Tier};

/// The replica to read: on `node` and `numa_node`, else on `node`, else the first DRAM one,
/// else the first.
pub fn pick_nearest<'a>(
    replicas: &'a [ReplicaInfo],
    node: &str,
    numa_node: Option<u32>,
) -> Option<&'a ReplicaInfo> {
    // `max_by_key` keeps the last of equal candidates; reversing keeps the master's order.
    replicas.iter().rev().max_by_key(|r| {
        let same_node = r.node == node;
        (
            same_node,
            same_node && numa_node == Some(r.numa_node),
            r.tier == Tier::Dram,
        )
    })
}
