//! Tier usage of a `KVCachePool` as its master reports it: the master's `Stats` RPC, signed with
//! the pool's `observer` role key (derived from the pool key, which the operator derives from
//! its root key) on the master Service's address, behind the [`MasterStats`] trait so the
//! reconcile tests can substitute a fake. A master that refuses the credential is told apart
//! ([`UsageError::AuthRejected`]): the pool's auth Secret then holds a key the operator did not
//! derive. [`PoolUsage`] is pure. The reader is injected through the controllers' `Context`, so
//! this module sits below it (and is re-exported as `cachepool::usage`, its former place).
//! I/O boundary: the gRPC call in [`GrpcMasterStats`].

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use kvpool_client::master::{ClientConfig, ClientError, MasterClient, MasterTls};
use kvpool_core::master::types::Tier;
use kvpool_crd::MasterTlsSpec;
use kvpool_proto::auth::{AuthKey, Role};
use kvpool_proto::master::{NodeStats, StatsResponse, tier_from_i32};

/// Usage figures of one pool, in bytes per tier, as the master counts them over the segments
/// its agents registered, and the transport state each live node reported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub dram_used: u64,
    pub dram_capacity: u64,
    pub ssd_used: u64,
    pub ssd_capacity: u64,
    pub objects: u64,
    pub nodes_alive: u64,
    pub segments: u64,
    /// Keys clients looked up since the master started: found, and not found.
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    /// Per live node that reported it, sorted by node name.
    pub transport: Vec<NodeTransport>,
    /// Keys looked up by Get alone (part of the lookups): found, and not found.
    pub get_hits: u64,
    pub get_misses: u64,
    /// Every live node, sorted by node name.
    pub nodes: Vec<NodeUsage>,
}

/// One live node's bytes and the Get hits it served, as the master counts them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeUsage {
    pub node: String,
    pub dram_used: u64,
    pub dram_capacity: u64,
    pub ssd_used: u64,
    pub ssd_capacity: u64,
    /// Per NUMA node and tier with a segment mounted (the master's order: NUMA nodes
    /// ascending, unbound last). Rows with a tier number this operator does not know are left
    /// out.
    pub numa: Vec<NumaUsage>,
    /// Keys whose Get was served from this node, over its tiers.
    pub get_hits: u64,
}

/// One tier's bytes on one NUMA node of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaUsage {
    /// `None` for segments announced unbound.
    pub numa_node: Option<u32>,
    pub tier: Tier,
    pub used: u64,
    pub capacity: u64,
}

/// How one node's agent moves bytes, as its heartbeat told the master.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeTransport {
    pub node: String,
    /// The agent was asked for RDMA (`rdma` or `auto`).
    pub rdma_requested: bool,
    /// RDMA was asked for but the agent's transfers went over TCP.
    pub fallback: bool,
    /// Why (empty without a fallback).
    pub reason: String,
    /// RDMA devices the agent opened.
    pub devices: Vec<String>,
}

impl PoolUsage {
    /// From the master's answer (tier index 0 is DRAM, 1 is SSD; a missing index counts as 0).
    /// The share of looked-up keys the pool held, with three decimals (`None` before any
    /// lookup).
    pub fn hit_ratio(&self) -> Option<String> {
        let total = self.lookup_hits.saturating_add(self.lookup_misses);
        (total > 0).then(|| format!("{:.3}", self.lookup_hits as f64 / total as f64))
    }

    pub fn from_stats(s: &StatsResponse) -> Self {
        let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
        Self {
            dram_used: at(&s.used_bytes, 0),
            dram_capacity: at(&s.capacity_bytes, 0),
            ssd_used: at(&s.used_bytes, 1),
            ssd_capacity: at(&s.capacity_bytes, 1),
            objects: s.objects,
            nodes_alive: s.nodes_alive,
            segments: s.segments,
            lookup_hits: s.lookup_hits,
            lookup_misses: s.lookup_misses,
            get_hits: s.get_hits,
            get_misses: s.get_misses,
            nodes: s.nodes.iter().map(node_usage).collect(),
            transport: s
                .transport
                .iter()
                .map(|n| {
                    let r = n.report.clone().unwrap_or_default();
                    NodeTransport {
                        node: n.node.clone(),
                        rdma_requested: r.rdma_requested,
                        fallback: r.fallback,
                        reason: r.fallback_reason,
                        devices: r.rdma_devices,
                    }
                })
                .collect(),
        }
    }
}

/// One node of the master's answer (tier index 0 is DRAM, 1 is SSD; a missing index counts as
/// 0).
fn node_usage(n: &NodeStats) -> NodeUsage {
    let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    NodeUsage {
        node: n.node.clone(),
        dram_used: at(&n.used_bytes, 0),
        dram_capacity: at(&n.capacity_bytes, 0),
        ssd_used: at(&n.used_bytes, 1),
        ssd_capacity: at(&n.capacity_bytes, 1),
        numa: n
            .numa
            .iter()
            .filter_map(|r| {
                Some(NumaUsage {
                    numa_node: (!r.unbound).then_some(r.numa_node),
                    tier: tier_from_i32(r.tier)?,
                    used: r.used_bytes,
                    capacity: r.capacity_bytes,
                })
            })
            .collect(),
        get_hits: n.get_hits.iter().fold(0u64, |a, h| a.saturating_add(*h)),
    }
}

