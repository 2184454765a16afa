//! Pool mode: the agent as a member of a kvpool pool. The DRAM tier's own mappings (NUMA-bound,
//! huge pages and locked as configured) and the pool-mode SSD segment are registered with the
//! transfer engine by [`PoolRegistrar`] (`registrar`) and mounted with the master by
//! [`PoolLink`] (`link`: heartbeats, remounts, adoption of the SSD index, the master's
//! segment-event feed), which hands the master's copy tasks to [`TaskRunner`] (`tasks`);
//! reads of the SSD segment are checked and the feed applied by `feed`; the engine API's
//! batches go to the pool through [`PoolApi`] (`api`). The master is the only allocator of
//! those bytes: the agent never carves them itself in pool mode. [`Member`] starts it all.
//! I/O boundary: the transfer-engine listener ([`Member::start`]) and the master's gRPC
//! channel (in `link`, `tasks` and `api`).

use std::net::SocketAddr;
use std::sync::Arc;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_client::pool::{PoolClient, tcp_endpoint};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer::{
    self as transfer, EngineConfig, ShmServer, StaticDirectory, TcpServer, TransferEngine,
    TransferMetrics,
};
use prometheus::Registry;

use crate::config::PoolConfig;
use crate::config::pool::ShmShare;

/// The Unix socket, in `engine_api.socket_dir`, on which pool mode shares its DRAM segments
/// with same-node engines (`pool.same_node_shm`).
pub const SHM_SOCKET_NAME: &str = "pool-shm.sock";

pub mod api;
pub mod feed;
pub mod link;
pub mod metrics;
pub mod registrar;
pub mod tasks;
#[cfg(test)]
mod test_fixtures;

pub use api::PoolApi;
pub use feed::{FeedState, SsdGuard};
pub use link::{PoolLink, is_unknown_node, rdma_readiness_blocker};
pub use metrics::PoolMetrics;
pub use registrar::{PoolRegistrar, SSD_SEGMENT, segment_name, spec_for};
pub use tasks::TaskRunner;

pub use crate::ssd::pool::SharedIndex;

