//! `kvpool-operator`: reconciles KVCachePool, PrefillPool and DecodePool resources. Thin: the
//! command line and every subcommand live in the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = kvpool_operator::cli::Cli::parse();
    kvpool::telemetry::init(cli.log_format);
    println!("{cli:?}");
    Ok(())
}
