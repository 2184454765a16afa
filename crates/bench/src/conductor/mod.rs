//! `kvpool bench conductor`: the front door's own cost. Starts `kvpool up --engine-protocol
//! sglang` (master, agents, synthetic prefill and decode engines in SGLang's convention, the
//! conductor in front of them) with a small time scale, so that the engines' modelled compute
//! is tiny and the front door's work shows; with `--vs-sglang-router`, also sglang-router
//! (PyPI `sglang-router`) in its prefill/decode mode in front of the same engines. Then, in
//! each round, drives every target with the same load generator: `direct` (the generator pairs
//! each request to a prefill and a decode engine itself, a front door of zero cost), the
//! conductor, and sglang-router, the two front doors in alternating order from round to round.
//! Reports, per target, the latency at one request in flight (p50, p99), what it adds over
//! `direct` in the same round, and the maximum request rate of a closed loop; medians over the
//! rounds, and the conductor's figures over the router's.
//! The map: `stack` starts `kvpool up`, `router` finds, installs and starts sglang-router,
//! `load` is the load generator over `http`'s keep-alive client, `report` the pure medians,
//! ratios and printing.
//! I/O boundary: child processes, loopback HTTP, stdout.

mod http;
mod load;
mod report;
pub mod router;
mod stack;

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use self::load::Load;
pub use self::load::{Phase, Target, Workload, prompt};
pub use self::report::{
    CONDUCTOR, DIRECT, ROUTER, Ratios, Report, Round, TargetRound, TargetSummary, TargetsMet,
};
use self::router::SglangRouter;
pub use self::stack::{Stack, parse_ready};

/// How long a front door gets to serve its first request once started.
const SERVING_TIMEOUT: Duration = Duration::from_secs(60);
/// Requests at one in flight before each target's measured phases (connections, caches).
const WARMUP_REQUESTS: u64 = 20;
/// How long `kvpool up` and the router get to stop.
const STOP_GRACE: Duration = Duration::from_secs(20);