/// Errors of joining a pool.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum PoolError {
    #[error("reading the pool key for the transfer engine")]
    TransferKey(#[source] transfer::AuthError),
    #[error("reading the pool key for the master")]
    MasterKey(#[source] kvpool_proto::auth::AuthError),
    #[error("the credential the operator issued is not usable: {0}")]
    IssuedKey(String),
    #[error(
        "credential file {path} is the agent credential of node {bound:?}, but this agent is \
         node {node:?}"
    )]
    WrongNode {
        path: std::path::PathBuf,
        bound: String,
        node: String,
    },
    #[error("pool metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("starting the transfer engine")]
    Engine(#[source] transfer::TransferError),
    #[error("listening for transfers on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: transfer::TransferError,
    },
    #[error("master client")]
    Client(#[source] ClientError),
    #[error("sharing the DRAM segments on {path} (pool.same_node_shm)")]
    Shm {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

kvpool_runtime::error_category!(PoolError);

/// Everything pool mode runs: the transfer engine and its TCP target, the registrar, the link
/// and the data client engines' requests go through.
pub struct Member {
    pub engine: TransferEngine,
    pub registrar: Arc<PoolRegistrar>,
    pub link: PoolLink,
    /// Puts and gets over the pool; replicas in this agent's own segments are copied in
    /// process.
    pub client: PoolClient,
    /// Serves the registered segments until dropped.
    pub server: TcpServer,
    /// Shares the memfd-backed segments with same-node engines until dropped
    /// (`pool.same_node_shm`).
    pub shm: Option<ShmServer>,
    /// The announced endpoint (`tcp://ip:port`).
    pub endpoint: String,
    /// Replicas of each block engines put through this agent.
    pub replicas: u8,
    /// Pool metrics (also used by the link and the task runner).
    pub metrics: PoolMetrics,
}

/// The transfer engine's settings for pool membership `cfg` on `node`: RDMA wanted or not, and
/// which NICs (the pool's allow-list and GID index; the pod's SR-IOV VFs come from the
/// device plugin's variables, read by `EngineConfig::default`).
pub fn engine_config(cfg: &PoolConfig, node: &str) -> EngineConfig {
    let defaults = EngineConfig::default();
    EngineConfig {
        node: node.to_owned(),
        // The agent reaches its own segments by in-process copies, and never maps another
        // agent's: its segments' `shm://` endpoints are for the node's engines.
        prefer_shm: false,
        want_rdma: cfg.want_rdma,
        integrity: cfg.integrity,
        tls: cfg.tls.clone(),
        rdma_nics: transfer::NicPolicy {
            allow: cfg.rdma_devices.clone(),
            gid_index: cfg.gid_index,
            ..defaults.rdma_nics.clone()
        },
        ..defaults
    }
}

impl Member {
    /// Read the pool key (from `issued`, the credential file the operator's issuer gave this
    /// node, else from `cfg.auth_key_file`), start the transfer engine (its metrics and the
    /// pool metrics go to `registry`) and its TCP target, build the master client (it
    /// connects on first use).
    pub fn start(
        cfg: &PoolConfig,
        node: &str,
        registry: &Registry,
        issued: Option<&[u8]>,
    ) -> Result<Self, PoolError> {
        let (transfer_key, master_key, origin) = match issued {
            Some(doc) => (
                transfer::AuthKey::from_document(doc).map_err(PoolError::IssuedKey)?,
                MasterKey::from_document(doc).map_err(PoolError::IssuedKey)?,
                std::path::PathBuf::from("(issued by the operator)"),
            ),
            None => (
                transfer::AuthKey::from_file(&cfg.auth_key_file).map_err(PoolError::TransferKey)?,
                MasterKey::from_file(&cfg.auth_key_file).map_err(PoolError::MasterKey)?,
                cfg.auth_key_file.clone(),
            ),
        };
        if let Some(bound) = master_key.node()
            && bound != node
        {
            return Err(PoolError::WrongNode {
                path: origin,
                bound: bound.to_owned(),
                node: node.to_owned(),
            });
        }
        let engine = TransferEngine::new(
            engine_config(cfg, node),
            transfer_key,
            Arc::new(StaticDirectory::new()),
            TransferMetrics::new(registry).map_err(PoolError::Metrics)?,
        )
        .map_err(PoolError::Engine)?;
        let metrics = PoolMetrics::new(registry).map_err(PoolError::Metrics)?;
        let server =
            engine
                .listen_tcp(cfg.transport_listen)
                .map_err(|source| PoolError::Listen {
                    addr: cfg.transport_listen,
                    source,
                })?;
        let endpoint = tcp_endpoint(SocketAddr::new(
            cfg.advertise_host,
            server.local_addr().port(),
        ));
        tracing::info!(%endpoint, listen = %server.local_addr(), "transfer target listening");
        let shm = cfg.shm.as_ref().map(|s| share(&engine, s)).transpose()?;
        let registrar = Arc::new(
            PoolRegistrar::new(engine.clone(), node.to_owned(), endpoint.clone())
                .with_shm_endpoint(shm.as_ref().map(|s| shm_endpoint(s.path()))),
        );
        let master = MasterClient::new(
            cfg.masters.clone(),
            master_key.clone(),
            ClientConfig {
                tls: cfg.master_tls.clone(),
                ..ClientConfig::default()
            },
        )
        .map_err(PoolError::Client)?;
        // The link's own client gives up quickly, so that a lost master shows in readiness
        // within a few heartbeat periods (the next pass tries again anyway).
        let link_client = MasterClient::new(
            cfg.masters.clone(),
            master_key,
            link::link_client_config(cfg),
        )
        .map_err(PoolError::Client)?;
        let runner = TaskRunner::new(
            engine.clone(),
            Arc::clone(&registrar),
            master.clone(),
            cfg.max_tasks,
            cfg.task_timeout,
            metrics.clone(),
        );
        let link = PoolLink::new(link_client, Arc::clone(&registrar), cfg.heartbeat_interval)
            .with_tasks(runner)
            .with_metrics(metrics.clone(), engine.clone());
        let client = PoolClient::new(master, engine.clone(), node.to_owned(), None)
            .with_local_segments(registrar.local_segments());
        Ok(Self {
            engine,
            registrar,
            link,
            client,
            server,
            shm,
            endpoint,
            replicas: cfg.replicas,
            metrics,
        })
    }
}

/// The `shm://` endpoint of the socket at `path`.
fn shm_endpoint(path: &std::path::Path) -> String {
    format!("shm://{}", path.display())
}

/// Serve the memfd-backed segments on `share.socket`, handed to `share.group` with mode 0660
/// when a group is set (engines need not run as the agent's user).
fn share(engine: &TransferEngine, share: &ShmShare) -> Result<ShmServer, PoolError> {
    let err = |source| PoolError::Shm {
        path: share.socket.clone(),
        source,
    };
    if let Some(dir) = share.socket.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let server = engine
        .listen_shm(&share.socket)
        .map_err(|e| err(std::io::Error::other(e)))?;
    if let Some(gid) = share.group {
        use std::os::unix::fs::PermissionsExt;
        std::os::unix::fs::chown(&share.socket, None, Some(gid))
            .and_then(|()| {
                std::fs::set_permissions(&share.socket, std::fs::Permissions::from_mode(0o660))
            })
            .map_err(err)?;
    }
    tracing::info!(socket = %share.socket.display(), "DRAM segments shared with same-node engines");
    Ok(server)
}
