//! The pool fetch term of the TTFT estimate, learnt from the prefill engines' measured pool
//! reads ([`FetchEstimate`]). Pure: the server feeds it the `x-kvpool-kv-load-*` headers.

/// The pool fetch term of the TTFT estimate, learnt from the engines: an exponentially weighted
/// moving average of the measured seconds per block read from the pool (cost-model seconds),
/// standing in for the configured bandwidth once the first measurement arrives. Pure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FetchEstimate {
    /// Seconds per block at the configured bandwidth, until a measurement arrives.
    configured_s: f64,
    measured_s: Option<f64>,
    samples: u64,
}

impl FetchEstimate {
    /// Weight of a new measurement in the average.
    pub const ALPHA: f64 = 0.2;

    /// Starts from the configured bandwidth (`bps`) for blocks of `block_bytes`.
    pub fn new(block_bytes: u64, bps: f64) -> Self {
        Self {
            configured_s: block_bytes as f64 / bps,
            measured_s: None,
            samples: 0,
        }
    }

    /// An engine read `blocks` blocks from the pool in `seconds` (cost-model seconds). Zero
    /// blocks or a non-finite or negative time carry no information and are ignored.
    pub fn observe(&mut self, blocks: u64, seconds: f64) {
        if blocks == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let per_block = seconds / blocks as f64;
        self.measured_s = Some(match self.measured_s {
            None => per_block,
            Some(old) => old + Self::ALPHA * (per_block - old),
        });
        self.samples += 1;
    }

    /// Seconds to fetch one block: the average of the measurements, or the configured figure.
    pub fn seconds_per_block(&self) -> f64 {
        self.measured_s.unwrap_or(self.configured_s)
    }

    /// Measurements taken so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The bandwidth the policy's fetch term should use for blocks of `block_bytes` (at least
    /// one byte per second, so that a zero measurement does not divide by zero).
    pub fn bandwidth_bps(&self, block_bytes: u64) -> f64 {
        let s = self.seconds_per_block();
        if s > 0.0 {
            block_bytes as f64 / s
        } else {
            f64::MAX
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_estimate_starts_configured_and_follows_measurements() {
        // 1 MB blocks at 1 GB/s: 1 ms per block until measured.
        let mut f = FetchEstimate::new(1_000_000, 1e9);
        assert!((f.seconds_per_block() - 1e-3).abs() < 1e-15);
        assert!((f.bandwidth_bps(1_000_000) - 1e9).abs() < 1.0);
        // Nothing read, or nonsense: ignored.
        f.observe(0, 5.0);
        f.observe(3, f64::NAN);
        f.observe(3, -1.0);
        assert_eq!(f.samples(), 0);
        // First measurement replaces the configured figure: 4 blocks in 40 ms = 10 ms each.
        f.observe(4, 0.04);
        assert!((f.seconds_per_block() - 0.01).abs() < 1e-15);
        assert!((f.bandwidth_bps(1_000_000) - 1e8).abs() < 1e-3);
        // Then a 20% step toward each new one: 10 ms + 0.2 x (30 ms - 10 ms) = 14 ms.
        f.observe(1, 0.03);
        assert!((f.seconds_per_block() - 0.014).abs() < 1e-15);
        assert_eq!(f.samples(), 2);
        // A measured zero (blocks already in memory) means no fetch cost, not a division by 0.
        let mut z = FetchEstimate::new(10, 1.0);
        z.observe(2, 0.0);
        assert_eq!(z.bandwidth_bps(10), f64::MAX);
    }
}
