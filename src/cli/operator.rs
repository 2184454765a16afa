//! `kvpool operator ...`: reconcile KVCachePool, PrefillPool and DecodePool resources, write
//! the CRDs, or copy the Python package into an engine pod's volume (its init container). Every
//! flag and the controllers live in `kvpool_operator`; this only dispatches.

use anyhow::Context as _;
use kvpool_operator::cli::Command;

/// Run one `kvpool operator` subcommand.
pub fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Run(args) => kvpool_operator::run::run_blocking(&super::runtime()?, args)
            .context("kvpool operator run"),
        Command::Crd(args) => match args.out_dir {
            Some(dir) => {
                for path in kvpool_operator::crd::write_dir(&dir).context("kvpool operator crd")? {
                    println!("wrote {}", path.display());
                }
                Ok(())
            }
            None => kvpool_operator::crd::write_stream(&mut std::io::stdout().lock())
                .context("kvpool operator crd"),
        },
        Command::InstallPython(args) => {
            let report = kvpool_operator::python_package::install(&args.from, &args.to)
                .context("kvpool operator install-python")?;
            println!("{report}");
            Ok(())
        }
    }
}
