//! Kubernetes-style conditions computed deterministically: the desired set of
//! (type, status, reason, message) is merged into the previous conditions with
//! `kvpool_crd::conditions::set_condition`, so `lastTransitionTime` changes only when a
//! condition's status flips and the list stays sorted by type. With the same inputs the output
//! is identical, which is what lets the controllers skip unchanged status writes.
//! I/O boundary: none; the current time is passed in.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
pub use kvpool_crd::conditions::{DEGRADED, PROGRESSING, READY};
use kvpool_crd::conditions::{
    FALSE, ObservedStatus, TRUE, UNKNOWN, condition_with_status, set_condition,
};

/// Reasons used in conditions and Events (shared ones come from `kvpool_crd::conditions`).
pub mod reason {
    pub use kvpool_crd::conditions::reasons::{
        AVAILABLE, INVALID_SPEC, KV_CACHE_POOL_NOT_FOUND as KVCACHEPOOL_NOT_FOUND, NO_NODES,
        REPLICAS_UNAVAILABLE as NOT_ALL_READY, ROLLING_OUT, UP_TO_DATE as RECONCILED,
    };
    /// Degraded=False: nothing is wrong.
    pub const AS_EXPECTED: &str = "AsExpected";
}

/// A condition as the controllers decide it, before timestamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub type_: &'static str,
    pub status: bool,
    /// Status `Unknown` (then `status` is ignored): the operator cannot tell.
    pub unknown: bool,
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
            unknown: false,
            reason,
            message: message.into(),
        }
    }

    /// A condition whose status is `Unknown`.
    pub fn unknown(type_: &'static str, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            unknown: true,
            ..Self::new(type_, false, reason, message)
        }
    }

    /// `True`, `False` or `Unknown`.
    pub fn status_str(&self) -> &'static str {
        match (self.unknown, self.status) {
            (true, _) => UNKNOWN,
            (false, true) => TRUE,
            (false, false) => FALSE,
        }
    }
}

/// Merge `desired` into `previous`: each previous `lastTransitionTime` whose status did not
/// change is kept, `now` is stamped otherwise; conditions of other types are dropped.
pub fn merge(
    previous: &[Condition],
    desired: &[Desired],
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let mut out: Vec<Condition> = previous
        .iter()
        .filter(|c| desired.iter().any(|d| d.type_ == c.type_))
        .cloned()
        .collect();
    out.sort_by(|a, b| a.type_.cmp(&b.type_));
    for d in desired {
        set_condition(
            &mut out,
            condition_with_status(
                d.type_,
                d.status_str(),
                d.reason,
                d.message.clone(),
                generation,
                Time(now),
            ),
        );
    }
    out
}

/// Add `extra` to `current` (conditions [`merge`] made without it), keeping the
/// `lastTransitionTime` it had in `previous` while its status holds.
pub fn add(
    current: &mut Vec<Condition>,
    previous: &[Condition],
    extra: &Desired,
    generation: Option<i64>,
    now: Timestamp,
) {
    if !current.iter().any(|c| c.type_ == extra.type_)
        && let Some(before) = previous.iter().find(|c| c.type_ == extra.type_)
    {
        current.push(before.clone());
        current.sort_by(|a, b| a.type_.cmp(&b.type_));
    }
    set_condition(
        current,
        condition_with_status(
            extra.type_,
            extra.status_str(),
            extra.reason,
            extra.message.clone(),
            generation,
            Time(now),
        ),
    );
}

/// Put `previous`'s condition of `type_` (if any) into `current` as it was: this pass could
/// not decide it.
pub fn keep(current: &mut Vec<Condition>, previous: &[Condition], type_: &str) {
    if let Some(before) = previous.iter().find(|c| c.type_ == type_)
        && !current.iter().any(|c| c.type_ == type_)
    {
        current.push(before.clone());
        current.sort_by(|a, b| a.type_.cmp(&b.type_));
    }
}

/// The condition of `type_` in `new` when it is True and says something else than in
/// `previous` (it became True, or its reason or message changed): what deserves a Warning
/// Event once, not on every pass.
pub fn newly_true<'a>(
    previous: &[Condition],
    new: &'a [Condition],
    type_: &str,
) -> Option<&'a Condition> {
    let now = find(new, type_).filter(|c| c.status == TRUE)?;
    let before = find(previous, type_);
    (before.map(|b| (&b.status, &b.reason, &b.message))
        != Some((&now.status, &now.reason, &now.message)))
    .then_some(now)
}

/// The trio for a resource that cannot be reconciled: not ready, not progressing, degraded.
pub fn invalid(reason: &'static str, message: &str) -> Vec<Desired> {
    vec![
        Desired::new(READY, false, reason, message),
        Desired::new(PROGRESSING, false, reason, message),
        Desired::new(DEGRADED, true, reason, message),
    ]
}

/// `previous` (or an empty status) with all three conditions saying `reason` and `message` at
/// `generation`; everything else is kept.
pub fn blocked<S: ObservedStatus>(
    previous: Option<&S>,
    generation: Option<i64>,
    reason: &'static str,
    message: &str,
    now: Timestamp,
) -> S {
    let mut status = previous.cloned().unwrap_or_default();
    let (conditions, observed_generation) = status.observed_mut();
    *conditions = merge(conditions, &invalid(reason, message), generation, now);
    *observed_generation = generation;
    status
}

