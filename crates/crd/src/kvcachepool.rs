//! The `KVCachePool` custom resource: which nodes lend DRAM and SSD to the shared KV cache, how
//! blocks move between them, and how the master and conductor run. Pure types, no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use super::conductor::{ConductorSlo, ConductorSpec, TokenizerSpec};
use super::defaults;
use super::master_tls::MasterTlsSpec;
pub use super::network::NetworkPolicySpec;
use super::pool_status::KVCachePoolStatus;

/// Desired state of a shared KV cache pool spread over a set of GPU nodes.
///
/// Every field has a default, so `spec: {}` is a valid pool: a quarter of each node's memory,
/// RDMA where available and TCP elsewhere, one master and one conductor.
// kube repeats keys (type_, priority) across printcolumn(...) groups by design.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kvpool.dev",
    version = "v1alpha1",
    kind = "KVCachePool",
    plural = "kvcachepools",
    singular = "kvcachepool",
    shortname = "kvcp",
    category = "kvpool",
    namespaced,
    status = "KVCachePoolStatus",
    derive = "PartialEq",
    validation = Rule::new("self.metadata.name.size() <= 53 && !self.metadata.name.contains('.')").message("metadata.name must be at most 53 characters and contain no dots: it prefixes the names of Services").reason(Reason::FieldValueInvalid),
    doc = "A cluster-wide pool of KV cache blocks held in the DRAM and SSDs of a set of GPU nodes.",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status",
        description = "Whether the pool serves blocks"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        json_path = ".status.nodesReady",
        description = "Nodes whose agent is ready"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.nodesDesired",
        description = "Nodes that should run an agent"
    ),
    printcolumn(
        name = "DRAM",
        type_ = "string",
        json_path = ".status.dram.capacity",
        description = "DRAM tier capacity over all ready nodes"
    ),
    printcolumn(
        name = "SSD",
        type_ = "string",
        json_path = ".status.ssd.capacity",
        description = "SSD tier capacity over all ready nodes"
    ),
    printcolumn(
        name = "DRAM-Used",
        type_ = "string",
        json_path = ".status.dram.used",
        description = "DRAM tier bytes in use, as the master reports",
        priority = 1
    ),
    printcolumn(
        name = "Objects",
        type_ = "integer",
        json_path = ".status.objects",
        description = "KV cache blocks held, as the master reports",
        priority = 1
    ),
    printcolumn(
        name = "Hit-Ratio",
        type_ = "string",
        json_path = ".status.hitRatio",
        description = "Share of the keys looked up that the pool held, as the master reports",
        priority = 1
    ),
    printcolumn(
        name = "Transport",
        type_ = "string",
        json_path = ".spec.transport.protocol",
        description = "Requested transport protocol",
        priority = 1
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        description = "Reason of the Ready condition",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.replication) || !has(self.replication.spreadLabelKey) || self.replication.spreadLabelKey == 'kubernetes.io/hostname' || (has(self.agent) && has(self.agent.serviceAccountName))").message(SPREAD_NEEDS_NODE_ACCESS).field_path(".replication.spreadLabelKey").reason(Reason::FieldValueRequired))]
pub struct KVCachePoolSpec {
    /// Labels a node must carry to run an agent and lend memory to this pool. Empty: every node
    /// the tolerations admit.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// Tolerations of the agent pods (GPU nodes are often tainted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// Secrets (in the pool's namespace) for pulling the images of every pod the operator runs
    /// for the pool: the agents, the master, the conductor, and the engine pods of its
    /// PrefillPools and DecodePools (whose init container runs the `kvpool` image), before an
    /// engine pool's own `template.spec.imagePullSecrets`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,

    /// How the node agent DaemonSet runs.
    #[serde(default)]
    pub agent: AgentSpec,

    /// The host-memory tier on each node.
    #[serde(default)]
    pub dram: DramTierSpec,

    /// The optional NVMe tier on each node. Absent: DRAM only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssd: Option<SsdTierSpec>,

    /// How blocks move between nodes.
    #[serde(default)]
    pub transport: TransportSpec,

    /// Tokens per KV cache block: the unit of hashing, placement and transfer. Engines must use a
    /// multiple of their own page size. Default 512 (the Mooncake trace's block size).
    #[serde(default = "defaults::block_size_tokens")]
    #[schemars(range(min = 1, max = 65536))]
    pub block_size_tokens: i32,

    /// How many copies of each block the pool keeps and how they spread.
    #[serde(default)]
    pub replication: ReplicationSpec,

    /// When and how blocks leave the DRAM tier.
    #[serde(default)]
    pub eviction: EvictionSpec,

    /// The metadata service (object keys to replicas, allocation, leases).
    #[serde(default)]
    pub master: MasterSpec,