/// Flags of `kvpool bench conductor`.
#[derive(Clone, Debug, Args)]
pub struct ConductorBenchArgs {
    /// Requests per target and round at one request in flight (the latency phase).
    #[arg(long, default_value_t = 2000)]
    pub requests: u64,
    /// Requests in flight in the closed loop (the maximum request rate).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// How long the closed loop runs per target and round.
    #[arg(long, default_value = "5s", value_parser = kvpool_core::flags::parse_duration)]
    pub duration: Duration,
    /// Rounds; the front doors' order alternates between rounds and the report gives medians.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Prompt bytes per request (stand-in tokens of 4 bytes: 256 B is 64 tokens, under one
    /// KV block, so that the engines move no prompt blocks through the pool).
    #[arg(long, default_value_t = 256)]
    pub prompt_bytes: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4)]
    pub max_tokens: u32,
    /// Ask for server-sent events (latency is then to the `[DONE]` event); default: JSON.
    #[arg(long)]
    pub stream: bool,
    /// Prefill engines.
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode engines.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Node agents (the pool through which the prefill engine hands each request's KV to the
    /// decode engine).
    #[arg(long, default_value_t = 1)]
    pub agents: usize,
    /// The engines' time scale (0: their modelled compute takes no time).
    #[arg(long, default_value_t = 0.0)]
    pub time_scale: f64,
    /// Model name served.
    #[arg(long, default_value = "kvpool-synthetic")]
    pub model: String,
    /// Also measure sglang-router (PyPI `sglang-router`, found or installed in a venv) in its
    /// prefill/decode mode in front of the same engines, in the same rounds.
    #[arg(long = "vs-sglang-router", alias = "vs_sglang_router")]
    pub vs_sglang_router: bool,
    /// The venv holding sglang-router (default: KVPOOL_ROUTER_VENV, else .tools/router, made
    /// and filled from PyPI when it lacks the router).
    #[arg(long = "router-venv", alias = "router_venv")]
    pub router_venv: Option<PathBuf>,
    /// Threads of the load generator's runtime.
    #[arg(long, default_value_t = 1)]
    pub client_threads: usize,
    /// Keep the children's logs in this directory (default: a temporary one, removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Errors of `kvpool bench conductor`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ConductorBenchError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error("I/O on the benchmark's files")]
    Io(#[source] std::io::Error),
    #[error(transparent)]
    Process(kvpool_harness::HarnessError),
    #[error("kvpool up: {0}")]
    Up(String),
    #[error("sglang-router: {0}")]
    Router(String),
    #[error("{target} does not serve: {error}")]
    NotServing { target: String, error: String },
    #[error("cannot start the Tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot encode the report")]
    Json(#[source] serde_json::Error),
}

kvpool_runtime::error_category!(ConductorBenchError);

impl ConductorBenchArgs {
    fn validate(&self) -> Result<(), ConductorBenchError> {
        let bad = |m: &str| Err(ConductorBenchError::Args(m.to_owned()));
        if self.requests == 0 || self.concurrency == 0 || self.rounds == 0 {
            return bad("--requests, --concurrency and --rounds must be > 0");
        }
        if self.duration.is_zero() {
            return bad("--duration must be > 0");
        }
        if self.prefill == 0 || self.decode == 0 || self.agents == 0 {
            return bad("--prefill, --decode and --agents must be > 0");
        }
        if self.max_tokens == 0 || self.client_threads == 0 {
            return bad("--max-tokens and --client-threads must be > 0");
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return bad("--time-scale must be a number >= 0");
        }
        Ok(())
    }

    fn workload(&self) -> Workload {
        Workload {
            model: self.model.clone(),
            prompt_bytes: self.prompt_bytes,
            max_tokens: self.max_tokens,
            stream: self.stream,
        }
    }
}

/// The targets of round `round`, in the order they run: `direct` first (the baseline the
/// front doors' added latency is taken against), then the front doors, whose order alternates.
pub fn round_order(round: u32, with_router: bool) -> Vec<&'static str> {
    let mut doors = vec![CONDUCTOR];
    if with_router {
        doors.push(ROUTER);
        if round % 2 == 1 {
            doors.reverse();
        }
    }
    std::iter::once(DIRECT).chain(doors).collect()
}

/// Entry point of `kvpool bench conductor`.
pub fn run(args: ConductorBenchArgs) -> Result<(), ConductorBenchError> {
    args.validate()?;
    let router = args
        .vs_sglang_router
        .then(|| SglangRouter::find_or_install(args.router_venv.as_deref()))
        .transpose()?;
    let temp = tempfile::Builder::new()
        .prefix("kvpool-bench-conductor-")
        .tempdir()
        .map_err(ConductorBenchError::Io)?;
    let dir = args.dir.clone().unwrap_or_else(|| temp.path().to_owned());
    let logs = dir.join("logs");
    let up_args = stack::up_args(&args, &dir.join("up"));
    let (mut up, stack) = stack::start(&up_args, &logs)?;
    let mut router_child = None;
    let mut router_command = None;
    if let Some(r) = &router {
        let ports = kvpool_harness::free_ports(2).map_err(ConductorBenchError::Process)?;
        let a = r.args(&stack.prefill, &stack.decode, ports[0], ports[1]);
        router_command = Some(format!("{} {}", r.python().display(), a.join(" ")));
        router_child = Some((
            r.spawn(&logs, &a)?,
            format!("http://127.0.0.1:{}", ports[0]),
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads)
        .enable_all()
        .build()
        .map_err(ConductorBenchError::Runtime)?;
    let targets = {
        let mut t = vec![
            (
                DIRECT,
                Target::Direct {
                    prefill: stack.prefill.clone(),
                    decode: stack.decode.clone(),
                },
            ),
            (
                CONDUCTOR,
                Target::Front {
                    base: stack.conductor.clone(),
                },
            ),
        ];
        if let Some((_, base)) = &router_child {
            t.push((ROUTER, Target::Front { base: base.clone() }));
        }
        t
    };
    let measured = runtime.block_on(measure(&args, &targets));
    drop(runtime);
    if let Some((mut child, _)) = router_child {
        child.stop(STOP_GRACE);
    }
    let stopped = up.stop(STOP_GRACE);
    if !stopped.clean() {
        tracing::warn!(status = ?stopped.status, logs = %logs.display(), "kvpool up did not stop cleanly");
    }
    let rounds = measured?;
    let summaries: std::collections::BTreeMap<String, report::TargetSummary> = targets
        .iter()
        .filter_map(|(name, _)| Some(((*name).to_owned(), report::summarise(&rounds, name)?)))
        .collect();
    let exe = std::env::current_exe().map_err(ConductorBenchError::Io)?;
    let report = Report {
        rounds: args.rounds,
        requests: args.requests,
        concurrency: args.concurrency,
        duration_s: args.duration.as_secs_f64(),
        prompt_bytes: args.prompt_bytes,
        max_tokens: args.max_tokens,
        stream: args.stream,
        prefill: args.prefill,
        decode: args.decode,
        agents: args.agents,
        time_scale: args.time_scale,
        up_command: format!("{} {}", exe.display(), up_args.join(" ")),
        orders: rounds.iter().map(|r| r.order.clone()).collect(),
        sglang_router_version: router.map(|r| r.version),
        sglang_router_command: router_command,
        ratio_vs_sglang_router: report::ratios(&summaries),
        targets_met: report::targets_met(&summaries),
        all_succeeded: summaries.values().all(|t| t.failed == 0),
        targets: summaries,
    };
    if args.json {
        let text = serde_json::to_string(&report).map_err(ConductorBenchError::Json)?;
        println!("{text}");
    } else {
        report::print_text(&report);
    }
    Ok(())
}

/// Every round: each target warmed up, then its two phases.
async fn measure(
    args: &ConductorBenchArgs,
    targets: &[(&'static str, Target)],
) -> Result<Vec<Round>, ConductorBenchError> {
    let load = Load::new(args.workload());
    for (name, target) in targets {
        load.wait_serving(target, SERVING_TIMEOUT)
            .await
            .map_err(|error| ConductorBenchError::NotServing {
                target: (*name).to_owned(),
                error,
            })?;
    }
    let with_router = targets.iter().any(|(n, _)| *n == ROUTER);
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let order = round_order(round, with_router);
        let mut r = Round {
            order: order.iter().map(|s| (*s).to_owned()).collect(),
            ..Round::default()
        };
        for name in order {
            let Some((_, target)) = targets.iter().find(|(n, _)| *n == name) else {
                continue;
            };
            load.sequential(target, WARMUP_REQUESTS).await;
            let one_in_flight = load.sequential(target, args.requests).await;
            let closed_loop = load
                .closed_loop(target, args.concurrency, args.duration)
                .await;
            tracing::info!(
                round,
                target = name,
                p50_ms = one_in_flight.p50_ms,
                rps = closed_loop.requests_per_second,
                "measured"
            );
            r.targets.insert(
                name.to_owned(),
                TargetRound {
                    one_in_flight,
                    closed_loop,
                },
            );
        }
        rounds.push(r);
    }
    Ok(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_runs_first_and_the_front_doors_alternate() {
        assert_eq!(round_order(0, true), [DIRECT, CONDUCTOR, ROUTER]);
        assert_eq!(round_order(1, true), [DIRECT, ROUTER, CONDUCTOR]);
        assert_eq!(round_order(2, true), [DIRECT, CONDUCTOR, ROUTER]);
        assert_eq!(round_order(1, false), [DIRECT, CONDUCTOR]);
    }
}
