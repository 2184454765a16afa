//! The `kvpool` command line, parsed with clap: one subcommand per role (`agent`, `operator`,
//! `master`, `conductor`, `engine`), plus `up`, the benchmarks and the simulators. Each role's
//! flags are defined by the crate that implements it; this module only mounts them and
//! dispatches. Lives in the library so that tests (and the packaging checks that parse container
//! args) use the same parser as the binary. I/O boundary: none here; `run` calls the roles.

mod agent;
pub mod auth;
#[cfg(feature = "k8s")]
mod operator;

use clap::{Parser, Subcommand};
use kvpool_runtime::telemetry::LogFormat;

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
    /// The node agent (the KVCachePool DaemonSet): topology discovery, DRAM and SSD tiers,
    /// engine API, transfer-engine endpoint.
    #[command(subcommand)]
    Agent(kvpool_agent::cli::Command),
    /// The Kubernetes operator for KVCachePool, PrefillPool and DecodePool.
    #[cfg(feature = "k8s")]
    #[command(subcommand)]
    Operator(kvpool_operator::cli::Command),
    /// Built without the `k8s` feature: says how to get `kvpool operator`.
    #[cfg(not(feature = "k8s"))]
    #[command(hide = true, disable_help_flag = true)]
    Operator(Absent),
    /// Run the pool's metadata master (gRPC API, eviction, repair, optional etcd HA).
    Master(Box<kvpool_master::cmd::MasterArgs>),
    /// Serve the OpenAI-compatible API and route each request to a prefill and a decode engine.
    Conductor(Box<kvpool_conductor::cli::ConductorArgs>),
    /// Run an inference engine; `--synthetic` takes its timing from the cost model (no GPU).
    Engine(Box<kvpool_synthetic::cli::EngineArgs>),
    /// Run all of kvpool on this machine (master, agents, synthetic engines, conductor) and
    /// optionally replay a trace through it.
    Up(Box<crate::up::UpArgs>),
    /// Run a benchmark (`kvpool bench transfer ...`).
    #[cfg(feature = "bench")]
    Bench(kvpool_bench::BenchArgs),
    /// The old spelling of `kvpool bench master`, kept hidden for one release.
    #[cfg(feature = "bench")]
    #[command(hide = true)]
    MasterBench(kvpool_bench::master::MasterBenchArgs),
    /// Built without the `bench` feature: says how to get `kvpool bench`.
    #[cfg(not(feature = "bench"))]
    #[command(hide = true, disable_help_flag = true)]
    Bench(Absent),
    /// Built without the `bench` feature: says how to get `kvpool master-bench`.
    #[cfg(not(feature = "bench"))]
    #[command(hide = true, disable_help_flag = true)]
    MasterBench(Absent),
    /// Credential files: `kvpool auth derive --role engine --auth-key-file K` makes a role's
    /// file from the pool key.
    #[command(subcommand)]
    Auth(auth::AuthCommand),
    /// Replay a Mooncake request trace through the scheduling policies (or, with
    /// --bench-decision, time one scheduling decision).
    Simulate(Box<crate::simulate::SimulateArgs>),
    /// Print a prompt's block hashes as the engine computes them (vLLM's sha256_cbor chain)
    /// and the pool key of each: check that an engine, its KV events and kvpool agree.
    Blocks(kvpool_conductor::blocks::BlocksArgs),
    /// Replay a Mooncake trace against a global block cache and report hit ratios per
    /// eviction policy and capacity.
    SimulateCache(crate::simulate_cache::SimulateCacheArgs),
    /// Print the completion script of a shell (`kvpool completions bash >
    /// /etc/bash_completion.d/kvpool`; zsh, fish, elvish and powershell too).
    Completions {
        /// The shell to complete in.
        shell: clap_complete::Shell,
    },
}

/// The arguments of a subcommand this binary was built without (a cargo feature left out, as
/// in the lean build of docs/adr/0011-lean-embedded-build.md): taken as they come, then refused
/// with the feature that brings the subcommand back.
#[derive(Debug, clap::Args)]
pub struct Absent {
    /// Whatever follows the subcommand; not read.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    _args: Vec<std::ffi::OsString>,
}

/// The error of running `kvpool <command>` built without `feature`.
#[cfg(any(not(feature = "k8s"), not(feature = "bench")))]
fn absent(command: &str, what: &str, feature: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "`kvpool {command}` is not in this binary: it was built without {what}; rebuild with \
         --features {feature}"
    )
}