    /// The KVCache-centric scheduler and OpenAI-compatible front door.
    #[serde(default)]
    pub conductor: ConductorSpec,

    /// The NetworkPolicies that admit only the traffic the pool needs to its master, agents and
    /// conductor.
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,
}

/// The node agent: one pod per selected node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// Agent image. Absent: the image the operator was built with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Compute resources of the agent container (the DRAM tier itself is requested separately
    /// when hugepages are used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// PriorityClass of the agent pods; a node-critical class keeps them from being evicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,

    /// ServiceAccount (in the pool's namespace) the agent pods run as, with its token mounted.
    /// Bound to the agent ClusterRole (`get` and `patch` on `nodes`, docs/install.md), it lets
    /// each agent read its node's value of `replication.spreadLabelKey` and label the node
    /// with its topology. Required when that key is not `kubernetes.io/hostname`. Absent: the
    /// agents have no API access (no token is mounted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub service_account_name: Option<String>,
}

/// Message of the rule that a spread label other than the hostname needs agents that can read
/// their Node object.
pub const SPREAD_NEEDS_NODE_ACCESS: &str = "replication.spreadLabelKey other than kubernetes.io/hostname requires agent.serviceAccountName: each agent reads its node's value of the label through the API (RBAC: get nodes, docs/install.md)";

/// Host memory each node lends to the pool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!(has(self.capacityPerNode) && has(self.nodeMemoryPercent))").message("dram: set at most one of capacityPerNode and nodeMemoryPercent").reason(Reason::FieldValueInvalid),
    validation = Rule::new("self.hugepages == 'none' || has(self.capacityPerNode)").message("dram.hugepages requires dram.capacityPerNode: hugepage memory is reserved as an explicit amount").field_path(".hugepages").reason(Reason::FieldValueRequired),
    validation = Rule::new("self.hugepages == 'none' || !has(self.capacityPerNode) || !isQuantity(string(self.capacityPerNode)) || (quantity(string(self.capacityPerNode)).isInteger() && quantity(string(self.capacityPerNode)).asInteger() % (self.hugepages == '1Gi' ? 1073741824 : 2097152) == 0)").message("dram.capacityPerNode must be a whole number of hugepages (a multiple of dram.hugepages)").field_path(".capacityPerNode").reason(Reason::FieldValueInvalid),
    validation = Rule::new("!has(self.persistence) || !has(self.persistence.mode) || self.persistence.mode != 'hugetlbfs' || self.hugepages != 'none'").message("dram.persistence.mode hugetlbfs requires dram.hugepages (the agent pod must request the huge pages its files hold)").field_path(".persistence.mode").reason(Reason::FieldValueInvalid)
)]
pub struct DramTierSpec {
    /// Bytes per node as a Kubernetes quantity (e.g. `512Gi`). Exclusive with
    /// `nodeMemoryPercent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("dram.capacityPerNode must be a positive quantity such as 512Gi"))]
    pub capacity_per_node: Option<Quantity>,

    /// Share of each node's memory, in percent (1-100). Used when `capacityPerNode` is absent;
    /// if both are absent the pool takes 25 percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub node_memory_percent: Option<i32>,

    /// Back the tier with hugepages of this size (the node must have them reserved).
    #[serde(default)]
    pub hugepages: Hugepages,

    /// Where the tier's memory is placed relative to NUMA nodes.
    #[serde(default)]
    pub numa_policy: NumaPolicy,

    /// Keep the tier in files on a tmpfs or hugetlbfs directory of the node, so that its
    /// committed blocks survive an agent restart or rollout. Absent: anonymous memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<super::persistence::DramPersistenceSpec>,
}

/// Page size backing the DRAM tier.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Hugepages {
    /// Ordinary 4 KiB pages.
    #[default]
    #[serde(rename = "none")]
    None,
    /// 2 MiB hugepages (`hugepages-2Mi` resource).
    #[serde(rename = "2Mi")]
    Size2Mi,
    /// 1 GiB hugepages (`hugepages-1Gi` resource).
    #[serde(rename = "1Gi")]
    Size1Gi,
}

/// NUMA placement of the DRAM tier.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum NumaPolicy {
    /// On the NUMA nodes of the NICs (and GPUs) that move the blocks.
    #[default]
    Local,
    /// Interleaved over all NUMA nodes.
    Interleave,
    /// No preference. The agent binds every segment it maps to a node, so it spreads the tier
    /// evenly over all NUMA nodes, as with `interleave`.
    None,
}

