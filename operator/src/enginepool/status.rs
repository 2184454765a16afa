//! Status of an engine pool from its Deployment as the API server returned it and the fields of
//! its `spec.template` the operator overrode (`TemplateConflict`), or the reason it could not be
//! reconciled (missing or invalid KVCachePool, invalid spec). Deterministic.
//! I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;
use kvpool_crd::EnginePoolStatus;
use kvpool_crd::conditions::{TEMPLATE_CONFLICT, reasons};

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

/// Conflicts named in the `TemplateConflict` message at most; the rest are counted.
const MAX_NAMED_CONFLICTS: usize = 8;

/// The `TemplateConflict` condition: True naming the template's fields that the operator's
/// values overrode (`conflicts`, from the build), False when there are none.
pub fn template_condition(conflicts: &[String]) -> Desired {
    if conflicts.is_empty() {
        return Desired::new(
            TEMPLATE_CONFLICT,
            false,
            reasons::TEMPLATE_APPLIED,
            "spec.template (if any) merged without touching a field the operator owns",
        );
    }
    let mut named = conflicts[..conflicts.len().min(MAX_NAMED_CONFLICTS)].join(", ");
    if conflicts.len() > MAX_NAMED_CONFLICTS {
        named.push_str(&format!(
            " and {} more",
            conflicts.len() - MAX_NAMED_CONFLICTS
        ));
    }
    Desired::new(
        TEMPLATE_CONFLICT,
        true,
        reasons::OPERATOR_OWNED_FIELDS,
        format!(
            "the operator's own values were kept instead of {named} (docs/crds.md, \"Engine pod template\")"
        ),
    )
}

/// The message of `new`'s `TemplateConflict` condition when it is True and says something
/// else than `previous`'s did (the conflicts are new or changed); `None` otherwise.
pub fn new_template_conflict(
    previous: Option<&EnginePoolStatus>,
    new: &EnginePoolStatus,
) -> Option<String> {
    let now = conditions::find(&new.conditions, TEMPLATE_CONFLICT)?;
    let before = previous.and_then(|p| conditions::find(&p.conditions, TEMPLATE_CONFLICT));
    (now.status == "True"
        && before.map(|b| (&b.status, &b.message)) != Some((&now.status, &now.message)))
    .then(|| now.message.clone())
}

/// Status after a successful apply; `template_conflicts` are the fields of `spec.template` the
/// operator overrode.
pub fn status(
    p: &ValidEnginePool,
    applied: &Deployment,
    template_conflicts: &[String],
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
            &[
                desired_conditions(ready, desired),
                vec![template_condition(template_conflicts)],
            ]
            .concat(),
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
