//! Autoscaling of an engine pool with `spec.autoscaling` (docs/operator.md, "Autoscaling";
//! docs/adr/0007-autoscaling-from-the-conductor.md): read the pool's role load from the
//! KVCachePool's conductor, take the signal's value against the pool's SLO, let the core's
//! [`Autoscaler`] decide the instance count, and describe the decision for the engine
//! Deployment's `replicas`, `status.autoscaling` and a `ScaledUp`/`ScaledDown` Event. The
//! pool's own `spec.replicas` is never written (it stays the GitOps-owned starting count).
//! I/O boundary: the conductor read ([`read_value`]) and the Event ([`publish`]); the rest is
//! pure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::{Event, EventType};
use kvpool_core::autoscale::{Autoscaler, Behavior, Bounds, Decision, Signal, Why};
use kvpool_crd::{AutoscalingConfig, AutoscalingSignal, EngineAutoscalingStatus, Role};
use kvpool_runtime::telemetry::chain;
use tracing::warn;

use super::validate::ValidEnginePool;
use crate::context::Context;
use crate::contract;
use crate::engine_kind::EnginePool;
use crate::error::{Error, Result};
use crate::labels::{self, Component};

/// Event reason of a scale-up.
pub const SCALED_UP: &str = "ScaledUp";
/// Event reason of a scale-down.
pub const SCALED_DOWN: &str = "ScaledDown";
/// `status.autoscaling.reason` before the first change.
pub const INITIAL: &str = "Initial";

/// The core's name of a CRD signal.
pub fn signal(s: AutoscalingSignal) -> Signal {
    match s {
        AutoscalingSignal::SloAttainment => Signal::SloAttainment,
        AutoscalingSignal::QueueDepth => Signal::QueueDepth,
        AutoscalingSignal::PredictedLatency => Signal::PredictedLatency,
        AutoscalingSignal::RejectionRate => Signal::RejectionRate,
    }
}

/// One pass's decision, ready to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct Scaling {
    /// The engine Deployment's replicas.
    pub desired: u32,
    /// The count before this pass.
    pub current: u32,
    pub status: EngineAutoscalingStatus,
    /// `(reason, message)` of the Event to publish once the Deployment is applied.
    pub event: Option<(&'static str, String)>,
}

/// `host:port` of the conductor API of the KVCachePool `p` uses, if it runs one.
pub fn conductor_addr(p: &ValidEnginePool) -> Option<String> {
    p.pool.effective.conductor.as_ref().map(|_| {
        format!(
            "{}.{}.svc:{}",
            labels::child_name(&p.pool.name, Component::Conductor),
            p.pool.namespace,
            contract::CONDUCTOR_PORT
        )
    })
}

/// The pool's SLO in seconds (TTFT for prefill, TPOT for decode).
fn slo_s(p: &ValidEnginePool) -> f64 {
    f64::from(p.effective.slo_millis) / 1000.0
}

fn slo_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "TTFT",
        Role::Decode => "TPOT",
    }
}

/// The signal's value and how the Event states it.
pub fn describe(p: &ValidEnginePool, s: Signal, value: f64, b: &Behavior) -> String {
    let slo = format!(
        "{} SLO {}",
        slo_name(p.effective.role),
        humantime::format_duration(p.effective.slo())
    );
    match s {
        Signal::PredictedLatency => format!(
            "predictedLatency {value:.2}: predicted {} p90 is {value:.2} x the {slo} (target {})",
            slo_name(p.effective.role),
            b.latency_target_ratio
        ),
        Signal::QueueDepth => format!(
            "queueDepth {value:.2}: requests waiting per instance (target {}; {slo})",
            b.queue_target_per_instance
        ),
        Signal::RejectionRate => format!(
            "rejectionRate {value:.3}: {:.1} % of requests rejected (target {} %; {slo})",
            value * 100.0,
            b.rejection_target * 100.0
        ),
        Signal::SloAttainment => format!(
            "sloAttainment {value:.3}: {:.1} % of requests admitted within the {slo} (target {} %)",
            value * 100.0,
            b.attainment_target * 100.0
        ),
    }
}

/// The count running before this pass: the last decision in status, else `spec.replicas`.
pub fn current(p: &ValidEnginePool, previous: Option<&EngineAutoscalingStatus>) -> u32 {
    previous
        .and_then(|a| u32::try_from(a.desired_replicas).ok())
        .unwrap_or(p.effective.replicas)
}

