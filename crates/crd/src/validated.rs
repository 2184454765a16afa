//! Effective settings of the custom resources: every default filled in, quantities resolved to
//! bytes, ranges and cross-field rules checked again in Rust (the operator's `validate` step, so
//! that `build` only ever sees consistent values). Pure, no I/O.
//!
//! `ValidatedKVCachePool` is also the data-plane view of a pool: it serializes (camelCase) into
//! the pool's ConfigMap, which the agent, master and conductor read.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};

use super::defaults;
use super::labels::Component;
use super::quantity::{self, QuantityError};
use super::{
    AutoscalingSignal, DecodePoolSpec, EngineKind, EvictionPolicy, Hugepages, KVCachePoolSpec,
    NumaPolicy, PrefillPoolSpec, Protocol,
};

/// Why a spec cannot be used. Each variant names the field (its path below `spec`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SpecError {
    /// A quantity field does not hold a byte size.
    #[error("spec.{field}: {source}")]
    #[strum(serialize = "invalid_quantity")]
    Quantity {
        /// Path of the field below `spec`.
        field: &'static str,
        /// What is wrong with the quantity.
        #[source]
        source: QuantityError,
    },
    /// A number lies outside its allowed range.
    #[error("spec.{field}: {value} is outside {min}..={max}")]
    OutOfRange {
        /// Path of the field below `spec`.
        field: &'static str,
        /// The value found.
        value: i64,
        /// Smallest allowed value.
        min: i64,
        /// Largest allowed value.
        max: i64,
    },
    /// Fields that cannot be combined.
    #[error("spec.{field}: {message}")]
    #[strum(serialize = "conflicting_fields")]
    Conflict {
        /// Path of the field below `spec`.
        field: &'static str,
        /// What conflicts with what.
        message: &'static str,
    },
    /// The resource's name cannot prefix its children's names.
    #[error("metadata.name {name:?}: {message}")]
    InvalidName {
        /// The name found.
        name: String,
        /// What is wrong with it.
        message: &'static str,
    },
    /// A field that the other fields make necessary is absent.
    #[error("spec.{field}: {message}")]
    #[strum(serialize = "missing_field")]
    Missing {
        /// Path of the field below `spec`.
        field: &'static str,
        /// Why it is needed.
        message: &'static str,
    },
}

impl SpecError {
    /// Short stable label for metrics and Events.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// Path of the offending field below `spec`, or `metadata.name`.
    pub fn field(&self) -> &'static str {
        match self {
            Self::InvalidName { .. } => "metadata.name",
            Self::Quantity { field, .. }
            | Self::OutOfRange { field, .. }
            | Self::Conflict { field, .. }
            | Self::Missing { field, .. } => field,
        }
    }
}

/// Longest name of a kvpool resource: children append up to 10 characters (`-conductor`) and
/// Service names are DNS labels of at most 63.
pub const MAX_NAME_LEN: usize = 53;

/// Checks a resource name the way the CRDs' root rule does: at most [`MAX_NAME_LEN`] characters
/// and no dots, so that `<name>-<component>` is a valid Service name.
pub fn validate_name(name: &str) -> Result<(), SpecError> {
    if name.len() > MAX_NAME_LEN || name.contains('.') {
        return Err(SpecError::InvalidName {
            name: name.to_owned(),
            message: "must be at most 53 characters and contain no dots: it prefixes the names of Services",
        });
    }
    Ok(())
}

fn ranged<T: TryFrom<i32>>(
    field: &'static str,
    value: i32,
    min: i32,
    max: i32,
) -> Result<T, SpecError> {
    let err = || SpecError::OutOfRange {
        field,
        value: i64::from(value),
        min: i64::from(min),
        max: i64::from(max),
    };
    if value < min || value > max {
        return Err(err());
    }
    T::try_from(value).map_err(|_| err())
}

/// The API server treats these lists as sets: an entry may appear once.
fn unique(field: &'static str, items: &[String]) -> Result<(), SpecError> {
    let mut seen = std::collections::BTreeSet::new();
    if items.iter().all(|i| seen.insert(i)) {
        Ok(())
    } else {
        Err(SpecError::Conflict {
            field,
            message: "lists an entry more than once",
        })
    }
}

