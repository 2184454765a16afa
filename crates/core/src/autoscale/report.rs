//! What the conductor's load endpoint (`GET /v1/kvpool/load`) serves and the operator reads:
//! per role, the instances, the requests waiting and the window's figures; and the value of
//! each signal taken from them. Pure serde types shared by both sides.

use super::Signal;
use super::window::LoadFigures;

/// The predicted-latency ratio a role without instances reports while it refuses requests.
pub const STARVED_LATENCY_RATIO: f64 = 1e3;

/// The endpoint's body.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadReport {
    /// Length of the window the figures cover, seconds.
    pub window_s: f64,
    pub prefill: RoleLoad,
    pub decode: RoleLoad,
}

/// One role's load.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoleLoad {
    /// Engines of this role the conductor routes to now.
    pub instances: u32,
    /// Requests waiting now: prefill, booked and not yet prefilled; decode, prefilled and not
    /// yet decoding.
    pub queue_depth: u64,
    /// The conductor's latency objective for the role (TTFT or TPOT), seconds; what
    /// `slo_attainment` was judged against.
    pub slo_s: f64,
    #[serde(flatten)]
    pub figures: LoadFigures,
}

impl RoleLoad {
    /// The value of `signal` against the pool's objective `slo_s` (used by `PredictedLatency`;
    /// the conductor's own judged `slo_attainment`). `current` stands in for the instance count
    /// when the conductor routes to none. A window without requests is an idle pool: no
    /// latency, no queue, nothing rejected, everything attained. Requests refused while the
    /// role has no instance at all (a pool scaled to zero) count as a prediction far past the
    /// SLO and as waiting, so every signal asks for instances.
    pub fn signal_value(&self, signal: Signal, slo_s: f64, current: u32) -> f64 {
        let f = &self.figures;
        let starved = self.instances == 0 && f.rejected > 0;
        match signal {
            Signal::PredictedLatency if starved => STARVED_LATENCY_RATIO,
            Signal::QueueDepth if starved => (self.queue_depth + f.rejected) as f64,
            Signal::PredictedLatency => {
                let p90 = f.predicted_p90_s.unwrap_or(0.0);
                if slo_s > 0.0 { p90 / slo_s } else { 0.0 }
            }
            Signal::QueueDepth => {
                let n = if self.instances > 0 {
                    self.instances
                } else {
                    current.max(1)
                };
                self.queue_depth as f64 / f64::from(n)
            }
            Signal::RejectionRate => f.rejection_rate.unwrap_or(0.0),
            Signal::SloAttainment => f.slo_attainment.unwrap_or(1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_per_signal_and_an_idle_window() {
        let load = RoleLoad {
            instances: 4,
            queue_depth: 10,
            slo_s: 2.0,
            figures: LoadFigures {
                arrivals: 100,
                rejected: 5,
                predicted_p50_s: Some(0.5),
                predicted_p90_s: Some(1.5),
                rejection_rate: Some(0.05),
                slo_attainment: Some(0.9),
            },
        };
        assert_eq!(load.signal_value(Signal::PredictedLatency, 1.0, 4), 1.5);
        assert_eq!(load.signal_value(Signal::QueueDepth, 1.0, 4), 2.5);
        assert_eq!(load.signal_value(Signal::RejectionRate, 1.0, 4), 0.05);
        assert_eq!(load.signal_value(Signal::SloAttainment, 1.0, 4), 0.9);
        let idle = RoleLoad::default();
        assert_eq!(idle.signal_value(Signal::PredictedLatency, 1.0, 3), 0.0);
        assert_eq!(idle.signal_value(Signal::QueueDepth, 1.0, 3), 0.0);
        assert_eq!(idle.signal_value(Signal::RejectionRate, 1.0, 3), 0.0);
        assert_eq!(idle.signal_value(Signal::SloAttainment, 1.0, 3), 1.0);
        // Scaled to zero and refusing: every signal asks for instances.
        let starved = RoleLoad {
            figures: LoadFigures {
                arrivals: 4,
                rejected: 4,
                rejection_rate: Some(1.0),
                slo_attainment: Some(0.0),
                ..LoadFigures::default()
            },
            ..RoleLoad::default()
        };
        let b = crate::autoscale::Behavior::default();
        for s in [
            Signal::PredictedLatency,
            Signal::QueueDepth,
            Signal::RejectionRate,
            Signal::SloAttainment,
        ] {
            let v = starved.signal_value(s, 1.0, 0);
            assert!(crate::autoscale::recommend(s, v, 0, &b) >= 1, "{s:?}");
        }
        // The body round-trips with the figures inline.
        let report = LoadReport {
            window_s: 30.0,
            prefill: load,
            decode: idle,
        };
        let text = serde_json::to_string(&report).expect("json");
        assert!(text.contains("\"predicted_p90_s\":1.5"), "{text}");
        assert_eq!(
            serde_json::from_str::<LoadReport>(&text).expect("parse"),
            report
        );
    }
}
