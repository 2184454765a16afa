//! The last `window_s` seconds of one role's requests as the scheduler judged them at
//! arrival: each admitted request's predicted latency (TTFT for prefill, TPOT for decode) and
//! each rejection blamed on the role. The conductor keeps one per role for its load endpoint;
//! the simulator keeps one for its autoscaler. Bounded: past `capacity` samples the oldest
//! go. Pure; time is passed in.

use std::collections::VecDeque;

use crate::quantile::nearest_rank;

/// Figures of one role over the window, what the load endpoint serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadFigures {
    /// Requests seen in the window (admitted plus rejected).
    pub arrivals: u64,
    pub rejected: u64,
    /// p50 and p90 of the predicted latency of the admitted requests, seconds (`None` when
    /// none was admitted).
    pub predicted_p50_s: Option<f64>,
    pub predicted_p90_s: Option<f64>,
    /// `rejected / arrivals` (`None` without arrivals).
    pub rejection_rate: Option<f64>,
    /// Share of arrivals admitted with a predicted latency within the SLO (`None` without
    /// arrivals).
    pub slo_attainment: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Sample {
    Admitted { predicted_s: f64 },
    Rejected,
}

/// A sliding window of samples.
#[derive(Clone, Debug)]
pub struct LoadWindow {
    window_s: f64,
    capacity: usize,
    samples: VecDeque<(f64, Sample)>,
}

impl LoadWindow {
    /// A window of `window_s` seconds holding at most `capacity` samples (at least 1).
    pub fn new(window_s: f64, capacity: usize) -> Self {
        Self {
            window_s: if window_s.is_finite() && window_s > 0.0 {
                window_s
            } else {
                1.0
            },
            capacity: capacity.max(1),
            samples: VecDeque::new(),
        }
    }

    pub fn window_s(&self) -> f64 {
        self.window_s
    }

    fn push(&mut self, now_s: f64, s: Sample) {
        self.expire(now_s);
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((now_s, s));
    }

    /// A request admitted at `now_s` with this predicted latency (non-finite values are
    /// ignored).
    pub fn admitted(&mut self, now_s: f64, predicted_s: f64) {
        if predicted_s.is_finite() && predicted_s >= 0.0 {
            self.push(now_s, Sample::Admitted { predicted_s });
        }
    }

    /// A request rejected at `now_s` for this role.
    pub fn rejected(&mut self, now_s: f64) {
        self.push(now_s, Sample::Rejected);
    }

    /// Drop samples older than the window.
    pub fn expire(&mut self, now_s: f64) {
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now_s - t > self.window_s)
        {
            self.samples.pop_front();
        }
    }

    /// The figures at `now_s` against the latency objective `slo_s`.
    pub fn figures(&mut self, now_s: f64, slo_s: f64) -> LoadFigures {
        self.expire(now_s);
        let mut predicted: Vec<f64> = Vec::with_capacity(self.samples.len());
        let mut rejected = 0u64;
        for &(_, s) in &self.samples {
            match s {
                Sample::Admitted { predicted_s } => predicted.push(predicted_s),
                Sample::Rejected => rejected += 1,
            }
        }
        predicted.sort_by(f64::total_cmp);
        let arrivals = self.samples.len() as u64;
        let within = predicted.iter().filter(|&&p| p <= slo_s).count() as f64;
        let share = |n: f64| (arrivals > 0).then(|| n / arrivals as f64);
        LoadFigures {
            arrivals,
            rejected,
            predicted_p50_s: nearest_rank(&predicted, 0.5),
            predicted_p90_s: nearest_rank(&predicted, 0.9),
            rejection_rate: share(rejected as f64),
            slo_attainment: share(within),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_cover_only_the_window() {
        let mut w = LoadWindow::new(10.0, 1000);
        for i in 0..10 {
            w.admitted(f64::from(i), f64::from(i + 1) / 10.0);
        }
        w.rejected(9.0);
        let f = w.figures(9.0, 0.5);
        assert_eq!(f.arrivals, 11);
        assert_eq!(f.rejected, 1);
        assert_eq!(f.predicted_p90_s, Some(0.9));
        assert_eq!(f.predicted_p50_s, Some(0.5));
        assert_eq!(f.rejection_rate, Some(1.0 / 11.0));
        assert_eq!(f.slo_attainment, Some(5.0 / 11.0));
        // 15 s later everything before t = 5 has left the window.
        let f = w.figures(15.0, 0.5);
        assert_eq!(f.arrivals, 5 + 1);
        assert_eq!(f.predicted_p90_s, Some(1.0));
        let f = w.figures(100.0, 0.5);
        assert_eq!(f, LoadFigures::default());
    }

    #[test]
    fn capacity_bounds_the_samples_and_bad_values_are_ignored() {
        let mut w = LoadWindow::new(60.0, 3);
        for i in 0..5 {
            w.admitted(0.0, f64::from(i));
        }
        w.admitted(0.0, f64::NAN);
        w.admitted(0.0, -1.0);
        let f = w.figures(0.0, 10.0);
        assert_eq!(f.arrivals, 3);
        assert_eq!(f.predicted_p50_s, Some(3.0));
    }
}
