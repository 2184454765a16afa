//! The hand-off model fitted online ([`HandoffFit`]): how long a request takes from its prefill
//! engine's answer to the first token its decode engine streams (the decode engine reading the
//! prompt's KV, its first step, the hop between), as a line in the prompt's length. The TTFT a
//! client sees ends there, and no prefill cost accounts for it. Fitted by exponentially
//! weighted least squares over the recent requests; its out-of-sample error is kept like the
//! other fits'. Pure: the server measures and applies.

use kvpool_core::sched::HandoffCost;

use crate::moving_error::MovingError;

/// Weight of the newest observation in the moving moments (about the last 40).
const WEIGHT: f64 = 0.025;
/// Observations before the fit replaces the prior.
pub const MIN_OBSERVATIONS: u64 = 8;
/// Below this spread of prompt lengths (tokens squared) the slope is not identifiable: the fit
/// is then the mean alone.
const MIN_VARIANCE: f64 = 1.0;

/// The hand-off model in use: the prior until enough hand-offs were measured, then the fit.
#[derive(Clone, Debug, PartialEq)]
pub struct HandoffFit {
    prior: HandoffCost,
    observations: u64,
    /// Exponentially weighted means of x (prompt tokens), y (seconds), x², xy.
    mx: f64,
    my: f64,
    mxx: f64,
    mxy: f64,
    /// How far the fit's predictions were from the hand-offs measured after them.
    error: MovingError,
}

/// What `GET /v1/kvpool/status` shows of the hand-off model.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HandoffFitStatus {
    pub cost: HandoffCost,
    pub prior: HandoffCost,
    /// `fitted` or `prior`.
    pub source: &'static str,
    pub observations: u64,
    pub relative_error: Option<f64>,
}

impl HandoffFit {
    pub fn new(prior: HandoffCost) -> Self {
        Self {
            prior,
            observations: 0,
            mx: 0.0,
            my: 0.0,
            mxx: 0.0,
            mxy: 0.0,
            error: MovingError::default(),
        }
    }

    pub fn is_fitted(&self) -> bool {
        self.observations >= MIN_OBSERVATIONS
    }

    /// The model placements assume: the prior until fitted, then the weighted least-squares
    /// line, kept non-negative (a negative slope becomes a flat mean, a negative intercept a
    /// line through the origin).
    pub fn current(&self) -> HandoffCost {
        if !self.is_fitted() {
            return self.prior;
        }
        let var = self.mxx - self.mx * self.mx;
        let flat = HandoffCost {
            fixed_s: self.my.max(0.0),
            per_token_s: 0.0,
        };
        if var < MIN_VARIANCE {
            return flat;
        }
        let slope = (self.mxy - self.mx * self.my) / var;
        if !slope.is_finite() || slope <= 0.0 {
            return flat;
        }
        let intercept = self.my - slope * self.mx;
        if intercept >= 0.0 {
            return HandoffCost {
                fixed_s: intercept,
                per_token_s: slope,
            };
        }
        // Through the origin: the least-squares slope of y = b x.
        HandoffCost {
            fixed_s: 0.0,
            per_token_s: if self.mxx > 0.0 {
                (self.mxy / self.mxx).max(0.0)
            } else {
                0.0
            },
        }
    }

    /// A request of `prompt_tokens` took `seconds` (cost-model seconds) from its prefill
    /// answer to its decode engine's first token. Returns whether it was used: a time that is
    /// not finite and >= 0 is not.
    pub fn observe(&mut self, prompt_tokens: u64, seconds: f64) -> bool {
        if !seconds.is_finite() || seconds < 0.0 {
            return false;
        }
        if self.is_fitted() {
            self.error
                .observe(self.current().seconds(prompt_tokens), seconds);
        }
        self.observations += 1;
        // The first ones weigh more, so the moments start at the first observations.
        let w = WEIGHT.max(1.0 / self.observations as f64);
        let x = prompt_tokens as f64;
        self.mx += w * (x - self.mx);
        self.my += w * (seconds - self.my);
        self.mxx += w * (x * x - self.mxx);
        self.mxy += w * (x * seconds - self.mxy);
        true
    }

    pub fn status(&self) -> HandoffFitStatus {
        HandoffFitStatus {
            cost: self.current(),
            prior: self.prior,
            source: if self.is_fitted() { "fitted" } else { "prior" },
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
    fn the_fit_finds_the_line_of_the_hand_offs() {
        let mut f = HandoffFit::new(HandoffCost::default());
        assert!(!f.observe(100, f64::NAN) && !f.observe(100, -1.0));
        // 0.05 s per request plus 0.1 ms per prompt token, prompts of 200-1,800 tokens.
        let truth = HandoffCost {
            fixed_s: 0.05,
            per_token_s: 1e-4,
        };
        for i in 0..7 {
            assert!(f.observe(200 + 100 * i, truth.seconds(200 + 100 * i)));
            assert_eq!(
                f.current(),
                HandoffCost::default(),
                "the prior until fitted"
            );
        }
        for i in 0..400u64 {
            let tokens = 200 + (i * 397) % 1_600;
            assert!(f.observe(tokens, truth.seconds(tokens)));
        }
        let c = f.current();
        assert!((c.fixed_s - 0.05).abs() < 1e-3, "{c:?}");
        assert!((c.per_token_s - 1e-4).abs() < 1e-6, "{c:?}");
        assert!(f.error_ratio().unwrap() < 0.01, "{:?}", f.status());
        assert_eq!(f.status().source, "fitted");
    }

    #[test]
    fn one_prompt_length_gives_the_mean_and_the_fit_stays_non_negative() {
        let mut f = HandoffFit::new(HandoffCost::default());
        for s in [0.1, 0.3, 0.2, 0.2, 0.1, 0.3, 0.2, 0.2] {
            f.observe(512, s);
        }
        let c = f.current();
        assert_eq!(c.per_token_s, 0.0);
        assert!((c.fixed_s - 0.2).abs() < 0.02, "{c:?}");
        // Longer prompts handed off faster: no negative slope, the mean instead.
        let mut g = HandoffFit::new(HandoffCost::default());
        for i in 0..50u64 {
            g.observe(100 + 50 * (i % 10), 1.0 - 1e-3 * (50 * (i % 10)) as f64);
        }
        let c = g.current();
        assert_eq!(c.per_token_s, 0.0);
        assert!(c.fixed_s > 0.5 && c.fixed_s < 1.0, "{c:?}");
        // A steep line whose intercept would be negative goes through the origin.
        let mut h = HandoffFit::new(HandoffCost::default());
        for i in 0..50u64 {
            let x = 1_000 + 100 * (i % 5);
            h.observe(x, (x as f64 - 900.0) * 1e-3);
        }
        let c = h.current();
        assert_eq!(c.fixed_s, 0.0);
        assert!(c.per_token_s > 0.0 && c.is_valid(), "{c:?}");
    }
}
