//! `kvpool simulate`: command-line flags of the trace simulator, validated into a `SimConfig`,
//! and the runner. I/O boundary: reads the trace and the optional prefill profile, prints the
//! report to stdout.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use kvpool_core::sched::{
    FitError, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo,
};

use kvpool_core::autoscale::Signal;
use kvpool_core::flags::{Bandwidth, FlagError, parse_bandwidth, parse_duration, positive};
use kvpool_core::sched::CostFlags;
use kvpool_core::sim::bench::{self, BenchConfig};
use kvpool_core::sim::engine::{SimConfig, SimError, UNLIMITED, simulate};
use kvpool_core::sim::scaling::AutoscaleConfig;
use kvpool_core::sim::trace::{self, TraceError};

/// A capacity in blocks, or `unlimited`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity(pub usize);

impl FromStr for Capacity {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "unlimited" | "inf" => Ok(Capacity(UNLIMITED)),
            _ => s
                .parse::<usize>()
                .map(Capacity)
                .map_err(|e| format!("expected a number of blocks or `unlimited`: {e}")),
        }
    }
}

/// A replica range `MIN:MAX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleRange {
    pub min: usize,
    pub max: usize,
}

impl FromStr for ScaleRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (min, max) = s
            .split_once(':')
            .ok_or_else(|| format!("expected MIN:MAX instances, got `{s}`"))?;
        let n = |v: &str| {
            v.trim()
                .parse::<usize>()
                .map_err(|e| format!("`{v}` in `{s}`: {e}"))
        };
        let (min, max) = (n(min)?, n(max)?);
        if min == 0 || min > max {
            return Err(format!("need 1 <= MIN <= MAX, got `{s}`"));
        }
        Ok(Self { min, max })
    }
}

