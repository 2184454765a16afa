//! Serving an HTTP router until shutdown: the one serve loop of the API servers (conductor,
//! synthetic engine) and of the admin server. I/O boundary: the bound TCP listener; what is
//! served is the caller's router.

use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets the requests in
/// flight finish (axum's graceful shutdown). The error is the listener's; callers wrap it in
/// their own error type.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}
