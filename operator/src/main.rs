//! `kvpool-operator`: reconciles KVCachePool, PrefillPool and DecodePool resources. Thin: the
//! command line and every subcommand live in the library.

use anyhow::Context as _;
use clap::Parser;
use kvpool_operator::cli::{Cli, Command};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kvpool::telemetry::init(cli.log_format);
    match cli.command {
        Command::Run(args) => kvpool_operator::run::run(args)
            .await
            .context("kvpool-operator run"),
        Command::Crd(args) => match args.out_dir {
            Some(dir) => {
                for path in kvpool_operator::crd::write_dir(&dir).context("kvpool-operator crd")? {
                    println!("wrote {}", path.display());
                }
                Ok(())
            }
            None => kvpool_operator::crd::write_stream(&mut std::io::stdout().lock())
                .context("kvpool-operator crd"),
        },
    }
}