/// The trio from ready/desired counts (`what` names the counted things).
pub fn from_counts(what: &str, ready: i32, desired: i32) -> Vec<Desired> {
    let msg = format!("{ready}/{desired} {what} ready");
    if desired == 0 {
        let msg = format!(
            "no {what} scheduled: no node matches the pool's node selector and tolerations"
        );
        vec![
            Desired::new(READY, false, reason::NO_NODES, msg.clone()),
            Desired::new(PROGRESSING, false, reason::NO_NODES, msg.clone()),
            Desired::new(DEGRADED, true, reason::NO_NODES, msg),
        ]
    } else {
        rollout(ready >= desired, msg)
    }
}

/// The trio of a resource whose children exist: ready and reconciled once `all_ready`, else
/// not ready and rolling out; never degraded. `message` goes into all three.
pub fn rollout(all_ready: bool, message: String) -> Vec<Desired> {
    if all_ready {
        vec![
            Desired::new(READY, true, reason::AVAILABLE, message.clone()),
            Desired::new(PROGRESSING, false, reason::RECONCILED, message.clone()),
            Desired::new(DEGRADED, false, reason::AS_EXPECTED, message),
        ]
    } else {
        vec![
            Desired::new(READY, false, reason::NOT_ALL_READY, message.clone()),
            Desired::new(PROGRESSING, true, reason::ROLLING_OUT, message.clone()),
            Desired::new(DEGRADED, false, reason::AS_EXPECTED, message),
        ]
    }
}

/// The condition of `type_` in `conditions` (tests and status readers).
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    kvpool_crd::conditions::find(conditions, type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("timestamp")
    }

    fn get<'a>(c: &'a [Condition], type_: &str) -> &'a Condition {
        find(c, type_).expect("condition present")
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let first = merge(&[], &from_counts("agents", 0, 2), Some(1), t(100));
        assert!(first.iter().all(|c| c.last_transition_time.0 == t(100)));
        let types: Vec<&str> = first.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, [DEGRADED, PROGRESSING, READY], "sorted by type");

        // Same statuses later (counts changed, message too): times are kept.
        let again = merge(&first, &from_counts("agents", 1, 2), Some(1), t(200));
        assert!(again.iter().all(|c| c.last_transition_time.0 == t(100)));
        assert_eq!(get(&again, READY).message, "1/2 agents ready");

        // Ready flips to True and Progressing to False; Degraded stays False.
        let ready = merge(&again, &from_counts("agents", 2, 2), Some(2), t(300));
        assert_eq!(get(&ready, READY).status, "True");
        assert_eq!(get(&ready, READY).last_transition_time.0, t(300));
        assert_eq!(get(&ready, PROGRESSING).last_transition_time.0, t(300));
        assert_eq!(get(&ready, DEGRADED).last_transition_time.0, t(100));
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
        assert_eq!(get(&a, DEGRADED).status, "True");
    }

    #[test]
    fn zero_desired_is_degraded_not_ready() {
        let c = from_counts("agents", 0, 0);
        assert!(!c[0].status);
        assert_eq!(c[0].reason, reason::NO_NODES);
        assert!(c[2].status);
    }

    #[test]
    fn conditions_of_other_types_are_dropped() {
        let mut foreign = merge(&[], &invalid(reason::INVALID_SPEC, "x"), None, t(1));
        foreign[0].type_ = "Foreign".to_owned();
        let out = merge(&foreign, &from_counts("agents", 1, 1), None, t(2));
        assert!(find(&out, "Foreign").is_none());
        assert_eq!(out.len(), 3);
    }

    /// A condition added after `merge` keeps its place in the sorted list and its transition
    /// time while its status holds; `newly_true` fires once per new True message.
    #[test]
    fn an_added_condition_is_sorted_and_keeps_its_time() {
        let extra =
            |status: bool, message: &str| Desired::new("ModelMismatch", status, "R", message);
        let mut first = merge(&[], &from_counts("agents", 1, 1), Some(1), t(1));
        add(&mut first, &[], &extra(true, "a"), Some(1), t(1));
        let types: Vec<&str> = first.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, [DEGRADED, "ModelMismatch", PROGRESSING, READY]);
        assert!(newly_true(&[], &first, "ModelMismatch").is_some());

        let mut again = merge(&first, &from_counts("agents", 1, 1), Some(1), t(5));
        add(&mut again, &first, &extra(true, "a"), Some(1), t(5));
        assert_eq!(again, first, "same inputs, same list");
        assert!(newly_true(&first, &again, "ModelMismatch").is_none());

        let mut changed = merge(&first, &from_counts("agents", 1, 1), Some(1), t(9));
        add(&mut changed, &first, &extra(true, "b"), Some(1), t(9));
        assert_eq!(get(&changed, "ModelMismatch").last_transition_time.0, t(1));
        assert!(
            newly_true(&first, &changed, "ModelMismatch").is_some(),
            "a new message"
        );

        let mut cleared = merge(&first, &from_counts("agents", 1, 1), Some(1), t(9));
        add(&mut cleared, &first, &extra(false, "ok"), Some(1), t(9));
        assert_eq!(get(&cleared, "ModelMismatch").last_transition_time.0, t(9));
        assert!(newly_true(&first, &cleared, "ModelMismatch").is_none());
    }
}
