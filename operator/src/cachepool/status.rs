//! Status of a `KVCachePool`, computed from what the apply step got back from the API server
//! (DaemonSet and Deployment status) and the previous status. Deterministic: the same inputs give
//! the same status, so an unchanged pool is never re-patched. I/O boundary: none.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::jiff::Timestamp;
use kvpool_crd::{KVCachePoolStatus, TierStatus};

use super::node_status;
use super::validate::ValidCachePool;
use crate::conditions::{self, Desired};
use crate::contract;
use crate::labels::{self, Component};
use crate::pool_usage::{NodeTransport, PoolUsage};
use kvpool_crd::quantity::format_bytes;
use kvpool_crd::{DramCapacity, Protocol};

/// The children as the API server returned them from the apply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AppliedCachePool {
    pub agent: DaemonSet,
    pub master: Deployment,
    pub conductor: Option<Deployment>,
}

/// Ready replicas and desired replicas of a Deployment.
pub fn deployment_counts(d: &Deployment) -> (i32, i32) {
    let desired = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let ready = d
        .status
        .as_ref()
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0);
    (ready, desired)
}

fn daemonset_counts(ds: &DaemonSet) -> (i32, i32) {
    ds.status
        .as_ref()
        .map(|s| (s.number_ready, s.desired_number_scheduled))
        .unwrap_or((0, 0))
}

/// Desired conditions from the children's counts.
pub fn desired_conditions(applied: &AppliedCachePool) -> Vec<Desired> {
    let (agents_ready, agents_desired) = daemonset_counts(&applied.agent);
    if agents_desired == 0 {
        return conditions::from_counts("agents", agents_ready, agents_desired);
    }
    let mut parts = vec![("agents", agents_ready, agents_desired)];
    let (r, d) = deployment_counts(&applied.master);
    parts.push(("masters", r, d));
    if let Some(c) = &applied.conductor {
        let (r, d) = deployment_counts(c);
        parts.push(("conductors", r, d));
    }
    let summary = parts
        .iter()
        .map(|(what, r, d)| format!("{r}/{d} {what}"))
        .collect::<Vec<_>>()
        .join(", ");
    let all_ready = parts.iter().all(|(_, r, d)| r >= d);
    conditions::rollout(all_ready, format!("{summary} ready"))
}

/// What the master said about the pool's usage on this pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UsageReading {
    /// The master answered.
    Read(PoolUsage),
    /// It did not (`category` is the failure's label); the last known figures stay.
    Failed {
        addr: String,
        category: &'static str,
    },
    /// It answered, refusing the operator's credential (`message` is its answer): the pool's
    /// auth Secret holds a key the operator did not derive. The last known figures stay.
    Rejected { addr: String, message: String },
}

impl UsageReading {
    /// The figures, when the master answered with them.
    pub fn figures(&self) -> Option<&PoolUsage> {
        match self {
            UsageReading::Read(u) => Some(u),
            UsageReading::Failed { .. } | UsageReading::Rejected { .. } => None,
        }
    }
}

/// What a user does about a refused key (the condition's and the Event's message).
pub fn rejected_message(pool: &ValidCachePool, addr: &str, answer: &str) -> String {
    let answer: String = answer.chars().take(MAX_REASON_CHARS).collect();
    let secret = labels::child_name(&pool.name, Component::Auth);
    format!(
        "the master at {addr} refused the key the operator derived from its root key ({answer}): \
         Secret {secret} holds a key the operator did not derive (made by hand, or by an older \
         operator that generated random keys; it lacks the annotation \
         {}: {}). Delete it (kubectl -n {ns} delete secret {secret}) so that the operator \
         creates it again with the derived key, then restart the pool's pods (master, agents, \
         conductor and engines) so they load it",
        crate::root_key::DERIVATION_ANNOTATION,
        crate::root_key::DERIVATION_VERSION,
        ns = pool.namespace,
    )
}

/// The `AuthKeyRejected` condition: True when the master refused the operator's derived key,
/// False when it accepted it, Unknown while it does not answer.
pub fn auth_condition(pool: &ValidCachePool, usage: &UsageReading) -> Desired {
    use kvpool_crd::conditions::{AUTH_KEY_REJECTED, reasons};
    match usage {
        UsageReading::Read(_) => Desired::new(
            AUTH_KEY_REJECTED,
            false,
            reasons::DERIVED_KEY_ACCEPTED,
            "the master accepted the operator's derived key",
        ),
        UsageReading::Rejected { addr, message } => Desired::new(
            AUTH_KEY_REJECTED,
            true,
            reasons::DERIVED_KEY_REFUSED,
            rejected_message(pool, addr, message),
        ),
        UsageReading::Failed { addr, category } => Desired::unknown(
            AUTH_KEY_REJECTED,
            reasons::MASTER_UNREACHABLE,
            format!("the master at {addr} did not answer ({category})"),
        ),
    }
}

