//! `kvpool bench tier`: runs `kvpool-agent bench tier` with the same flags (the tier benchmark
//! needs the agent's code, which the `kvpool` binary does not link). I/O boundary: the child
//! process, which inherits stdin, stdout and stderr.

use std::path::PathBuf;
use std::process::Command;

/// Flags of `kvpool bench tier`.
#[derive(Debug, Clone, clap::Args)]
pub struct TierBenchArgs {
    /// The `kvpool-agent` binary; default: next to this binary, then on PATH.
    #[arg(long, env = "KVPOOL_AGENT_BIN")]
    pub agent_bin: Option<PathBuf>,
    /// Flags passed on unchanged (`--json`, `--dir DIR`, `--repeat N`, see `kvpool-agent bench
    /// tier --help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

/// Errors of `kvpool bench tier`.
#[derive(Debug, thiserror::Error)]
pub enum TierBenchError {
    #[error("cannot find kvpool-agent")]
    AgentBinary(#[source] crate::up::UpError),
    #[error("cannot run {program}")]
    Spawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kvpool-agent bench tier failed ({0})")]
    Failed(std::process::ExitStatus),
}

impl TierBenchError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            TierBenchError::AgentBinary(_) => "agent_binary",
            TierBenchError::Spawn { .. } => "spawn",
            TierBenchError::Failed(_) => "failed",
        }
    }
}

/// Entry point of `kvpool bench tier`.
pub fn run(args: &TierBenchArgs) -> Result<(), TierBenchError> {
    let program =
        crate::up::agent_binary(args.agent_bin.as_deref()).map_err(TierBenchError::AgentBinary)?;
    let status = Command::new(&program)
        .args(["bench", "tier"])
        .args(&args.args)
        .status()
        .map_err(|source| TierBenchError::Spawn {
            program: program.clone(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(TierBenchError::Failed(status))
    }
}
