//! The master's gRPC service: authenticates every call (see `auth`), answers only
//! while this master is the leader, applies calls to the [`MasterState`] behind a mutex and,
//! with HA on, waits until the changes a call made are persisted before answering.
//! I/O boundary: the gRPC listener (in [`serve`], shared with the fast lane); persistence goes through a bounded channel
//! to `ha`.
//!
//! - `auth`: the check of each call's credential (role, method, replay, leadership) on both
//!   lanes.
//! - `core`: [`Core`] (state, metrics, [`Role`], the route to persistence) and its leader gate.
//! - `dispatch`: the tonic trait, timing and labelling every call.
//! - `segments`, `heartbeat`, `tasks`, `objects`, `admin`: the handlers, by area;
//!   `conductors`: the conductor replicas' shared bookings (`ShareLoad`; the soft state is
//!   `crate::conductor_loads`).
//! - `batch`: request limits and per-item answers the handlers share.
//! - `fast`: the fast lane on the gRPC port (same calls, same handlers, plain framing), and
//!   the accept loop that routes connections between it and gRPC.
//! - `limits`: connection caps and the deadline to authenticate (issue 15).
//! - `tls`: optional TLS on the port (the acceptor from PEM files, the plain-or-TLS stream).
//! - `tls_config`: the port's TLS configuration, read again from its files while serving.
//!
//! [`MasterState`]: kvpool_core::master::state::MasterState

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

use kvpool_proto::auth::Verifier;
use kvpool_proto::master::master_server::MasterServer;

mod admin;
mod auth;
mod batch;
mod conductors;
mod core;
mod dispatch;
mod fast;
mod heartbeat;
mod limits;
mod objects;
mod segments;
mod tasks;
mod tls;
mod tls_config;

pub use self::auth::{MarkingVerifier, WithMethod};
pub use self::core::{Core, PersistBatch, Role};
pub use self::fast::dispatch as dispatch_fast_call;
pub use self::limits::ConnLimits;
pub use self::tls::{TlsError, acceptor as tls_acceptor};
pub use self::tls_config::{
    Reload, ReloadCounters, ReloadingTls, ServerTls, TlsPaths, watch as watch_tls,
};

/// Errors of running the service.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ServiceError {
    #[error("gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

kvpool_runtime::error_category!(ServiceError);

/// The tonic service implementation.
#[derive(Clone, Debug)]
pub struct MasterSvc {
    core: Arc<Core>,
}

impl MasterSvc {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

/// The service wrapped with authentication, ready for a tonic router.
pub fn authenticated(
    core: Arc<Core>,
    verifier: Verifier,
) -> WithMethod<InterceptedService<MasterServer<MasterSvc>, MarkingVerifier>> {
    let check = MarkingVerifier::new(verifier, core.clone());
    WithMethod(MasterServer::with_interceptor(MasterSvc::new(core), check))
}

/// Serve the authenticated service on `listener` until `shutdown`: gRPC, and the fast lane
/// (see `fast`) on the same port, both under `limits`, over TLS when `tls` is set (the
/// handshake within the handshake deadline; a client that does not start one is refused).
pub async fn serve(
    listener: TcpListener,
    core: Arc<Core>,
    verifier: Verifier,
    limits: ConnLimits,
    tls: Option<ServerTls>,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    let (grpc, incoming) = tokio::sync::mpsc::channel(64);
    let router = tokio::spawn(fast::route(
        listener,
        grpc,
        MasterSvc::new(core.clone()),
        verifier.clone(),
        limits,
        tls.map(|t| t.config),
        shutdown.clone(),
    ));
    let served = tonic::transport::Server::builder()
        // Dead peers are found by pings; one connection cannot open streams without bound.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .max_concurrent_streams(Some(1024))
        .http2_max_header_list_size(Some(64 * 1024))
        .add_service(authenticated(core, verifier))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::ReceiverStream::new(incoming),
            shutdown.cancelled_owned(),
        )
        .await;
    router.abort();
    served.map_err(ServiceError::Serve)
}
