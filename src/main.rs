//! `kvpool`: one executable with a subcommand per role (agent, operator, master, conductor,
//! engine), `kvpool up`, the benchmarks and the simulators. Thin: parse, set up logging,
//! dispatch into the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = kvpool::cli::Cli::parse();
    kvpool_runtime::telemetry::init(cli.log_format);
    kvpool::cli::run(cli)
}
