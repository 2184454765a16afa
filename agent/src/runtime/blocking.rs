//! `kvpool agent run` from start to exit on a Tokio runtime of its own: signals, the pool
//! membership when the config names a master, then [`super::run`]. Synchronous on purpose: the
//! agent's futures are then compiled in this crate only, not again in the binary that calls it.
//! I/O boundary: the runtime, signal handlers and everything [`super::run`] touches.

use std::sync::Arc;

use prometheus::Registry;
use tokio_util::sync::CancellationToken;

use super::{Mode, RunError};
use crate::config::AgentConfig;
use crate::pool::{Member, PoolError};
use crate::registrar::LocalRegistrar;

/// Why `kvpool agent run` stopped with an error.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AgentError {
    #[error("cannot start the Tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("joining the pool")]
    Join(#[source] PoolError),
    #[error(transparent)]
    Run(#[from] RunError),
}

impl AgentError {
    /// Short label for metrics and logs.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Runs the agent of `cfg` until SIGTERM/SIGINT (Ok) or a fatal error: local-only without a
/// `pool` section, else as a member of the pool (the runtime runs the link and unmounts before
/// the memory is withdrawn; the transfer target closes last).
pub fn run_blocking(cfg: AgentConfig) -> Result<(), AgentError> {
    let runtime = tokio::runtime::Runtime::new().map_err(AgentError::Runtime)?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        kvpool_runtime::shutdown::cancel_on_signal(shutdown.clone())
            .map_err(AgentError::Signals)?;
        let registry = Registry::new();
        match cfg.pool.clone() {
            None => {
                let mode = Mode::Local(Arc::new(LocalRegistrar::new()));
                super::run(cfg, mode, registry, shutdown, |_| {}).await?;
            }
            Some(pool) => {
                let member =
                    Member::start(&pool, &cfg.node_name, &registry).map_err(AgentError::Join)?;
                let ran = super::run(cfg, Mode::Pool(&member), registry, shutdown, |_| {}).await;
                drop(member);
                ran?;
            }
        }
        Ok(())
    })
}
