//! The `kvpool` command line: one binary for the master, the conductor, synthetic engines,
//! benchmarks, the trace simulator and `kvpool up`. Thin: every subcommand lives in the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = kvpool::cli::Cli::parse();
    kvpool::telemetry::init(cli.log_format);
    kvpool::cli::run(cli)
}