/// The NVMe tier of each node.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SsdTierSpec {
    /// Absolute directory on the node where the agent keeps block files, mounted read-write
    /// into the agent: below `/mnt/`, `/data/` or `/var/lib/kvpool/`, without `.`, `..` or
    /// empty segments.
    #[schemars(length(min = 2, max = 4096), regex(pattern = r"^/"))]
    #[x_kube(validation = Rule::new(super::network::SSD_HOST_PATH_RULE).message(super::network::SSD_HOST_PATH_MESSAGE).reason(Reason::FieldValueInvalid))]
    pub host_path: String,

    /// Bytes per node as a Kubernetes quantity (e.g. `3Ti`).
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("ssd.capacityPerNode must be a positive quantity such as 3Ti"))]
    pub capacity_per_node: Quantity,
}

/// How agents talk to each other and to engines.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.protocol != 'tcp' || !has(self.sriov)").message("transport.sriov requires transport.protocol rdma or auto").field_path(".sriov").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.protocol != 'tcp' || size(self.networks) == 0").message("transport.networks (Multus) requires transport.protocol rdma or auto").field_path(".networks").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.protocol != 'tcp' || size(self.devices) == 0").message("transport.devices lists RDMA devices and requires transport.protocol rdma or auto").field_path(".devices").reason(Reason::FieldValueForbidden),
    validation = Rule::new("self.protocol != 'tcp' || !has(self.gidIndex)").message("transport.gidIndex selects an RDMA GID and requires transport.protocol rdma or auto").field_path(".gidIndex").reason(Reason::FieldValueForbidden)
)]
pub struct TransportSpec {
    /// `rdma` requires RDMA devices on every node, `tcp` never uses them, `auto` uses RDMA where
    /// the agent finds a usable device and TCP elsewhere.
    #[serde(default)]
    pub protocol: Protocol,

    /// RDMA devices the agent may use (e.g. `mlx5_0`). Empty: all it finds.
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Set)]
    #[schemars(length(max = 64), inner(length(min = 1, max = 64)))]
    pub devices: Vec<String>,

    /// GID table index every RDMA port sends from, instead of the automatic choice (the
    /// RoCE v2 entry with an IPv4 address, else any RoCE v2 entry that is not link-local).
    /// For fabrics whose routable GID sits at another index. A port without a populated
    /// entry there is not used (the agent reports why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 255))]
    pub gid_index: Option<i32>,

    /// SR-IOV virtual functions requested by each agent pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sriov: Option<SriovSpec>,

    /// Multus NetworkAttachmentDefinitions attached to agent pods (`name` or `namespace/name`).
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Set)]
    #[schemars(length(max = 16), inner(length(min = 1, max = 253)))]
    pub networks: Vec<String>,

    /// TCP port of the transfer endpoint (also the RDMA connection manager's port).
    #[serde(default = "defaults::transport_port")]
    #[schemars(range(min = 1024, max = 65535))]
    pub port: i32,

    /// Per-frame integrity of the TCP transfer lanes (docs/transfer.md, "Per-frame
    /// integrity"): `require` seals every frame between engines and agents and between
    /// agents (a frame altered, dropped or replayed on the wire fails its transfer); `allow`
    /// grants it to a peer that asks and asks for nothing; `off` never seals.
    #[serde(default)]
    pub integrity: TransferIntegrity,

    /// TLS on the TCP transfer lanes (docs/transfer.md, "TLS"): the agents serve the
    /// certificate of `secretName`, engines and agents verify it. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<crate::TransferTlsSpec>,
}

impl Default for TransportSpec {
    fn default() -> Self {
        Self {
            protocol: Protocol::default(),
            devices: Vec::new(),
            gid_index: None,
            sriov: None,
            networks: Vec::new(),
            port: defaults::transport_port(),
            integrity: TransferIntegrity::default(),
            tls: None,
        }
    }
}

/// Per-frame integrity of the TCP transfer lanes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TransferIntegrity {
    /// Never seal frames; a peer that requires it is refused.
    Off,
    /// Seal for a peer that asks; ask for nothing.
    #[default]
    Allow,
    /// Seal every frame to and from every peer; a peer that cannot is refused.
    Require,
}

impl TransferIntegrity {
    /// The setting as the agent's `pool.transport_integrity` and `KVPOOL_TRANSFER_INTEGRITY`
    /// spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferIntegrity::Off => "off",
            TransferIntegrity::Allow => "allow",
            TransferIntegrity::Require => "require",
        }
    }
}

/// Transfer protocol between nodes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Protocol {
    /// RDMA where available, TCP elsewhere.
    #[default]
    Auto,
    /// RDMA only; a node without a usable device is not ready.
    Rdma,
    /// TCP only.
    Tcp,
}

/// SR-IOV virtual functions for the agent pods, as exposed by the SR-IOV device plugin: either
/// one resource for all rails (`resourceName` and `count`), or one resource per NIC rail
/// (`resources`, e.g. `nvidia.com/rdma_vf_rail0` to `..._rail7`), each requested separately.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("has(self.resourceName) != (has(self.resources) && size(self.resources) > 0)").message("transport.sriov: set exactly one of resourceName (one resource for all rails) and resources (one per rail)").reason(Reason::FieldValueInvalid)
)]
pub struct SriovSpec {
    /// Extended resource name of the VFs of every rail (e.g. `nvidia.com/rdma_vf`). Exclusive
    /// with `resources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub resource_name: Option<String>,

