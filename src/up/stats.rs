//! The arithmetic of a replay's summary: what happened to each request, latency statistics
//! (mean and nearest-rank quantiles), and how the conductor's predicted TTFT (its
//! `x-kvpool-ttft-estimate-ms` response header) compares with the TTFT the client observed.
//! Pure: `replay` measures, this module only counts.

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// Streamed to the end: seconds to the first token, and between tokens after it; the
    /// conductor's TTFT estimate for it (seconds), when its response carried one.
    Served {
        ttft_s: f64,
        tpot_s: Option<f64>,
        tokens: u64,
        predicted_ttft_s: Option<f64>,
    },
    /// 429 from the conductor (early rejection under load), or 400 `slo_unattainable` (a
    /// request that cannot meet its SLO on an idle pool either).
    Rejected,
    /// Anything else (status or transport error).
    Failed,
}

/// `q`-quantile (0..=1) of `values` by nearest rank ([`kvpool_core::quantile`]); `None` when
/// empty.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    kvpool_core::quantile::nearest_rank(&v, q)
}

/// The arithmetic mean; `None` when empty.
pub fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Mean, median, 90th and 99th percentile of some latencies (`None` when there were none).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Quantiles {
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

impl Quantiles {
    /// Of `values`, in any order.
    pub fn of(values: &[f64]) -> Self {
        Quantiles {
            mean: mean(values),
            p50: quantile(values, 0.5),
            p90: quantile(values, 0.9),
            p99: quantile(values, 0.99),
        }
    }
}

/// The conductor's TTFT prediction against the observed TTFT, over the served requests whose
/// response carried a prediction (milliseconds; `None` when there were none).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Served requests with a prediction.
    pub requests: usize,
    /// Median of the predictions.
    pub median_predicted_ms: Option<f64>,
    /// Median of the observed TTFTs of the same requests.
    pub median_observed_ms: Option<f64>,
    /// `median_predicted_ms / median_observed_ms`: 1 is a calibrated estimate, above 1 a
    /// pessimistic one.
    pub median_ratio: Option<f64>,
    /// Median over the requests of `|predicted - observed| / observed`.
    pub median_abs_error_ratio: Option<f64>,
    /// Mean over the requests of `(predicted - observed) / observed` (the sign says which way
    /// the estimate leans).
    pub mean_error_ratio: Option<f64>,
}

impl Prediction {
    /// Of `(predicted, observed)` pairs in milliseconds, in any order; pairs with an observed
    /// TTFT of zero count in the medians but not in the error ratios.
    pub fn of(pairs: &[(f64, f64)]) -> Self {
        let predicted: Vec<f64> = pairs.iter().map(|p| p.0).collect();
        let observed: Vec<f64> = pairs.iter().map(|p| p.1).collect();
        let signed: Vec<f64> = pairs
            .iter()
            .filter(|(_, o)| *o > 0.0)
            .map(|(p, o)| (p - o) / o)
            .collect();
        let abs: Vec<f64> = signed.iter().map(|e| e.abs()).collect();
        let median_predicted_ms = quantile(&predicted, 0.5);
        let median_observed_ms = quantile(&observed, 0.5);
        Prediction {
            requests: pairs.len(),
            median_predicted_ms,
            median_observed_ms,
            median_ratio: median_predicted_ms
                .zip(median_observed_ms)
                .filter(|(_, o)| *o > 0.0)
                .map(|(p, o)| p / o),
            median_abs_error_ratio: quantile(&abs, 0.5),
            mean_error_ratio: mean(&signed),
        }
    }
}

/// Counts and latency statistics of a replay (latencies in milliseconds of wall-clock time).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayStats {
    pub requests: usize,
    pub served: usize,
    pub rejected: usize,
    pub failed: usize,
    pub generated_tokens: u64,
    pub ttft_ms: Quantiles,
    pub tpot_ms: Quantiles,
    pub ttft_prediction: Prediction,
    pub wall_s: f64,
}