/// Flags of `kvpool simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// Mooncake-format trace (JSON lines). Required unless --bench-decision.
    #[arg(long, required_unless_present = "bench_decision")]
    pub trace: Option<PathBuf>,
    /// Prefill placement policy.
    #[arg(long, value_enum, default_value_t = Policy::Conductor)]
    pub policy: Policy,
    /// Run every policy and report them side by side (ignores --policy).
    #[arg(long)]
    pub compare: bool,
    /// Early rejection mode.
    #[arg(long, value_enum, default_value_t = Rejection::None)]
    pub rejection: Rejection,
    /// Prefill instances (with --autoscale, the count at the start).
    #[arg(long, default_value_t = 8)]
    pub prefill: usize,
    /// Scale the prefill instances between MIN and MAX with the operator's autoscaling
    /// decision, every 15 s of replay time on the last 30 s of requests (docs/scheduling.md,
    /// "Autoscaling in the simulator").
    #[arg(long, value_name = "MIN:MAX")]
    pub autoscale: Option<ScaleRange>,
    /// The signal --autoscale follows.
    #[arg(long, value_enum, default_value_t = Signal::PredictedLatency, requires = "autoscale")]
    pub autoscale_signal: Signal,
    /// Target of the --autoscale signal instead of the operator's (predicted-latency: p90 over
    /// the SLO, 0.5; queue-depth: waiting per instance, 1; rejection-rate: 0.01;
    /// slo-attainment: 0.99).
    #[arg(long, requires = "autoscale")]
    pub autoscale_target: Option<f64>,
    /// Start-up time of an instance --autoscale adds (a duration: `30s`).
    #[arg(long, default_value = "30s", value_parser = parse_duration, requires = "autoscale")]
    pub autoscale_startup: Duration,
    /// Decode instances (with --autoscale-decode, the count at the start).
    #[arg(long, default_value_t = 8)]
    pub decode: usize,
    /// Scale the decode instances between MIN and MAX with the operator's autoscaling
    /// decision on the decode role's figures (predicted TPOT against --tpot-slo by default),
    /// every 15 s of replay time on the last 30 s of requests (docs/scheduling.md,
    /// "Autoscaling in the simulator").
    #[arg(long, value_name = "MIN:MAX")]
    pub autoscale_decode: Option<ScaleRange>,
    /// The signal --autoscale-decode follows (queue-depth: requests at a decode instance
    /// waiting for KV memory).
    #[arg(long, value_enum, default_value_t = Signal::PredictedLatency, requires = "autoscale_decode")]
    pub autoscale_decode_signal: Signal,
    /// Target of the --autoscale-decode signal instead of the operator's (as --autoscale-target).
    #[arg(long, requires = "autoscale_decode")]
    pub autoscale_decode_target: Option<f64>,
    /// Start-up time of a decode instance --autoscale-decode adds (a duration: `30s`).
    #[arg(long, default_value = "30s", value_parser = parse_duration, requires = "autoscale_decode")]
    pub autoscale_decode_startup: Duration,
    /// Local cache per prefill instance, blocks (`unlimited` allowed). Default: 3M tokens.
    #[arg(long, default_value = "5859")]
    pub local_cache_blocks: Capacity,
    /// Global pool capacity, blocks (`unlimited` allowed). Default: about 51M tokens.
    #[arg(long, default_value = "100000")]
    pub pool_blocks: Capacity,
    /// Tokens per block; must match the trace's hash_ids (512 for the Mooncake traces).
    #[arg(long, default_value_t = 512)]
    pub block_size: u32,
    #[command(flatten)]
    pub cost: CostFlags,
    /// Fit the prefill cost from a profile instead: CSV lines `tokens,seconds` (a header line
    /// and `#` comments are allowed).
    #[arg(long)]
    pub prefill_profile: Option<PathBuf>,
    /// KV tokens one decode instance holds.
    #[arg(long, default_value_t = 1_500_000)]
    pub decode_kv_capacity_tokens: u64,
    /// KV bytes per token (320 KiB: a 70B model with GQA in BF16; `--bytes-per-token` is its
    /// old spelling).
    #[arg(long, alias = "bytes-per-token", default_value_t = 327_680)]
    pub kv_bytes_per_token: u64,
    /// Pool -> prefill rate (`25GB/s`, `200Gbit/s`; a bare number is GB/s, as its old spelling
    /// `--pool-bandwidth-gbps` read it).
    #[arg(long, alias = "pool-bandwidth-gbps", default_value = "25GB/s", value_parser = parse_bandwidth)]
    pub pool_bandwidth: Bandwidth,
    /// Prefill -> decode KV transfer rate (as --pool-bandwidth; old spelling
    /// `--kv-bandwidth-gbps`).
    #[arg(long, alias = "kv-bandwidth-gbps", default_value = "25GB/s", value_parser = parse_bandwidth)]
    pub kv_bandwidth: Bandwidth,
    /// TTFT SLO (a duration: `30s`; `--ttft-slo-s` is its old spelling).
    #[arg(long, alias = "ttft-slo-s", default_value = "30s", value_parser = parse_duration)]
    pub ttft_slo: Duration,
    /// TPOT SLO (a duration: `100ms`; `--tpot-slo-s` is its old spelling).
    #[arg(long, alias = "tpot-slo-s", default_value = "100ms", value_parser = parse_duration)]
    pub tpot_slo: Duration,
    /// Replicate a hot prefix every this many hits on a block (0: off).
    #[arg(long, default_value_t = 0)]
    pub hot_threshold: u32,
    /// Instances a hot prefix is copied to each time.
    #[arg(long, default_value_t = 2)]
    pub hot_fanout: usize,
    /// Replay speed: arrival times are divided by this.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Benchmark one scheduling decision instead of simulating (release build recommended).
    #[arg(long)]
    pub bench_decision: bool,
    /// Benchmark: indexed blocks.
    #[arg(long, default_value_t = 1_000_000)]
    pub bench_blocks: usize,
    /// Benchmark: decisions to time.
    #[arg(long, default_value_t = 100_000)]
    pub bench_decisions: usize,
}

