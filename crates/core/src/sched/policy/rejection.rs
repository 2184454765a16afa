//! Early rejection: with `early` or `predicted` rejection, a request whose estimated TTFT misses
//! the SLO, that no decode instance has KV memory for, or whose decode step time would miss the
//! TPOT SLO is refused at arrival, before any prefill is spent; and whether a refused request
//! would be refused on an idle pool too (a request that can never meet its SLO, which a client
//! must not retry). Pure.

use super::Scheduler;
use super::config::Rejection;
use super::decision::{RejectReason, Request, TtftEstimate};
use super::load::PrefillLoad;
use crate::sched::index::PrefixIndex;

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

    /// Why `req`, arriving at `now_s`, would be refused even if the pool were idle (no prefill
    /// queue, no decode load), with its cached prefix in `index` over the first
    /// `prefill_instances` instances: its best TTFT without queueing misses the SLO, its prompt
    /// exceeds a decode instance's KV memory, or a decode step with it alone misses the TPOT SLO.
    /// `None` when load alone is to blame (or the mode rejects nothing early). Meant for the
    /// rejection path: it walks the prefix index once more.
    pub fn refused_when_idle(
        &self,
        now_s: f64,
        req: &Request<'_>,
        index: &PrefixIndex,
        prefill_instances: usize,
    ) -> Option<RejectReason> {
        if !matches!(
            self.config.rejection,
            Rejection::Early | Rejection::Predicted
        ) {
            return None;
        }
        let n = prefill_instances
            .min(self.config.prefill_costs.len())
            .min(index.instances());
        let mut matches = Vec::new();
        index.match_prefix(req.keys, self.config.policy.uses_pool(), &mut matches);
        let idle = PrefillLoad { free_at_s: now_s };
        let best_ttft_s = matches
            .iter()
            .take(n)
            .enumerate()
            .filter(|(i, _)| self.eligible.prefill(*i))
            .map(|(i, &m)| self.estimate_ttft(i, m, req, idle, now_s).total_s())
            .min_by(f64::total_cmp);
        if let Some(estimate_s) = best_ttft_s
            && estimate_s > self.config.slo.ttft_s
        {
            return Some(RejectReason::Ttft { estimate_s });
        }
        if req.input_tokens > self.config.decode_kv_capacity_tokens {
            return Some(RejectReason::DecodeMemory);
        }
        let alone_s = self.config.decode_cost.step_seconds(1, req.input_tokens);
        (alone_s > self.config.slo.tpot_s).then_some(RejectReason::Tpot {
            estimate_s: alone_s,
        })
    }
}