/// Summarises the outcomes.
pub fn summarise(outcomes: &[Outcome], wall_s: f64) -> ReplayStats {
    let mut s = ReplayStats {
        requests: outcomes.len(),
        wall_s,
        ..ReplayStats::default()
    };
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let mut pairs = Vec::new();
    for o in outcomes {
        match o {
            Outcome::Served {
                ttft_s,
                tpot_s,
                tokens,
                predicted_ttft_s,
            } => {
                s.served += 1;
                s.generated_tokens += tokens;
                ttft.push(ttft_s * 1e3);
                if let Some(t) = tpot_s {
                    tpot.push(t * 1e3);
                }
                if let Some(p) = predicted_ttft_s {
                    pairs.push((p * 1e3, ttft_s * 1e3));
                }
            }
            Outcome::Rejected => s.rejected += 1,
            Outcome::Failed => s.failed += 1,
        }
    }
    s.ttft_ms = Quantiles::of(&ttft);
    s.tpot_ms = Quantiles::of(&tpot);
    s.ttft_prediction = Prediction::of(&pairs);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(ttft_s: f64, predicted: Option<f64>) -> Outcome {
        Outcome::Served {
            ttft_s,
            tpot_s: None,
            tokens: 1,
            predicted_ttft_s: predicted,
        }
    }

    #[test]
    fn quantiles_and_summary() {
        assert_eq!(quantile(&[], 0.5), None);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.0));
        assert_eq!(quantile(&v, 0.9), Some(90.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&[3.0], 0.99), Some(3.0));
        assert_eq!(mean(&v), Some(50.5));
        assert_eq!(mean(&[]), None);
        let s = summarise(
            &[
                Outcome::Served {
                    ttft_s: 0.1,
                    tpot_s: Some(0.01),
                    tokens: 5,
                    predicted_ttft_s: None,
                },
                served(0.3, None),
                Outcome::Rejected,
                Outcome::Failed,
            ],
            2.0,
        );
        assert_eq!((s.requests, s.served, s.rejected, s.failed), (4, 2, 1, 1));
        assert_eq!(s.generated_tokens, 6);
        assert_eq!(s.ttft_ms.p50, Some(100.0));
        assert_eq!(s.ttft_ms.p90, Some(300.0));
        assert_eq!(s.ttft_ms.p99, Some(300.0));
        assert_eq!(s.ttft_ms.mean, Some(200.0));
        assert_eq!(s.tpot_ms.p50, Some(10.0));
        // No response carried a prediction: nothing to compare.
        assert_eq!(s.ttft_prediction, Prediction::default());
    }

    #[test]
    fn the_prediction_is_compared_per_request_and_by_medians() {
        // Observed 100, 200, 400 ms; predicted 150 (+50%), 200 (0), 300 (-25%) ms; one
        // request without a prediction stays out of the comparison.
        let s = summarise(
            &[
                served(0.1, Some(0.15)),
                served(0.2, Some(0.2)),
                served(0.4, Some(0.3)),
                served(5.0, None),
                Outcome::Rejected,
            ],
            1.0,
        );
        let p = s.ttft_prediction;
        assert_eq!(p.requests, 3);
        assert_eq!(p.median_predicted_ms, Some(200.0));
        assert_eq!(p.median_observed_ms, Some(200.0));
        assert_eq!(p.median_ratio, Some(1.0));
        // Absolute errors 0.5, 0, 0.25: the median is 0.25 although the medians agree.
        assert_eq!(p.median_abs_error_ratio, Some(0.25));
        let mean = p.mean_error_ratio.unwrap();
        assert!((mean - (0.5 + 0.0 - 0.25) / 3.0).abs() < 1e-12, "{mean}");
        // All four served requests count in the TTFT statistics.
        assert_eq!(s.ttft_ms.p99, Some(5000.0));
    }

    #[test]
    fn an_observed_ttft_of_zero_gives_no_error_ratio() {
        let p = Prediction::of(&[(10.0, 0.0)]);
        assert_eq!(p.requests, 1);
        assert_eq!(p.median_predicted_ms, Some(10.0));
        assert_eq!((p.median_ratio, p.median_abs_error_ratio), (None, None));
        assert_eq!(p.mean_error_ratio, None);
    }
}
