//! Admin HTTP server shared by every long-running kvpool process: `/livez`, `/readyz` and
//! `/metrics` (Prometheus text format). I/O boundary: one TCP listener.
//!
//! Besides the process's own registry, `/metrics` serves the metrics every process exports
//! ([`crate::process_metrics`]: build information, process CPU, memory and file descriptors).
//!
//! Readiness is a shared flag that the owning process flips once it can do its job; liveness
//! answers as long as the runtime is serving requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Errors of the admin server.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AdminError {
    #[error("cannot bind admin listener on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("admin server failed")]
    Serve(#[source] std::io::Error),
}

crate::error_category!(AdminError);

/// Readiness flag shared between a process and its admin server.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn set_ready(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AdminState {
    registry: Registry,
    /// Build information and process metrics ([`crate::process_metrics`]).
    process: Option<Registry>,
    readiness: Readiness,
}

/// Router with the three admin endpoints; callers may merge their own routes into it.
/// `/metrics` serves `registry` and the process-wide metrics of [`crate::process_metrics`].
pub fn router(registry: Registry, readiness: Readiness) -> Router {
    let process = match crate::process_metrics::registry() {
        Ok(r) => Some(r),
        Err(err) => {
            tracing::error!(error = %err, "cannot register the build and process metrics; /metrics serves the process's own only");
            None
        }
    };
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AdminState {
            registry,
            process,
            readiness,
        })
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    if state.readiness.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    let encoder = TextEncoder::new();
    let mut buf = Vec::new();
    let mut families = state.registry.gather();
    if let Some(process) = &state.process {
        families.extend(process.gather());
    }
    match encoder.encode(&families, &mut buf) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, encoder.format_type().to_owned())],
            buf,
        ),
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain".to_owned())],
            format!("encoding metrics failed: {err}\n").into_bytes(),
        ),
    }
}

/// Bind the admin listener. Split from [`serve`] so callers learn the bound port (port 0).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, AdminError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AdminError::Bind { addr, source })
}

/// Serve `router` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> Result<(), AdminError> {
    crate::http::serve(listener, router, shutdown)
        .await
        .map_err(AdminError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get_path(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.expect("write");
        let mut out = String::new();
        stream.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn endpoints_follow_readiness_and_expose_metrics() {
        let registry = Registry::new();
        let counter =
            prometheus::IntCounter::new("kvpool_test_total", "test counter").expect("counter");
        registry
            .register(Box::new(counter.clone()))
            .expect("register");
        counter.inc_by(3);
        let readiness = Readiness::new();
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve(
            listener,
            router(registry, readiness.clone()),
            shutdown.clone(),
        ));

        assert!(get_path(addr, "/livez").await.starts_with("HTTP/1.1 200"));
        assert!(get_path(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        readiness.set_ready(true);
        assert!(get_path(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        let metrics = get_path(addr, "/metrics").await;
        assert!(metrics.contains("kvpool_test_total 3"), "{metrics}");
        assert!(metrics.contains("kvpool_build_info{"), "{metrics}");
        assert!(
            metrics.contains("process_resident_memory_bytes "),
            "{metrics}"
        );

        shutdown.cancel();
        server.await.expect("join").expect("serve");
    }
}
