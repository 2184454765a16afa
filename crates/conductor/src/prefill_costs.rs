//! The prefill cost model of every prefill engine ([`PrefillCosts`]): the configured prior
//! (`--prefill-cost`) and, with `--fit-prefill-cost`, one online fit per engine URL
//! ([`kvpool_core::sched::CostFitter`]) fed with the engine's measured prefills, and how far
//! the fit's predictions were from the measurements that followed ([`FitError`]); engines keep
//! their fit over engine-set changes. Pure: the server measures and applies.

use std::collections::HashMap;

use kvpool_core::sched::{CostFitter, FitConfig, Observed, PrefillCost};

/// Every prefill engine's cost model, by base URL.
#[derive(Debug)]
pub struct PrefillCosts {
    prior: PrefillCost,
    fit: Option<FitConfig>,
    fitters: HashMap<String, CostFitter>,
    errors: HashMap<String, FitError>,
}

/// Weight of the newest prediction in [`FitError`]'s moving mean (about the last 20).
const ERROR_WEIGHT: f64 = 0.05;

/// How far a fitted model's predictions were from the measured prefills that followed: the
/// exponentially weighted mean of `|predicted - measured| / measured`, each prediction made by
/// the fit in use before the measurement came (out of sample).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FitError {
    pub mean_ratio: f64,
    pub predictions: u64,
}

impl FitError {
    fn add(&mut self, ratio: f64) {
        self.predictions += 1;
        // The first ones weigh more, so the mean starts at the first errors, not at 0.
        let w = ERROR_WEIGHT.max(1.0 / self.predictions as f64);
        self.mean_ratio += w * (ratio - self.mean_ratio);
    }
}

/// One engine's model as `GET /v1/kvpool/status` shows it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CostStatus {
    pub engine: String,
    /// The model placements assume now.
    pub cost: PrefillCost,
    /// `fitted` or `prior`.
    pub source: &'static str,
    pub prior: PrefillCost,
    /// Measured prefills the fit kept.
    pub observations: u64,
    /// Mean relative error of the fit's predictions of the measured prefills that followed
    /// (`null` until a fitted model predicted one).
    pub relative_error: Option<f64>,
    /// Predicted seconds of a 2,000-token prompt, nothing cached, under `cost`.
    pub seconds_2000_tokens: f64,
}

impl PrefillCosts {
    /// `prior` for every engine; fitted from measurements when `fit` is set.
    pub fn new(prior: PrefillCost, fit: Option<FitConfig>) -> Self {
        Self {
            prior,
            fit,
            fitters: HashMap::new(),
            errors: HashMap::new(),
        }
    }

    pub fn fitting(&self) -> bool {
        self.fit.is_some()
    }

    pub fn prior(&self) -> PrefillCost {
        self.prior
    }

    /// The model in use for `engine`: its fit, else the prior.
    pub fn current(&self, engine: &str) -> PrefillCost {
        self.fitters
            .get(engine)
            .map_or(self.prior, CostFitter::current)
    }

    /// Whether `engine`'s model is fitted.
    pub fn is_fitted(&self, engine: &str) -> bool {
        self.fitters
            .get(engine)
            .is_some_and(|f| f.fitted().is_some())
    }

    /// Prefilling `tokens` uncached tokens on `engine` took `seconds` (cost-model seconds, the
    /// engine's own compute). `None` when fitting is off.
    pub fn observe(&mut self, engine: &str, tokens: u64, seconds: f64) -> Option<Observed> {
        let config = self.fit?;
        let prior = self.prior;
        if let Some(fit) = self.fitters.get(engine).and_then(CostFitter::fitted)
            && seconds.is_finite()
            && seconds > 0.0
        {
            let ratio = (fit.seconds(0, tokens) - seconds).abs() / seconds;
            self.errors.entry(engine.to_owned()).or_default().add(ratio);
        }
        Some(
            self.fitters
                .entry(engine.to_owned())
                .or_insert_with(|| CostFitter::new(prior, config))
                .observe(tokens, seconds),
        )
    }

    /// The fit's prediction error on `engine`, once a fitted model predicted a prefill.
    pub fn error(&self, engine: &str) -> Option<FitError> {
        self.errors.get(engine).copied()
    }

    /// The status of each of `engines`.
    pub fn status(&self, engines: &[String]) -> Vec<CostStatus> {
        engines
            .iter()
            .map(|e| {
                let cost = self.current(e);
                CostStatus {
                    engine: e.clone(),
                    cost,
                    source: if self.is_fitted(e) { "fitted" } else { "prior" },
                    prior: self.prior,
                    observations: self.fitters.get(e).map_or(0, CostFitter::observations),
                    relative_error: self.error(e).map(|f| f.mean_ratio),
                    seconds_2000_tokens: cost.seconds(0, 2_000),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_start_on_the_prior_and_fit_apart() {
        let truth = PrefillCost {
            fixed_s: 0.1,
            linear_s: 5e-4,
            quadratic_s: 0.0,
        };
        let mut c = PrefillCosts::new(PrefillCost::default(), Some(FitConfig::default()));
        for i in 0..20u64 {
            let n = 100 * (i % 5 + 1);
            assert_eq!(
                c.observe("http://a", n, truth.seconds(0, n)),
                Some(Observed::Kept)
            );
        }
        let s = c.status(&["http://a".into(), "http://b".into()]);
        assert_eq!((s[0].source, s[0].observations), ("fitted", 20));
        assert!((s[0].seconds_2000_tokens - truth.seconds(0, 2_000)).abs() < 1e-6);
        assert_eq!((s[1].source, s[1].cost), ("prior", PrefillCost::default()));
        // Exact measurements: the fit predicts them (near) exactly; one twice as slow as
        // predicted counts 100% and moves the mean.
        let exact = c.error("http://a").expect("predicted once fitted");
        assert!(
            exact.predictions >= 12 && exact.mean_ratio < 1e-6,
            "{exact:?}"
        );
        assert_eq!(s[0].relative_error, Some(exact.mean_ratio));
        assert_eq!((c.error("http://b"), s[1].relative_error), (None, None));
        c.observe("http://a", 300, 2.0 * truth.seconds(0, 300));
        let slow = c.error("http://a").unwrap();
        let w = ERROR_WEIGHT.max(1.0 / slow.predictions as f64);
        let moved = exact.mean_ratio + w * (0.5 - exact.mean_ratio);
        assert!((slow.mean_ratio - moved).abs() < 1e-3, "{slow:?}");
        // Fitting off: observations are ignored.
        let mut off = PrefillCosts::new(PrefillCost::default(), None);
        assert_eq!(off.observe("http://a", 100, 1.0), None);
        assert_eq!(off.current("http://a"), PrefillCost::default());
    }
}
