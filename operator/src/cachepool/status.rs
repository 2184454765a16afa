//! Status of a `KVCachePool`, computed from what the apply step got back from the API server
//! (DaemonSet and Deployment status) and the previous status. Deterministic: the same inputs give
//! the same status, so an unchanged pool is never re-patched. I/O boundary: none.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::jiff::Timestamp;
use kvpool::crd::{KVCachePoolStatus, TierStatus};

use super::validate::ValidCachePool;
use crate::conditions::{self, Desired};
use crate::contract;
use crate::labels::{self, Component};
use kvpool::crd::DramCapacity;
use kvpool::crd::quantity::format_bytes;

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
    if all_ready {
        vec![
            Desired::new(
                conditions::READY,
                true,
                conditions::reason::AVAILABLE,
                format!("{summary} ready"),
            ),
            Desired::new(
                conditions::PROGRESSING,
                false,
                conditions::reason::RECONCILED,
                format!("{summary} ready"),
            ),
            Desired::new(
                conditions::DEGRADED,
                false,
                conditions::reason::AS_EXPECTED,
                format!("{summary} ready"),
            ),
        ]
    } else {
        vec![
            Desired::new(
                conditions::READY,
                false,
                conditions::reason::NOT_ALL_READY,
                format!("{summary} ready"),
            ),
            Desired::new(
                conditions::PROGRESSING,
                true,
                conditions::reason::ROLLING_OUT,
                format!("{summary} ready"),
            ),
            Desired::new(
                conditions::DEGRADED,
                false,
                conditions::reason::AS_EXPECTED,
                format!("{summary} ready"),
            ),
        ]
    }
}

/// The status of a reconciled pool. `previous` keeps condition transition times stable.
pub fn status(
    pool: &ValidCachePool,
    applied: &AppliedCachePool,
    previous: Option<&KVCachePoolStatus>,
    now: Timestamp,
) -> KVCachePoolStatus {
    let (nodes_ready, nodes_desired) = daemonset_counts(&applied.agent);
    let previous_conditions = previous.map(|p| p.conditions.as_slice()).unwrap_or(&[]);
    let ready_nodes = u64::try_from(nodes_ready).unwrap_or(0);
    // Capacity is known when it is an explicit amount per node; usage is reported by the master
    // (not by the operator), so the operator keeps whatever value is there.
    let dram = match pool.effective.dram.capacity {
        DramCapacity::Bytes(b) => Some(TierStatus {
            capacity: format_bytes(b.saturating_mul(ready_nodes)),
            used: previous
                .and_then(|p| p.dram.as_ref())
                .map(|t| t.used.clone())
                .unwrap_or_else(|| format_bytes(0)),
        }),
        DramCapacity::NodeMemoryPercent(_) => previous.and_then(|p| p.dram.clone()),
    };
    let ssd = pool.effective.ssd.as_ref().map(|s| TierStatus {
        capacity: format_bytes(s.capacity_bytes.saturating_mul(ready_nodes)),
        used: previous
            .and_then(|p| p.ssd.as_ref())
            .map(|t| t.used.clone())
            .unwrap_or_else(|| format_bytes(0)),
    });
    KVCachePoolStatus {
        conditions: conditions::merge(
            previous_conditions,
            &desired_conditions(applied),
            pool.generation,
            now,
        ),
        observed_generation: pool.generation,
        nodes_desired,
        nodes_ready,
        dram,
        ssd,
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
    let mut status = previous.cloned().unwrap_or_default();
    status.conditions = conditions::merge(
        &status.conditions,
        &conditions::invalid(conditions::reason::INVALID_SPEC, message),
        generation,
        now,
    );
    status.observed_generation = generation;
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::find;
    use crate::test_fixtures::{roce, tcp, valid};
    use k8s_openapi::api::apps::v1::{DaemonSetStatus, DeploymentSpec, DeploymentStatus};

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
        let s = status(&pool, &applied(2, 4, 1, Some(1)), None, t(10));
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
        let first = status(&pool, &applied(1, 1, 1, None), None, t(10));
        let again = status(&pool, &applied(1, 1, 1, None), Some(&first), t(99));
        assert_eq!(first, again, "no timestamps that change every pass");
        assert!(kvpool::crd::conditions::is_true(&first.conditions, "Ready"));
        assert!(
            first.dram.is_none(),
            "percent-of-node capacity is not known to the operator"
        );
        assert!(first.conductor_endpoint.is_none());
    }

    #[test]
    fn no_matching_nodes_is_degraded() {
        let pool = valid(&tcp());
        let s = status(&pool, &applied(0, 0, 1, None), None, t(1));
        let degraded = find(&s.conditions, "Degraded").expect("degraded");
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "NoMatchingNodes")
        );
    }
}