/// Why the usage could not be read.
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The master answered UNAUTHENTICATED or PERMISSION_DENIED: it holds another pool key.
    #[error("master {addr} refused the operator's credential: {message}")]
    AuthRejected { addr: String, message: String },
    #[error("cannot build a master client for {addr}")]
    Client {
        addr: String,
        #[source]
        source: ClientError,
    },
    #[error("master {addr} did not answer Stats")]
    Stats {
        addr: String,
        #[source]
        source: ClientError,
    },
    #[error("master {addr} did not answer Stats within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error(
        "master {addr} serves TLS (spec.master.tls) but the operator has no CA to verify it: \
         start it with --master-ca-file (chart: operator.masterTLS.caConfigMap)"
    )]
    NoCa { addr: String },
}

impl UsageError {
    /// Short label for metrics and condition messages.
    pub fn category(&self) -> &'static str {
        match self {
            UsageError::AuthRejected { .. } => "auth_rejected",
            UsageError::Client { .. } => "client",
            UsageError::Stats { source, .. } => match source.category() {
                "refused" => "refused",
                "rpc" => "rpc",
                _ => "unreachable",
            },
            UsageError::Timeout { .. } => "timeout",
            UsageError::NoCa { .. } => "no_master_ca",
        }
    }
}

/// The credential the operator signs `Stats` with: the `observer` role key of the pool key
/// `pool_key_hex` (the least a usage read needs). `None` for a key shorter than 16 bytes, which a
/// derived key never is.
pub fn observer_key(pool_key_hex: &str) -> Option<AuthKey> {
    AuthKey::from_bytes(pool_key_hex.as_bytes())?.derive(Role::Observer)
}

/// Whether a failed call was refused for its credential rather than not answered.
fn refused_credential(e: &ClientError) -> Option<String> {
    match e {
        ClientError::Rpc { source, .. }
            if matches!(
                source.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            ) =>
        {
            Some(source.message().to_owned())
        }
        _ => None,
    }
}

/// Reads a pool's usage from its master. Object-safe so the context can hold any implementation.
pub trait MasterStats: Send + Sync {
    /// Ask the master at `addr` (`host:port`) for its figures, authenticated with `key`, over
    /// TLS when the pool's master serves it (`tls`, its `spec.master.tls`).
    fn stats<'a>(
        &'a self,
        addr: &'a str,
        tls: Option<&'a MasterTlsSpec>,
        key: AuthKey,
    ) -> BoxFuture<'a, Result<PoolUsage, UsageError>>;
}

/// The real reader: one short-lived gRPC client per call, bounded by `timeout` as a whole.
#[derive(Clone, Debug)]
pub struct GrpcMasterStats {
    pub timeout: Duration,
    /// The CA that verifies the masters that serve TLS (`--master-ca-file`).
    pub ca_file: Option<PathBuf>,
}

impl Default for GrpcMasterStats {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            ca_file: None,
        }
    }
}

impl GrpcMasterStats {
    /// The client's TLS for a master with `tls` (plain text without).
    fn master_tls(&self, addr: &str, tls: Option<&MasterTlsSpec>) -> Result<MasterTls, UsageError> {
        let Some(tls) = tls else {
            return Ok(MasterTls::default());
        };
        let ca_file = self.ca_file.clone().ok_or_else(|| UsageError::NoCa {
            addr: addr.to_owned(),
        })?;
        Ok(MasterTls {
            ca_file: Some(ca_file),
            server_name: tls.server_name.clone(),
            ..MasterTls::default()
        })
    }
}

impl MasterStats for GrpcMasterStats {
    fn stats<'a>(
        &'a self,
        addr: &'a str,
        tls: Option<&'a MasterTlsSpec>,
        key: AuthKey,
    ) -> BoxFuture<'a, Result<PoolUsage, UsageError>> {
        Box::pin(async move {
            let config = ClientConfig {
                connect_timeout: self.timeout,
                request_timeout: self.timeout,
                // A standby answers UNAVAILABLE: retry briefly, the next pass tries again anyway.
                failover_budget: Duration::from_secs(1).min(self.timeout),
                tls: self.master_tls(addr, tls)?,
                ..Default::default()
            };
            let client =
                MasterClient::new(vec![addr.to_owned()], key, config).map_err(|source| {
                    UsageError::Client {
                        addr: addr.to_owned(),
                        source,
                    }
                })?;
            match tokio::time::timeout(self.timeout, client.stats()).await {
                Ok(Ok(s)) => Ok(PoolUsage::from_stats(&s)),
                Ok(Err(source)) => Err(match refused_credential(&source) {
                    Some(message) => UsageError::AuthRejected {
                        addr: addr.to_owned(),
                        message,
                    },
                    None => UsageError::Stats {
                        addr: addr.to_owned(),
                        source,
                    },
                }),
                Err(_) => Err(UsageError::Timeout {
                    addr: addr.to_owned(),
                    timeout: self.timeout,
                }),
            }
        })
    }
}