/// The `MasterReachable` condition for a reading.
pub fn master_condition(usage: &UsageReading) -> Desired {
    match usage {
        UsageReading::Read(_) => Desired::new(
            kvpool_crd::conditions::MASTER_REACHABLE,
            true,
            kvpool_crd::conditions::reasons::STATS_READ,
            "usage figures read from the master",
        ),
        UsageReading::Failed { addr, category } => Desired::new(
            kvpool_crd::conditions::MASTER_REACHABLE,
            false,
            kvpool_crd::conditions::reasons::MASTER_UNREACHABLE,
            format!(
                "the master at {addr} did not report usage ({category}); figures are the last known"
            ),
        ),
        UsageReading::Rejected { addr, .. } => Desired::new(
            kvpool_crd::conditions::MASTER_REACHABLE,
            false,
            kvpool_crd::conditions::reasons::DERIVED_KEY_REFUSED,
            format!(
                "the master at {addr} refused the operator's credential (see AuthKeyRejected); figures are the last known"
            ),
        ),
    }
}

/// Nodes named in a `TransportDegraded` message; the rest are counted.
const MAX_NODES_NAMED: usize = 5;
/// Longest per-node reason quoted in the message, in characters.
const MAX_REASON_CHARS: usize = 160;

/// Whether a node's report counts as degraded for a pool that asked for `protocol`: with `rdma`
/// any fallback does; with `auto` only a fallback on a node that has RDMA devices (a node
/// without any is expected to use TCP); with `tcp` nothing does.
fn degraded(protocol: Protocol, n: &NodeTransport) -> bool {
    match protocol {
        Protocol::Tcp => false,
        Protocol::Rdma => n.fallback,
        Protocol::Auto => n.fallback && !n.devices.is_empty(),
    }
}

/// How many of the pool's reporting nodes count as degraded (see [`transport_condition`]).
pub fn degraded_nodes(protocol: Protocol, usage: &PoolUsage) -> usize {
    usage
        .transport
        .iter()
        .filter(|n| degraded(protocol, n))
        .count()
}

/// The `TransportDegraded` condition: True with the nodes and their reasons when a node fell
/// back from RDMA to TCP although the pool asked for RDMA, False otherwise, Unknown while the
/// master (which holds the agents' reports) does not answer.
pub fn transport_condition(protocol: Protocol, usage: &UsageReading) -> Desired {
    use kvpool_crd::conditions::{TRANSPORT_DEGRADED, reasons};
    let usage = match usage {
        UsageReading::Read(u) => u,
        UsageReading::Failed { addr, category } => {
            return Desired::unknown(
                TRANSPORT_DEGRADED,
                reasons::MASTER_UNREACHABLE,
                format!(
                    "the master at {addr} did not answer ({category}); the agents' transport state is unknown"
                ),
            );
        }
        UsageReading::Rejected { addr, .. } => {
            return Desired::unknown(
                TRANSPORT_DEGRADED,
                reasons::DERIVED_KEY_REFUSED,
                format!(
                    "the master at {addr} refused the operator's credential; the agents' transport state is unknown"
                ),
            );
        }
    };
    let bad: Vec<&NodeTransport> = usage
        .transport
        .iter()
        .filter(|n| degraded(protocol, n))
        .collect();
    if bad.is_empty() {
        let on_rdma = usage
            .transport
            .iter()
            .filter(|n| n.rdma_requested && !n.fallback)
            .count();
        let message = match protocol {
            Protocol::Tcp => "the pool asked for TCP".to_owned(),
            _ if usage.transport.is_empty() => "no agent has reported its transport yet".to_owned(),
            _ => format!(
                "{on_rdma} of {} reporting nodes move bytes over RDMA, none fell back",
                usage.transport.len()
            ),
        };
        return Desired::new(
            TRANSPORT_DEGRADED,
            false,
            reasons::TRANSPORT_AS_REQUESTED,
            message,
        );
    }
    let mut named: Vec<String> = bad
        .iter()
        .take(MAX_NODES_NAMED)
        .map(|n| {
            let reason: String = n.reason.chars().take(MAX_REASON_CHARS).collect();
            if reason.is_empty() {
                n.node.clone()
            } else {
                format!("{} ({reason})", n.node)
            }
        })
        .collect();
    if bad.len() > MAX_NODES_NAMED {
        named.push(format!("and {} more", bad.len() - MAX_NODES_NAMED));
    }
    Desired::new(
        TRANSPORT_DEGRADED,
        true,
        reasons::RDMA_FALLBACK,
        format!(
            "{} of {} reporting nodes fell back from RDMA to TCP: {}",
            bad.len(),
            usage.transport.len(),
            named.join(", ")
        ),
    )
}

