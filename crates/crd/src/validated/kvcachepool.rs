//! [`ValidatedKVCachePool`]: a `KVCachePool` spec with every default filled in, quantities
//! resolved to bytes and the ranges and cross-field rules of the schema checked again, so that
//! the operator's `build` only sees consistent values and the data plane reads one settled
//! document from the pool's ConfigMap. Pure, no I/O.

use serde::{Deserialize, Serialize};

use super::error::{SpecError, validate_label_key};
use super::fields::{positive_bytes, ranged, unique};
use super::pool_config::{
    ConductorConfig, DramCapacity, DramConfig, EvictionConfig, MasterConfig, ReplicationConfig,
    SriovConfig, SriovRequest, SsdConfig, TransportConfig,
};
use crate::defaults;
use crate::{Hugepages, KVCachePoolSpec, Protocol};

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

        let persistence =
            crate::persistence::validate_persistence(dram.persistence.as_ref(), dram.hugepages)?;
        let ssd = match &spec.ssd {
            None => None,
            Some(ssd) => {
                if !crate::ssd_host_path_allowed(&ssd.host_path) {
                    return Err(SpecError::Conflict {
                        field: "ssd.hostPath",
                        message: "must be a directory below /mnt/, /data/ or /var/lib/kvpool/ with no '.', '..' or empty segments (the agent mounts it read-write on every node)",
                    });
                }
                Some(SsdConfig {
                    host_path: ssd.host_path.clone(),
                    capacity_bytes: positive_bytes("ssd.capacityPerNode", &ssd.capacity_per_node)?,
                })
            }
        };

        let np = &spec.network_policy;
        let peer_message = "each peer sets either ipBlock or podSelector and/or namespaceSelector";
        if !np.conductor_from.iter().all(crate::ConductorPeer::is_valid) {
            return Err(SpecError::Conflict {
                field: "networkPolicy.conductorFrom",
                message: peer_message,
            });
        }
        if !np.engine_from.iter().all(crate::EnginePeer::is_valid) {
            return Err(SpecError::Conflict {
                field: "networkPolicy.engineFrom",
                message: peer_message,
            });
        }
        if !np.metrics_from.iter().all(crate::MetricsPeer::is_valid) {
            return Err(SpecError::Conflict {
                field: "networkPolicy.metricsFrom",
                message: peer_message,
            });
        }

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
            if t.gid_index.is_some() {
                return Err(SpecError::Conflict {
                    field: "transport.gidIndex",
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
            gid_index: t
                .gid_index
                .map(|g| ranged("transport.gidIndex", g, 0, 255))
                .transpose()?,
            sriov,
            networks: t.networks.clone(),
            port: ranged("transport.port", t.port, 1024, 65535)?,
            integrity: t.integrity,
            tls: t.tls.clone(),
        };
        if let Some(tls) = &t.tls {
            tls.validate()?;
        }

        validate_label_key(
            "replication.spreadLabelKey",
            &spec.replication.spread_label_key,
        )?;
        if spec.replication.spread_label_key != defaults::SPREAD_LABEL_KEY
            && spec.agent.service_account_name.is_none()
        {
            return Err(SpecError::Missing {
                field: "agent.serviceAccountName",
                message: crate::kvcachepool::SPREAD_NEEDS_NODE_ACCESS,
            });
        }
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
        if let Some(tls) = &spec.master.tls {
            tls.validate()?;
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
            engine_block_size: ranged("conductor.engineBlockSize", c.engine_block_size, 1, 1024)?,
        };
        if let Some(t) = &c.tokenizer {
            tokenizer_source(t)?;
        }
        let conductor = c.enabled.then_some(conductor_config);

        Ok(Self {
            block_size_tokens,
            dram: DramConfig {
                capacity,
                hugepages: dram.hugepages,
                numa_policy: dram.numa_policy,
                persistence,
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

/// The conductor's tokenizer volume: exactly one source, and a relative sub-path without `.`
/// or `..` segments (the API server's CEL rules say the same).
fn tokenizer_source(t: &crate::TokenizerSpec) -> Result<(), SpecError> {
    let sources = [
        t.config_map.is_some(),
        t.persistent_volume_claim.is_some(),
        t.image.is_some(),
    ];
    if sources.iter().filter(|&&s| s).count() != 1 {
        return Err(SpecError::Conflict {
            field: "conductor.tokenizer",
            message: "needs exactly one of configMap, persistentVolumeClaim and image",
        });
    }
    if let Some(sub) = &t.sub_path {
        let plain = |seg: &str| {
            !seg.is_empty()
                && seg != "."
                && seg != ".."
                && seg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        };
        if !sub.split('/').all(plain) {
            return Err(SpecError::Conflict {
                field: "conductor.tokenizer.subPath",
                message: "must be a relative path without '.' or '..' segments",
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{EvictionPolicy, KVCachePool, NumaPolicy};

    fn pool(spec_yaml: &str) -> KVCachePoolSpec {
        crate::validated::fixture::<KVCachePool>(spec_yaml).spec
    }

    #[test]
    fn every_eviction_policy_parses_and_writes_back_as_its_name() {
        for policy in EvictionPolicy::ALL {
            let spec = pool(&format!("  eviction: {{policy: {}}}", policy.as_str()));
            let v = ValidatedKVCachePool::validate(&spec).expect("valid");
            assert_eq!(v.eviction.policy, policy);
            assert_eq!(
                serde_json::to_value(policy).expect("json"),
                serde_json::Value::from(policy.as_str())
            );
        }
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
                "  ssd: {hostPath: /etc, capacityPerNode: 1Ti}",
                "ssd.hostPath",
                "conflicting_fields",
            ),
            (
                "  ssd: {hostPath: /mnt/../etc, capacityPerNode: 1Ti}",
                "ssd.hostPath",
                "conflicting_fields",
            ),
            (
                "  ssd: {hostPath: /mnt/x, capacityPerNode: -1}",
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
            (
                "  transport: {protocol: tcp, gidIndex: 3}",
                "transport.gidIndex",
                "conflicting_fields",
            ),
            (
                "  transport: {protocol: rdma, gidIndex: 256}",
                "transport.gidIndex",
                "out_of_range",
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
                "  replication: {spreadLabelKey: \"Rack Label\"}",
                "replication.spreadLabelKey",
                "invalid_label_key",
            ),
            (
                "  replication: {spreadLabelKey: topology.kubernetes.io/zone}",
                "agent.serviceAccountName",
                "missing_field",
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
