//! Cost models of prefill and decode instances, and the least-squares fit of the prefill model
//! from measured (tokens, seconds) profiles. Pure; no I/O (profiles are passed in as numbers).
//!
//! Prefill of a whole prompt of `n` tokens takes `f(n) = fixed + linear * n + quadratic * n^2`
//! seconds: the linear term is the per-token MLP/projection work, the quadratic term attention.
//! Prefilling the tokens after a cached prefix of `p` tokens costs `fixed + linear * (n - p) +
//! quadratic * (n^2 - p^2)`: the new tokens still attend to the cached ones.
//! A decode step (one token for every running sequence) takes `fixed + per_seq * batch +
//! per_ctx_token * context_tokens` seconds: weights are read once per step, the KV cache of every
//! running sequence once per step.

/// Errors of fitting a prefill cost model.
#[derive(Debug, thiserror::Error, PartialEq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum FitError {
    #[error("need at least 3 profile samples to fit fixed + linear + quadratic terms, got {got}")]
    TooFewSamples { got: usize },
    #[error(
        "profile sample {index} is invalid: tokens {tokens}, seconds {seconds} (seconds must be finite and >= 0)"
    )]
    InvalidSample {
        index: usize,
        tokens: u64,
        seconds: f64,
    },
    #[error(
        "profile samples span fewer than 3 distinct token counts; cannot separate the three terms"
    )]
    Degenerate,
}

impl FitError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Prefill time model of one instance, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct PrefillCost {
    /// Per-request overhead (scheduling, kernel launches), seconds.
    pub fixed_s: f64,
    /// Seconds per prompt token.
    pub linear_s: f64,
    /// Seconds per squared prompt token (attention).
    pub quadratic_s: f64,
}

impl Default for PrefillCost {
    /// A 70B-class dense model with GQA on one 8-GPU node, tensor parallel (see
    /// docs/scheduling.md for the derivation): about 1.5 s for 12k tokens, 30 s for 128k.
    fn default() -> Self {
        Self {
            fixed_s: 0.02,
            linear_s: 1.1e-4,
            quadratic_s: 1.0e-9,
        }
    }
}

impl PrefillCost {
    /// Seconds to prefill a prompt of `total` tokens whose first `cached` tokens are already in
    /// the instance's KV cache. Never negative.
    pub fn seconds(&self, cached: u64, total: u64) -> f64 {
        let cached = cached.min(total) as f64;
        let total = total as f64;
        let t = self.fixed_s
            + self.linear_s * (total - cached)
            + self.quadratic_s * (total * total - cached * cached);
        t.max(0.0)
    }

    /// Least-squares fit of `seconds = fixed + linear * tokens + quadratic * tokens^2` over full
    /// prefill profiles `(tokens, seconds)`.
    pub fn fit(samples: &[(u64, f64)]) -> Result<Self, FitError> {
        if samples.len() < 3 {
            return Err(FitError::TooFewSamples { got: samples.len() });
        }
        for (index, &(tokens, seconds)) in samples.iter().enumerate() {
            if !seconds.is_finite() || seconds < 0.0 {
                return Err(FitError::InvalidSample {
                    index,
                    tokens,
                    seconds,
                });
            }
        }
        let mut distinct: Vec<u64> = samples.iter().map(|s| s.0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() < 3 {
            return Err(FitError::Degenerate);
        }
        // Scale tokens to [0, 1] so that the normal equations stay well conditioned.
        let scale = distinct.last().copied().unwrap_or(1).max(1) as f64;
        // Normal equations A^T A theta = A^T y with rows (1, x, x^2).
        let mut ata = [[0.0f64; 3]; 3];
        let mut aty = [0.0f64; 3];
        for &(tokens, seconds) in samples {
            let x = tokens as f64 / scale;
            let row = [1.0, x, x * x];
            for r in 0..3 {
                for c in 0..3 {
                    ata[r][c] += row[r] * row[c];
                }
                aty[r] += row[r] * seconds;
            }
        }
        let theta = solve3(ata, aty).ok_or(FitError::Degenerate)?;
        Ok(Self {
            fixed_s: theta[0],
            linear_s: theta[1] / scale,
            quadratic_s: theta[2] / (scale * scale),
        })
    }
}

/// Gaussian elimination with partial pivoting; `None` when the system is singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..3 {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0f64; 3];
    for row in (0..3).rev() {
        let mut s = b[row];
        for k in row + 1..3 {
            s -= a[row][k] * x[k];
        }
        x[row] = s / a[row][row];
    }
    Some(x)
}

