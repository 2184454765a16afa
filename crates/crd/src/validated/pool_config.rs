//! The effective settings of a `KVCachePool`, section by section (DRAM and SSD tiers,
//! transport, replication, eviction, master, conductor), as [`super::ValidatedKVCachePool`]
//! holds them and the pool's ConfigMap carries them (camelCase). Pure types, no I/O.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{EvictionPolicy, Hugepages, NumaPolicy, Protocol};

/// How much host memory each node lends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DramCapacity {
    /// A fixed number of bytes on every node.
    Bytes(u64),
    /// A share of each node's memory, in percent (1-100).
    NodeMemoryPercent(u8),
}

impl DramCapacity {
    /// Bytes to lend on a node with `node_memory_bytes` of memory. A fixed size larger than the
    /// node's memory is returned as is: the agent reports it when it cannot allocate.
    pub fn bytes_for_node(self, node_memory_bytes: u64) -> u64 {
        match self {
            Self::Bytes(bytes) => bytes,
            Self::NodeMemoryPercent(pct) => {
                let share = u128::from(node_memory_bytes) * u128::from(pct) / 100;
                u64::try_from(share).unwrap_or(u64::MAX)
            }
        }
    }
}

/// Effective DRAM tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DramConfig {
    /// Size per node.
    pub capacity: DramCapacity,
    /// Page size backing the tier.
    pub hugepages: Hugepages,
    /// NUMA placement.
    pub numa_policy: NumaPolicy,
    /// Files that keep the tier across agent restarts; absent: anonymous memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<crate::DramPersistenceConfig>,
}

/// Effective SSD tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SsdConfig {
    /// Directory on the node.
    pub host_path: String,
    /// Bytes per node.
    pub capacity_bytes: u64,
}

/// Effective transport settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TransportConfig {
    /// Requested protocol.
    pub protocol: Protocol,
    /// RDMA device allow-list; empty means all.
    pub devices: Vec<String>,
    /// GID index override for every RDMA port; `None`: automatic choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid_index: Option<u32>,
    /// SR-IOV extended resource name and VFs per agent pod.
    pub sriov: Option<SriovConfig>,
    /// Multus networks of the agent pods.
    pub networks: Vec<String>,
    /// Transfer endpoint port.
    pub port: u16,
    /// Per-frame integrity of the TCP lanes (agents and engines).
    #[serde(default)]
    pub integrity: crate::TransferIntegrity,
    /// TLS of the TCP lanes; absent: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::TransferTlsSpec>,
}

/// Effective SR-IOV request: every extended resource an agent pod requests (the single-name
/// form of the spec becomes one entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SriovConfig {
    pub resources: Vec<SriovRequest>,
}

/// VFs of one extended resource per agent pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SriovRequest {
    /// Extended resource name.
    pub resource_name: String,
    /// VFs per agent pod.
    pub count: u32,
}

/// Effective replication.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicationConfig {
    /// Copies of each block (1-8).
    pub replicas: u8,
    /// Node label copies spread over.
    pub spread_label_key: String,
}

/// Effective eviction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EvictionConfig {
    /// Start evicting at this usage, percent.
    pub high_watermark_percent: u8,
    /// Stop evicting at this usage, percent (below high).
    pub low_watermark_percent: u8,
    /// Eviction order.
    pub policy: EvictionPolicy,
}

/// Effective master settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MasterConfig {
    /// Replicas (more than one only with etcd).
    pub replicas: u8,
    /// etcd client URLs; empty means in-memory state.
    pub etcd_endpoints: Vec<String>,
}

impl MasterConfig {
    /// Whether state lives in etcd with leader election.
    pub fn is_ha(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }
}

/// Effective conductor settings (present only when enabled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConductorConfig {
    /// Replicas.
    pub replicas: u16,
    /// TTFT objective, milliseconds.
    pub ttft_millis: u32,
    /// TPOT objective, milliseconds.
    pub tpot_millis: u32,
    /// Tokens per KV block of the engines (the unit of their block hashes).
    pub engine_block_size: u32,
}

impl ConductorConfig {
    /// TTFT objective.
    pub fn ttft(&self) -> Duration {
        Duration::from_millis(u64::from(self.ttft_millis))
    }

    /// TPOT objective.
    pub fn tpot(&self) -> Duration {
        Duration::from_millis(u64::from(self.tpot_millis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dram_share_of_node_memory() {
        assert_eq!(
            DramCapacity::NodeMemoryPercent(25).bytes_for_node(1 << 40),
            1 << 38
        );
        assert_eq!(
            DramCapacity::NodeMemoryPercent(100).bytes_for_node(u64::MAX),
            u64::MAX
        );
        assert_eq!(DramCapacity::NodeMemoryPercent(33).bytes_for_node(100), 33);
        assert_eq!(DramCapacity::Bytes(7).bytes_for_node(1 << 40), 7);
    }
}
