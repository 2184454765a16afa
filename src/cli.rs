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
    /// Run a benchmark (`kvpool bench transfer ...`).
    Bench(crate::bench::BenchArgs),
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => println!("kvpool {}", env!("CARGO_PKG_VERSION")),
        Command::Bench(args) => crate::bench::run(args)?,
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
