//! `kvpool`: one executable with a subcommand per role (agent, operator, master, conductor,
//! engine), `kvpool up`, the benchmarks and the simulators. Thin: carry renamed environment
//! variables over, parse, set up logging, dispatch into the library.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let renamed = kvpool::cli::renamed_env_vars(|name| std::env::var_os(name));
    for (_, new, value) in &renamed {
        // SAFETY: nothing else runs yet: no thread has been started and no library has read
        // the environment, so setting a variable cannot race with a reader.
        unsafe { std::env::set_var(new, value) };
    }
    let cli = kvpool::cli::Cli::parse();
    kvpool_runtime::telemetry::init(cli.log_format);
    for (old, new, _) in &renamed {
        tracing::warn!(
            old = *old,
            new = *new,
            "environment variable {old} is deprecated and will be removed in the next release; set {new} instead"
        );
    }
    kvpool::cli::run(cli)
}
