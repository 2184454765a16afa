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

/// A failure of the wiring itself, or of the service it ran (`E`).
#[derive(Debug, thiserror::Error)]
pub enum WiringError<E: std::error::Error + 'static> {
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
    #[error("service")]
    Service(#[source] E),
}

impl<E: std::error::Error + 'static> WiringError<E> {
    /// Short label for metrics (the service's own errors are `service`).
    pub fn category(&self) -> &'static str {
        match self {
            WiringError::Runtime(_) => "runtime",
            WiringError::Signals(_) => "signals",
            WiringError::Bind { .. } => "bind",
            WiringError::Admin(_) => "admin",
            WiringError::Service(_) => "service",
        }
    }
}

/// What a service gets once its process is wired: the registry its metrics go into (served on
/// the admin port), its readiness flag (false until the service sets it) and the token that
/// SIGTERM or SIGINT cancels.
#[derive(Clone, Debug)]
pub struct Wired {
    pub registry: Registry,
    pub readiness: Readiness,
    pub shutdown: CancellationToken,
}

/// Runs a service on a new multi-threaded Tokio runtime until SIGTERM or SIGINT:
/// `setup` builds it (its router, background tasks...) from the [`Wired`] handles and returns
/// what `serve` needs; then the API listener on `listen` and the admin server on
/// `admin_listen` are bound, the admin server starts, `serve` runs on the API listener until
/// the shutdown token is cancelled, readiness drops, and the admin server stops last.
/// `setup` runs before any listener is bound, so a bad configuration fails without opening
/// ports; `serve` gets the listener once the admin server is up.
pub fn run<S, E, Setup, SetupFut, Serve, ServeFut>(
    listen: SocketAddr,
    admin_listen: SocketAddr,
    setup: Setup,
    serve: Serve,
) -> Result<(), WiringError<E>>
where
    E: std::error::Error + 'static,
    Setup: FnOnce(Wired) -> SetupFut,
    SetupFut: Future<Output = Result<S, E>>,
    Serve: FnOnce(S, TcpListener, Wired) -> ServeFut,
    ServeFut: Future<Output = Result<(), E>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(WiringError::Runtime)?;
    runtime.block_on(async {
        let wired = Wired {
            registry: Registry::new(),
            readiness: Readiness::new(),
            shutdown: CancellationToken::new(),
        };
        crate::shutdown::cancel_on_signal(wired.shutdown.clone()).map_err(WiringError::Signals)?;
        let service = setup(wired.clone()).await.map_err(WiringError::Service)?;
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|source| WiringError::Bind {
                addr: listen,
                source,
            })?;
        let admin_listener = admin::bind(admin_listen)
            .await
            .map_err(WiringError::Admin)?;
        let admin_shutdown = CancellationToken::new();
        let admin_task = tokio::spawn(admin::serve(
            admin_listener,
            admin::router(wired.registry.clone(), wired.readiness.clone()),
            admin_shutdown.clone(),
        ));
        let readiness = wired.readiness.clone();
        let served = serve(service, listener, wired).await;
        readiness.set_ready(false);
        // The admin server goes last.
        admin_shutdown.cancel();
        let admin_result = admin_task.await;
        served.map_err(WiringError::Service)?;
        match admin_result {
            Ok(r) => r.map_err(WiringError::Admin),
            Err(join) => Err(WiringError::Admin(AdminError::Serve(
                std::io::Error::other(join),
            ))),
        }
    })
}
