//! The prefill cost model of every prefill engine ([`PrefillCosts`]): the configured prior
//! (`--prefill-cost`) and, with `--fit-prefill-cost`, one online fit per engine URL
//! ([`kvpool_core::sched::CostFitter`]) fed with the engine's measured prefills, and how far
//! the model in use predicted the measurements that followed ([`MovingError`]); engines keep
//! their fit over engine-set changes. Until an engine has enough measurements of its own it
//! uses the pooled fit of every engine of its group (the engines serving the same model), so a
//! pool of N engines leaves the prior N times sooner. Pure: the server measures and applies.

use std::collections::HashMap;

use kvpool_core::sched::{CostFitter, FitConfig, Observed, PrefillCost};

use crate::moving_error::MovingError;

/// Every prefill engine's cost model, by base URL.
#[derive(Debug)]
pub struct PrefillCosts {
    prior: PrefillCost,
    fit: Option<FitConfig>,
    fitters: HashMap<String, CostFitter>,
    /// Each engine's group (the model it was measured serving), and each group's pooled fit.
    groups: HashMap<String, String>,
    pooled: HashMap<String, CostFitter>,
    errors: HashMap<String, MovingError>,
}

/// One engine's model as `GET /v1/kvpool/status` shows it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CostStatus {
    pub engine: String,
    /// The model placements assume now.
    pub cost: PrefillCost,
    /// `fitted` (the engine's own), `pooled` (its group's, until its own is ready) or `prior`.
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
            groups: HashMap::new(),
            pooled: HashMap::new(),
            errors: HashMap::new(),
        }
    }

    pub fn fitting(&self) -> bool {
        self.fit.is_some()
    }

    pub fn prior(&self) -> PrefillCost {
        self.prior
    }

    /// The model in use for `engine`: its fit, else its group's pooled fit, else the prior.
    pub fn current(&self, engine: &str) -> PrefillCost {
        self.fitted_model(engine).map_or(self.prior, |(c, _)| c)
    }

    /// The fitted model `engine` uses and where it comes from (`fitted`: its own, `pooled`: its
    /// group's); `None` while it is on the prior.
    fn fitted_model(&self, engine: &str) -> Option<(PrefillCost, &'static str)> {
        if let Some(own) = self.fitters.get(engine).and_then(CostFitter::fitted) {
            return Some((own, "fitted"));
        }
        self.groups
            .get(engine)
            .and_then(|g| self.pooled.get(g))
            .and_then(CostFitter::fitted)
            .map(|c| (c, "pooled"))
    }

    /// Whether `engine` uses a fitted model (its own or its group's).
    pub fn is_fitted(&self, engine: &str) -> bool {
        self.fitted_model(engine).is_some()
    }

    /// `fitted`, `pooled` or `prior`: where `engine`'s model in use comes from.
    pub fn source(&self, engine: &str) -> &'static str {
        self.fitted_model(engine).map_or("prior", |(_, s)| s)
    }

    /// Prefilling `tokens` uncached tokens on `engine`, serving `group` (its model), took
    /// `seconds` (cost-model seconds, the engine's own compute): the engine's fit and its
    /// group's pooled fit learn it. `None` when fitting is off.
    pub fn observe(
        &mut self,
        engine: &str,
        group: &str,
        tokens: u64,
        seconds: f64,
    ) -> Option<Observed> {
        let config = self.fit?;
        let prior = self.prior;
        if self.groups.get(engine).is_none_or(|g| g != group) {
            self.groups.insert(engine.to_owned(), group.to_owned());
        }
        if let Some((fit, _)) = self.fitted_model(engine)
            && seconds.is_finite()
            && seconds > 0.0
        {
            self.errors
                .entry(engine.to_owned())
                .or_default()
                .observe(fit.seconds(0, tokens), seconds);
        }
        self.pooled
            .entry(group.to_owned())
            .or_insert_with(|| CostFitter::new(prior, config))
            .observe(tokens, seconds);
        Some(
            self.fitters
                .entry(engine.to_owned())
                .or_insert_with(|| CostFitter::new(prior, config))
                .observe(tokens, seconds),
        )
    }

    /// The fit's prediction error on `engine`, once a fitted model predicted a prefill.
    pub fn error(&self, engine: &str) -> Option<MovingError> {
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
                    source: self.source(e),
                    prior: self.prior,
                    observations: self.fitters.get(e).map_or(0, CostFitter::observations),
                    relative_error: self.error(e).and_then(|f| f.mean()),
                    seconds_2000_tokens: cost.seconds(0, 2_000),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moving_error::ERROR_WEIGHT;

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
                c.observe("http://a", "m", n, truth.seconds(0, n)),
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
            exact.count() >= 12 && exact.mean().unwrap() < 1e-6,
            "{exact:?}"
        );
        assert_eq!(s[0].relative_error, exact.mean());
        assert_eq!((c.error("http://b"), s[1].relative_error), (None, None));
        c.observe("http://a", "m", 300, 2.0 * truth.seconds(0, 300));
        let slow = c.error("http://a").unwrap();
        let w = ERROR_WEIGHT.max(1.0 / slow.count() as f64);
        let moved = exact.mean().unwrap() + w * (0.5 - exact.mean().unwrap());
        assert!((slow.mean().unwrap() - moved).abs() < 1e-3, "{slow:?}");
        // Fitting off: observations are ignored.
        let mut off = PrefillCosts::new(PrefillCost::default(), None);
        assert_eq!(off.observe("http://a", "m", 100, 1.0), None);
        assert_eq!(off.current("http://a"), PrefillCost::default());
    }

    #[test]
    fn engines_of_a_group_share_a_pooled_fit_until_their_own_is_ready() {
        let truth = PrefillCost {
            fixed_s: 0.1,
            linear_s: 5e-4,
            quadratic_s: 0.0,
        };
        let mut c = PrefillCosts::new(PrefillCost::default(), Some(FitConfig::default()));
        // Four prefills each on two engines of model m: neither has the 8 a fit needs, their
        // group has.
        for i in 0..4u64 {
            for e in ["http://a", "http://b"] {
                let n = 100 * (i + 1) + if e == "http://a" { 50 } else { 0 };
                c.observe(e, "m", n, truth.seconds(0, n));
            }
        }
        // A third engine measured serving another model stays on the prior.
        c.observe("http://c", "other", 500, 9.0);
        let s = c.status(&["http://a".into(), "http://b".into(), "http://c".into()]);
        let sources: Vec<_> = s.iter().map(|r| (r.source, r.observations)).collect();
        assert_eq!(sources, [("pooled", 4), ("pooled", 4), ("prior", 1)]);
        assert!((s[1].seconds_2000_tokens - truth.seconds(0, 2_000)).abs() < 1e-6);
        assert_eq!(c.current("http://c"), PrefillCost::default());
        assert!(c.is_fitted("http://a") && !c.is_fitted("http://c"));
        // The pooled model predicts, so the error is counted from then on.
        c.observe("http://a", "m", 700, truth.seconds(0, 700));
        assert!(
            c.error("http://a")
                .and_then(|e| e.mean())
                .is_some_and(|m| m < 1e-6)
        );
        // Once a has its own 8, it uses them.
        for n in [800, 900, 1_000] {
            c.observe("http://a", "m", n, 2.0 * truth.seconds(0, n));
        }
        assert_eq!(c.source("http://a"), "fitted");
        assert_eq!(c.source("http://b"), "pooled");
    }
}
