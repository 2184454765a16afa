//! Process shutdown: turns SIGTERM and SIGINT into the cancellation of a root
//! [`CancellationToken`]. Components take child tokens so that shutdown runs as a tree.
//! I/O boundary: Unix signal handlers.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Spawn a task that cancels `token` on the first SIGTERM or SIGINT.
pub fn cancel_on_signal(token: CancellationToken) -> std::io::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
            _ = token.cancelled() => return,
        }
        token.cancel();
    });
    Ok(())
}
