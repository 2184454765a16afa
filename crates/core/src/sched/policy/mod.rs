//! Scheduling decisions: pick a prefill and a decode instance for a request, estimate its TTFT
//! and TPOT, reject early what would miss an SLO, and plan hot-block replication. Pure; no I/O
//! and no clock: the caller passes the current time and the instances' loads.
//!
//! TTFT on prefill instance `i` = time until `i` is free + fetch of the prefix blocks that are in
//! the pool but not local (at the pool bandwidth) + prefill of the uncached tokens (cost model).
//! The decode instance is the one with the lowest step time after adding the request, among
//! those whose KV memory can take it. With prediction, decode load is projected to the time the
//! request will reach decode: running requests predicted to finish by then leave the batch and
//! requests still in prefill that will arrive by then join it (request-level prediction); the
//! request is admitted only if KV memory will have room for it on arrival.
//!
//! This module holds the [`Scheduler`] and its decision; the rest is one file per concern:
//! `config` (policies, SLOs, validation), `load` (instance loads and decode-load prediction),
//! `decision` (request, placement, rejection reasons), `prefill_choice` (the Mooncake conductor
//! policy and the baselines), `decode_choice`, `rejection` (early rejection) and `replication`
//! (hot blocks).

mod config;
mod decision;
mod decode_choice;
mod load;
mod prefill_choice;
mod rejection;
mod replication;

pub use config::{ConfigError, HotConfig, Policy, Rejection, SchedulerConfig, Slo};
pub use decision::{Decision, Placement, RejectReason, Request, TtftEstimate};
pub use load::{DecodeLoad, DecodeMember, DecodeView, PrefillLoad};
pub use replication::Replication;

use super::index::{PrefixIndex, PrefixMatch};
use super::rng::SplitMix64;

/// The instances the next decisions may use, when a request can go only to some (the
/// conductor's engines serve different models): `None` for a role means all of its instances.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Eligible {
    pub prefill: Option<Vec<bool>>,
    pub decode: Option<Vec<bool>>,
}

impl Eligible {
    pub fn prefill(&self, i: usize) -> bool {
        self.prefill
            .as_ref()
            .is_none_or(|m| m.get(i) == Some(&true))
    }

    pub fn decode(&self, j: usize) -> bool {
        self.decode.as_ref().is_none_or(|m| m.get(j) == Some(&true))
    }
}

/// The scheduler: configuration plus the little state the baselines need.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    decode_instances: usize,
    rng: SplitMix64,
    next_prefill: usize,
    next_decode: usize,
    matches: Vec<PrefixMatch>,
    finish_scratch: Vec<(f64, u64)>,
    eligible: Eligible,
}

impl Scheduler {
    /// Validates `config` for `decode_instances` decode instances (prefill instances are
    /// `config.prefill_costs.len()`).
    pub fn new(config: SchedulerConfig, decode_instances: usize) -> Result<Self, ConfigError> {
        config::validate(&config, decode_instances)?;
        let n = config.prefill_costs.len();
        let rng = SplitMix64(config.seed);
        Ok(Self {
            config,
            decode_instances,
            rng,
            next_prefill: 0,
            next_decode: 0,
            matches: Vec::with_capacity(n),
            finish_scratch: Vec::new(),
            eligible: Eligible::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Replaces the pool -> prefill bandwidth of the fetch term (a measured figure); values that
    /// are not finite and positive are ignored.
    pub fn set_pool_bandwidth_bps(&mut self, bps: f64) {
        if bps.is_finite() && bps > 0.0 {
            self.config.pool_bandwidth_bps = bps;
        }
    }

    /// Replaces the prefill cost model of instance `instance` (a fitted one); unknown instances
    /// and models with a term that is not finite and >= 0 are ignored.
    pub fn set_prefill_cost(&mut self, instance: usize, cost: super::cost::PrefillCost) {
        let ok = [cost.fixed_s, cost.linear_s, cost.quadratic_s]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0);
        if let (true, Some(slot)) = (ok, self.config.prefill_costs.get_mut(instance)) {
            *slot = cost;
        }
    }

    /// Replaces the decode cost model (a fitted one); models with a term that is not finite
    /// and >= 0 are ignored.
    pub fn set_decode_cost(&mut self, cost: super::cost::DecodeCost) {
        let ok = [cost.fixed_s, cost.per_seq_s, cost.per_ctx_token_s]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0);
        if ok {
            self.config.decode_cost = cost;
        }
    }

    /// Replaces the hand-off model (a fitted one); one with a term that is not finite and >= 0
    /// is ignored.
    pub fn set_handoff_cost(&mut self, cost: super::cost::HandoffCost) {
        if cost.is_valid() {
            self.config.handoff = cost;
        }
    }

    pub fn prefill_instances(&self) -> usize {
        self.config.prefill_costs.len()
    }

    pub fn decode_instances(&self) -> usize {
        self.decode_instances
    }

    /// Restricts the next decisions (placement, hot-block targets, the idle check) to
    /// `eligible` instances; `Eligible::default()` lifts the restriction.
    pub fn set_eligible(&mut self, eligible: Eligible) {
        self.eligible = eligible;
    }

    /// An instance in `0..bound` for the `random` policy.
    fn next_random(&mut self, bound: usize) -> usize {
        self.rng.below(bound)
    }

    /// Prompt tokens of `req` that need no prefill when its cached prefix is `m`.
    fn cached_tokens(&self, m: PrefixMatch, req: &Request<'_>) -> u64 {
        let bs = u64::from(self.config.block_size.get());
        (u64::from(m.matched_blocks) * bs).min(req.input_tokens)
    }

    /// Chooses instances for `req` arriving at `now_s`, or rejects it. `prefill` and `decode`
    /// hold one load per instance; instances beyond the configured counts are ignored.
    pub fn decide(
        &mut self,
        now_s: f64,
        req: &Request<'_>,
        index: &PrefixIndex,
        prefill: &[PrefillLoad],
        decode: &[DecodeLoad],
    ) -> Decision {
        let n = prefill
            .len()
            .min(self.config.prefill_costs.len())
            .min(index.instances());
        let d = decode.len().min(self.decode_instances);
        if !(0..n).any(|i| self.eligible.prefill(i)) || !(0..d).any(|j| self.eligible.decode(j)) {
            return Decision::Reject(RejectReason::NoInstance);
        }
        let mut matches = std::mem::take(&mut self.matches);
        index.match_prefix(req.keys, self.config.policy.uses_pool(), &mut matches);
        let p = self.choose_prefill(n, &matches, req, prefill, now_s);
        let prefix = matches[p];
        self.matches = matches;
        let ttft = self.estimate_ttft(p, prefix, req, prefill[p], now_s);
        let cached_tokens = self.cached_tokens(prefix, req);
        let kv_transfer_s =
            (req.input_tokens * self.config.bytes_per_token) as f64 / self.config.kv_bandwidth_bps;
        let reaches_decode_s = now_s + ttft.total_s() + kv_transfer_s;
        let (dj, (tpot_s, fits)) = self.choose_decode(d, req, decode, now_s, reaches_decode_s);
        if let Some(reason) = self.early_rejection(&ttft, fits, tpot_s) {
            return Decision::Reject(reason);
        }
        Decision::Accept(Placement {
            prefill: p,
            decode: dj,
            prefix,
            cached_tokens,
            ttft,
            kv_transfer_s,
            tpot_s,
        })
    }
}

#[cfg(test)]
mod tests;
