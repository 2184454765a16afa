//! Condition types and reasons of the kvpool resources' status, and a pure helper that updates a
//! condition list the way Kubernetes expects (transition time kept while the status holds). No I/O.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Declares the status struct of a kvpool resource: the `conditions` and `observedGeneration`
/// every status starts with, then the fields given. One declaration keeps the common part of the
/// statuses (and of their schemas) alike.
macro_rules! status_struct {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $($fields:tt)*
        }
    ) => {
        $(#[$meta])*
        #[derive(
            ::kube::KubeSchema,
            ::serde::Serialize,
            ::serde::Deserialize,
            Clone,
            Debug,
            Default,
            PartialEq,
        )]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            /// `Ready`, `Progressing` and `Degraded` (see `crate::conditions`).
            #[serde(default, skip_serializing_if = "Vec::is_empty")]
            #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
            pub conditions: Vec<::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,

            /// The `metadata.generation` this status describes.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub observed_generation: Option<i64>,

            $($fields)*
        }

        impl $crate::conditions::ObservedStatus for $name {
            fn observed_mut(
                &mut self,
            ) -> (
                &mut Vec<::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
                &mut Option<i64>,
            ) {
                (&mut self.conditions, &mut self.observed_generation)
            }
        }
    };
}
pub(crate) use status_struct;

/// The part every kvpool status starts with (declared by `status_struct!`), so that code which
/// only sets conditions serves every kind.
pub trait ObservedStatus: Clone + Default {
    /// The conditions, and the `metadata.generation` they describe.
    fn observed_mut(&mut self) -> (&mut Vec<Condition>, &mut Option<i64>);
}

/// The resource does its job: the pool serves blocks / the engines serve requests.
pub const READY: &str = "Ready";
/// The operator is moving children towards the spec (rollout, scaling, first start).
pub const PROGRESSING: &str = "Progressing";
/// Something that worked is now failing, or part of the pool is unavailable.
pub const DEGRADED: &str = "Degraded";

/// A `KVCachePool`'s master answered the operator's usage query (`dram.used`, `ssd.used` and
/// `objects` are current); False keeps the last known figures.
pub const MASTER_REACHABLE: &str = "MasterReachable";

/// A `KVCachePool` that asked for RDMA has nodes whose transfer engine fell back to TCP (from
/// the transport state the agents report to the master); Unknown while the master does not
/// answer.
pub const TRANSPORT_DEGRADED: &str = "TransportDegraded";

/// A `KVCachePool`'s master refused the credential the operator derived for the pool (from its
/// root key): the pool's auth Secret holds a key the operator did not derive (made by hand, or
/// by an operator that generated random keys). Unknown while the master does not answer.
pub const AUTH_KEY_REJECTED: &str = "AuthKeyRejected";

/// A `PrefillPool`'s or `DecodePool`'s `spec.template` sets fields the operator owns (a
/// selector label, a volume or mount path it injects, the engine container's image, ...): the
/// engines run with the operator's values and the message names the template's fields.
pub const TEMPLATE_CONFLICT: &str = "TemplateConflict";

/// The engine pools sharing a `KVCachePool` cannot serve some model together: a model served
/// by prefill pools but by no decode pool (or the reverse), or pools of one model that disagree
/// on what the KV hand-off needs (the engines' disaggregation convention, the tensor parallel
/// size). Set on the KVCachePool and on each engine pool concerned; the message names the pools
/// and the model. Reported only: nothing is held back or deleted.
pub const MODEL_MISMATCH: &str = "ModelMismatch";

/// Condition statuses.
pub const TRUE: &str = "True";
/// Condition statuses.
pub const FALSE: &str = "False";
/// Condition statuses.
pub const UNKNOWN: &str = "Unknown";