/// One tier's status: the master's figures when it answered with a capacity, otherwise the
/// capacity known from the spec (`spec_capacity`) or the previous one, with the last known usage.
fn tier(
    read: Option<(u64, u64)>,
    spec_capacity: Option<u64>,
    previous: Option<&TierStatus>,
) -> Option<TierStatus> {
    let used = match (read, previous) {
        (Some((used, _)), _) => format_bytes(used),
        (None, Some(p)) => p.used.clone(),
        (None, None) => format_bytes(0),
    };
    let capacity = match (read, spec_capacity, previous) {
        (Some((_, cap)), _, _) if cap > 0 => format_bytes(cap),
        (_, Some(cap), _) => format_bytes(cap),
        (_, None, Some(p)) => p.capacity.clone(),
        (_, None, None) => return None,
    };
    Some(TierStatus { capacity, used })
}

/// The status of a reconciled pool. `previous` keeps condition transition times stable and the
/// usage figures while the master does not answer.
pub fn status(
    pool: &ValidCachePool,
    applied: &AppliedCachePool,
    usage: &UsageReading,
    previous: Option<&KVCachePoolStatus>,
    now: Timestamp,
) -> KVCachePoolStatus {
    let (nodes_ready, nodes_desired) = daemonset_counts(&applied.agent);
    let previous_conditions = previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]);
    let ready_nodes = u64::try_from(nodes_ready).unwrap_or(0);
    let read = usage.figures();
    // The spec gives the capacity when it is an explicit amount per node; a share of node
    // memory is known only to the agents, hence to the master.
    let dram_spec = match pool.effective.dram.capacity {
        DramCapacity::Bytes(b) => Some(b.saturating_mul(ready_nodes)),
        DramCapacity::NodeMemoryPercent(_) => None,
    };
    let dram = tier(
        read.map(|u| (u.dram_used, u.dram_capacity)),
        dram_spec,
        previous.and_then(|p| p.dram.as_ref()),
    );
    let ssd = pool.effective.ssd.as_ref().and_then(|s| {
        tier(
            read.map(|u| (u.ssd_used, u.ssd_capacity)),
            Some(s.capacity_bytes.saturating_mul(ready_nodes)),
            previous.and_then(|p| p.ssd.as_ref()),
        )
    });
    let (nodes, nodes_omitted) = match read {
        Some(u) => node_status::nodes_status(u),
        None => previous.map_or_else(Default::default, |p| (p.nodes.clone(), p.nodes_omitted)),
    };
    let mut desired = desired_conditions(applied);
    desired.push(master_condition(usage));
    desired.push(transport_condition(
        pool.effective.transport.protocol,
        usage,
    ));
    desired.push(auth_condition(pool, usage));
    KVCachePoolStatus {
        conditions: conditions::merge(previous_conditions, &desired, pool.generation, now),
        observed_generation: pool.generation,
        nodes_desired,
        nodes_ready,
        dram,
        ssd,
        objects: match read {
            Some(u) => Some(i64::try_from(u.objects).unwrap_or(i64::MAX)),
            None => previous.and_then(|p| p.objects),
        },
        nodes_registered: match read {
            Some(u) => Some(i32::try_from(u.nodes_alive).unwrap_or(i32::MAX)),
            None => previous.and_then(|p| p.nodes_registered),
        },
        hit_ratio: match read {
            Some(u) => u.hit_ratio(),
            None => previous.and_then(|p| p.hit_ratio.clone()),
        },
        lookups: match read {
            Some(u) => Some(
                i64::try_from(u.lookup_hits.saturating_add(u.lookup_misses)).unwrap_or(i64::MAX),
            ),
            None => previous.and_then(|p| p.lookups),
        },
        nodes,
        nodes_omitted,
        master_endpoint: Some(pool.master_addr()),
        conductor_endpoint: applied.conductor.as_ref().map(|_| {
            format!(
                "{}.{}.svc:{}",
                labels::child_name(&pool.name, Component::Conductor),
                pool.namespace,
                contract::CONDUCTOR_PORT
            )
        }),
    }
}

