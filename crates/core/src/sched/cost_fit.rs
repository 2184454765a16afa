//! Online fit of a prefill cost model ([`PrefillCost`]) from measured prefills: observations
//! `(n uncached prompt tokens, y seconds)` go in, and once enough of them span enough distinct
//! `n`, the weighted least-squares fit of `y = a + b n + c n^2` with `a, b, c >= 0` replaces the
//! prior (the default model or a user profile). Pure; no I/O and no clock.
//!
//! - Forgetting: the fit runs over the last `window` observations, observation `k` places back
//!   weighted `forgetting^k`, so the model follows an engine whose speed drifts.
//! - Non-negativity: the unconstrained fit is used when no coefficient is negative; otherwise
//!   every subset of the three terms is fitted and the non-negative one with the least weighted
//!   squared error wins (exact non-negative least squares for three terms).
//! - Outliers: once the fit is in use, an observation more than `outlier_factor` times the
//!   current prediction (a request that queued behind work the caller did not see, a stalled
//!   engine) is dropped. `drift_after` such observations in a row are taken as a real change and
//!   accepted, so a much slower engine is still followed.
//! - Invalid observations (NaN, infinite, negative seconds) are dropped.

use std::collections::VecDeque;

use super::cost::PrefillCost;

/// Settings of a [`CostFitter`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct FitConfig {
    /// Observations kept (the oldest falls out).
    pub window: usize,
    /// Weight factor per observation of age, in (0, 1]; 1 is no forgetting within the window.
    pub forgetting: f64,
    /// Observations needed before the fit replaces the prior.
    pub min_observations: usize,
    /// Distinct token counts needed among them.
    pub min_distinct: usize,
    /// After warm-up, observations above this multiple of the prediction are outliers.
    pub outlier_factor: f64,
    /// Outliers in a row after which they are accepted (the engine got slower).
    pub drift_after: u32,
}

impl Default for FitConfig {
    fn default() -> Self {
        Self {
            window: 256,
            forgetting: 0.99,
            min_observations: 8,
            min_distinct: 3,
            outlier_factor: 10.0,
            drift_after: 8,
        }
    }
}

/// What became of one observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// Kept (the fit may or may not be in use yet).
    Kept,
    /// Dropped as an outlier.
    Outlier,
    /// Dropped: seconds not finite or negative.
    Invalid,
}

/// One prefill engine's cost model: the prior until the observations support a fit.
#[derive(Clone, Debug)]
pub struct CostFitter {
    config: FitConfig,
    prior: PrefillCost,
    fitted: Option<PrefillCost>,
    /// Newest first.
    window: VecDeque<(u64, f64)>,
    kept: u64,
    outliers_in_a_row: u32,
}

impl CostFitter {
    pub fn new(prior: PrefillCost, config: FitConfig) -> Self {
        Self {
            config,
            prior,
            fitted: None,
            window: VecDeque::new(),
            kept: 0,
            outliers_in_a_row: 0,
        }
    }

    pub fn prior(&self) -> PrefillCost {
        self.prior
    }

    /// The fitted model, once it replaced the prior.
    pub fn fitted(&self) -> Option<PrefillCost> {
        self.fitted
    }

    /// The model in use: the fit when there is one, else the prior.
    pub fn current(&self) -> PrefillCost {
        self.fitted.unwrap_or(self.prior)
    }

    /// Observations kept since the start (also those that fell out of the window).
    pub fn observations(&self) -> u64 {
        self.kept
    }

    /// Records that prefilling `tokens` uncached tokens took `seconds`, and refits.
    pub fn observe(&mut self, tokens: u64, seconds: f64) -> Observed {
        if !seconds.is_finite() || seconds < 0.0 {
            return Observed::Invalid;
        }
        if let Some(fit) = self.fitted {
            let predicted = fit.seconds(0, tokens);
            if seconds > self.config.outlier_factor * predicted
                && self.outliers_in_a_row + 1 < self.config.drift_after.max(1)
            {
                self.outliers_in_a_row += 1;
                return Observed::Outlier;
            }
        }
        self.outliers_in_a_row = 0;
        self.window.push_front((tokens, seconds));
        self.window.truncate(self.config.window.max(1));
        self.kept += 1;
        self.refit();
        Observed::Kept
    }

