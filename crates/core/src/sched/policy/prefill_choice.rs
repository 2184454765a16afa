//! Choosing the prefill instance: the KVCache-centric policy of Mooncake's conductor (lowest
//! estimated TTFT, counting prefix blocks in local caches and in the global pool), its
//! local-only variant, and the baselines (cache-aware, least-load, round-robin, random). Pure.

use crate::sched::index::PrefixMatch;

use super::Scheduler;
use super::config::Policy;
use super::decision::{Request, TtftEstimate};
use super::load::PrefillLoad;

impl Scheduler {
    /// Estimated TTFT of `req` on prefill instance `i` whose cached prefix is `m`.
    pub fn estimate_ttft(
        &self,
        i: usize,
        m: PrefixMatch,
        req: &Request<'_>,
        load: PrefillLoad,
        now_s: f64,
    ) -> TtftEstimate {
        let bs = u64::from(self.config.block_size.get());
        let cached = self.cached_tokens(m, req);
        let fetch_bytes = u64::from(m.pool_blocks()) * bs * self.config.bytes_per_token;
        let cost = self
            .config
            .prefill_costs
            .get(i)
            .copied()
            .unwrap_or_default();
        TtftEstimate {
            queue_s: (load.free_at_s - now_s).max(0.0),
            fetch_s: fetch_bytes as f64 / self.config.pool_bandwidth_bps,
            prefill_s: cost.seconds(cached, req.input_tokens),
            handoff_s: self.config.handoff.seconds(req.input_tokens),
        }
    }

    /// The prefill instance among the first `n` (the eligible ones) for `req` under the
    /// configured policy; the request's cached prefix on instance `i` is `matches[i]`.
    pub(super) fn choose_prefill(
        &mut self,
        n: usize,
        matches: &[PrefixMatch],
        req: &Request<'_>,
        prefill: &[PrefillLoad],
        now_s: f64,
    ) -> usize {
        let queue = |i: usize| (prefill[i].free_at_s - now_s).max(0.0);
        let eligible = std::mem::take(&mut self.eligible);
        let ok = |i: &usize| eligible.prefill(*i);
        let choice = match self.config.policy {
            Policy::Random => {
                let k = self.next_random((0..n).filter(ok).count());
                (0..n).filter(ok).nth(k).unwrap_or(0)
            }
            Policy::RoundRobin => {
                let start = self.next_prefill % n;
                let p = (0..n)
                    .map(|o| (start + o) % n)
                    .find(|i| eligible.prefill(*i))
                    .unwrap_or(start);
                self.next_prefill = (p + 1) % n;
                p
            }
            Policy::LeastLoad => (0..n)
                .filter(ok)
                .min_by(|&a, &b| queue(a).total_cmp(&queue(b)))
                .unwrap_or(0),
            Policy::CacheAware => (0..n)
                .filter(ok)
                .min_by(|&a, &b| {
                    matches[b]
                        .local_blocks
                        .cmp(&matches[a].local_blocks)
                        .then(queue(a).total_cmp(&queue(b)))
                })
                .unwrap_or(0),
            Policy::Conductor | Policy::LocalOnly => (0..n)
                .filter(ok)
                .map(|i| (i, self.estimate_ttft(i, matches[i], req, prefill[i], now_s)))
                .min_by(|a, b| a.1.total_s().total_cmp(&b.1.total_s()))
                .map_or(0, |(i, _)| i),
        };
        self.eligible = eligible;
        choice
    }
}
