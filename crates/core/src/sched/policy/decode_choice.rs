//! Choosing the decode instance: the one with the lowest step time once the request joins,
//! among those whose KV memory takes it, judged on the load now or, with predicted rejection,
//! on the load predicted for when the request arrives there; round-robin and random as the
//! baselines. Pure.

use super::Scheduler;
use super::config::{Policy, Rejection};
use super::decision::Request;
use super::load::DecodeLoad;

impl Scheduler {
    /// The decode instance among the first `d` for `req`, which reaches decode at
    /// `reaches_decode_s`, with its expected TPOT and whether its KV memory takes the request.
    pub(super) fn choose_decode(
        &mut self,
        d: usize,
        req: &Request<'_>,
        decode: &[DecodeLoad],
        now_s: f64,
        reaches_decode_s: f64,
    ) -> (usize, (f64, bool)) {
        // Step time after adding the request, on the load now or as predicted.
        let cost = self.config.decode_cost;
        let cap = self.config.decode_kv_capacity_tokens;
        let predict = self.config.rejection == Rejection::Predicted;
        let mut scratch = std::mem::take(&mut self.finish_scratch);
        // (expected TPOT, whether KV memory takes the request)
        let mut option = |j: usize| -> (f64, bool) {
            if predict {
                // Room must be there when the request arrives: a predicted wait for memory
                // counts as no room (admitting into a queue lets it grow to the SLO's edge).
                match decode[j].predicted_admission(
                    now_s,
                    reaches_decode_s,
                    &cost,
                    cap,
                    req.input_tokens,
                    &mut scratch,
                ) {
                    Some((v, wait_s)) => (
                        cost.step_seconds(v.batch + 1, v.context_tokens + req.input_tokens),
                        wait_s <= 0.0,
                    ),
                    None => (f64::INFINITY, false),
                }
            } else {
                let v = decode[j].current(now_s);
                let ctx = v.context_tokens + req.input_tokens;
                (cost.step_seconds(v.batch + 1, ctx), ctx <= cap)
            }
        };
        let eligible = std::mem::take(&mut self.eligible);
        let ok = |j: &usize| eligible.decode(*j);
        let choice = match self.config.policy {
            Policy::Random => {
                let k = self.next_random((0..d).filter(ok).count());
                let j = (0..d).filter(ok).nth(k).unwrap_or(0);
                (j, option(j))
            }
            Policy::RoundRobin => {
                let start = self.next_decode % d;
                let j = (0..d)
                    .map(|o| (start + o) % d)
                    .find(|j| eligible.decode(*j))
                    .unwrap_or(start);
                self.next_decode = (j + 1) % d;
                (j, option(j))
            }
            _ => (0..d)
                .filter(ok)
                .map(|j| (j, option(j)))
                .min_by(|a, b| {
                    // Instances with room first, then the lowest step time.
                    b.1.1.cmp(&a.1.1).then(a.1.0.total_cmp(&b.1.0))
                })
                .unwrap_or((0, (f64::INFINITY, false))),
        };
        self.finish_scratch = scratch;
        self.eligible = eligible;
        choice
    }
}
