//! `kvpool bench ...`: benchmark subcommands. Each area adds a variant to [`BenchCommand`] and a
//! module here (`transfer`, `sched`, `store`, `stress`, `master`, `conductor`, `engine`,
//! `idle_memory`); the
//! tier benchmark is the node agent's own (`kvpool_agent::bench`).
//! I/O boundary: whatever each benchmark drives (sockets, child processes, stdout).

pub mod conductor;
pub mod engine;
pub mod idle_memory;
pub mod master;
pub mod mooncake;
pub mod sched;
pub mod store;
pub mod stress;
pub mod transfer;

use clap::{Args, Subcommand};

/// `kvpool bench`
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Transfer engine throughput and latency (flags mirror Mooncake's transfer_engine_bench).
    Transfer(Box<transfer::TransferBenchArgs>),
    /// Latency of one scheduling decision (64 prefill and 64 decode instances, 10^6 indexed
    /// blocks by default).
    Sched(sched::SchedBenchArgs),
    /// The node agent's tiers: DRAM put/get through the engine API and SSD sequential I/O,
    /// against memcpy and dd.
    Tier(kvpool_agent::bench::TierArgs),
    /// The start-up cost of an agent with a persistent DRAM tier: every block's checksum
    /// verified when the tier's index is opened again.
    DramRestart(kvpool_agent::bench_restart::DramRestartArgs),
    /// The pool end to end on loopback (master, agents, client processes) against Redis.
    Store(Box<store::StoreBenchArgs>),
    /// The shape of Mooncake's stress benchmark (a writer process's `batch_put_from`, then a
    /// reader process's `batch_get_into`, and the `_multi_buffers` forms) through kvpool's
    /// Mooncake API, and (with --vs-mooncake) against Mooncake Store in the same run.
    Stress(Box<stress::StressBenchArgs>),
    /// The conductor's own cost in front of synthetic SGLang-convention engines: added
    /// latency at one request in flight and maximum request rate, against a direct client
    /// and (with --vs-sglang-router) sglang-router in the same run.
    Conductor(Box<conductor::ConductorBenchArgs>),
    /// The master's metadata path: lookups/s, puts/s and RSS per object (`kvpool master-bench`
    /// is its old spelling).
    Master(master::MasterBenchArgs),
    /// Time to first token on real vLLM (CPU build) of a prefix loaded from kvpool (kvpool's
    /// connector and vLLM's MooncakeStoreConnector) and from real Mooncake Store, against
    /// vLLM's own prefix-cache hit and recompute, in one run; plus shared-prefix throughput.
    /// `--engine sglang`: the same on real SGLang with HiCache (kvpool's storage backend and
    /// SGLang's own `mooncake` backend on real Mooncake Store).
    Engine(Box<engine::EngineBenchArgs>),
    /// This machine's cost of touching memory again after it sat idle (on virtual machines
    /// whose host reclaims idle guest memory, a read after seconds idle is many times a hot
    /// read): how to read the store and engine numbers of such a machine.
    IdleMemory(idle_memory::IdleMemoryArgs),
}

/// Errors of the benchmark commands.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("transfer benchmark failed")]
    Transfer(#[source] transfer::TransferBenchError),
    #[error("scheduling benchmark failed")]
    Sched(#[source] sched::SchedBenchError),
    #[error("tier benchmark failed")]
    Tier(#[source] kvpool_agent::bench::BenchError),
    #[error("cannot start the Tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot encode the report")]
    Json(#[source] serde_json::Error),
    #[error("store benchmark failed")]
    Store(#[source] store::StoreBenchError),
    #[error("conductor benchmark failed")]
    Conductor(#[source] conductor::ConductorBenchError),
    #[error("master benchmark failed")]
    Master(#[source] master::BenchError),
    #[error("engine benchmark failed")]
    Engine(#[source] store::StoreBenchError),
    #[error("idle-memory benchmark failed")]
    IdleMemory(#[source] idle_memory::IdleMemoryError),
}

impl BenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            BenchError::Transfer(e) => e.category(),
            BenchError::Sched(e) => e.category(),
            BenchError::Tier(e) => e.category(),
            BenchError::Runtime(_) => "runtime",
            BenchError::Json(_) => "json",
            BenchError::Store(e) => e.category(),
            BenchError::Conductor(e) => e.category(),
            BenchError::Master(e) => e.category(),
            BenchError::Engine(e) => e.category(),
            BenchError::IdleMemory(e) => e.category(),
        }
    }
}

/// Run a benchmark subcommand.
pub fn run(args: BenchArgs) -> Result<(), BenchError> {
    match args.command {
        BenchCommand::Transfer(a) => transfer::run(*a).map_err(BenchError::Transfer),
        BenchCommand::Sched(a) => sched::run(&a).map_err(BenchError::Sched),
        BenchCommand::Tier(a) => tier(&a),
        BenchCommand::DramRestart(a) => dram_restart(&a),
        BenchCommand::Store(a) => store::run(*a).map_err(BenchError::Store),
        BenchCommand::Stress(a) => stress::run(*a).map_err(BenchError::Store),
        BenchCommand::Conductor(a) => conductor::run(*a).map_err(BenchError::Conductor),
        BenchCommand::Engine(a) => engine::run(*a).map_err(BenchError::Engine),
        BenchCommand::IdleMemory(a) => {
            let report = idle_memory::run_report(&a).map_err(BenchError::IdleMemory)?;
            print_report(a.json, &report, idle_memory::render_text)
        }
        BenchCommand::Master(a) => {
            let runtime = tokio::runtime::Runtime::new().map_err(BenchError::Runtime)?;
            master::run_blocking(&runtime, a)
                .map(drop)
                .map_err(BenchError::Master)
        }
    }
}

/// `kvpool bench dram-restart`, printed as JSON or text.
fn dram_restart(args: &kvpool_agent::bench_restart::DramRestartArgs) -> Result<(), BenchError> {
    use kvpool_agent::bench_restart::{render_text, run};
    let report = run(args).map_err(BenchError::Tier)?;
    print_report(args.json, &report, render_text)
}

/// `kvpool bench tier`: the agent's tier benchmark in this process, printed as JSON or text.
fn tier(args: &kvpool_agent::bench::TierArgs) -> Result<(), BenchError> {
    let report = tokio::runtime::Runtime::new()
        .map_err(BenchError::Runtime)?
        .block_on(kvpool_agent::bench::run_tier(args))
        .map_err(BenchError::Tier)?;
    print_report(args.json, &report, kvpool_agent::bench::render_text)
}

/// Print `report` as pretty JSON (`json`) or as `text` renders it.
fn print_report<T: serde::Serialize>(
    json: bool,
    report: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<(), BenchError> {
    if json {
        let out = serde_json::to_string_pretty(report).map_err(BenchError::Json)?;
        println!("{out}");
    } else {
        print!("{}", text(report));
    }
    Ok(())
}
