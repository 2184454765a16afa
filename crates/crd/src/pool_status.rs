//! The KVCachePool's observed state (`status`), written by the operator only: conditions,
//! endpoints, per-tier capacity and use, hit ratio, and the per-node list
//! ([`NodeStatus`]). Types only; the operator computes them.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

crate::conditions::status_struct! {
    /// Observed state of a KV cache pool, written by the operator only.
    pub struct KVCachePoolStatus {
        /// Nodes that should run an agent.
        #[serde(default)]
        pub nodes_desired: i32,

        /// Nodes whose agent is ready.
        #[serde(default)]
        pub nodes_ready: i32,

        /// DRAM tier over all ready nodes.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub dram: Option<TierStatus>,

        /// SSD tier over all ready nodes; absent without an SSD tier.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub ssd: Option<TierStatus>,

        /// KV cache objects (blocks) the master holds, as of its last answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub objects: Option<i64>,

        /// Agents registered with the master and alive, as of its last answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub nodes_registered: Option<i32>,

        /// Share of the keys clients looked up (Get, Exists, LongestPrefix) that the pool held,
        /// since the leading master started, as a decimal string with three places (`0.734`);
        /// absent before the first lookup.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub hit_ratio: Option<String>,

        /// Keys looked up since the leading master started (the hit ratio's sample), as of its
        /// last answer.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub lookups: Option<i64>,

        /// Per node, as the leading master last reported them: tiers, NUMA split, transport and
        /// share of the Get lookups served. The first `MAX_STATUS_NODES` (128) live nodes by name;
        /// kept from the last answer while the master does not answer.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub nodes: Vec<NodeStatus>,

        /// Live nodes left out of `nodes` by its cap; absent when none was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub nodes_omitted: Option<i32>,

        /// Address (`host:port`) of the master Service.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub master_endpoint: Option<String>,

        /// Address (`host:port`) of the conductor Service; absent when disabled.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub conductor_endpoint: Option<String>,
    }
}

/// Capacity and usage of one tier. Capacity is what the master counts over the segments agents
/// registered when it answers, otherwise the spec's amount times the ready nodes; `used` is the
/// master's figure, kept from the last answer while it does not answer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TierStatus {
    /// Bytes the tier holds, as a quantity (e.g. `4Ti`).
    pub capacity: Quantity,

    /// Bytes in use, as a quantity.
    pub used: Quantity,
}

/// At most this many nodes are listed in `status.nodes` (the first by name); the rest are
/// counted in `status.nodesOmitted`. 128 entries of about 400 bytes keep the status near
/// 50 KiB, far below etcd's 1.5 MiB object limit, on a pool of any size.
pub const MAX_STATUS_NODES: usize = 128;

/// One node of the pool, as the leading master last reported it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Node name (the agent's node).
    pub name: String,

    /// DRAM over the node's segments; absent when it mounted none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dram: Option<TierStatus>,

    /// SSD over the node's segments; absent when it mounted none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssd: Option<TierStatus>,

    /// The node's tiers split by the NUMA node their segments are bound to: NUMA nodes
    /// ascending, then segments announced unbound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub numa: Vec<NumaStatus>,

    /// How the node's agent moves bytes; absent until its heartbeat reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<NodeTransportStatus>,

    /// Share of the pool's Get lookups (since the leading master started) answered from this
    /// node, three decimals (`0.250`). A miss belongs to no node, so the nodes' ratios add up
    /// to the pool's Get hit ratio. Absent before the first Get.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_ratio: Option<String>,
}

/// One tier's bytes on one NUMA node of a node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NumaStatus {
    /// The NUMA node number, or `unbound` for segments whose binding the agent could not
    /// verify.
    pub numa_node: String,

    /// `dram` or `ssd`.
    pub tier: String,

    /// Bytes mounted, as a quantity.
    pub capacity: Quantity,

    /// Bytes in use, as a quantity.
    pub used: Quantity,
}

/// The transport a node's agent uses.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeTransportStatus {
    /// `rdma`, or `tcp` (asked for, or fallen back to).
    pub protocol: String,

    /// Why the agent fell back to TCP when RDMA was asked for; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
}
