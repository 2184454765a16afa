//! What a scheduler is configured with: the policy that chooses the prefill instance, when
//! requests are rejected, the SLOs, hot-block replication, the cluster's bandwidths and cost
//! models, and the validation of all of it. Pure data; the front door and the simulator build
//! it from their flags.

use std::num::NonZeroU32;

use crate::sched::cost::{DecodeCost, HandoffCost, PrefillCost};
use crate::sched::index::MAX_PREFILL_INSTANCES;

/// How the prefill instance is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// KVCache-centric (Mooncake): lowest estimated TTFT using local caches and the global pool.
    Conductor,
    /// Lowest estimated TTFT using local caches only: no global pool.
    LocalOnly,
    /// Most cached prefix blocks on the instance (longest prefix match), ties by load.
    CacheAware,
    /// Shortest queue.
    LeastLoad,
    /// Instances in turn.
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
}

impl Policy {
    /// Every policy, in the order reports list them.
    pub const ALL: [Policy; 6] = [
        Policy::Conductor,
        Policy::LocalOnly,
        Policy::CacheAware,
        Policy::LeastLoad,
        Policy::RoundRobin,
        Policy::Random,
    ];

    /// Whether prefill instances may fetch prefix blocks from the global pool.
    pub fn uses_pool(self) -> bool {
        self != Policy::LocalOnly
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Conductor => "conductor",
            Policy::LocalOnly => "local-only",
            Policy::CacheAware => "cache-aware",
            Policy::LeastLoad => "least-load",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
        }
    }
}

/// When requests are rejected at arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum Rejection {
    /// Never: every request is served, however late.
    None,
    /// On the estimated TTFT and the decode load as it is now.
    Early,
    /// On the estimated TTFT and the decode load predicted for when the request reaches decode.
    Predicted,
    /// Not at arrival: the decode instance refuses the request when it arrives there after its
    /// prefill, on its load then (the paper's baseline; the prefill is wasted). Simulator only.
    AtDecode,
}

impl Rejection {
    pub fn name(self) -> &'static str {
        match self {
            Rejection::None => "none",
            Rejection::Early => "early",
            Rejection::Predicted => "predicted",
            Rejection::AtDecode => "at-decode",
        }
    }
}

/// Service level objectives.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Slo {
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Time per output token, seconds.
    pub tpot_s: f64,
}

impl Slo {
    /// The SLO of the `--ttft-slo` and `--tpot-slo` flags; both must be above zero.
    pub fn from_flags(
        ttft: std::time::Duration,
        tpot: std::time::Duration,
    ) -> Result<Self, crate::flags::FlagError> {
        use crate::flags::positive;
        Ok(Self {
            ttft_s: positive("ttft-slo", ttft.as_secs_f64())?,
            tpot_s: positive("tpot-slo", tpot.as_secs_f64())?,
        })
    }
}

/// Hot-block replication: every `threshold` hits on a block, copy the prefix up to it into the
/// local caches of up to `fanout` more instances (least loaded first). `threshold` 0 disables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HotConfig {
    pub threshold: u32,
    pub fanout: usize,
}

/// Everything a scheduler needs to know about the cluster that does not change per request.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SchedulerConfig {
    pub policy: Policy,
    pub rejection: Rejection,
    pub slo: Slo,
    /// Tokens per block.
    pub block_size: NonZeroU32,
    /// KV bytes per token (2 x layers x kv heads x head dim x dtype bytes).
    pub bytes_per_token: u64,
    /// Bytes per second from the pool into a prefill instance.
    pub pool_bandwidth_bps: f64,
    /// Bytes per second from a prefill instance to a decode instance.
    pub kv_bandwidth_bps: f64,
    /// One cost model per prefill instance.
    pub prefill_costs: Vec<PrefillCost>,
    /// Decode step cost (every decode instance alike).
    pub decode_cost: DecodeCost,
    /// From the end of a prefill to the decode instance's first token (every pair alike).
    pub handoff: HandoffCost,
    /// KV tokens one decode instance can hold.
    pub decode_kv_capacity_tokens: u64,
    pub hot: HotConfig,
    /// Seed of the `random` policy.
    pub seed: u64,
}

/// A configuration value that makes no sense.
#[derive(Debug, thiserror::Error, PartialEq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ConfigError {
    #[error("{field} must be a finite number > 0, got {value}")]
    NotPositive { field: &'static str, value: f64 },
    #[error("{field} must be a finite number >= 0, got {value}")]
    Negative { field: &'static str, value: f64 },
    #[error("prefill instances must be between 1 and {MAX_PREFILL_INSTANCES}, got {got}")]
    PrefillInstances { got: usize },
    #[error("decode instances must be at least 1")]
    NoDecodeInstances,
}

impl ConfigError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Checks `config` for `decode_instances` decode instances (prefill instances are
/// `config.prefill_costs.len()`).
pub(super) fn validate(
    config: &SchedulerConfig,
    decode_instances: usize,
) -> Result<(), ConfigError> {
    let n = config.prefill_costs.len();
    if n == 0 || n > MAX_PREFILL_INSTANCES {
        return Err(ConfigError::PrefillInstances { got: n });
    }
    if decode_instances == 0 {
        return Err(ConfigError::NoDecodeInstances);
    }
    positive("ttft slo", config.slo.ttft_s)?;
    positive("tpot slo", config.slo.tpot_s)?;
    positive("pool bandwidth", config.pool_bandwidth_bps)?;
    positive("kv bandwidth", config.kv_bandwidth_bps)?;
    positive("bytes per token", config.bytes_per_token as f64)?;
    for (field, value) in [
        ("handoff fixed seconds", config.handoff.fixed_s),
        ("handoff seconds per token", config.handoff.per_token_s),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(ConfigError::Negative { field, value });
        }
    }
    positive(
        "decode kv capacity",
        config.decode_kv_capacity_tokens as f64,
    )
}

fn positive(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::NotPositive { field, value })
    }
}
