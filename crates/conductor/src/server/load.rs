//! The load signal the operator autoscales the engine pools by (`GET /v1/kvpool/load`,
//! docs/scheduling.md "Load signal"): per role, the requests of the last
//! [`LOAD_WINDOW`] as the policy judged them at arrival (predicted TTFT of admitted requests
//! for prefill, predicted TPOT for decode, rejections blamed on the role), the requests
//! waiting now and the instances served. Pure: the caller passes the time (`Shared::wall_s`,
//! wall seconds, not the engines' time scale: the window is what an operator polling it sees).

use std::time::Duration;

use kvpool_core::autoscale::{LoadReport, LoadWindow, RoleLoad};
use kvpool_core::sched::RejectReason;

/// How far back the figures reach.
pub const LOAD_WINDOW: Duration = Duration::from_secs(30);
/// Samples kept per role (a busier conductor keeps the latest ones of the window).
const MAX_SAMPLES: usize = 50_000;

/// The two roles' windows.
#[derive(Debug)]
pub(super) struct LoadWindows {
    prefill: LoadWindow,
    decode: LoadWindow,
}

impl Default for LoadWindows {
    fn default() -> Self {
        let w = LOAD_WINDOW.as_secs_f64();
        Self {
            prefill: LoadWindow::new(w, MAX_SAMPLES),
            decode: LoadWindow::new(w, MAX_SAMPLES),
        }
    }
}

impl LoadWindows {
    /// A request admitted at `now_s` (wall seconds since start) with these predictions.
    pub(super) fn admitted(&mut self, now_s: f64, ttft_s: f64, tpot_s: f64) {
        self.prefill.admitted(now_s, ttft_s);
        self.decode.admitted(now_s, tpot_s);
    }

    /// A request refused at arrival for `reason`: a missed TTFT is prefill's, a missed TPOT or
    /// full decode memory is decode's, no instance at all is both's.
    pub(super) fn rejected(&mut self, now_s: f64, reason: RejectReason) {
        match reason {
            RejectReason::Ttft { .. } => self.prefill.rejected(now_s),
            RejectReason::Tpot { .. } | RejectReason::DecodeMemory => self.decode.rejected(now_s),
            RejectReason::NoInstance => {
                self.prefill.rejected(now_s);
                self.decode.rejected(now_s);
            }
        }
    }
}

impl LoadWindows {
    /// The endpoint's body at `now_s` (wall seconds since start): `instances` and `queues`
    /// are (prefill, decode), judged against the conductor's `slo`.
    pub(super) fn report(
        &mut self,
        now_s: f64,
        instances: (usize, usize),
        queues: (u64, u64),
        slo: kvpool_core::sched::Slo,
    ) -> LoadReport {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        LoadReport {
            window_s: LOAD_WINDOW.as_secs_f64(),
            prefill: RoleLoad {
                instances: count(instances.0),
                queue_depth: queues.0,
                slo_s: slo.ttft_s,
                figures: self.prefill.figures(now_s, slo.ttft_s),
            },
            decode: RoleLoad {
                instances: count(instances.1),
                queue_depth: queues.1,
                slo_s: slo.tpot_s,
                figures: self.decode.figures(now_s, slo.tpot_s),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejections_are_blamed_on_their_role() {
        let mut w = LoadWindows::default();
        w.admitted(0.0, 1.0, 0.05);
        w.rejected(0.0, RejectReason::Ttft { estimate_s: 9.0 });
        w.rejected(0.0, RejectReason::DecodeMemory);
        w.rejected(0.0, RejectReason::NoInstance);
        let p = w.prefill.figures(0.0, 2.0);
        let d = w.decode.figures(0.0, 0.1);
        assert_eq!((p.arrivals, p.rejected), (3, 2));
        assert_eq!((d.arrivals, d.rejected), (3, 2));
        assert_eq!(p.predicted_p90_s, Some(1.0));
        assert_eq!(d.predicted_p90_s, Some(0.05));
    }
}
