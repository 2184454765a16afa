//! Kubernetes-style conditions computed deterministically: the desired set of
//! (type, status, reason, message) is merged with the previous conditions so that
//! `lastTransitionTime` changes only when a condition's status flips. With the same inputs the
//! output is byte-for-byte the same, which is what lets the controllers skip unchanged status
//! writes. I/O boundary: none; the current time is passed in.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Condition type: the resource does its job.
pub const READY: &str = "Ready";
/// Condition type: children are being created or rolled out.
pub const PROGRESSING: &str = "Progressing";
/// Condition type: something is wrong that needs attention.
pub const DEGRADED: &str = "Degraded";

/// Reasons used in conditions and Events.
pub mod reason {
    pub const AVAILABLE: &str = "Available";
    pub const ROLLING_OUT: &str = "RollingOut";
    pub const RECONCILED: &str = "Reconciled";
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const KVCACHEPOOL_NOT_FOUND: &str = "KVCachePoolNotFound";
    pub const AS_EXPECTED: &str = "AsExpected";
    pub const NOT_ALL_READY: &str = "NotAllReady";
    pub const NO_NODES: &str = "NoMatchingNodes";
}

/// A condition as the controllers decide it, before timestamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Desired {
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status,
            reason,
            message: message.into(),
        }
    }
}

fn status_str(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// Merge `desired` with `previous`: keep each previous `lastTransitionTime` whose status did not
/// change, stamp `now` otherwise. The order of `desired` is the order of the output.
pub fn merge(
    previous: &[Condition],
    desired: &[Desired],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    desired
        .iter()
        .map(|d| {
            let status = status_str(d.status);
            let last_transition_time = previous
                .iter()
                .find(|p| p.type_ == d.type_ && p.status == status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or(Time(now));
            Condition {
                last_transition_time,
                message: d.message.clone(),
                observed_generation: generation,
                reason: d.reason.to_owned(),
                status: status.to_owned(),
                type_: d.type_.to_owned(),
            }
        })
        .collect()
}

/// The standard trio for a resource that is invalid: not ready, not progressing, degraded.
pub fn invalid(reason: &'static str, message: &str) -> Vec<Desired> {
    vec![
        Desired::new(READY, false, reason, message),
        Desired::new(PROGRESSING, false, reason, message),
        Desired::new(DEGRADED, true, reason, message),
    ]
}

/// The trio from ready/desired counts of the children.
pub fn from_counts(what: &str, ready: i32, desired: i32) -> Vec<Desired> {
    if desired > 0 && ready >= desired {
        let msg = format!("{ready}/{desired} {what} ready");
        vec![
            Desired::new(READY, true, reason::AVAILABLE, msg.clone()),
            Desired::new(PROGRESSING, false, reason::RECONCILED, msg.clone()),
            Desired::new(DEGRADED, false, reason::AS_EXPECTED, msg),
        ]
    } else if desired == 0 {
        let msg = format!("no {what} scheduled: no node matches the pool's node selector");
        vec![
            Desired::new(READY, false, reason::NO_NODES, msg.clone()),
            Desired::new(PROGRESSING, false, reason::NO_NODES, msg.clone()),
            Desired::new(DEGRADED, true, reason::NO_NODES, msg),
        ]
    } else {
        let msg = format!("{ready}/{desired} {what} ready");
        vec![
            Desired::new(READY, false, reason::NOT_ALL_READY, msg.clone()),
            Desired::new(PROGRESSING, true, reason::ROLLING_OUT, msg.clone()),
            Desired::new(DEGRADED, false, reason::AS_EXPECTED, msg),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("timestamp")
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let first = merge(&[], &from_counts("agents", 0, 2), Some(1), t(100));
        assert!(first.iter().all(|c| c.last_transition_time.0 == t(100)));

        // Same statuses later (counts changed, message too): times are kept.
        let again = merge(&first, &from_counts("agents", 1, 2), Some(1), t(200));
        assert!(again.iter().all(|c| c.last_transition_time.0 == t(100)));
        assert_eq!(again[0].message, "1/2 agents ready");

        // Ready flips to True and Progressing to False; Degraded stays False.
        let ready = merge(&again, &from_counts("agents", 2, 2), Some(2), t(300));
        assert_eq!(ready[0].status, "True");
        assert_eq!(ready[0].last_transition_time.0, t(300));
        assert_eq!(ready[1].last_transition_time.0, t(300));
        assert_eq!(ready[2].last_transition_time.0, t(100));
        assert!(ready.iter().all(|c| c.observed_generation == Some(2)));
    }

    #[test]
    fn same_inputs_give_identical_output() {
        let a = merge(
            &[],
            &invalid(reason::INVALID_SPEC, "spec.x: bad"),
            Some(3),
            t(5),
        );
        let b = merge(
            &a,
            &invalid(reason::INVALID_SPEC, "spec.x: bad"),
            Some(3),
            t(9),
        );
        assert_eq!(a, b);
        assert_eq!(a[2].type_, DEGRADED);
        assert_eq!(a[2].status, "True");
    }

    #[test]
    fn zero_desired_is_degraded_not_ready() {
        let c = from_counts("agents", 0, 0);
        assert!(!c[0].status);
        assert_eq!(c[0].reason, reason::NO_NODES);
        assert!(c[2].status);
    }
}