    /// VFs of `resourceName` requested per agent pod (ignored with `resources`).
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 1, max = 64))]
    pub count: i32,

    /// One extended resource per NIC rail, each requested by every agent pod. Exclusive with
    /// `resourceName`. A list map keyed by `resourceName`: the API server refuses a name twice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["resourceName".into()]))]
    #[schemars(length(max = 16))]
    pub resources: Vec<SriovResource>,
}

/// The VFs of one rail.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SriovResource {
    /// Extended resource name of the rail's VFs (e.g. `nvidia.com/rdma_vf_rail0`).
    #[schemars(
        length(min = 1, max = 253),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub resource_name: String,

    /// VFs of this resource per agent pod.
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 1, max = 64))]
    pub count: i32,
}

/// How many copies of each block exist.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicationSpec {
    /// Copies of each block (1-8).
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 1, max = 8))]
    pub replicas: i32,

    /// Node label whose values copies of a block are spread over (e.g. a rack label): each
    /// agent announces its node's value of it, and no two copies of a block share one (nodes
    /// without the label count only as distinct nodes). Agents read it from their Node object
    /// (RBAC: `get nodes`).
    #[serde(default = "defaults::spread_label_key")]
    #[schemars(
        length(min = 1, max = 316),
        regex(
            pattern = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
        )
    )]
    pub spread_label_key: String,
}

impl Default for ReplicationSpec {
    fn default() -> Self {
        Self {
            replicas: defaults::one(),
            spread_label_key: defaults::spread_label_key(),
        }
    }
}

/// When and which blocks leave the DRAM tier.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.lowWatermarkPercent < self.highWatermarkPercent").message("eviction.lowWatermarkPercent must be below eviction.highWatermarkPercent").field_path(".lowWatermarkPercent").reason(Reason::FieldValueInvalid))]
pub struct EvictionSpec {
    /// Usage (percent of the tier) at which eviction starts.
    #[serde(default = "defaults::high_watermark_percent")]
    #[schemars(range(min = 1, max = 100))]
    pub high_watermark_percent: i32,

    /// Usage (percent of the tier) at which eviction stops.
    #[serde(default = "defaults::low_watermark_percent")]
    #[schemars(range(min = 0, max = 99))]
    pub low_watermark_percent: i32,

    /// Which blocks go first.
    #[serde(default)]
    pub policy: EvictionPolicy,
}

impl Default for EvictionSpec {
    fn default() -> Self {
        Self {
            high_watermark_percent: defaults::high_watermark_percent(),
            low_watermark_percent: defaults::low_watermark_percent(),
            policy: EvictionPolicy::default(),
        }
    }
}

/// Eviction order (of the DRAM and the SSD tier).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum EvictionPolicy {
    /// Least recently used first.
    #[default]
    Lru,
    /// Least frequently used first, with counters halved as they age so that blocks hot long
    /// ago do not stay forever.
    Lfu,
    /// S3-FIFO: blocks read once leave through a small probationary queue (scan resistant).
    #[serde(rename = "s3fifo")]
    S3fifo,
}

impl EvictionPolicy {
    /// Every value, in schema order.
    pub const ALL: [EvictionPolicy; 3] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::S3fifo,
    ];

    /// The value as the spec and the master's `--eviction-policy` write it.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::S3fifo => "s3fifo",
        }
    }
}

/// The pool's metadata service.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.replicas == 1 || size(self.etcdEndpoints) > 0").message("master.etcdEndpoints is required when master.replicas is above 1 (HA state lives in etcd)").field_path(".etcdEndpoints").reason(Reason::FieldValueRequired))]
pub struct MasterSpec {
    /// Master replicas; more than one elects a leader through etcd.
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 1, max = 5))]
    pub replicas: i32,

    /// etcd client URLs (`http://host:2379`). Empty: state in memory, one replica.
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Set)]
    #[schemars(
        length(max = 9),
        inner(length(min = 1, max = 512), regex(pattern = r"^https?://"))
    )]
    pub etcd_endpoints: Vec<String>,

    /// Image of the `kvpool` CLI. Absent: the operator's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Compute resources of the master container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// TLS on the master's gRPC port, with its certificate from a Secret (see
    /// docs/operator.md, "Master TLS"). Absent: plain text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<MasterTlsSpec>,
}

impl Default for MasterSpec {
    fn default() -> Self {
        Self {
            replicas: defaults::one(),
            etcd_endpoints: Vec::new(),
            image: None,
            resources: None,
            tls: None,
        }
    }
}
