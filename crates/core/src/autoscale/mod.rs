//! SLO-driven autoscaling, pure: the replica count an engine pool should have from one load
//! signal (the conductor's predicted latency against the SLO, queue depth, rejection rate or
//! SLO attainment), with a scale-up and a longer scale-down stabilization window, step limits,
//! a cool-down after every change, and the pool's min/max bounds ([`Autoscaler`]); and the
//! sliding window of per-request figures the conductor and the simulator compute the signal
//! from ([`LoadWindow`], in `window`). The operator and `kvpool simulate --autoscale` run the
//! same code. Time is passed in (seconds on any monotonic scale). I/O boundary: none.

mod report;
mod window;

use std::collections::VecDeque;

pub use report::{LoadReport, RoleLoad};
pub use window::{LoadFigures, LoadWindow};

/// What drives the replica count (the CRD's `spec.autoscaling.signal`).
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Signal {
    /// Share of arrivals admitted with a predicted latency within the SLO (0..=1; higher is
    /// better). Scales up when the missed share exceeds `1 - attainment_target`.
    SloAttainment,
    /// Requests waiting per instance (prefill: booked and not yet prefilled; decode: prefilled
    /// and not yet decoding). Proportional, like an HPA `AverageValue` target.
    QueueDepth,
    /// The p90 of the predicted TTFT (prefill) or TPOT (decode) over the window, divided by the
    /// pool's SLO. Proportional: keeps the ratio at `latency_target_ratio`.
    PredictedLatency,
    /// Share of arrivals the conductor rejected for this role (0..=1; lower is better).
    RejectionRate,
}

impl Signal {
    /// Name as the CRD spells it.
    pub fn name(self) -> &'static str {
        match self {
            Signal::SloAttainment => "sloAttainment",
            Signal::QueueDepth => "queueDepth",
            Signal::PredictedLatency => "predictedLatency",
            Signal::RejectionRate => "rejectionRate",
        }
    }
}

/// Tuning of the decision. [`Behavior::default`] is what the operator uses (docs/operator.md,
/// "Autoscaling"); every field is in the signal's unit or in seconds.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Behavior {
    /// `PredictedLatency`: keep predicted p90 / SLO at this ratio.
    pub latency_target_ratio: f64,
    /// `QueueDepth`: waiting requests per instance to aim for.
    pub queue_target_per_instance: f64,
    /// `RejectionRate`: rejected share above which the pool scales up.
    pub rejection_target: f64,
    /// `SloAttainment`: attained share below which the pool scales up.
    pub attainment_target: f64,
    /// Ratios within `1 ± tolerance` of the target change nothing.
    pub tolerance: f64,
    /// A scale-up happens only to the lowest recommendation of this window (so a spike must
    /// last this long).
    pub up_window_s: f64,
    /// A scale-down happens only to the highest recommendation of this window.
    pub down_window_s: f64,
    /// No change within this long after the previous change (either direction).
    pub cooldown_s: f64,
    /// One scale-up adds at most `max(up_step_instances, current * up_step_ratio)`.
    pub up_step_instances: u32,
    pub up_step_ratio: f64,
    /// One scale-down removes at most `max(1, current * down_step_ratio)`.
    pub down_step_ratio: f64,
}

impl Default for Behavior {
    fn default() -> Self {
        Self {
            latency_target_ratio: 0.5,
            queue_target_per_instance: 1.0,
            rejection_target: 0.01,
            attainment_target: 0.99,
            tolerance: 0.1,
            up_window_s: 30.0,
            down_window_s: 300.0,
            cooldown_s: 60.0,
            up_step_instances: 4,
            up_step_ratio: 1.0,
            down_step_ratio: 0.25,
        }
    }
}

/// Replica bounds (`minReplicas`, `maxReplicas`); `min <= max` is the caller's invariant
/// (the CRD's CEL rule), [`Bounds::new`] orders them anyway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
}

impl Bounds {
    pub fn new(a: u32, b: u32) -> Self {
        Self {
            min: a.min(b),
            max: a.max(b),
        }
    }

    pub fn clamp(self, n: u32) -> u32 {
        n.clamp(self.min, self.max)
    }
}

/// Why the decision is what it is (for the operator's Event and status, and the simulator).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "camelCase")]
pub enum Why {
    /// No signal value (the conductor did not answer, or saw no requests): nothing changes.
    NoSignal,
    /// The signal is within the tolerance of its target, or the window's recommendations
    /// disagree (some want more, some fewer): nothing changes.
    Stable,
    /// Inside the cool-down after the previous change.
    CoolingDown,
    /// The current count lies outside min/max (the bounds changed): moved to the bound.
    Bounds,
    ScaledUp,
    ScaledDown,
}

impl Why {
    pub fn name(self) -> &'static str {
        self.into()
    }
}

/// One decision: the replica count to run and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub desired: u32,
    /// What this observation alone recommends (before windows, steps and cool-down).
    pub recommended: u32,
    pub why: Why,
}

