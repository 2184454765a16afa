//! Process wiring shared by the HTTP services started from the CLI, `kvpool engine` and
//! `kvpool conductor`: the Tokio runtime, SIGTERM/SIGINT to a cancellation token, the API
//! listener, and the admin server (`/livez`, `/readyz`, `/metrics`) that starts first and stops
//! last. I/O boundary: sockets and signals; what is served is the caller's.

use std::future::Future;
use std::net::SocketAddr;

use prometheus::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminError, Readiness};
use crate::http::{HttpLimits, HttpStats};
use crate::listen::Listening;

/// A failure of the wiring itself (the service's own errors are the caller's).
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum WiringError {
    #[error("cannot start the Tokio runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot bind the API listener on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("admin server")]
    Admin(#[source] AdminError),
    #[error("cannot register the HTTP connection metrics")]
    Metrics(#[source] prometheus::Error),
}

crate::error_category!(WiringError);

/// What a service gets once its process is wired: the registry its metrics go into (served on
/// the admin port), its readiness flag (false until the service sets it) and the token that
/// SIGTERM or SIGINT cancels.
#[derive(Clone, Debug)]
pub struct Wired {
    pub registry: Registry,
    pub readiness: Readiness,
    pub shutdown: CancellationToken,
    /// Connection limits of the API server (the admin server has the same).
    pub http: HttpLimits,
    /// Connection metrics of the API server (`server="api"`), registered in `registry`.
    pub http_stats: HttpStats,
}

impl Wired {
    /// Serves `router` on the API `listener` under these limits and metrics until the shutdown
    /// token is cancelled (what a service's `serve` step usually is).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        router: axum::Router,
    ) -> std::io::Result<()> {
        crate::http::serve_with(listener, router, self.shutdown, self.http, self.http_stats).await
    }
}

/// Runs a service on a new multi-threaded Tokio runtime until SIGTERM or SIGINT (errors of the
/// wiring become the service's error type through its `From<WiringError>`):
/// `setup` builds it (its router, background tasks...) from the [`Wired`] handles and returns
/// what `serve` needs; then the API listener on `listening.api` and the admin server on
/// `listening.admin` are bound, the admin server starts, `serve` runs on the API listener until
/// the shutdown token is cancelled, readiness drops, and the admin server stops last.
/// `setup` runs before any listener is bound, so a bad configuration fails without opening
/// ports; `serve` gets the listener once the admin server is up. Both servers apply
/// `listening.http` (the API server through [`crate::http::serve_with`] with [`Wired::http`]).
pub fn run<S, E, Setup, SetupFut, Serve, ServeFut>(
    listening: Listening,
    setup: Setup,
    serve: Serve,
) -> Result<(), E>
where
    E: From<WiringError>,
    Setup: FnOnce(Wired) -> SetupFut,
    SetupFut: Future<Output = Result<S, E>>,
    Serve: FnOnce(S, TcpListener, Wired) -> ServeFut,
    ServeFut: Future<Output = Result<(), E>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| E::from(WiringError::Runtime(e)))?;
    runtime.block_on(async {
        let registry = Registry::new();
        let stats = |server: &str| {
            let stats = HttpStats::new(server).map_err(|e| E::from(WiringError::Metrics(e)))?;
            stats
                .register(&registry)
                .map_err(|e| E::from(WiringError::Metrics(e)))?;
            Ok::<_, E>(stats)
        };
        let (http_stats, admin_stats) = (stats("api")?, stats("admin")?);
        let wired = Wired {
            registry: registry.clone(),
            readiness: Readiness::new(),
            shutdown: CancellationToken::new(),
            http: listening.http,
            http_stats,
        };
        crate::shutdown::cancel_on_signal(wired.shutdown.clone())
            .map_err(|e| E::from(WiringError::Signals(e)))?;
        let service = setup(wired.clone()).await?;
        let listener = TcpListener::bind(listening.api).await.map_err(|source| {
            E::from(WiringError::Bind {
                addr: listening.api,
                source,
            })
        })?;
        let admin_listener = admin::bind(listening.admin)
            .await
            .map_err(|e| E::from(WiringError::Admin(e)))?;
        let admin_shutdown = CancellationToken::new();
        let admin_task = tokio::spawn(crate::http::serve_with(
            admin_listener,
            admin::router(wired.registry.clone(), wired.readiness.clone()),
            admin_shutdown.clone(),
            listening.http,
            admin_stats,
        ));
        let readiness = wired.readiness.clone();
        let served = serve(service, listener, wired).await;
        readiness.set_ready(false);
        // The admin server goes last.
        admin_shutdown.cancel();
        let admin_result = admin_task.await;
        served?;
        let admin_result = admin_result.unwrap_or_else(|join| Err(std::io::Error::other(join)));
        admin_result.map_err(|e| E::from(WiringError::Admin(AdminError::Serve(e))))
    })
}