fn positive_bytes(field: &'static str, q: &Quantity) -> Result<u64, SpecError> {
    match quantity::parse_bytes(q) {
        Ok(0) => Err(SpecError::OutOfRange {
            field,
            value: 0,
            min: 1,
            max: i64::MAX,
        }),
        Ok(bytes) => Ok(bytes),
        Err(source) => Err(SpecError::Quantity { field, source }),
    }
}

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
    /// SR-IOV extended resource name and VFs per agent pod.
    pub sriov: Option<SriovConfig>,
    /// Multus networks of the agent pods.
    pub networks: Vec<String>,
    /// Transfer endpoint port.
    pub port: u16,
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

/// A KVCachePool spec with defaults applied and every rule checked. Pod-level settings (node
/// selector, tolerations, images, resources) stay in the spec; this holds what the data plane
/// needs and is what the pool's ConfigMap carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ValidatedKVCachePool {
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// DRAM tier.
    pub dram: DramConfig,
    /// SSD tier, if any.
    pub ssd: Option<SsdConfig>,
    /// Transport.
    pub transport: TransportConfig,
    /// Replication.
    pub replication: ReplicationConfig,
    /// Eviction.
    pub eviction: EvictionConfig,
    /// Master.
    pub master: MasterConfig,
    /// Conductor, when enabled.
    pub conductor: Option<ConductorConfig>,
}

