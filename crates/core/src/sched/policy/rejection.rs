//! Early rejection: with `early` or `predicted` rejection, a request whose estimated TTFT misses
//! the SLO, that no decode instance has KV memory for, or whose decode step time would miss the
//! TPOT SLO is refused at arrival, before any prefill is spent. Pure.

use super::Scheduler;
use super::config::Rejection;
use super::decision::{RejectReason, TtftEstimate};

impl Scheduler {
    /// Why the request with estimate `ttft`, expected `tpot_s` on its decode instance and KV
    /// memory there (`fits`) is refused at arrival; `None` when it is accepted.
    pub(super) fn early_rejection(
        &self,
        ttft: &TtftEstimate,
        fits: bool,
        tpot_s: f64,
    ) -> Option<RejectReason> {
        if matches!(
            self.config.rejection,
            Rejection::Early | Rejection::Predicted
        ) {
            if ttft.total_s() > self.config.slo.ttft_s {
                return Some(RejectReason::Ttft {
                    estimate_s: ttft.total_s(),
                });
            }
            if !fits {
                return Some(RejectReason::DecodeMemory);
            }
            if tpot_s > self.config.slo.tpot_s {
                return Some(RejectReason::Tpot { estimate_s: tpot_s });
            }
        }
        None
    }
}