/// Errors of `kvpool simulate`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SimulateError {
    #[error(transparent)]
    Flag(#[from] FlagError),
    #[error("cannot read prefill profile {path}")]
    ProfileRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("prefill profile {path} line {line}: {problem}")]
    ProfileLine {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("cannot fit the prefill profile {path}")]
    ProfileFit {
        path: PathBuf,
        #[source]
        source: FitError,
    },
    #[error("cannot load the trace")]
    Trace(#[source] TraceError),
    #[error("simulation failed")]
    Sim(#[source] SimError),
    #[error("benchmark failed")]
    Bench(#[source] bench::BenchError),
    #[error("cannot encode the report as JSON")]
    Json(#[source] serde_json::Error),
}

kvpool_runtime::error_category!(SimulateError);

fn flag(flag: &'static str, problem: impl Into<String>) -> SimulateError {
    FlagError::new(flag, problem).into()
}

/// Parses a prefill profile: `tokens,seconds` per line; blank lines, `#` comments and one
/// non-numeric header line are skipped.
pub fn parse_profile(text: &str, path: &Path) -> Result<Vec<(u64, f64)>, SimulateError> {
    let mut samples = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |problem: String| SimulateError::ProfileLine {
            path: path.to_owned(),
            line: i + 1,
            problem,
        };
        let mut parts = line.split(',').map(str::trim);
        let (Some(t), Some(s), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(format!("expected `tokens,seconds`, got `{line}`")));
        };
        if samples.is_empty() && i == 0 && t.parse::<f64>().is_err() {
            continue; // header
        }
        let tokens = t
            .parse::<u64>()
            .map_err(|e| bad(format!("tokens `{t}`: {e}")))?;
        let seconds = s
            .parse::<f64>()
            .map_err(|e| bad(format!("seconds `{s}`: {e}")))?;
        samples.push((tokens, seconds));
    }
    Ok(samples)
}

/// The autoscaling of one role from its flags: `start` is the role's count flag (`--prefill`,
/// `--decode`), which must lie in `range`; `flag_name` names the range flag, whose `-target`
/// sibling overrides the operator's target of `signal`.
fn scale_config(
    range: ScaleRange,
    (count_flag, start): (&'static str, usize),
    most: usize,
    (flag_name, signal): (&'static str, Signal),
    target: Option<f64>,
    startup: Duration,
) -> Result<AutoscaleConfig, SimulateError> {
    if range.max > most {
        return Err(flag(
            flag_name,
            format!("MAX must be at most {most}, got {}", range.max),
        ));
    }
    if !(range.min..=range.max).contains(&start) {
        return Err(flag(
            count_flag,
            format!(
                "must lie within --{flag_name} {}:{}, got {start}",
                range.min, range.max
            ),
        ));
    }
    let mut a = AutoscaleConfig {
        start,
        startup_s: startup.as_secs_f64(),
        ..AutoscaleConfig::new(range.min, range.max, signal)
    };
    if let Some(t) = target {
        let b = &mut a.behavior;
        let (value, allowed) = match signal {
            Signal::PredictedLatency => (&mut b.latency_target_ratio, 0.0..=100.0),
            Signal::QueueDepth => (&mut b.queue_target_per_instance, 0.0..=1e6),
            Signal::RejectionRate => (&mut b.rejection_target, 0.0..=1.0),
            Signal::SloAttainment => (&mut b.attainment_target, 0.0..=1.0),
        };
        if !(t > *allowed.start() && t <= *allowed.end()) {
            let target_flag = match flag_name {
                "autoscale" => "autoscale-target",
                _ => "autoscale-decode-target",
            };
            return Err(flag(
                target_flag,
                format!(
                    "must lie in ({}, {}], got {t}",
                    allowed.start(),
                    allowed.end()
                ),
            ));
        }
        *value = t;
    }
    Ok(a)
}

/// Validates the flags into a simulation configuration.
pub fn sim_config(args: &SimulateArgs) -> Result<SimConfig, SimulateError> {
    if args.prefill == 0 || args.prefill > kvpool_core::sched::index::MAX_PREFILL_INSTANCES {
        return Err(flag(
            "prefill",
            format!(
                "must be between 1 and {}, got {}",
                kvpool_core::sched::index::MAX_PREFILL_INSTANCES,
                args.prefill
            ),
        ));
    }
    if args.decode == 0 {
        return Err(flag("decode", "must be at least 1"));
    }
    let autoscale = args
        .autoscale
        .map(|r| {
            scale_config(
                r,
                ("prefill", args.prefill),
                kvpool_core::sched::index::MAX_PREFILL_INSTANCES,
                ("autoscale", args.autoscale_signal),
                args.autoscale_target,
                args.autoscale_startup,
            )
        })
        .transpose()?;
    let autoscale_decode = args
        .autoscale_decode
        .map(|r| {
            scale_config(
                r,
                ("decode", args.decode),
                usize::MAX,
                ("autoscale-decode", args.autoscale_decode_signal),
                args.autoscale_decode_target,
                args.autoscale_decode_startup,
            )
        })
        .transpose()?;
    let instances = autoscale.map_or(args.prefill, |a| a.max);
    let block_size =
        NonZeroU32::new(args.block_size).ok_or_else(|| flag("block-size", "must be at least 1"))?;
    let prefill_cost = match &args.prefill_profile {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|source| SimulateError::ProfileRead {
                    path: path.clone(),
                    source,
                })?;
            let samples = parse_profile(&text, path)?;
            PrefillCost::fit(&samples).map_err(|source| SimulateError::ProfileFit {
                path: path.clone(),
                source,
            })?
        }
        None => args.cost.prefill()?,
    };
    let decode_cost = args.cost.decode()?;
    if args.decode_kv_capacity_tokens == 0 {
        return Err(flag("decode-kv-capacity-tokens", "must be at least 1"));
    }
    if args.kv_bytes_per_token == 0 {
        return Err(flag("kv-bytes-per-token", "must be at least 1"));
    }
    Ok(SimConfig {
        scheduler: SchedulerConfig {
            policy: args.policy,
            rejection: args.rejection,
            slo: Slo::from_flags(args.ttft_slo, args.tpot_slo)?,
            block_size,
            bytes_per_token: args.kv_bytes_per_token,
            pool_bandwidth_bps: args.pool_bandwidth.bytes_per_s(),
            kv_bandwidth_bps: args.kv_bandwidth.bytes_per_s(),
            prefill_costs: vec![prefill_cost; instances],
            decode_cost,
            handoff: Default::default(),
            decode_kv_capacity_tokens: args.decode_kv_capacity_tokens,
            hot: HotConfig {
                threshold: args.hot_threshold,
                fanout: args.hot_fanout,
            },
            seed: args.seed,
        },
        decode_instances: autoscale_decode.map_or(args.decode, |a| a.max),
        local_cache_blocks: args.local_cache_blocks.0,
        pool_blocks: args.pool_blocks.0,
        time_scale: positive("time-scale", args.time_scale)?,
        autoscale,
        autoscale_decode,
    })
}

/// Runs `kvpool simulate` and returns what to print.
pub fn execute(args: &SimulateArgs) -> Result<String, SimulateError> {
    if args.bench_decision {
        let report = bench::run(BenchConfig {
            prefill_instances: args.prefill,
            decode_instances: args.decode,
            blocks: args.bench_blocks,
            decisions: args.bench_decisions,
            seed: args.seed,
            ..BenchConfig::default()
        })
        .map_err(SimulateError::Bench)?;
        return if args.json {
            serde_json::to_string_pretty(&report).map_err(SimulateError::Json)
        } else {
            Ok(report.to_text())
        };
    }
    let config = sim_config(args)?;
    let path = args
        .trace
        .as_deref()
        .ok_or_else(|| flag("trace", "is required"))?;
    let records = trace::load(path, args.block_size).map_err(SimulateError::Trace)?;
    let policies: Vec<Policy> = if args.compare {
        Policy::ALL.to_vec()
    } else {
        vec![args.policy]
    };
    let mut reports = Vec::with_capacity(policies.len());
    let mut text = String::new();
    for policy in policies {
        let mut cfg = config.clone();
        cfg.scheduler.policy = policy;
        let started = Instant::now();
        let report = simulate(&records, &cfg).map_err(SimulateError::Sim)?;
        tracing::info!(
            policy = policy.name(),
            requests = records.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "simulated"
        );
        text.push_str(&report.to_text());
        text.push('\n');
        reports.push(report);
    }
    if args.json {
        if args.compare {
            serde_json::to_string_pretty(&reports).map_err(SimulateError::Json)
        } else {
            serde_json::to_string_pretty(&reports[0]).map_err(SimulateError::Json)
        }
    } else {
        Ok(text)
    }
}

/// Entry point of the subcommand.
pub fn run(args: &SimulateArgs) -> Result<(), SimulateError> {
    let out = execute(args)?;
    println!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests;
