//! Rust client of the master (agents, engines, the conductor): single and batched calls,
//! authenticated with the pool key, following the leader across master replicas, and nearest
//! replica choice. Concurrent single-item `get`, `put_start`, `put_end` and lease releases are
//! coalesced into batched calls (one in flight per kind; what arrives meanwhile goes in the
//! next), and lease releases can be left to a background sender. I/O boundary: gRPC channels
//! to the masters (opened in `connection`); the other files build requests and check answers.
//!
//! - `connection`: the channel to the current master, retries and leader redirects.
//! - `coalesce`: the queues that turn concurrent single-item calls into batched ones.
//! - `agents`, `puts`, `reads`, `catalog`: the calls, grouped by who makes them and what they touch.
//! - `answers`: checks shared by the calls' answers; `error`: [`ClientError`].
//! - `nearest`: which replica to read ([`pick_nearest`]).
//! - `tls`: TLS to the master ([`MasterTls`], from `KVPOOL_MASTER_CA_FILE` and the like);
//!   `tls_args`: the same as process flags (`MasterTlsArgs`, with the `clap` feature).

use std::sync::Arc;

use tonic::transport::Endpoint;

use kvpool_proto::auth::{AuthKey, Signer};

/// One unary call through [`MasterClient::call`] (retries, leader following): the request is
/// cloned for each attempt.
macro_rules! rpc {
    ($client:expr, $method:ident, $req:expr) => {{
        let req = $req;
        let client = &$client;
        match client.call_fast(stringify!($method), &req) {
            Some(answer) => answer,
            None => {
                client
                    .call(stringify!($method), move |mut c| {
                        let req = req.clone();
                        async move { c.$method(req).await }
                    })
                    .await
            }
        }
    }};
}

mod agents;
mod answers;
mod catalog;
mod coalesce;
mod conductors;
mod connection;
mod error;
mod fast;
mod nearest;
mod puts;
mod reads;
mod tls;
#[cfg(feature = "clap")]
mod tls_args;

pub use answers::{LEASE_MARGIN, Located};
pub use coalesce::BatchedCalls;
pub use connection::ClientConfig;
pub use error::ClientError;
pub use nearest::pick_nearest;
pub use tls::{CA_FILE_ENV, CLIENT_CERT_FILE_ENV, CLIENT_KEY_FILE_ENV, MasterTls, SERVER_NAME_ENV};
#[cfg(feature = "clap")]
pub use tls_args::MasterTlsArgs;

/// Client of the master (cheap to clone; clones share the connection).
#[derive(Clone, Debug)]
pub struct MasterClient {
    endpoints: Arc<Vec<String>>,
    signer: Signer,
    config: ClientConfig,
    conn: Arc<parking_lot::Mutex<connection::Conn>>,
    batch: Arc<coalesce::Batchers>,
    /// Set on a [fork](Self::fork): lease releases go through the parent, on its runtime.
    parent: Option<Arc<(MasterClient, tokio::runtime::Handle)>>,
    /// A fork's blocking connection to the master's fast lane.
    fast: Option<Arc<fast::FastLane>>,
    /// TLS to the master, when on (loaded from `config.tls`).
    tls: Option<Arc<tls::LoadedTls>>,
}

impl MasterClient {
    /// A client for the given masters (`host:port` or URLs); connects on first use.
    pub fn new(
        endpoints: Vec<String>,
        key: AuthKey,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        if endpoints.is_empty() {
            return Err(ClientError::NoEndpoints);
        }
        let tls = config.tls.load()?;
        for e in &endpoints {
            if e.starts_with("https://") && tls.is_none() {
                return Err(ClientError::TlsSetup(format!(
                    "master endpoint {e} is https but {CA_FILE_ENV} is not set"
                )));
            }
            Endpoint::from_shared(connection::uri(e, tls.is_some())).map_err(|source| {
                ClientError::Endpoint {
                    endpoint: e.clone(),
                    source,
                }
            })?;
        }
        Ok(Self {
            endpoints: Arc::new(endpoints),
            signer: Signer(key),
            config,
            conn: Arc::default(),
            batch: Arc::default(),
            parent: None,
            fast: None,
            tls,
        })
    }

    /// A client of the same masters with connections of its own, for one thread that drives
    /// its calls itself (a current-thread runtime): its calls are sent at once, never
    /// coalesced with other callers' (nothing of it runs between its caller's calls), the hot
    /// ones over the master's fast lane (a blocking socket: the thread waits anyway), and its
    /// lease releases go through this client, on `runtime` (which must keep running).
    pub fn fork(&self, runtime: tokio::runtime::Handle) -> MasterClient {
        let root = match &self.parent {
            Some(p) => p.clone(),
            None => Arc::new((self.clone(), runtime)),
        };
        let lane = Arc::default();
        fast::register(&root.0.batch.lanes, &lane);
        MasterClient {
            endpoints: self.endpoints.clone(),
            signer: self.signer.clone(),
            config: self.config.clone(),
            conn: Arc::default(),
            batch: Arc::default(),
            parent: Some(root),
            fast: Some(lane),
            tls: self.tls.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