/// Environment variables renamed with the flags they set (one naming scheme: docs/cli.md),
/// `(old, new)`. Each old name still works for one release: the binary copies it to the new
/// name (when that is unset) before parsing and warns.
pub const RENAMED_ENV_VARS: &[(&str, &str)] = &[
    ("KVPOOL_MASTER_ADMIN_ADDR", "KVPOOL_MASTER_ADMIN_LISTEN"),
    ("KVPOOL_ADMIN_ADDR", "KVPOOL_OPERATOR_ADMIN_LISTEN"),
    ("KVPOOL_ENGINE_PYTHON", "KVPOOL_UP_ENGINE_PYTHON"),
    ("KVPOOL_ENGINE_ARGS", "KVPOOL_UP_ENGINE_ARGS"),
];

/// The renamed variables to carry over: `(old, new, value)` for each old name that is set
/// while its new name is not. `get` reads one variable (`std::env::var_os` in the binary).
pub fn renamed_env_vars(
    get: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Vec<(&'static str, &'static str, std::ffi::OsString)> {
    RENAMED_ENV_VARS
        .iter()
        .filter(|(_, new)| get(new).is_none())
        .filter_map(|&(old, new)| get(old).map(|value| (old, new, value)))
        .collect()
}

/// A multi-threaded Tokio runtime for a role's synchronous entry point.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context as _;
    tokio::runtime::Runtime::new().context("starting the tokio runtime")
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Version => println!("kvpool {}", env!("CARGO_PKG_VERSION")),
        Command::Agent(cmd) => agent::run(cmd)?,
        #[cfg(feature = "k8s")]
        Command::Operator(cmd) => operator::run(cmd)?,
        #[cfg(not(feature = "k8s"))]
        Command::Operator(_) => return Err(absent("operator", "Kubernetes support", "k8s")),
        Command::Master(args) => kvpool_master::cmd::run_blocking(&runtime()?, *args)?,
        Command::Conductor(args) => kvpool_conductor::cli::run(&args)?,
        Command::Blocks(args) => {
            println!("{}", kvpool_conductor::blocks::report(&args)?.trim_end())
        }
        Command::Engine(args) => kvpool_synthetic::cli::run(&args)?,
        Command::Up(args) => crate::up::run(&args)?,
        #[cfg(feature = "bench")]
        Command::Bench(args) => kvpool_bench::run(args)?,
        #[cfg(feature = "bench")]
        Command::MasterBench(args) => {
            kvpool_bench::master::run_blocking(&runtime()?, args)?;
        }
        #[cfg(not(feature = "bench"))]
        Command::Bench(_) => return Err(absent("bench", "the benchmarks", "bench")),
        #[cfg(not(feature = "bench"))]
        Command::MasterBench(_) => {
            return Err(absent("master-bench", "the benchmarks", "bench"));
        }
        Command::Auth(cmd) => auth::run(&cmd)?,
        Command::Simulate(args) => crate::simulate::run(&args)?,
        Command::SimulateCache(args) => {
            crate::simulate_cache::run(&args)?;
        }
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "kvpool", &mut std::io::stdout());
        }
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

    #[test]
    fn every_role_is_a_subcommand() {
        let cmd = Cli::command();
        for role in [
            "agent",
            "operator",
            "master",
            "conductor",
            "engine",
            "up",
            "bench",
        ] {
            assert!(
                cmd.find_subcommand(role).is_some(),
                "`kvpool {role}` is missing"
            );
        }
        let agent = cmd.find_subcommand("agent").expect("agent");
        for sub in ["run", "discover", "check-config"] {
            assert!(agent.find_subcommand(sub).is_some(), "`kvpool agent {sub}`");
        }
        #[cfg(feature = "k8s")]
        {
            let operator = cmd.find_subcommand("operator").expect("operator");
            for sub in ["run", "crd"] {
                assert!(
                    operator.find_subcommand(sub).is_some(),
                    "`kvpool operator {sub}`"
                );
            }
        }
    }

    #[test]
    #[cfg(not(all(feature = "k8s", feature = "bench")))]
    fn a_left_out_subcommand_says_which_feature_brings_it_back() {
        let help = Cli::command().render_long_help().to_string();
        for (argv, feature, shown) in [
            (
                ["kvpool", "operator", "run", "--help"],
                "k8s",
                cfg!(feature = "k8s"),
            ),
            (
                ["kvpool", "bench", "transfer", "--json"],
                "bench",
                cfg!(feature = "bench"),
            ),
        ] {
            assert_eq!(help.contains(&format!("\n  {} ", argv[1])), shown, "{help}");
            if shown {
                continue;
            }
            let cli = Cli::try_parse_from(argv).expect("taken as it comes");
            let err = run(cli).expect_err("left out").to_string();
            assert!(err.contains(&format!("--features {feature}")), "{err}");
        }
    }
}
