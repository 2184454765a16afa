//! `kvpool bench ...`: benchmark subcommands. Each area adds a variant to [`BenchCommand`] and a
//! module here (`transfer`, `sched`, `store`, `tier`).
//! I/O boundary: whatever each benchmark drives (sockets, child processes, stdout).

pub mod sched;
pub mod store;
pub mod tier;
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
    /// The node agent's tier benchmark (runs `kvpool-agent bench tier` with the same flags).
    Tier(tier::TierBenchArgs),
    /// The pool end to end on loopback (master, agents, client processes) against Redis.
    Store(Box<store::StoreBenchArgs>),
}

/// Errors of the benchmark commands.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("transfer benchmark failed")]
    Transfer(#[source] transfer::TransferBenchError),
    #[error("scheduling benchmark failed")]
    Sched(#[source] sched::SchedBenchError),
    #[error("tier benchmark failed")]
    Tier(#[source] tier::TierBenchError),
    #[error("store benchmark failed")]
    Store(#[source] store::StoreBenchError),
}

impl BenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            BenchError::Transfer(e) => e.category(),
            BenchError::Sched(e) => e.category(),
            BenchError::Tier(e) => e.category(),
            BenchError::Store(e) => e.category(),
        }
    }
}

/// Run a benchmark subcommand.
pub fn run(args: BenchArgs) -> Result<(), BenchError> {
    match args.command {
        BenchCommand::Transfer(a) => transfer::run(*a).map_err(BenchError::Transfer),
        BenchCommand::Sched(a) => sched::run(&a).map_err(BenchError::Sched),
        BenchCommand::Tier(a) => tier::run(&a).map_err(BenchError::Tier),
        BenchCommand::Store(a) => store::run(*a).map_err(BenchError::Store),
    }
}
