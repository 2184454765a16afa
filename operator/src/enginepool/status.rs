//! Status of an engine pool from its Deployment as the API server returned it, or the reason it
//! could not be reconciled (missing or invalid KVCachePool, invalid spec). Deterministic.
//! I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kvpool_crd::EnginePoolStatus;

use super::build;
use super::validate::ValidEnginePool;
use crate::conditions::{self, Desired, reason};
use crate::contract;

/// Reason: the referenced KVCachePool exists but is invalid.
pub const KVCACHEPOOL_INVALID: &str = "KVCachePoolInvalid";
/// Reason: zero replicas requested.
pub const SCALED_TO_ZERO: &str = "ScaledToZero";

/// Desired conditions from the engine Deployment's counts.
pub fn desired_conditions(ready: i32, desired: i32) -> Vec<Desired> {
    let msg = format!("{ready}/{desired} engines ready");
    if desired == 0 {
        let msg = "scaled to zero replicas";
        vec![
            Desired::new(conditions::READY, false, SCALED_TO_ZERO, msg),
            Desired::new(conditions::PROGRESSING, false, SCALED_TO_ZERO, msg),
            Desired::new(conditions::DEGRADED, false, reason::AS_EXPECTED, msg),
        ]
    } else {
        conditions::rollout(ready >= desired, msg)
    }
}

/// Status after a successful apply.
pub fn status(
    p: &ValidEnginePool,
    applied: &Deployment,
    previous: Option<&EnginePoolStatus>,
    now: Timestamp,
) -> EnginePoolStatus {
    let desired = applied.spec.as_ref().and_then(|s| s.replicas).unwrap_or(0);
    let st = applied.status.as_ref();
    let replicas = st.and_then(|s| s.replicas).unwrap_or(0);
    let ready = st.and_then(|s| s.ready_replicas).unwrap_or(0);
    EnginePoolStatus {
        conditions: conditions::merge(
            previous.map(|s| s.conditions.as_slice()).unwrap_or(&[]),
            &desired_conditions(ready, desired),
            p.generation,
            now,
        ),
        observed_generation: p.generation,
        replicas,
        ready_replicas: ready,
        selector: Some(build::selector_string(p)),
        endpoints: vec![format!(
            "{}.{}.svc:{}",
            build::child_name(p),
            p.namespace,
            contract::ENGINE_PORT
        )],
        // Set by the reconcile from the autoscaling step (absent without spec.autoscaling).
        autoscaling: None,
    }
}

/// Status of a pool that cannot be reconciled now: `reason` and `message` in all three
/// conditions, counts kept from before.
pub fn blocked_status(
    previous: Option<&EnginePoolStatus>,
    generation: Option<i64>,
    why: &'static str,
    message: &str,
    now: Timestamp,
) -> EnginePoolStatus {
    conditions::blocked(previous, generation, why, message, now)
}