/// Reasons (CamelCase, as Kubernetes requires).
pub mod reasons {
    /// All children exist and report ready.
    pub const AVAILABLE: &str = "Available";
    /// Children are being created or rolled out.
    pub const ROLLING_OUT: &str = "RollingOut";
    /// Children match the spec; nothing left to do.
    pub const UP_TO_DATE: &str = "UpToDate";
    /// Fewer ready replicas or nodes than desired.
    pub const REPLICAS_UNAVAILABLE: &str = "ReplicasUnavailable";
    /// No node matches the pool's node selector and tolerations.
    pub const NO_NODES: &str = "NoMatchingNodes";
    /// The spec fails a check the schema cannot express; the message names the field.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The `kvCachePoolRef` names a KVCachePool that does not exist in the namespace.
    pub const KV_CACHE_POOL_NOT_FOUND: &str = "KVCachePoolNotFound";
    /// The referenced KVCachePool exists but is not ready.
    pub const KV_CACHE_POOL_NOT_READY: &str = "KVCachePoolNotReady";
    /// Applying children to the API server failed (transient; retried with backoff).
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// Nothing observed yet.
    pub const PENDING: &str = "Pending";
    /// `Degraded=False`: nothing is wrong.
    pub const AS_EXPECTED: &str = "AsExpected";
    /// `MasterReachable=True`: the usage figures were read from the master on the last pass.
    pub const STATS_READ: &str = "StatsRead";
    /// `MasterReachable=False`: the master did not answer (not started yet, or down); the
    /// message names the address and the failure category.
    pub const MASTER_UNREACHABLE: &str = "MasterUnreachable";
    /// `TransportDegraded=True`: nodes fell back from RDMA to TCP; the message names them and
    /// the reason each agent reported.
    pub const RDMA_FALLBACK: &str = "RdmaFallback";
    /// `TransportDegraded=False`: every reporting node moves bytes as the pool asked (RDMA, or
    /// TCP where `tcp` was asked or `auto` found no device).
    pub const TRANSPORT_AS_REQUESTED: &str = "TransportAsRequested";
    /// `AuthKeyRejected=True` (and `MasterReachable=False`): the master refused the key the
    /// operator derived; the message says how to replace the pool's auth Secret.
    pub const DERIVED_KEY_REFUSED: &str = "DerivedKeyRefused";
    /// `AuthKeyRejected=False`: the master accepted the operator's derived key on the last pass.
    pub const DERIVED_KEY_ACCEPTED: &str = "DerivedKeyAccepted";
    /// `TemplateConflict=True`: fields of `spec.template` were overridden by the operator's own;
    /// the message names them.
    pub const OPERATOR_OWNED_FIELDS: &str = "OperatorOwnedFields";
    /// `TemplateConflict=False`: every field of `spec.template` (if any) reached the engine pods.
    pub const TEMPLATE_APPLIED: &str = "TemplateApplied";
    /// `ModelMismatch=True`: a model is served by prefill pools but by no decode pool.
    pub const NO_DECODE_POOL: &str = "NoDecodePool";
    /// `ModelMismatch=True`: a model is served by decode pools but by no prefill pool.
    pub const NO_PREFILL_POOL: &str = "NoPrefillPool";
    /// `ModelMismatch=True`: the pools serving one model speak different disaggregation
    /// conventions (`kvpool.dev/engine-protocol`: vllm, vllm-mooncake, sglang).
    pub const ENGINE_PROTOCOL_MISMATCH: &str = "EngineProtocolMismatch";
    /// `ModelMismatch=True`: the pools serving one model split it over different tensor
    /// parallel sizes, so their KV layout per rank differs.
    pub const TENSOR_PARALLEL_MISMATCH: &str = "TensorParallelMismatch";
    /// `ModelMismatch=False`: every model is served by prefill and decode pools that agree.
    pub const ENGINE_POOLS_MATCH: &str = "EnginePoolsMatch";