/// The proportional recommendation for one signal value, ignoring windows and bounds.
/// `value` is in the signal's unit (see [`Signal`]); `current` is the count running now.
pub fn recommend(signal: Signal, value: f64, current: u32, b: &Behavior) -> u32 {
    if !value.is_finite() || value < 0.0 {
        return current;
    }
    // Scaled to zero: any load at all asks for one instance, and the next pass scales on.
    let base = f64::from(current.max(1));
    let proportional = |ratio: f64| -> u32 {
        if (ratio - 1.0).abs() <= b.tolerance {
            current
        } else {
            let want = (base * ratio).ceil();
            if want >= f64::from(u32::MAX) {
                u32::MAX
            } else {
                want.max(0.0) as u32
            }
        }
    };
    match signal {
        Signal::PredictedLatency => proportional(value / b.latency_target_ratio),
        Signal::QueueDepth => {
            if current == 0 {
                return u32::from(value > 0.0);
            }
            proportional(value / b.queue_target_per_instance)
        }
        // Shares cannot say how much capacity is spare: above the target the pool grows by
        // the share missed (served share scales with capacity); at or below a quarter of the
        // target it gives back one instance; in between it holds.
        Signal::RejectionRate | Signal::SloAttainment => {
            let (missed, target) = match signal {
                Signal::SloAttainment => (1.0 - value.min(1.0), 1.0 - b.attainment_target),
                _ => (value.min(1.0), b.rejection_target),
            };
            if missed > target {
                let served = (1.0 - missed).max(0.05);
                let want = (base / served).ceil() as u32;
                want.max(current.saturating_add(1))
            } else if missed <= target / 4.0 {
                current.saturating_sub(1)
            } else {
                current
            }
        }
    }
}

/// The decision state of one pool: recent recommendations (for the windows) and the time of
/// the last change (for the cool-down). The operator keeps one per pool in memory and seeds
/// `last_change_s` from `status.autoscaling.lastScaleTime` after a restart.
#[derive(Clone, Debug, Default)]
pub struct Autoscaler {
    behavior: Behavior,
    /// `(time, recommendation)`, oldest first, no older than the longer window.
    recommendations: VecDeque<(f64, u32)>,
    last_change_s: Option<f64>,
}

impl Autoscaler {
    pub fn new(behavior: Behavior) -> Self {
        Self {
            behavior,
            recommendations: VecDeque::new(),
            last_change_s: None,
        }
    }

    pub fn behavior(&self) -> &Behavior {
        &self.behavior
    }

    /// When the count last changed, if known.
    pub fn last_change_s(&self) -> Option<f64> {
        self.last_change_s
    }

    /// Seed the time of the last change (from status, after a restart); a later one wins.
    pub fn remember_change(&mut self, at_s: f64) {
        if at_s.is_finite() && self.last_change_s.is_none_or(|t| t < at_s) {
            self.last_change_s = Some(at_s);
        }
    }

    /// Decide the count at `now_s` for a pool running `current` instances, from `value` of
    /// `signal` (`None`: no figure this time). The result always lies within `bounds`; it
    /// differs from `current` inside the cool-down only to re-enter the bounds.
    pub fn decide(
        &mut self,
        now_s: f64,
        signal: Signal,
        value: Option<f64>,
        current: u32,
        bounds: Bounds,
    ) -> Decision {
        let b = self.behavior;
        let horizon = b.up_window_s.max(b.down_window_s);
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| now_s - t > horizon)
        {
            self.recommendations.pop_front();
        }
        let recommended = match value {
            Some(v) => bounds.clamp(recommend(signal, v, current, &b)),
            None => bounds.clamp(current),
        };
        if value.is_some() {
            self.recommendations.push_back((now_s, recommended));
        }
        let decision = |desired, why| Decision {
            desired,
            recommended,
            why,
        };
        if bounds.clamp(current) != current {
            let desired = bounds.clamp(current);
            self.last_change_s = Some(now_s);
            return decision(desired, Why::Bounds);
        }
        if value.is_none() {
            return decision(current, Why::NoSignal);
        }
        if self
            .last_change_s
            .is_some_and(|t| now_s - t < b.cooldown_s && now_s >= t)
        {
            return decision(current, Why::CoolingDown);
        }
        let within = |w: f64| {
            self.recommendations
                .iter()
                .filter(move |&&(t, _)| now_s - t <= w)
                .map(|&(_, r)| r)
        };
        // HPA's rule: up to the lowest recommendation of the up window, down to the highest
        // of the down window, so only a lasting change moves the count.
        let up = within(b.up_window_s).min().unwrap_or(current);
        let down = within(b.down_window_s).max().unwrap_or(current);
        let desired = if up > current {
            let step = b
                .up_step_instances
                .max((f64::from(current) * b.up_step_ratio).ceil() as u32)
                .max(1);
            up.min(current.saturating_add(step))
        } else if down < current {
            let step = ((f64::from(current) * b.down_step_ratio).floor() as u32).max(1);
            down.max(current.saturating_sub(step))
        } else {
            return decision(current, Why::Stable);
        };
        let desired = bounds.clamp(desired);
        if desired == current {
            return decision(current, Why::Stable);
        }
        self.last_change_s = Some(now_s);
        let why = if desired > current {
            Why::ScaledUp
        } else {
            Why::ScaledDown
        };
        decision(desired, why)
    }
}

#[cfg(test)]
mod tests;