/// Time from the end of a prefill to the first token the decode instance sends: the hand-off of
/// the prompt's KV cache to the decode engine (on the pool path: the decode engine reading it
/// back) and the decode engine's first step, linear in the prompt's length. It is part of the
/// TTFT a client sees and of no prefill engine's time. The default is zero: a model that has not
/// measured it adds nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct HandoffCost {
    /// Seconds per request (the HTTP hop and the first decode step).
    pub fixed_s: f64,
    /// Seconds per prompt token (its KV read on the decode side).
    pub per_token_s: f64,
}

impl HandoffCost {
    /// Seconds for a prompt of `prompt_tokens`.
    pub fn seconds(&self, prompt_tokens: u64) -> f64 {
        self.fixed_s + self.per_token_s * prompt_tokens as f64
    }

    /// Whether both terms are finite and >= 0.
    pub fn is_valid(&self) -> bool {
        [self.fixed_s, self.per_token_s]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// Decode step time model of one instance, in seconds per step (one token per running sequence).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DecodeCost {
    /// Seconds per step regardless of load (reading the weights once).
    pub fixed_s: f64,
    /// Seconds per running sequence per step.
    pub per_seq_s: f64,
    /// Seconds per context token in the batch per step (reading the KV cache).
    pub per_ctx_token_s: f64,
}

/// The cost models as command-line flags (`--prefill-fixed-s` ... `--decode-per-ctx-token-s`),
/// for every role that models engine time: the synthetic engine and the simulators. Defaults
/// are the models' defaults.
#[cfg(feature = "clap")]
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct CostFlags {
    /// Prefill cost: fixed seconds per request.
    #[arg(long, default_value_t = PrefillCost::default().fixed_s)]
    pub prefill_fixed_s: f64,
    /// Prefill cost: seconds per prompt token.
    #[arg(long, default_value_t = PrefillCost::default().linear_s)]
    pub prefill_linear_s: f64,
    /// Prefill cost: seconds per squared prompt token.
    #[arg(long, default_value_t = PrefillCost::default().quadratic_s)]
    pub prefill_quadratic_s: f64,
    /// Decode step cost: fixed seconds.
    #[arg(long, default_value_t = DecodeCost::default().fixed_s)]
    pub decode_fixed_s: f64,
    /// Decode step cost: seconds per running sequence.
    #[arg(long, default_value_t = DecodeCost::default().per_seq_s)]
    pub decode_per_seq_s: f64,
    /// Decode step cost: seconds per context token in the batch.
    #[arg(long, default_value_t = DecodeCost::default().per_ctx_token_s)]
    pub decode_per_ctx_token_s: f64,
}

#[cfg(feature = "clap")]
impl CostFlags {
    /// The prefill model of the flags; every term must be finite and >= 0.
    pub fn prefill(&self) -> Result<PrefillCost, crate::flags::FlagError> {
        use crate::flags::non_negative;
        Ok(PrefillCost {
            fixed_s: non_negative("prefill-fixed-s", self.prefill_fixed_s)?,
            linear_s: non_negative("prefill-linear-s", self.prefill_linear_s)?,
            quadratic_s: non_negative("prefill-quadratic-s", self.prefill_quadratic_s)?,
        })
    }

