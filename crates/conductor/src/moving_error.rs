//! How far a fitted model's predictions were from what was measured after them: the moving
//! mean of `|predicted - measured| / measured` that the prefill, decode and hand-off fits keep,
//! each prediction made by the model in use before its measurement came (out of sample).
//! Pure.

/// Weight of the newest error once the mean is warm (about the last 20).
pub const ERROR_WEIGHT: f64 = 0.05;

/// An exponentially weighted mean of relative errors that starts as a plain mean: the first
/// errors weigh `1/n` until that falls below [`ERROR_WEIGHT`], so the mean starts at the
/// first errors, not at 0.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MovingError {
    mean: f64,
    count: u64,
}

impl MovingError {
    /// Count a prediction of `predicted` that was measured as `measured`. Returns whether it
    /// counted: both must be finite and the measurement positive.
    pub fn observe(&mut self, predicted: f64, measured: f64) -> bool {
        if !predicted.is_finite() || !measured.is_finite() || measured <= 0.0 {
            return false;
        }
        self.count += 1;
        let w = ERROR_WEIGHT.max(1.0 / self.count as f64);
        let ratio = (predicted - measured).abs() / measured;
        self.mean += w * (ratio - self.mean);
        true
    }

    /// The mean, once one error counted.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then_some(self.mean)
    }

    /// Errors counted.
    pub fn count(&self) -> u64 {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_starts_as_a_plain_mean_then_moves_by_the_weight() {
        let mut e = MovingError::default();
        assert_eq!(e.mean(), None);
        assert!(e.observe(1.5, 1.0)); // 50% off
        assert_eq!(e.mean(), Some(0.5));
        assert!(e.observe(1.0, 1.0)); // exact: the plain mean of the two
        assert_eq!(e.mean(), Some(0.25));
        for _ in 0..18 {
            e.observe(1.0, 1.0);
        }
        // From the 20th on, each error moves the mean by the weight.
        let before = e.mean().unwrap();
        e.observe(2.0, 1.0);
        let want = before + ERROR_WEIGHT * (1.0 - before);
        assert!((e.mean().unwrap() - want).abs() < 1e-12);
        assert_eq!(e.count(), 21);
    }

    #[test]
    fn measurements_that_are_not_finite_and_positive_do_not_count() {
        let mut e = MovingError::default();
        for (p, m) in [
            (1.0, 0.0),
            (1.0, -1.0),
            (f64::NAN, 1.0),
            (1.0, f64::INFINITY),
        ] {
            assert!(!e.observe(p, m));
        }
        assert_eq!((e.count(), e.mean()), (0, None));
    }
}