impl ValidatedKVCachePool {
    /// Checks a spec and resolves its defaults. The first failing rule is reported.
    pub fn validate(spec: &KVCachePoolSpec) -> Result<Self, SpecError> {
        let block_size_tokens = ranged("blockSizeTokens", spec.block_size_tokens, 1, 65536)?;

        let dram = &spec.dram;
        let capacity = match (&dram.capacity_per_node, dram.node_memory_percent) {
            (Some(_), Some(_)) => {
                return Err(SpecError::Conflict {
                    field: "dram",
                    message: "set at most one of capacityPerNode and nodeMemoryPercent",
                });
            }
            (Some(q), None) => DramCapacity::Bytes(positive_bytes("dram.capacityPerNode", q)?),
            (None, pct) => DramCapacity::NodeMemoryPercent(ranged(
                "dram.nodeMemoryPercent",
                pct.unwrap_or(defaults::NODE_MEMORY_PERCENT),
                1,
                100,
            )?),
        };
        let page_bytes: u64 = match dram.hugepages {
            Hugepages::None => 1,
            Hugepages::Size2Mi => 2 << 20,
            Hugepages::Size1Gi => 1 << 30,
        };
        match capacity {
            DramCapacity::NodeMemoryPercent(_) if page_bytes > 1 => {
                return Err(SpecError::Missing {
                    field: "dram.capacityPerNode",
                    message: "hugepages require an explicit capacityPerNode",
                });
            }
            DramCapacity::Bytes(bytes) if !bytes.is_multiple_of(page_bytes) => {
                return Err(SpecError::Conflict {
                    field: "dram.capacityPerNode",
                    message: "must be a whole number of hugepages (a multiple of dram.hugepages)",
                });
            }
            _ => {}
        }

        let ssd = match &spec.ssd {
            None => None,
            Some(ssd) => {
                if !ssd.host_path.starts_with('/') || ssd.host_path.len() < 2 {
                    return Err(SpecError::Conflict {
                        field: "ssd.hostPath",
                        message: "must be an absolute directory other than /",
                    });
                }
                Some(SsdConfig {
                    host_path: ssd.host_path.clone(),
                    capacity_bytes: positive_bytes("ssd.capacityPerNode", &ssd.capacity_per_node)?,
                })
            }
        };

        let t = &spec.transport;
        if t.protocol == Protocol::Tcp {
            if t.sriov.is_some() {
                return Err(SpecError::Conflict {
                    field: "transport.sriov",
                    message: "requires transport.protocol rdma or auto",
                });
            }
            if !t.networks.is_empty() {
                return Err(SpecError::Conflict {
                    field: "transport.networks",
                    message: "requires transport.protocol rdma or auto",
                });
            }
            if !t.devices.is_empty() {
                return Err(SpecError::Conflict {
                    field: "transport.devices",
                    message: "requires transport.protocol rdma or auto",
                });
            }
        }
        unique("transport.devices", &t.devices)?;
        unique("transport.networks", &t.networks)?;
        let sriov = match &t.sriov {
            None => None,
            Some(s) => {
                let resources = match (&s.resource_name, s.resources.as_slice()) {
                    (Some(name), []) => vec![SriovRequest {
                        resource_name: name.clone(),
                        count: ranged("transport.sriov.count", s.count, 1, 64)?,
                    }],
                    (None, rails) if !rails.is_empty() => {
                        let names: Vec<String> =
                            rails.iter().map(|r| r.resource_name.clone()).collect();
                        unique("transport.sriov.resources", &names)?;
                        rails
                            .iter()
                            .map(|r| {
                                Ok(SriovRequest {
                                    resource_name: r.resource_name.clone(),
                                    count: ranged(
                                        "transport.sriov.resources.count",
                                        r.count,
                                        1,
                                        64,
                                    )?,
                                })
                            })
                            .collect::<Result<Vec<_>, SpecError>>()?
                    }
                    _ => {
                        return Err(SpecError::Conflict {
                            field: "transport.sriov",
                            message: "set exactly one of resourceName and resources",
                        });
                    }
                };
                Some(SriovConfig { resources })
            }
        };
        let transport = TransportConfig {
            protocol: t.protocol,
            devices: t.devices.clone(),
            sriov,
            networks: t.networks.clone(),
            port: ranged("transport.port", t.port, 1024, 65535)?,
        };

        let replication = ReplicationConfig {
            replicas: ranged("replication.replicas", spec.replication.replicas, 1, 8)?,
            spread_label_key: spec.replication.spread_label_key.clone(),
        };

        let e = &spec.eviction;
        let high_watermark_percent = ranged(
            "eviction.highWatermarkPercent",
            e.high_watermark_percent,
            1,
            100,
        )?;
        let low_watermark_percent = ranged(
            "eviction.lowWatermarkPercent",
            e.low_watermark_percent,
            0,
            99,
        )?;
        if low_watermark_percent >= high_watermark_percent {
            return Err(SpecError::Conflict {
                field: "eviction.lowWatermarkPercent",
                message: "must be below eviction.highWatermarkPercent",
            });
        }
        let eviction = EvictionConfig {
            high_watermark_percent,
            low_watermark_percent,
            policy: e.policy,
        };

        unique("master.etcdEndpoints", &spec.master.etcd_endpoints)?;
        if spec
            .master
            .etcd_endpoints
            .iter()
            .any(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return Err(SpecError::Conflict {
                field: "master.etcdEndpoints",
                message: "every endpoint is a URL starting with http:// or https://",
            });
        }
        let master = MasterConfig {
            replicas: ranged("master.replicas", spec.master.replicas, 1, 5)?,
            etcd_endpoints: spec.master.etcd_endpoints.clone(),
        };
        if master.replicas > 1 && !master.is_ha() {
            return Err(SpecError::Missing {
                field: "master.etcdEndpoints",
                message: "master.replicas above 1 keeps state in etcd",
            });
        }

        // Checked even when disabled: the API server rejects bad values either way.
        let c = &spec.conductor;
        let conductor_config = ConductorConfig {
            replicas: ranged("conductor.replicas", c.replicas, 1, 16)?,
            ttft_millis: ranged("conductor.slo.ttftMillis", c.slo.ttft_millis, 1, 3_600_000)?,
            tpot_millis: ranged("conductor.slo.tpotMillis", c.slo.tpot_millis, 1, 60_000)?,
        };
        let conductor = c.enabled.then_some(conductor_config);

        Ok(Self {
            block_size_tokens,
            dram: DramConfig {
                capacity,
                hugepages: dram.hugepages,
                numa_policy: dram.numa_policy,
            },
            ssd,
            transport,
            replication,
            eviction,
            master,
            conductor,
        })
    }

    /// Bytes of one block for a model: `block_size_tokens` x bytes per token (2 x layers x KV
    /// heads x head dim x dtype bytes, computed by the caller). `None` on overflow.
    pub fn block_bytes(&self, bytes_per_token: u64) -> Option<u64> {
        u64::from(self.block_size_tokens).checked_mul(bytes_per_token)
    }
}

/// Serving phase of an engine pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// Computes prompts' KV cache.
    Prefill,
    /// Generates tokens from prefilled KV cache.
    Decode,
}

impl Role {
    /// The label component of the role's children.
    pub fn component(self) -> Component {
        match self {
            Self::Prefill => Component::Prefill,
            Self::Decode => Component::Decode,
        }
    }