/// What one pass observed and decided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observed {
    /// The count before this pass.
    pub current: u32,
    /// The signal's value (`None`: no answer).
    pub value: Option<f64>,
    pub decision: Decision,
}

/// Pure: the scaling of this pass from the decision.
pub fn scaling(
    p: &ValidEnginePool,
    cfg: AutoscalingConfig,
    previous: Option<&EngineAutoscalingStatus>,
    seen: Observed,
    b: &Behavior,
    now: Timestamp,
) -> Scaling {
    let Observed {
        current,
        value,
        decision,
    } = seen;
    let s = signal(cfg.signal);
    let desired = decision.desired;
    let changed = desired != current;
    let to_i32 = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    let (status, event) = if changed {
        let reason = if desired > current {
            SCALED_UP
        } else {
            SCALED_DOWN
        };
        let why = match (decision.why, value) {
            (Why::Bounds, _) => format!(
                "outside autoscaling bounds {}..{}",
                cfg.min_replicas, cfg.max_replicas
            ),
            (_, Some(v)) => describe(p, s, v, b),
            (_, None) => "no signal".to_owned(),
        };
        let message = format!(
            "{} scaled from {current} to {desired} instances: {why}",
            p.kind
        );
        (
            EngineAutoscalingStatus {
                desired_replicas: to_i32(desired),
                last_scale_time: Some(Time(now)),
                signal: cfg.signal,
                value: value.map(|v| format!("{v:.3}")),
                reason: if decision.why == Why::Bounds {
                    "Bounds".to_owned()
                } else {
                    reason.to_owned()
                },
            },
            Some((reason, message)),
        )
    } else {
        // Unchanged: status stays as it was (deterministic; no write).
        let status = match previous {
            Some(prev) if prev.signal == cfg.signal => EngineAutoscalingStatus {
                desired_replicas: to_i32(desired),
                ..prev.clone()
            },
            _ => EngineAutoscalingStatus {
                desired_replicas: to_i32(desired),
                last_scale_time: previous.and_then(|a| a.last_scale_time.clone()),
                signal: cfg.signal,
                value: None,
                reason: INITIAL.to_owned(),
            },
        };
        (status, None)
    };
    Scaling {
        desired,
        current,
        status,
        event,
    }
}

/// Read the pool's signal from its conductor: `None` when there is no conductor or it did not
/// answer (logged; the count then holds).
pub async fn read_value(
    ctx: &Context,
    p: &ValidEnginePool,
    s: Signal,
    current: u32,
) -> Option<f64> {
    let addr = ctx.conductor_addr(conductor_addr(p)?);
    match ctx.conductor_load.load(&addr).await {
        Ok(report) => {
            let mut load = match p.effective.role {
                Role::Prefill => report.prefill,
                Role::Decode => report.decode,
            };
            // Several conductor replicas each see their share of the queue; the Service
            // answered from one of them.
            let replicas = p
                .pool
                .effective
                .conductor
                .as_ref()
                .map_or(1, |c| u64::from(c.replicas.max(1)));
            load.queue_depth = load.queue_depth.saturating_mul(replicas);
            Some(load.signal_value(s, slo_s(p), current))
        }
        Err(e) => {
            warn!(engine_pool = %p.name, conductor = %addr, error = %chain(&e), category = e.category(), "cannot read the conductor's load; keeping the instance count");
            None
        }
    }
}

/// Seconds of `t` since the epoch (the autoscaler's time scale).
fn seconds(t: Timestamp) -> f64 {
    t.as_millisecond() as f64 / 1000.0
}

/// The key of a pool's decision state in `Context::autoscalers`.
pub fn state_key(kind: &str, namespace: &str, name: &str) -> String {
    format!("{kind}/{namespace}/{name}")
}

/// Forget a pool's decision state (autoscaling turned off, or the pool is going away).
pub fn forget(ctx: &Context, key: &str) {
    ctx.autoscalers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(key);
}