    fn refit(&mut self) {
        let mut distinct: Vec<u64> = self.window.iter().map(|o| o.0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if self.window.len() < self.config.min_observations.max(1)
            || distinct.len() < self.config.min_distinct.max(1)
        {
            return;
        }
        if let Some(fit) = fit_non_negative(&self.window, self.config.forgetting) {
            self.fitted = Some(fit);
        }
    }
}

/// Weighted non-negative least squares of `y = a + b n + c n^2` over `obs` (newest first,
/// weights `forgetting^age`): the best non-negative fit over all subsets of the three terms.
/// `None` when no subset can be solved (no observations).
pub fn fit_non_negative(obs: &VecDeque<(u64, f64)>, forgetting: f64) -> Option<PrefillCost> {
    let forgetting = if forgetting.is_finite() && forgetting > 0.0 {
        forgetting.min(1.0)
    } else {
        1.0
    };
    // Tokens scaled to [0, 1] keep the normal equations well conditioned.
    let scale = obs.iter().map(|o| o.0).max().unwrap_or(1).max(1) as f64;
    let rows: Vec<([f64; 3], f64, f64)> = obs
        .iter()
        .scan(1.0f64, |w, &(n, y)| {
            let x = n as f64 / scale;
            let row = ([1.0, x, x * x], y, *w);
            *w *= forgetting;
            Some(row)
        })
        .collect();
    let mut best: Option<([f64; 3], f64)> = None;
    // Subsets as bit masks over (fixed, linear, quadratic); all three first.
    for mask in [7u8, 3, 5, 6, 1, 2, 4] {
        let cols: Vec<usize> = (0..3).filter(|c| mask & (1 << c) != 0).collect();
        let Some(theta) = solve_subset(&rows, &cols) else {
            continue;
        };
        if theta.iter().any(|t| !t.is_finite() || *t < 0.0) {
            continue;
        }
        let sse: f64 = rows
            .iter()
            .map(|(r, y, w)| {
                let e = r.iter().zip(theta).map(|(a, t)| a * t).sum::<f64>() - y;
                w * e * e
            })
            .sum();
        // The full model wins outright when it is non-negative (it has the least error).
        if mask == 7 {
            best = Some((theta, sse));
            break;
        }
        if best.is_none_or(|(_, b)| sse < b) {
            best = Some((theta, sse));
        }
    }
    let (theta, _) = best?;
    Some(PrefillCost {
        fixed_s: theta[0],
        linear_s: theta[1] / scale,
        quadratic_s: theta[2] / (scale * scale),
    })
}

/// Weighted least squares on the columns `cols` of `rows`; the other coefficients are 0.
fn solve_subset(rows: &[([f64; 3], f64, f64)], cols: &[usize]) -> Option<[f64; 3]> {
    let k = cols.len();
    let mut a = [[0.0f64; 3]; 3];
    let mut b = [0.0f64; 3];
    for (r, y, w) in rows {
        for (i, &ci) in cols.iter().enumerate() {
            for (j, &cj) in cols.iter().enumerate() {
                a[i][j] += w * r[ci] * r[cj];
            }
            b[i] += w * r[ci] * y;
        }
    }
    let x = solve(&mut a, &mut b, k)?;
    let mut theta = [0.0f64; 3];
    for (i, &c) in cols.iter().enumerate() {
        theta[c] = x[i];
    }
    Some(theta)
}

/// Gaussian elimination with partial pivoting on the leading `k x k` block; `None` when it is
/// (nearly) singular.
fn solve(a: &mut [[f64; 3]; 3], b: &mut [f64; 3], k: usize) -> Option<[f64; 3]> {
    let norm = (0..k).map(|i| a[i][i].abs()).fold(0.0, f64::max);
    if norm <= 0.0 || !norm.is_finite() {
        return None;
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * norm {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..k {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).take(k).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0f64; 3];
    for row in (0..k).rev() {
        let mut s = b[row];
        for c in row + 1..k {
            s -= a[row][c] * x[c];
        }
        x[row] = s / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn truth() -> PrefillCost {
        PrefillCost {
            fixed_s: 0.1,
            linear_s: 5e-4,
            quadratic_s: 2e-8,
        }
    }

    /// Deterministic noise in [-1, 1].
    fn noise(i: u64) -> f64 {
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        (x % 2001) as f64 / 1000.0 - 1.0
    }

    fn valid(c: PrefillCost) -> bool {
        [c.fixed_s, c.linear_s, c.quadratic_s]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0)
    }

    #[test]
    fn recovers_known_coefficients_from_noisy_data() {
        let t = truth();
        let mut f = CostFitter::new(PrefillCost::default(), FitConfig::default());
        for i in 0..200u64 {
            let n = 100 + (i * 397) % 8_000;
            let y = t.seconds(0, n) * (1.0 + 0.03 * noise(i));
            assert_eq!(f.observe(n, y), Observed::Kept);
        }
        let fit = f.fitted().expect("fitted");
        assert!(valid(fit), "{fit:?}");
        for n in [500u64, 2_000, 6_000] {
            let (p, want) = (fit.seconds(0, n), t.seconds(0, n));
            assert!((p - want).abs() < 0.03 * want, "n {n}: {p} vs {want}");
        }
        assert!(
            (fit.linear_s - t.linear_s).abs() < 0.15 * t.linear_s,
            "{fit:?}"
        );
    }

    #[test]
    fn stays_on_the_prior_with_too_little_data() {
        let prior = PrefillCost::default();
        let mut f = CostFitter::new(prior, FitConfig::default());
        for n in [100u64, 200, 300, 400, 500, 600, 700] {
            f.observe(n, truth().seconds(0, n));
        }
        assert_eq!(f.fitted(), None);
        assert_eq!(f.current(), prior);
        // Many observations of only two distinct sizes: still the prior.
        let mut g = CostFitter::new(prior, FitConfig::default());
        for i in 0..50u64 {
            g.observe(1_000 * (1 + i % 2), 1.0);
        }
        assert_eq!(g.current(), prior);
        assert_eq!(g.observations(), 50);
    }

    #[test]
    fn identical_sizes_and_zero_tokens_never_break_the_fit() {
        let cfg = FitConfig {
            min_distinct: 1,
            min_observations: 1,
            ..FitConfig::default()
        };
        // Twenty observations of one size, each taking `seconds`: the fit predicts that time.
        for (tokens, seconds) in [(0, 0.05), (1_000, 0.5)] {
            let mut f = CostFitter::new(PrefillCost::default(), cfg);
            for _ in 0..20 {
                f.observe(tokens, seconds);
            }
            let fit = f.current();
            assert!(valid(fit), "{fit:?}");
            assert!((fit.seconds(0, tokens) - seconds).abs() < 1e-9, "{fit:?}");
        }
    }

    #[test]
    fn coefficients_are_never_negative_or_nan() {
        // Decreasing with n: the unconstrained fit has a negative slope.
        let mut f = CostFitter::new(PrefillCost::default(), FitConfig::default());
        for i in 0..40u64 {
            let n = 100 * (i % 10 + 1);
            f.observe(n, 2.0 - n as f64 / 1_000.0);
            assert!(valid(f.current()), "{:?}", f.current());
        }
        assert!(f.fitted().is_some());
        // Concave data: the unconstrained quadratic term is negative.
        let mut g = CostFitter::new(PrefillCost::default(), FitConfig::default());
        for i in 0..40u64 {
            let n = 100 * (i % 10 + 1);
            g.observe(n, (n as f64).sqrt());
            assert!(valid(g.current()), "{:?}", g.current());
        }
        // Nonsense is dropped.
        assert_eq!(g.observe(10, f64::NAN), Observed::Invalid);
        assert_eq!(g.observe(10, -1.0), Observed::Invalid);
        assert_eq!(g.observe(10, f64::INFINITY), Observed::Invalid);
        assert!(valid(g.current()));
    }

    /// Feeds `count` observations to `f`, of 200 to 2000 tokens in turn, each taking
    /// `seconds(tokens)`.
    fn feed(f: &mut CostFitter, count: u64, seconds: impl Fn(u64) -> f64) {
        for i in 0..count {
            let n = 200 * (i % 10 + 1);
            f.observe(n, seconds(n));
        }
    }

    #[test]
    fn outliers_are_dropped_until_they_persist() {
        let t = truth();
        let mut f = CostFitter::new(PrefillCost::default(), FitConfig::default());
        feed(&mut f, 30, |n| t.seconds(0, n));
        let before = f.current();
        assert_eq!(f.observe(1_000, 100.0), Observed::Outlier);
        assert_eq!(f.current(), before);
        // The engine became 50x slower for good: after `drift_after` in a row the fit follows.
        let slow = |n: u64| 50.0 * t.seconds(0, n);
        feed(&mut f, 300, slow);
        let p = f.current().seconds(0, 1_000);
        assert!((p - slow(1_000)).abs() < 0.05 * slow(1_000), "{p}");
    }

    #[test]
    fn forgetting_follows_drift() {
        let t = truth();
        let mut f = CostFitter::new(PrefillCost::default(), FitConfig::default());
        feed(&mut f, 200, |n| t.seconds(0, n));
        // Twice as slow (not an outlier): recent observations dominate.
        feed(&mut f, 200, |n| 2.0 * t.seconds(0, n));
        let p = f.current().seconds(0, 1_000);
        let want = 2.0 * t.seconds(0, 1_000);
        assert!((p - want).abs() < 0.05 * want, "{p} vs {want}");
    }
}
