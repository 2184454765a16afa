//! `kvpool agent run` on a Tokio runtime the caller built: [`super::run`] in local-only or pool
//! mode. Synchronous on purpose: the agent's futures are then compiled in this crate only, not
//! again in the binary that calls it. I/O boundary: everything [`super::run`] touches.

use prometheus::Registry;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use super::{Mode, RunError};
use crate::config::AgentConfig;

/// Runs the agent of `cfg` in `mode` on `runtime` until `shutdown` (Ok) or a fatal error.
pub fn run_blocking(
    runtime: &Runtime,
    cfg: AgentConfig,
    mode: Mode<'_>,
    registry: Registry,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    runtime.block_on(super::run(cfg, mode, registry, shutdown, |_| {}))
}