/// The whole step for one pass: read, decide, describe.
pub async fn step<K: EnginePool>(
    ctx: &Context,
    obj: &K,
    p: &ValidEnginePool,
    cfg: AutoscalingConfig,
) -> Scaling {
    let previous = obj.engine_status().and_then(|s| s.autoscaling.as_ref());
    let current = current(p, previous);
    let s = signal(cfg.signal);
    let value = read_value(ctx, p, s, current).await;
    let now = ctx.now();
    let key = state_key(p.kind, &p.namespace, &p.name);
    let (decision, b) = {
        let mut all = ctx.autoscalers.lock().unwrap_or_else(|e| e.into_inner());
        let a = all
            .entry(key)
            .or_insert_with(|| Autoscaler::new(Behavior::default()));
        if let Some(t) = previous.and_then(|a| a.last_scale_time.as_ref()) {
            a.remember_change(seconds(t.0));
        }
        let bounds = Bounds::new(cfg.min_replicas, cfg.max_replicas);
        (
            a.decide(seconds(now), s, value, current, bounds),
            *a.behavior(),
        )
    };
    let seen = Observed {
        current,
        value,
        decision,
    };
    scaling(p, cfg, previous, seen, &b, now)
}

/// Publish the Event of a change on `obj`.
pub async fn publish<K: EnginePool>(
    ctx: &Context,
    obj: &K,
    reason: &'static str,
    message: &str,
) -> Result<()> {
    ctx.recorder
        .publish(
            &Event {
                type_: EventType::Normal,
                reason: reason.to_owned(),
                note: Some(message.chars().take(1000).collect()),
                action: "Scale".to_owned(),
                secondary: None,
            },
            &obj.object_ref(&()),
        )
        .await
        .map_err(|source| Error::PublishEvent { reason, source })?;
    tracing::info!(engine_pool = %obj.name_any(), reason, %message, "autoscaled");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::enginepool::validate;
    use crate::test_fixtures::{roce, valid};
    use kvpool_crd::PrefillPool;

    fn prefill() -> ValidEnginePool {
        let pool = valid(&roce());
        let obj: PrefillPool = serde_saphyr::from_str(
            "apiVersion: kvpool.dev/v1alpha1\nkind: PrefillPool\nmetadata: {name: p, namespace: llm, uid: u1, generation: 1}\nspec:\n  kvCachePoolRef: {name: roce}\n  replicas: 2\n  engine: {kind: custom, image: i}\n  resources: {gpus: 0}\n  slo: {ttftMillis: 2000}\n  autoscaling: {minReplicas: 1, maxReplicas: 8, signal: predictedLatency}\n",
        )
        .expect("yaml");
        validate::validate(&obj, pool).expect("valid")
    }

    #[test]
    fn a_change_is_described_with_the_value_and_the_slo() {
        let p = prefill();
        let cfg = p.effective.autoscaling.expect("autoscaling");
        let b = Behavior::default();
        let now = Timestamp::from_second(1_000).expect("time");
        let d = Decision {
            desired: 4,
            recommended: 4,
            why: Why::ScaledUp,
        };
        let seen = |current, value, decision| Observed {
            current,
            value,
            decision,
        };
        let s = scaling(&p, cfg, None, seen(2, Some(1.6), d), &b, now);
        assert_eq!(s.status.desired_replicas, 4);
        assert_eq!(s.status.reason, SCALED_UP);
        assert_eq!(s.status.value.as_deref(), Some("1.600"));
        let (reason, message) = s.event.expect("event");
        assert_eq!(reason, SCALED_UP);
        assert!(message.contains("from 2 to 4"), "{message}");
        assert!(message.contains("1.60 x the TTFT SLO 2s"), "{message}");
        // Nothing changed: status as before, no Event.
        let held = Decision {
            desired: 4,
            recommended: 4,
            why: Why::Stable,
        };
        let again = scaling(&p, cfg, Some(&s.status), seen(4, Some(0.8), held), &b, now);
        assert_eq!(again.status, s.status);
        assert_eq!(again.event, None);
        // A first pass without a change reports the starting count.
        let none = Decision {
            desired: 2,
            recommended: 2,
            why: Why::NoSignal,
        };
        let first = scaling(&p, cfg, None, seen(2, None, none), &b, now);
        assert_eq!(first.status.reason, INITIAL);
        assert_eq!(first.status.desired_replicas, 2);
        assert_eq!(current(&p, Some(&s.status)), 4);
        assert_eq!(current(&p, None), 2);
        assert_eq!(
            conductor_addr(&p).as_deref(),
            Some("roce-conductor.llm.svc:8000")
        );
    }
}