    /// Lowercase name (`prefill`, `decode`), as engines are told their role.
    pub fn as_str(self) -> &'static str {
        self.component().as_str()
    }
}

/// Effective autoscaling bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingConfig {
    /// Fewest instances.
    pub min_replicas: u32,
    /// Most instances.
    pub max_replicas: u32,
    /// Load signal.
    pub signal: AutoscalingSignal,
}

/// A PrefillPool or DecodePool spec with defaults applied and rules checked: one shape for both
/// kinds, so the operator builds both with the same code.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedEnginePool {
    /// Prefill or decode.
    pub role: Role,
    /// Name of the KVCachePool in the same namespace.
    pub kv_cache_pool: String,
    /// Desired instances.
    pub replicas: u32,
    /// Engine implementation.
    pub kind: EngineKind,
    /// Engine image.
    pub image: String,
    /// Model, required unless `kind` is custom.
    pub model: Option<String>,
    /// Entrypoint override.
    pub command: Vec<String>,
    /// User arguments.
    pub args: Vec<String>,
    /// User environment.
    pub env: Vec<EnvVar>,
    /// GPUs per instance (a multiple of `tensor_parallel_size`).
    pub gpus: u32,
    /// GPU extended resource name.
    pub gpu_resource_name: String,
    /// RDMA extended resources per instance.
    pub rdma: BTreeMap<String, Quantity>,
    /// Other container resources.
    pub container: Option<ResourceRequirements>,
    /// GPUs per model replica.
    pub tensor_parallel_size: u32,
    /// The role's latency objective: TTFT for prefill, TPOT for decode, milliseconds.
    pub slo_millis: u32,
    /// Autoscaling bounds, if any.
    pub autoscaling: Option<AutoscalingConfig>,
}

/// The fields PrefillPoolSpec and DecodePoolSpec share, borrowed.
struct EngineFields<'a> {
    pool: &'a str,
    replicas: i32,
    engine: &'a super::EngineSpec,
    resources: &'a super::EngineResources,
    tensor_parallel_size: i32,
    autoscaling: Option<&'a super::AutoscalingSpec>,
}

impl ValidatedEnginePool {
    /// Checks a PrefillPool spec.
    pub fn from_prefill(spec: &PrefillPoolSpec) -> Result<Self, SpecError> {
        let slo_millis = ranged("slo.ttftMillis", spec.slo.ttft_millis, 1, 3_600_000)?;
        Self::build(
            Role::Prefill,
            slo_millis,
            EngineFields {
                pool: &spec.kv_cache_pool_ref.name,
                replicas: spec.replicas,
                engine: &spec.engine,
                resources: &spec.resources,
                tensor_parallel_size: spec.tensor_parallel_size,
                autoscaling: spec.autoscaling.as_ref(),
            },
        )
    }

    /// Checks a DecodePool spec.
    pub fn from_decode(spec: &DecodePoolSpec) -> Result<Self, SpecError> {
        let slo_millis = ranged("slo.tpotMillis", spec.slo.tpot_millis, 1, 60_000)?;
        Self::build(
            Role::Decode,
            slo_millis,
            EngineFields {
                pool: &spec.kv_cache_pool_ref.name,
                replicas: spec.replicas,
                engine: &spec.engine,
                resources: &spec.resources,
                tensor_parallel_size: spec.tensor_parallel_size,
                autoscaling: spec.autoscaling.as_ref(),
            },
        )
    }

    /// The role's SLO as a duration.
    pub fn slo(&self) -> Duration {
        Duration::from_millis(u64::from(self.slo_millis))
    }