    /// Every reason above (docs/crds.md documents each).
    pub const ALL: &[&str] = &[
        AVAILABLE,
        ROLLING_OUT,
        UP_TO_DATE,
        REPLICAS_UNAVAILABLE,
        NO_NODES,
        INVALID_SPEC,
        KV_CACHE_POOL_NOT_FOUND,
        KV_CACHE_POOL_NOT_READY,
        APPLY_FAILED,
        PENDING,
        AS_EXPECTED,
        STATS_READ,
        MASTER_UNREACHABLE,
        RDMA_FALLBACK,
        TRANSPORT_AS_REQUESTED,
        DERIVED_KEY_REFUSED,
        DERIVED_KEY_ACCEPTED,
        OPERATOR_OWNED_FIELDS,
        TEMPLATE_APPLIED,
        NO_DECODE_POOL,
        NO_PREFILL_POOL,
        ENGINE_PROTOCOL_MISMATCH,
        TENSOR_PARALLEL_MISMATCH,
        ENGINE_POOLS_MATCH,
    ];
}

/// Sets the condition of `new.type_` in `conditions`, keeping its `lastTransitionTime` when its
/// status did not change, and returns whether anything changed. The list stays sorted by type
/// so that the status is deterministic.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(existing) => {
            let transition = if existing.status == new.status {
                existing.last_transition_time.clone()
            } else {
                new.last_transition_time.clone()
            };
            let updated = Condition {
                last_transition_time: transition,
                ..new
            };
            if *existing == updated {
                false
            } else {
                *existing = updated;
                true
            }
        }
        None => {
            conditions.push(new);
            conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
            true
        }
    }
}

/// Builds a condition.
pub fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) -> Condition {
    let status = if status { TRUE } else { FALSE };
    condition_with_status(type_, status, reason, message, observed_generation, now)
}

/// Builds a condition with status `status` ([`TRUE`], [`FALSE`] or [`UNKNOWN`]).
pub fn condition_with_status(
    type_: &str,
    status: &str,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    now: Time,
) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.into(),
        observed_generation,
        last_transition_time: now,
    }
}

/// The condition of the given type, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// The status and reason of the condition of the given type, if present.
pub fn status_and_reason<'a>(
    conditions: &'a [Condition],
    type_: &str,
) -> Option<(&'a str, &'a str)> {
    find(conditions, type_).map(|c| (c.status.as_str(), c.reason.as_str()))
}

/// Whether the condition of the given type is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == TRUE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("valid timestamp"))
    }

    #[test]
    fn same_status_keeps_transition_time_and_reports_message_changes() {
        let mut list = Vec::new();
        assert!(set_condition(
            &mut list,
            condition(READY, false, reasons::ROLLING_OUT, "0/2", Some(1), at(10))
        ));
        // same everything but the clock: no change
        assert!(!set_condition(
            &mut list,
            condition(READY, false, reasons::ROLLING_OUT, "0/2", Some(1), at(20))
        ));
        assert_eq!(list[0].last_transition_time, at(10));
        // new message, same status: change, time kept
        assert!(set_condition(
            &mut list,
            condition(READY, false, reasons::ROLLING_OUT, "1/2", Some(1), at(30))
        ));
        assert_eq!(list[0].last_transition_time, at(10));
        assert_eq!(list[0].message, "1/2");
        // status flips: time moves
        assert!(set_condition(
            &mut list,
            condition(READY, true, reasons::AVAILABLE, "2/2", Some(1), at(40))
        ));
        assert_eq!(list[0].last_transition_time, at(40));
        assert!(is_true(&list, READY));
    }

    #[test]
    fn list_is_sorted_by_type() {
        let mut list = Vec::new();
        for t in [READY, DEGRADED, PROGRESSING] {
            set_condition(
                &mut list,
                condition(t, false, reasons::PENDING, "", None, at(0)),
            );
        }
        let types: Vec<_> = list.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, [DEGRADED, PROGRESSING, READY]);
        assert!(!is_true(&list, READY));
        assert!(find(&list, "Other").is_none());
    }
}