    /// The decode model of the flags; every term must be finite and >= 0.
    pub fn decode(&self) -> Result<DecodeCost, crate::flags::FlagError> {
        use crate::flags::non_negative;
        Ok(DecodeCost {
            fixed_s: non_negative("decode-fixed-s", self.decode_fixed_s)?,
            per_seq_s: non_negative("decode-per-seq-s", self.decode_per_seq_s)?,
            per_ctx_token_s: non_negative("decode-per-ctx-token-s", self.decode_per_ctx_token_s)?,
        })
    }
}

impl Default for DecodeCost {
    /// The same 70B-class model on one 8-GPU node (see docs/scheduling.md): 320 KiB of KV per
    /// token read at about 16 TB/s of aggregate HBM bandwidth gives 2e-8 s per context token.
    fn default() -> Self {
        Self {
            fixed_s: 0.015,
            per_seq_s: 2.0e-4,
            per_ctx_token_s: 2.0e-8,
        }
    }
}

impl DecodeCost {
    /// Seconds of one decode step with `batch` sequences holding `context_tokens` in total.
    pub fn step_seconds(&self, batch: u64, context_tokens: u64) -> f64 {
        (self.fixed_s
            + self.per_seq_s * batch as f64
            + self.per_ctx_token_s * context_tokens as f64)
            .max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-12)
    }

    #[test]
    fn prefill_seconds_hand_computed() {
        let m = PrefillCost {
            fixed_s: 0.5,
            linear_s: 0.01,
            quadratic_s: 0.001,
        };
        // 0.5 + 0.01*100 + 0.001*100^2 = 0.5 + 1 + 10
        assert!(close(m.seconds(0, 100), 11.5, 1e-12));
        // cached 60: 0.5 + 0.01*40 + 0.001*(10000-3600) = 0.5 + 0.4 + 6.4
        assert!(close(m.seconds(60, 100), 7.3, 1e-12));
        // fully cached: only the fixed cost; cached beyond total is clamped
        assert!(close(m.seconds(100, 100), 0.5, 1e-12));
        assert!(close(m.seconds(500, 100), 0.5, 1e-12));
    }

    #[test]
    fn fit_recovers_exact_quadratic() {
        let truth = PrefillCost::default();
        let samples: Vec<(u64, f64)> = [1_000u64, 4_000, 16_000, 64_000, 128_000]
            .iter()
            .map(|&n| (n, truth.seconds(0, n)))
            .collect();
        let fit = PrefillCost::fit(&samples).unwrap();
        assert!(close(fit.fixed_s, truth.fixed_s, 1e-6), "{fit:?}");
        assert!(close(fit.linear_s, truth.linear_s, 1e-6), "{fit:?}");
        assert!(close(fit.quadratic_s, truth.quadratic_s, 1e-6), "{fit:?}");
    }

    #[test]
    fn fit_is_least_squares_on_noisy_points() {
        // Points (0,1),(1,0),(2,1),(3,0),(4,1) are symmetric about x = 2; with u = x - 2 the
        // normal equations are 5a + 10g = 3 and 10a + 34g = 8, so g = 1/7 and a = 11/35:
        // y = 11/35 + (x - 2)^2 / 7 = 31/35 - 4/7 x + 1/7 x^2.
        let samples = [(0, 1.0), (1, 0.0), (2, 1.0), (3, 0.0), (4, 1.0)];
        let fit = PrefillCost::fit(&samples).unwrap();
        assert!(close(fit.fixed_s, 31.0 / 35.0, 1e-9), "{fit:?}");
        assert!(close(fit.linear_s, -4.0 / 7.0, 1e-9), "{fit:?}");
        assert!(close(fit.quadratic_s, 1.0 / 7.0, 1e-9), "{fit:?}");
    }

    #[test]
    fn fit_rejects_bad_input() {
        assert_eq!(
            PrefillCost::fit(&[(1, 1.0), (2, 2.0)]),
            Err(FitError::TooFewSamples { got: 2 })
        );
        assert_eq!(
            PrefillCost::fit(&[(1, 1.0), (1, 1.1), (2, 2.0), (2, 2.1)]),
            Err(FitError::Degenerate)
        );
        let err = PrefillCost::fit(&[(1, 1.0), (2, f64::NAN), (3, 2.0)]).unwrap_err();
        assert_eq!(err.category(), "invalid_sample");
        assert!(err.to_string().contains("sample 1"), "{err}");
    }

    #[test]
    fn decode_step_hand_computed() {
        let d = DecodeCost {
            fixed_s: 0.01,
            per_seq_s: 0.001,
            per_ctx_token_s: 1e-6,
        };
        // 0.01 + 0.001*10 + 1e-6*20000 = 0.01 + 0.01 + 0.02
        assert!(close(d.step_seconds(10, 20_000), 0.04, 1e-12));
    }
}