    fn build(role: Role, slo_millis: u32, f: EngineFields<'_>) -> Result<Self, SpecError> {
        if f.pool.is_empty() {
            return Err(SpecError::Missing {
                field: "kvCachePoolRef.name",
                message: "names the KVCachePool to use",
            });
        }
        let replicas = ranged("replicas", f.replicas, 0, 1024)?;
        let gpus: u32 = ranged("resources.gpus", f.resources.gpus, 0, 64)?;
        let tensor_parallel_size: u32 =
            ranged("tensorParallelSize", f.tensor_parallel_size, 1, 64)?;
        if !gpus.is_multiple_of(tensor_parallel_size) {
            return Err(SpecError::Conflict {
                field: "resources.gpus",
                message: "must be a multiple of tensorParallelSize",
            });
        }
        if f.engine.kind != EngineKind::Custom && f.engine.model.is_none() {
            return Err(SpecError::Missing {
                field: "engine.model",
                message: "required for engine.kind vllm and sglang",
            });
        }
        if f.engine.image.is_empty() {
            return Err(SpecError::Missing {
                field: "engine.image",
                message: "names the engine's container image",
            });
        }
        let autoscaling = match f.autoscaling {
            None => None,
            Some(a) => {
                let min_replicas = ranged("autoscaling.minReplicas", a.min_replicas, 0, 1024)?;
                let max_replicas = ranged("autoscaling.maxReplicas", a.max_replicas, 1, 1024)?;
                if min_replicas > max_replicas {
                    return Err(SpecError::Conflict {
                        field: "autoscaling.minReplicas",
                        message: "must not exceed autoscaling.maxReplicas",
                    });
                }
                if replicas < min_replicas || replicas > max_replicas {
                    return Err(SpecError::Conflict {
                        field: "replicas",
                        message: "must lie within autoscaling.minReplicas..autoscaling.maxReplicas",
                    });
                }
                Some(AutoscalingConfig {
                    min_replicas,
                    max_replicas,
                    signal: a.signal,
                })
            }
        };
        Ok(Self {
            role,
            kv_cache_pool: f.pool.to_owned(),
            replicas,
            kind: f.engine.kind,
            image: f.engine.image.clone(),
            model: f.engine.model.clone(),
            command: f.engine.command.clone(),
            args: f.engine.args.clone(),
            env: f.engine.env.clone(),
            gpus,
            gpu_resource_name: f.resources.gpu_resource_name.clone(),
            rdma: f.resources.rdma.clone(),
            container: f.resources.container.clone(),
            tensor_parallel_size,
            slo_millis,
            autoscaling,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DecodePool, KVCachePool, PrefillPool};

    fn pool(spec_yaml: &str) -> KVCachePoolSpec {
        let text = format!(
            "apiVersion: kvpool.dev/v1alpha1\nkind: KVCachePool\nmetadata:\n  name: p\nspec:\n{spec_yaml}"
        );
        let pool: KVCachePool = serde_saphyr::from_str(&text).expect("fixture parses");
        pool.spec
    }

    fn prefill(spec_yaml: &str) -> PrefillPoolSpec {
        let text = format!(
            "apiVersion: kvpool.dev/v1alpha1\nkind: PrefillPool\nmetadata:\n  name: p\nspec:\n  kvCachePoolRef: {{name: cache}}\n{spec_yaml}"
        );
        let p: PrefillPool = serde_saphyr::from_str(&text).expect("fixture parses");
        p.spec
    }

    #[test]
    fn empty_spec_resolves_to_documented_defaults() {
        let v = ValidatedKVCachePool::validate(&pool("  {}")).expect("valid");
        assert_eq!(v.block_size_tokens, 512);
        assert_eq!(v.dram.capacity, DramCapacity::NodeMemoryPercent(25));
        assert_eq!(v.dram.hugepages, Hugepages::None);
        assert_eq!(v.dram.numa_policy, NumaPolicy::Local);
        assert_eq!(v.ssd, None);
        assert_eq!(v.transport.protocol, Protocol::Auto);
        assert_eq!(v.transport.port, 15500);
        assert_eq!(v.replication.replicas, 1);
        assert_eq!(v.replication.spread_label_key, "kubernetes.io/hostname");
        assert_eq!(
            (
                v.eviction.high_watermark_percent,
                v.eviction.low_watermark_percent
            ),
            (90, 80)
        );
        assert_eq!(v.eviction.policy, EvictionPolicy::Lru);
        assert_eq!(v.master.replicas, 1);
        assert!(!v.master.is_ha());
        let c = v.conductor.expect("conductor on by default");
        assert_eq!(
            (c.replicas, c.ttft(), c.tpot()),
            (1, Duration::from_secs(2), Duration::from_millis(100))
        );
    }

    #[test]
    fn quantities_resolve_to_bytes() {
        let v = ValidatedKVCachePool::validate(&pool(
            "  dram: {capacityPerNode: 512Gi, hugepages: 1Gi}\n  ssd: {hostPath: /mnt/nvme, capacityPerNode: 3Ti}\n  conductor: {enabled: false}",
        ))
        .expect("valid");
        assert_eq!(v.dram.capacity, DramCapacity::Bytes(512 << 30));
        assert_eq!(v.dram.hugepages, Hugepages::Size1Gi);
        assert_eq!(
            v.ssd,
            Some(SsdConfig {
                host_path: "/mnt/nvme".into(),
                capacity_bytes: 3 << 40
            })
        );
        assert_eq!(v.conductor, None);
        assert_eq!(v.block_bytes(160 * 1024), Some(512 * 160 * 1024));
        assert_eq!(v.block_bytes(u64::MAX), None);
    }

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

    #[test]
    fn errors_name_the_field_and_category() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "  dram: {capacityPerNode: 1Gi, nodeMemoryPercent: 5}",
                "dram",
                "conflicting_fields",
            ),
            (
                "  dram: {hugepages: 2Mi}",
                "dram.capacityPerNode",
                "missing_field",
            ),
            (
                "  dram: {capacityPerNode: '0'}",
                "dram.capacityPerNode",
                "out_of_range",
            ),
            (
                "  dram: {capacityPerNode: 1GB}",
                "dram.capacityPerNode",
                "invalid_quantity",
            ),
            (
                "  dram: {nodeMemoryPercent: 0}",
                "dram.nodeMemoryPercent",
                "out_of_range",
            ),
            (
                "  ssd: {hostPath: rel, capacityPerNode: 1Ti}",
                "ssd.hostPath",
                "conflicting_fields",
            ),
            (
                "  ssd: {hostPath: /x, capacityPerNode: -1}",
                "ssd.capacityPerNode",
                "invalid_quantity",
            ),
            (
                "  transport: {protocol: tcp, networks: [a]}",
                "transport.networks",
                "conflicting_fields",
            ),
            ("  transport: {port: 80}", "transport.port", "out_of_range"),
            (
                "  transport: {devices: [mlx5_0, mlx5_0]}",
                "transport.devices",
                "conflicting_fields",
            ),
            ("  blockSizeTokens: 0", "blockSizeTokens", "out_of_range"),
            (
                "  replication: {replicas: 9}",
                "replication.replicas",
                "out_of_range",
            ),
            (
                "  eviction: {highWatermarkPercent: 50}",
                "eviction.lowWatermarkPercent",
                "conflicting_fields",
            ),
            (
                "  master: {replicas: 2}",
                "master.etcdEndpoints",
                "missing_field",
            ),
            (
                "  conductor: {replicas: 0}",
                "conductor.replicas",
                "out_of_range",
            ),
        ];
        for (yaml, field, category) in cases {
            let err = ValidatedKVCachePool::validate(&pool(yaml)).expect_err(yaml);
            assert_eq!(
                (err.field(), err.category()),
                (*field, *category),
                "{yaml}: {err}"
            );
            assert!(
                err.to_string().starts_with(&format!("spec.{field}: ")),
                "{err}"
            );
        }
    }

    #[test]
    fn names_leave_room_for_child_suffixes() {
        assert_eq!(validate_name(&"a".repeat(53)), Ok(()));
        let long = validate_name(&"a".repeat(54)).expect_err("too long");
        assert_eq!(
            (long.field(), long.category()),
            ("metadata.name", "invalid_name")
        );
        assert!(long.to_string().starts_with("metadata.name \""), "{long}");
        assert!(validate_name("cache.v2").is_err());
        assert_eq!(format!("{}-conductor", "a".repeat(MAX_NAME_LEN)).len(), 63);
    }

    #[test]
    fn engine_pools_share_one_validated_shape() {
        let p = ValidatedEnginePool::from_prefill(&prefill(
            "  replicas: 2\n  engine: {kind: vllm, image: vllm/vllm-openai, model: m}\n  tensorParallelSize: 4\n  resources: {gpus: 8}\n  autoscaling: {minReplicas: 1, maxReplicas: 4}",
        ))
        .expect("valid");
        assert_eq!(p.role, Role::Prefill);
        assert_eq!(p.role.as_str(), "prefill");
        assert_eq!(p.kv_cache_pool, "cache");
        assert_eq!((p.replicas, p.gpus, p.tensor_parallel_size), (2, 8, 4));
        assert_eq!(p.gpu_resource_name, "nvidia.com/gpu");
        assert_eq!(p.slo(), Duration::from_secs(2));
        assert_eq!(
            p.autoscaling,
            Some(AutoscalingConfig {
                min_replicas: 1,
                max_replicas: 4,
                signal: AutoscalingSignal::SloAttainment
            })
        );

        let text = "apiVersion: kvpool.dev/v1alpha1\nkind: DecodePool\nmetadata: {name: d}\nspec:\n  kvCachePoolRef: {name: cache}\n  engine: {kind: custom, image: my/engine}\n  resources: {gpus: 0}\n  slo: {tpotMillis: 40}";
        let d: DecodePool = serde_saphyr::from_str(text).expect("parses");
        let d = ValidatedEnginePool::from_decode(&d.spec).expect("custom needs no model");
        assert_eq!(
            (d.role, d.gpus, d.model.as_deref()),
            (Role::Decode, 0, None)
        );
        assert_eq!(d.slo(), Duration::from_millis(40));
        assert_eq!(d.role.component(), Component::Decode);
    }

    #[test]
    fn engine_pool_errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("  engine: {kind: vllm, image: i}", "engine.model"),
            ("  engine: {kind: custom, image: ''}", "engine.image"),
            (
                "  engine: {kind: custom, image: i}\n  tensorParallelSize: 2\n  resources: {gpus: 3}",
                "resources.gpus",
            ),
            (
                "  engine: {kind: custom, image: i}\n  replicas: 5\n  autoscaling: {maxReplicas: 4}",
                "replicas",
            ),
            (
                "  engine: {kind: custom, image: i}\n  autoscaling: {minReplicas: 3, maxReplicas: 2}",
                "autoscaling.minReplicas",
            ),
            (
                "  engine: {kind: custom, image: i}\n  slo: {ttftMillis: 0}",
                "slo.ttftMillis",
            ),
            (
                "  engine: {kind: custom, image: i}\n  replicas: -1",
                "replicas",
            ),
        ];
        for (yaml, field) in cases {
            let err = ValidatedEnginePool::from_prefill(&prefill(yaml)).expect_err(yaml);
            assert_eq!(err.field(), *field, "{yaml}: {err}");
        }
    }

    #[test]
    fn sriov_rails_become_one_request_each_and_a_repeated_rail_is_named() {
        let v = ValidatedKVCachePool::validate(&pool(
            "  transport: {sriov: {resources: [{resourceName: a/rail0}, {resourceName: a/rail1, count: 2}]}}",
        ))
        .expect("valid");
        let sriov = v.transport.sriov.expect("sriov");
        assert_eq!(
            sriov.resources,
            vec![
                SriovRequest {
                    resource_name: "a/rail0".into(),
                    count: 1
                },
                SriovRequest {
                    resource_name: "a/rail1".into(),
                    count: 2
                },
            ]
        );
        for (yaml, field) in [
            (
                "  transport: {sriov: {resources: [{resourceName: a/r, count: 1}, {resourceName: a/r, count: 2}]}}",
                "transport.sriov.resources",
            ),
            (
                "  transport: {sriov: {resourceName: a/r, resources: [{resourceName: a/s}]}}",
                "transport.sriov",
            ),
            ("  transport: {sriov: {count: 2}}", "transport.sriov"),
            (
                "  transport: {sriov: {resources: [{resourceName: a/r, count: 0}]}}",
                "transport.sriov.resources.count",
            ),
        ] {
            let err = ValidatedKVCachePool::validate(&pool(yaml)).expect_err(yaml);
            assert_eq!(err.field(), field, "{yaml}: {err}");
        }
    }

    #[test]
    fn configmap_form_is_camel_case_and_round_trips() {
        let v = ValidatedKVCachePool::validate(&pool(
            "  transport: {sriov: {resourceName: nvidia.com/roce_vf, count: 8}}\n  dram: {capacityPerNode: 1Ti}",
        ))
        .expect("valid");
        let json = serde_json::to_value(&v).expect("serializes");
        assert_eq!(json["blockSizeTokens"], 512);
        assert_eq!(
            json["dram"]["capacity"],
            serde_json::json!({"bytes": 1u64 << 40})
        );
        assert_eq!(
            json["transport"]["sriov"]["resources"],
            serde_json::json!([{"resourceName": "nvidia.com/roce_vf", "count": 8}])
        );
        assert_eq!(json["eviction"]["highWatermarkPercent"], 90);
        let back: ValidatedKVCachePool = serde_json::from_value(json).expect("parses back");
        assert_eq!(back, v);
    }
}
