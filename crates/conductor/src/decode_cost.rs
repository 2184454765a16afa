//! The decode cost model fitted online ([`DecodeFit`]): the configured model's shape (fixed,
//! per sequence, per context token; `kvpool_core::sched::DecodeCost`) times one scale learnt
//! from the time per output token the decode engines' answers show, each compared with what the
//! placement predicted for that request. Pure: the server measures and applies.

use kvpool_core::sched::DecodeCost;

use crate::moving_error::MovingError;

/// Weight of the newest observation in the moving means (about the last 20).
const WEIGHT: f64 = 0.05;
/// Observations before the fitted scale replaces the prior.
pub const MIN_OBSERVATIONS: u64 = 8;
/// Scales are kept within this factor of the prior either way (a handful of odd answers
/// cannot make the model absurd).
const MAX_FACTOR: f64 = 1e4;

/// The decode cost model in use: the prior, scaled once enough TPOTs were observed.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeFit {
    prior: DecodeCost,
    scale: f64,
    observations: u64,
    /// How far the predictions were from the TPOTs observed after them.
    error: MovingError,
}

/// What `GET /v1/kvpool/status` shows of the decode model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DecodeFitStatus {
    pub cost: DecodeCost,
    pub prior: DecodeCost,
    /// `fitted` or `prior`.
    pub source: &'static str,
    pub scale: f64,
    pub observations: u64,
    pub relative_error: Option<f64>,
}

impl DecodeFit {
    pub fn new(prior: DecodeCost) -> Self {
        Self {
            prior,
            scale: 1.0,
            observations: 0,
            error: MovingError::default(),
        }
    }

    pub fn prior(&self) -> DecodeCost {
        self.prior
    }

    pub fn is_fitted(&self) -> bool {
        self.observations >= MIN_OBSERVATIONS
    }

    /// The model placements assume: the prior until fitted, then the prior times the scale.
    pub fn current(&self) -> DecodeCost {
        if !self.is_fitted() {
            return self.prior;
        }
        let s = self.scale;
        DecodeCost {
            fixed_s: self.prior.fixed_s * s,
            per_seq_s: self.prior.per_seq_s * s,
            per_ctx_token_s: self.prior.per_ctx_token_s * s,
        }
    }

    /// A request whose placement predicted `predicted_s` per output token (under the model in
    /// use then) was served at `observed_s` (both cost-model seconds). Returns whether it was
    /// used: predictions or observations that are not finite and positive are not.
    pub fn observe(&mut self, predicted_s: f64, observed_s: f64) -> bool {
        let ok = |v: f64| v.is_finite() && v > 0.0;
        if !ok(predicted_s) || !ok(observed_s) {
            return false;
        }
        self.observations += 1;
        let w = WEIGHT.max(1.0 / self.observations as f64);
        self.error.observe(predicted_s, observed_s);
        // The scale that would have predicted it, from the one the prediction was made under;
        // averaged in log space, so being 2x off either way weighs the same.
        let used = if self.observations > MIN_OBSERVATIONS {
            self.scale
        } else {
            1.0
        };
        let target = (used * observed_s / predicted_s).clamp(1.0 / MAX_FACTOR, MAX_FACTOR);
        let log = self.scale.ln() + w * (target.ln() - self.scale.ln());
        self.scale = log.exp();
        true
    }

    pub fn status(&self) -> DecodeFitStatus {
        DecodeFitStatus {
            cost: self.current(),
            prior: self.prior,
            source: if self.is_fitted() { "fitted" } else { "prior" },
            scale: self.scale,
            observations: self.observations,
            relative_error: self.error.mean(),
        }
    }

    pub fn error_ratio(&self) -> Option<f64> {
        self.error.mean()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_follows_engines_slower_than_the_prior() {
        let prior = DecodeCost::default();
        let mut f = DecodeFit::new(prior);
        assert_eq!((f.current(), f.status().source), (prior, "prior"));
        assert!(!f.observe(f64::INFINITY, 0.1) && !f.observe(0.05, 0.0));
        // The engine is 3x slower than the model predicts: before the fit every prediction
        // is the prior's; after, the predictions scale with the model in use.
        let truth = 3.0;
        for _ in 0..200 {
            let predicted = f.current().step_seconds(4, 4_000);
            let observed = truth * prior.step_seconds(4, 4_000);
            assert!(f.observe(predicted, observed));
        }
        let s = f.status();
        assert_eq!(s.source, "fitted");
        assert!((s.scale - truth).abs() < 0.05, "{s:?}");
        assert!((f.current().fixed_s - truth * prior.fixed_s).abs() < 0.05 * prior.fixed_s);
        // The predictions now land close to what is observed.
        assert!(f.error_ratio().unwrap() < 0.05, "{s:?}");
    }
}