/// Status of a pool whose spec is invalid: conditions say why, counts are kept.
pub fn invalid_status(
    previous: Option<&KVCachePoolStatus>,
    generation: Option<i64>,
    message: &str,
    now: Timestamp,
) -> KVCachePoolStatus {
    conditions::blocked(
        previous,
        generation,
        conditions::reason::INVALID_SPEC,
        message,
        now,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::find;
    use crate::test_fixtures::{roce, tcp, valid};
    use k8s_openapi::api::apps::v1::{DaemonSetStatus, DeploymentSpec, DeploymentStatus};
    use kvpool_crd::conditions::status_and_reason;

    fn silent() -> UsageReading {
        UsageReading::Failed {
            addr: "m:1".into(),
            category: "timeout",
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("ts")
    }

    fn applied(
        ready: i32,
        desired: i32,
        masters_ready: i32,
        conductor: Option<i32>,
    ) -> AppliedCachePool {
        let deployment = |ready: i32| Deployment {
            spec: Some(DeploymentSpec {
                replicas: Some(1),
                ..DeploymentSpec::default()
            }),
            status: Some(DeploymentStatus {
                ready_replicas: Some(ready),
                ..DeploymentStatus::default()
            }),
            ..Deployment::default()
        };
        AppliedCachePool {
            agent: DaemonSet {
                status: Some(DaemonSetStatus {
                    number_ready: ready,
                    desired_number_scheduled: desired,
                    ..DaemonSetStatus::default()
                }),
                ..DaemonSet::default()
            },
            master: deployment(masters_ready),
            conductor: conductor.map(deployment),
        }
    }

    #[test]
    fn counts_capacity_and_endpoints_come_from_the_children() {
        let pool = valid(&roce());
        let s = status(&pool, &applied(2, 4, 1, Some(1)), &silent(), None, t(10));
        assert_eq!((s.nodes_ready, s.nodes_desired), (2, 4));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(s.dram.as_ref().map(|d| d.capacity.0.as_str()), Some("1Ti"));
        assert_eq!(s.ssd.as_ref().map(|d| d.capacity.0.as_str()), Some("6Ti"));
        assert_eq!(
            s.master_endpoint.as_deref(),
            Some("roce-master.llm.svc:50051")
        );
        assert_eq!(
            s.conductor_endpoint.as_deref(),
            Some("roce-conductor.llm.svc:8000")
        );
        let ready = find(&s.conditions, "Ready").expect("ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "ReplicasUnavailable")
        );
        assert_eq!(
            ready.message,
            "2/4 agents, 1/1 masters, 1/1 conductors ready"
        );
    }

    #[test]
    fn unchanged_inputs_give_an_equal_status_later() {
        let pool = valid(&tcp());
        let first = status(&pool, &applied(1, 1, 1, None), &silent(), None, t(10));
        let again = status(
            &pool,
            &applied(1, 1, 1, None),
            &silent(),
            Some(&first),
            t(99),
        );
        assert_eq!(first, again, "no timestamps that change every pass");
        assert!(kvpool_crd::conditions::is_true(&first.conditions, "Ready"));
        assert!(
            first.dram.is_none(),
            "percent-of-node capacity is not known to the operator"
        );
        assert!(first.conductor_endpoint.is_none());
    }

    #[test]
    fn no_matching_nodes_is_degraded() {
        let pool = valid(&tcp());
        let s = status(&pool, &applied(0, 0, 1, None), &silent(), None, t(1));
        assert_eq!(
            status_and_reason(&s.conditions, "Degraded"),
            Some(("True", "NoMatchingNodes"))
        );
    }

    #[test]
    fn usage_comes_from_the_master_and_survives_its_silence() {
        let pool = valid(&roce());
        let read = UsageReading::Read(PoolUsage {
            dram_used: 3 << 30,
            dram_capacity: 1 << 40,
            ssd_used: 5 << 30,
            ssd_capacity: 2 << 40,
            objects: 42,
            nodes_alive: 2,
            segments: 4,
            lookup_hits: 3,
            lookup_misses: 1,
            get_hits: 2,
            get_misses: 1,
            nodes: vec![crate::pool_usage::NodeUsage {
                node: "gpu-0".into(),
                dram_used: 3 << 30,
                dram_capacity: 1 << 40,
                get_hits: 2,
                ..Default::default()
            }],
            transport: Vec::new(),
        });
        let first = status(&pool, &applied(2, 2, 1, None), &read, None, t(10));
        let names: Vec<(&str, Option<&str>)> = first
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n.hit_ratio.as_deref()))
            .collect();
        assert_eq!(names, [("gpu-0", Some("0.667"))]);
        assert_eq!(first.nodes_omitted, None);
        assert_eq!(
            (first.hit_ratio.as_deref(), first.lookups),
            (Some("0.750"), Some(4))
        );
        let dram = first.dram.clone().expect("dram");
        assert_eq!(
            (dram.capacity.0.as_str(), dram.used.0.as_str()),
            ("1Ti", "3Gi")
        );
        let ssd = first.ssd.clone().expect("ssd");
        assert_eq!(
            (ssd.capacity.0.as_str(), ssd.used.0.as_str()),
            ("2Ti", "5Gi")
        );
        assert_eq!((first.objects, first.nodes_registered), (Some(42), Some(2)));
        assert_eq!(
            status_and_reason(&first.conditions, "MasterReachable"),
            Some(("True", "StatsRead"))
        );

        // The master goes silent: figures kept, condition flips with the address and category.
        let later = status(
            &pool,
            &applied(2, 2, 1, None),
            &silent(),
            Some(&first),
            t(20),
        );
        assert_eq!(
            later.dram.as_ref().map(|d| &d.used.0),
            Some(&"3Gi".to_owned())
        );
        assert_eq!(
            later.ssd.as_ref().map(|d| &d.used.0),
            Some(&"5Gi".to_owned())
        );
        assert_eq!(later.objects, Some(42));
        assert_eq!(later.nodes, first.nodes, "the per-node list is kept");
        assert_eq!(
            (later.hit_ratio.as_deref(), later.lookups),
            (Some("0.750"), Some(4))
        );
        let reachable = find(&later.conditions, "MasterReachable").expect("condition");
        assert_eq!(
            (reachable.status.as_str(), reachable.reason.as_str()),
            ("False", "MasterUnreachable")
        );
        assert!(reachable.message.contains("m:1") && reachable.message.contains("timeout"));
        // The other conditions did not move.
        assert_eq!(
            find(&first.conditions, "Ready"),
            find(&later.conditions, "Ready")
        );
    }

    #[test]
    fn percent_of_node_capacity_appears_once_the_master_reports_it() {
        let pool = valid(&tcp());
        let read = UsageReading::Read(PoolUsage {
            dram_used: 0,
            dram_capacity: 64 << 30,
            ..PoolUsage::default()
        });
        let s = status(&pool, &applied(1, 1, 1, None), &read, None, t(1));
        let dram = s.dram.expect("capacity known from the master");
        assert_eq!(
            (dram.capacity.0.as_str(), dram.used.0.as_str()),
            ("64Gi", "0")
        );
        // A master with no segments yet reports no capacity: nothing to show for a share.
        let empty = UsageReading::Read(PoolUsage::default());
        let s = status(&pool, &applied(1, 1, 1, None), &empty, None, t(1));
        assert!(s.dram.is_none());
    }

    fn node(name: &str, fallback: bool, devices: &[&str]) -> NodeTransport {
        NodeTransport {
            node: name.into(),
            rdma_requested: true,
            fallback,
            reason: if fallback {
                format!("{name}: peer does not serve RDMA")
            } else {
                String::new()
            },
            devices: devices.iter().map(|d| (*d).to_owned()).collect(),
        }
    }

    fn reading(nodes: Vec<NodeTransport>) -> UsageReading {
        UsageReading::Read(PoolUsage {
            transport: nodes,
            ..PoolUsage::default()
        })
    }

    #[test]
    fn transport_degraded_follows_the_requested_protocol() {
        let mixed = reading(vec![
            node("a", false, &["mlx5_0"]),
            node("b", true, &[]),
            node("c", true, &["mlx5_1"]),
        ]);
        // rdma: every fallback counts, named with its reason.
        let d = transport_condition(Protocol::Rdma, &mixed);
        assert_eq!((d.status_str(), d.reason), ("True", "RdmaFallback"));
        assert_eq!(
            d.message,
            "2 of 3 reporting nodes fell back from RDMA to TCP: b (b: peer does not serve RDMA), c (c: peer does not serve RDMA)"
        );
        // auto: a node without devices is expected on TCP; one with a NIC that fell back is not.
        let d = transport_condition(Protocol::Auto, &mixed);
        assert_eq!((d.status_str(), d.reason), ("True", "RdmaFallback"));
        assert!(
            d.message.starts_with("1 of 3") && d.message.contains("c ("),
            "{}",
            d.message
        );
        let d = transport_condition(
            Protocol::Auto,
            &reading(vec![node("a", false, &["mlx5_0"]), node("b", true, &[])]),
        );
        assert_eq!(
            (d.status_str(), d.reason),
            ("False", "TransportAsRequested")
        );
        assert_eq!(
            d.message,
            "1 of 2 reporting nodes move bytes over RDMA, none fell back"
        );
        // tcp: nothing to degrade.
        let d = transport_condition(Protocol::Tcp, &mixed);
        assert_eq!(
            (d.status_str(), d.message.as_str()),
            ("False", "the pool asked for TCP")
        );
        // No report yet, and a master that does not answer.
        let d = transport_condition(Protocol::Rdma, &reading(vec![]));
        assert_eq!(d.status_str(), "False");
        assert_eq!(d.message, "no agent has reported its transport yet");
        let d = transport_condition(Protocol::Rdma, &silent());
        assert_eq!((d.status_str(), d.reason), ("Unknown", "MasterUnreachable"));
        assert!(d.message.contains("m:1") && d.message.contains("timeout"));
    }

    #[test]
    fn transport_degraded_message_is_bounded() {
        let many: Vec<NodeTransport> = (0..40)
            .map(|i| NodeTransport {
                reason: "x".repeat(10_000),
                ..node(&format!("gpu-{i:02}"), true, &[])
            })
            .collect();
        let d = transport_condition(Protocol::Rdma, &reading(many));
        assert!(
            d.message.starts_with("40 of 40 reporting nodes"),
            "{}",
            d.message
        );
        assert!(d.message.ends_with("and 35 more"), "{}", d.message);
        assert!(d.message.len() < 2_000, "{} bytes", d.message.len());
    }

    #[test]
    fn transport_degraded_sits_next_to_master_reachable_in_the_status() {
        let pool = valid(&roce());
        let s = status(
            &pool,
            &applied(2, 2, 1, None),
            &reading(vec![node("gpu-1", true, &[])]),
            None,
            t(5),
        );
        assert_eq!(
            status_and_reason(&s.conditions, "TransportDegraded"),
            Some(("True", "RdmaFallback"))
        );
        let s = status(&pool, &applied(2, 2, 1, None), &silent(), Some(&s), t(6));
        let c = find(&s.conditions, "TransportDegraded").expect("condition");
        assert_eq!(c.status, "Unknown");
        assert_eq!(c.last_transition_time.0, t(6), "the status flipped");
        assert!(find(&s.conditions, "MasterReachable").is_some());
    }

    #[test]
    fn auth_key_rejected_follows_the_masters_answer_and_says_what_to_do() {
        let pool = valid(&roce());
        let rejected = UsageReading::Rejected {
            addr: "roce-master.llm.svc:50051".into(),
            message: "credential does not match its role's key for this method".into(),
        };
        let s = status(&pool, &applied(2, 2, 1, None), &rejected, None, t(5));
        let c = find(&s.conditions, "AuthKeyRejected").expect("condition");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "DerivedKeyRefused")
        );
        for needle in [
            "roce-master.llm.svc:50051",
            "does not match",
            "kubectl -n llm delete secret roce-auth",
            "kvpool.dev/auth-derivation: v1",
        ] {
            assert!(c.message.contains(needle), "{needle}: {}", c.message);
        }
        assert_eq!(
            status_and_reason(&s.conditions, "MasterReachable"),
            Some(("False", "DerivedKeyRefused"))
        );
        let td = find(&s.conditions, "TransportDegraded").expect("condition");
        assert_eq!(td.status, "Unknown");

        let s = status(&pool, &applied(2, 2, 1, None), &silent(), Some(&s), t(6));
        assert_eq!(
            status_and_reason(&s.conditions, "AuthKeyRejected"),
            Some(("Unknown", "MasterUnreachable"))
        );
        let s = status(
            &pool,
            &applied(2, 2, 1, None),
            &reading(vec![]),
            Some(&s),
            t(7),
        );
        assert_eq!(
            status_and_reason(&s.conditions, "AuthKeyRejected"),
            Some(("False", "DerivedKeyAccepted"))
        );
    }
}