/// A reader with fixed figures, for tests: `None` behaves as a master that never answers.
#[derive(Clone, Debug, Default)]
pub struct FixedStats(pub Option<PoolUsage>);

impl MasterStats for FixedStats {
    fn stats<'a>(
        &'a self,
        addr: &'a str,
        _tls: Option<&'a MasterTlsSpec>,
        _key: AuthKey,
    ) -> BoxFuture<'a, Result<PoolUsage, UsageError>> {
        let answer = self.0.clone().ok_or_else(|| UsageError::Timeout {
            addr: addr.to_owned(),
            timeout: Duration::ZERO,
        });
        Box::pin(std::future::ready(answer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_the_tier_indices_and_missing_ones_are_zero() {
        let s = StatsResponse {
            objects: 7,
            used_bytes: vec![10, 20],
            capacity_bytes: vec![100],
            nodes_alive: 2,
            segments: 3,
            ..StatsResponse::default()
        };
        assert_eq!(
            PoolUsage::from_stats(&s),
            PoolUsage {
                dram_used: 10,
                dram_capacity: 100,
                ssd_used: 20,
                ssd_capacity: 0,
                objects: 7,
                nodes_alive: 2,
                segments: 3,
                transport: Vec::new(),
                ..PoolUsage::default()
            }
        );
        let s = StatsResponse {
            lookup_hits: 2,
            lookup_misses: 1,
            ..StatsResponse::default()
        };
        assert_eq!(
            PoolUsage::from_stats(&s).hit_ratio().as_deref(),
            Some("0.667")
        );
        assert_eq!(PoolUsage::default().hit_ratio(), None);
        let s = StatsResponse {
            transport: vec![kvpool_proto::master::NodeTransport {
                node: "gpu-1".into(),
                report: Some(kvpool_proto::master::TransportReport {
                    rdma_requested: true,
                    fallback: true,
                    fallback_reason: "no usable RDMA device on this host".into(),
                    rdma_devices: vec![],
                }),
            }],
            ..StatsResponse::default()
        };
        assert_eq!(
            PoolUsage::from_stats(&s).transport,
            [NodeTransport {
                node: "gpu-1".into(),
                rdma_requested: true,
                fallback: true,
                reason: "no usable RDMA device on this host".into(),
                devices: vec![],
            }]
        );
    }

    #[test]
    fn nodes_come_with_their_numa_rows_and_unknown_tiers_are_left_out() {
        use kvpool_proto::master::NumaStats;
        let row = |unbound, numa_node, tier| NumaStats {
            unbound,
            numa_node,
            tier,
            used_bytes: 1,
            capacity_bytes: 8,
        };
        let s = StatsResponse {
            get_hits: 5,
            get_misses: 2,
            nodes: vec![NodeStats {
                node: "gpu-0".into(),
                used_bytes: vec![1, 2],
                capacity_bytes: vec![8],
                numa: vec![row(false, 1, 0), row(true, 0, 1), row(false, 0, 7)],
                get_hits: vec![3, 2],
            }],
            ..StatsResponse::default()
        };
        let u = PoolUsage::from_stats(&s);
        assert_eq!((u.get_hits, u.get_misses), (5, 2));
        assert_eq!(
            u.nodes,
            [NodeUsage {
                node: "gpu-0".into(),
                dram_used: 1,
                dram_capacity: 8,
                ssd_used: 2,
                ssd_capacity: 0,
                numa: vec![
                    NumaUsage {
                        numa_node: Some(1),
                        tier: Tier::Dram,
                        used: 1,
                        capacity: 8,
                    },
                    NumaUsage {
                        numa_node: None,
                        tier: Tier::Ssd,
                        used: 1,
                        capacity: 8,
                    },
                ],
                get_hits: 5,
            }]
        );
    }

    #[test]
    fn usage_is_read_as_the_observer_which_may_call_stats_only() {
        let pool_hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let key = observer_key(pool_hex).expect("observer");
        assert_eq!(key.role(), Role::Observer);
        let verifier = kvpool_proto::auth::Verifier::new(
            &AuthKey::from_bytes(pool_hex.as_bytes()).expect("pool"),
        )
        .expect("verifier");
        assert!(verifier.verify(Some(&key.sign("Stats")), "Stats").is_ok());
        assert!(
            verifier
                .verify(Some(&key.sign("RemoveAll")), "RemoveAll")
                .is_err()
        );
        assert!(observer_key("short").is_none());
    }

    #[tokio::test]
    async fn an_unreachable_master_is_an_error_not_a_hang() {
        // A port nobody listens on: bind, learn the port, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let key = AuthKey::from_bytes(b"0123456789abcdef0123").expect("key");
        let reader = GrpcMasterStats {
            timeout: Duration::from_secs(3),
            ca_file: None,
        };
        let err = reader
            .stats(&format!("127.0.0.1:{port}"), None, key)
            .await
            .expect_err("nothing listens");
        assert!(
            matches!(err.category(), "unreachable" | "timeout" | "rpc"),
            "{err:?}"
        );
    }
}
