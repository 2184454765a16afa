//! Exact quantiles of small samples by nearest rank: the autoscaler's window of predicted
//! latencies and the simulator's report, whose figures feed decisions and exact test
//! expectations. Latencies measured in volume (the benchmarks) go into an `hdrhistogram`
//! instead. Pure.

/// The `q`-quantile (`q` clamped to 0..=1) of `sorted` (ascending) by nearest rank: the
/// smallest value with at least a `q` share of the sample at or below it. `None` when empty.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::nearest_rank;

    #[test]
    fn nearest_rank_of_a_hundred_one_and_none() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 0.5), Some(50.0));
        assert_eq!(nearest_rank(&v, 0.99), Some(99.0));
        assert_eq!(nearest_rank(&v, 1.0), Some(100.0));
        assert_eq!(nearest_rank(&v, 0.0), Some(1.0));
        assert_eq!(nearest_rank(&v, 7.0), Some(100.0));
        assert_eq!(nearest_rank(&[3.0], 0.99), Some(3.0));
        assert_eq!(nearest_rank(&[], 0.5), None);
        assert_eq!(nearest_rank(&v, f64::NAN), Some(1.0));
    }
}
