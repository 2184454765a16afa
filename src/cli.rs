//! The `kvpool` command line, parsed with clap. Lives in the library so that tests (and the
//! packaging checks that parse container args) use the same parser as the binary.
//! I/O boundary: none here; `run` dispatches to the subcommand implementations.

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

/// Top-level command line of the `kvpool` binary.
#[derive(Debug, Parser)]
#[command(
    name = "kvpool",
    version,
    about = "KVCache-centric disaggregated LLM serving"
)]
pub struct Cli {
    /// Log format.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "KVPOOL_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands of `kvpool`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the version and exit.
    Version,
    /// Replay a Mooncake trace against a global block cache and report hit ratios per
    /// eviction policy and capacity.
    SimulateCache(crate::master::simulate::SimulateCacheArgs),
    /// Run the pool's metadata master (gRPC API, eviction, repair, optional etcd HA).
    Master(Box<crate::master::cmd::MasterArgs>),
    /// Benchmark the master's metadata path (lookups/s, puts/s, RSS per object).
    MasterBench(crate::master::bench::MasterBenchArgs),
    /// Replay a Mooncake request trace through the scheduling policies (or, with
    /// --bench-decision, time one scheduling decision).
    Simulate(Box<crate::sim::cli::SimulateArgs>),
    /// Run an inference engine; `--synthetic` takes its timing from the cost model (no GPU).
    Engine(Box<crate::synthetic::cli::EngineArgs>),
    /// Serve the OpenAI-compatible API and route each request to a prefill and a decode engine.
    Conductor(Box<crate::conductor::cli::ConductorArgs>),
    /// Run a benchmark (`kvpool bench transfer ...`).
    Bench(crate::bench::BenchArgs),
    /// Run all of kvpool on this machine (master, agents, synthetic engines, conductor) and
    /// optionally replay a trace through it.
    Up(Box<crate::up::UpArgs>),
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => println!("kvpool {}", env!("CARGO_PKG_VERSION")),
        Command::SimulateCache(args) => {
            crate::master::simulate::run(&args)?;
        }
        Command::Master(args) => {
            tokio::runtime::Runtime::new()?.block_on(crate::master::cmd::run(*args))?;
        }
        Command::MasterBench(args) => {
            tokio::runtime::Runtime::new()?.block_on(crate::master::bench::run(args))?;
        }
        Command::Simulate(args) => crate::sim::cli::run(&args)?,
        Command::Engine(args) => crate::synthetic::cli::run(&args)?,
        Command::Conductor(args) => crate::conductor::cli::run(&args)?,
        Command::Bench(args) => crate::bench::run(args)?,
        Command::Up(args) => crate::up::run(&args)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
