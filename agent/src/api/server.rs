//! Engine API server: sessions (each with a shared-memory staging file) and the put, get,
//! exists and remove batches, each validated once and handed to the service's
//! [`BlockStore`] (the node's tiered store or the pool, see `block_store`). I/O boundary: the
//! Unix socket listener (tonic) and the per-session staging files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status as RpcStatus};

use super::block_store::{BatchError, BlockStore};
use super::shm::{ShmError, Staging};
use crate::locality::SessionLocality;
use crate::metrics::AgentMetrics;
use crate::numa_verify;
use crate::proto::engine_api_server::{EngineApi, EngineApiServer};
use crate::proto::{
    CloseSessionRequest, CloseSessionResponse, ExistsRequest, ExistsResponse, GetRequest,
    GetResponse, OpenSessionRequest, OpenSessionResponse, PutRequest, PutResponse, RemoveRequest,
    RemoveResponse,
};

/// Most items in one batch.
pub const MAX_BATCH: usize = 4096;
/// Largest gRPC message (a full batch of long keys fits).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Errors of the API server.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ServerError {
    #[error("cannot prepare socket directory {path}")]
    SocketDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot bind Unix socket {path}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

kvpool_runtime::error_category!(ServerError);

/// Limits of the API.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    pub max_sessions: usize,
    pub max_staging_bytes: u64,
}

struct Session {
    staging: Arc<Staging>,
    last_used: Instant,
}

/// The gRPC service.
#[derive(Clone, derive_more::Debug)]
pub struct EngineService {
    /// Where the blocks of every batch go and come from.
    #[debug(skip)]
    store: Arc<dyn BlockStore>,
    /// Sessions, staging bytes, batch latencies and staging errors are counted here.
    #[debug(skip)]
    metrics: Arc<AgentMetrics>,
    #[debug(skip)]
    sessions: Arc<Mutex<HashMap<u64, Session>>>,
    next_id: Arc<AtomicU64>,
    shm_dir: PathBuf,
    limits: ApiLimits,
    /// Group staging files are handed to (`engine_api.client_group`).
    client_group: Option<u32>,
    /// The node's topology as sessions need it (None: engines' locality is not used).
    locality: Option<Arc<SessionLocality>>,
}

fn invalid(msg: impl Into<String>) -> RpcStatus {
    RpcStatus::invalid_argument(msg.into())
}

/// Refuse batches of more than [`MAX_BATCH`] items.
fn check_batch(items: usize) -> Result<(), RpcStatus> {
    if items > MAX_BATCH {
        return Err(invalid(format!("batch larger than {MAX_BATCH}")));
    }
    Ok(())
}

impl EngineService {
    /// Serve batches from `store`, with staging files in `shm_dir`.
    pub fn new(
        store: Arc<dyn BlockStore>,
        metrics: Arc<AgentMetrics>,
        shm_dir: PathBuf,
        limits: ApiLimits,
    ) -> Self {
        Self {
            store,
            metrics,
            sessions: Arc::new(Mutex::new(HashMap::new())),
            next_id: Arc::new(AtomicU64::new(1)),
            shm_dir,
            limits,
            client_group: None,
            locality: None,
        }
    }

    /// Place sessions near their engines: a session that names its NUMA node or GPU gets its
    /// staging area bound to that node and the NICs there (see [`SessionLocality`]).
    #[must_use]
    pub fn with_locality(mut self, locality: SessionLocality) -> Self {
        self.locality = Some(Arc::new(locality));
        self
    }

    /// The NUMA node for a session that asked for `numa` / `gpu`, bound and verified on its
    /// `staging` area, and the NICs there. A node or GPU the host lacks is refused; a binding
    /// that fails leaves the area unbound (warned, counted).
    fn place(
        &self,
        numa: Option<u32>,
        gpu: &str,
        staging: &mut Staging,
    ) -> Result<(Option<u32>, Vec<String>), RpcStatus> {
        let Some(locality) = &self.locality else {
            return Ok((None, Vec::new()));
        };
        let Some(node) = locality
            .resolve(numa, gpu)
            .map_err(|e| invalid(e.to_string()))?
        else {
            return Ok((None, Vec::new()));
        };
        match numa_verify::bind_staging(staging, node) {
            Ok(node) => {
                staging.set_numa_node(Some(node));
                Ok((Some(node), locality.nics_on(node)))
            }
            Err(e) => {
                tracing::warn!(numa_node = node, error = %e, "staging area left unbound");
                self.metrics.numa_binding_failures.inc();
                Ok((None, Vec::new()))
            }
        }
    }

    /// Hand staging files to `group` (mode 0660) so engines in that group can map them.
    #[must_use]
    pub fn with_client_group(mut self, group: Option<u32>) -> Self {
        self.client_group = group;
        self
    }

    /// Run one batch of `op`, counting its latency when it completes.
    async fn timed<T>(
        &self,
        op: &str,
        batch: impl Future<Output = Result<T, BatchError>>,
    ) -> Result<T, RpcStatus> {
        let started = Instant::now();
        let out = batch.await.map_err(|e| e.to_status())?;
        self.metrics
            .op_seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        Ok(out)
    }

    /// Close every session (shutdown), removing the staging files.
    pub fn close_all(&self) {
        self.sessions.lock().clear();
        self.metrics.sessions.set(0);
        self.metrics.staging_bytes.set(0.0);
    }

    fn staging(&self, id: u64) -> Result<Arc<Staging>, RpcStatus> {
        let mut sessions = self.sessions.lock();
        let session = sessions
            .get_mut(&id)
            .ok_or_else(|| RpcStatus::not_found(format!("no session {id}")))?;
        session.last_used = Instant::now();
        Ok(Arc::clone(&session.staging))
    }

    /// Close sessions unused for at least `max_idle` (engines that died without closing);
    /// returns how many. A call in flight keeps its staging mapping alive until it finishes.
    pub fn reap_idle(&self, max_idle: std::time::Duration) -> usize {
        let mut sessions = self.sessions.lock();
        let before = sessions.len();
        sessions.retain(|id, s| {
            let keep = s.last_used.elapsed() < max_idle;
            if !keep {
                tracing::info!(session = id, "idle session closed");
            }
            keep
        });
        self.refresh_session_gauges(&sessions);
        before - sessions.len()
    }

    fn refresh_session_gauges(&self, sessions: &HashMap<u64, Session>) {
        self.metrics.sessions.set(sessions.len() as i64);
        self.metrics
            .staging_bytes
            .set(sessions.values().map(|s| s.staging.size()).sum::<u64>() as f64);
    }
}

#[tonic::async_trait]
impl EngineApi for EngineService {
    async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<Response<OpenSessionResponse>, RpcStatus> {
        let req = request.into_inner();
        if req.staging_bytes == 0 || req.staging_bytes > self.limits.max_staging_bytes {
            return Err(invalid(format!(
                "staging_bytes must be in 1..={}",
                self.limits.max_staging_bytes
            )));
        }
        if self.sessions.lock().len() >= self.limits.max_sessions {
            return Err(RpcStatus::resource_exhausted(format!(
                "{} sessions open already",
                self.limits.max_sessions
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{id}", std::process::id());
        let mut staging =
            Staging::create_for_group(&self.shm_dir, &name, req.staging_bytes, self.client_group)
                .map_err(|e: ShmError| {
                self.metrics.errors.with_label_values(&[e.category()]).inc();
                RpcStatus::resource_exhausted(format!("{e}: {}", source_text(&e)))
            })?;
        let (numa_node, nics) = self.place(req.numa_node, &req.gpu_pci_bus_id, &mut staging)?;
        let path = staging.path().to_string_lossy().into_owned();
        tracing::info!(session = id, client = %req.client_name, bytes = req.staging_bytes,
            numa_node = ?numa_node, nics = ?nics, "session opened");
        let mut sessions = self.sessions.lock();
        sessions.insert(
            id,
            Session {
                staging: Arc::new(staging),
                last_used: Instant::now(),
            },
        );
        self.refresh_session_gauges(&sessions);
        Ok(Response::new(OpenSessionResponse {
            session_id: id,
            staging_path: path,
            staging_bytes: req.staging_bytes,
            numa_node,
            nics,
        }))
    }

    async fn close_session(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, RpcStatus> {
        let id = request.into_inner().session_id;
        let mut sessions = self.sessions.lock();
        if sessions.remove(&id).is_none() {
            return Err(RpcStatus::not_found(format!("no session {id}")));
        }
        self.refresh_session_gauges(&sessions);
        Ok(Response::new(CloseSessionResponse {}))
    }

    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, RpcStatus> {
        let req = request.into_inner();
        check_batch(req.items.len())?;
        let staging = self.staging(req.session_id)?;
        let batch = Arc::clone(&self.store).put_batch(staging, req);
        let statuses = self.timed("put", batch).await?;
        Ok(Response::new(PutResponse { statuses }))
    }

    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, RpcStatus> {
        let req = request.into_inner();
        check_batch(req.items.len())?;
        let staging = self.staging(req.session_id)?;
        let batch = Arc::clone(&self.store).get_batch(staging, req.items);
        let results = self.timed("get", batch).await?;
        Ok(Response::new(GetResponse { results }))
    }

    async fn exists(
        &self,
        request: Request<ExistsRequest>,
    ) -> Result<Response<ExistsResponse>, RpcStatus> {
        let keys = request.into_inner().keys;
        check_batch(keys.len())?;
        let batch = Arc::clone(&self.store).exists_batch(keys);
        let present = self.timed("exists", batch).await?;
        Ok(Response::new(ExistsResponse { present }))
    }

    async fn remove(
        &self,
        request: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, RpcStatus> {
        let keys = request.into_inner().keys;
        check_batch(keys.len())?;
        let batch = Arc::clone(&self.store).remove_batch(keys);
        let removed = self.timed("remove", batch).await?;
        Ok(Response::new(RemoveResponse { removed }))
    }
}

fn source_text(e: &dyn std::error::Error) -> String {
    e.source().map(ToString::to_string).unwrap_or_default()
}

/// Create the socket directory and bind the socket, replacing a stale socket file.
pub fn bind(socket_dir: &Path) -> Result<(UnixListener, PathBuf), ServerError> {
    bind_for_group(socket_dir, None)
}

/// [`bind`], then hand the socket to `group` with mode 0660: connecting to a Unix socket needs
/// write permission on it, so engines running as another user in that group can connect.
pub fn bind_for_group(
    socket_dir: &Path,
    group: Option<u32>,
) -> Result<(UnixListener, PathBuf), ServerError> {
    std::fs::create_dir_all(socket_dir).map_err(|source| ServerError::SocketDir {
        path: socket_dir.to_owned(),
        source,
    })?;
    let path = socket_dir.join(super::SOCKET_NAME);
    if path.exists() {
        // A socket left by a previous process: nobody can be listening on it any more if we
        // are the node's only agent (the DaemonSet guarantees that).
        std::fs::remove_file(&path).map_err(|source| ServerError::Bind {
            path: path.clone(),
            source,
        })?;
    }
    let listener = UnixListener::bind(&path).map_err(|source| ServerError::Bind {
        path: path.clone(),
        source,
    })?;
    if let Some(gid) = group {
        use std::os::unix::fs::PermissionsExt;
        std::os::unix::fs::chown(&path, None, Some(gid))
            .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660)))
            .map_err(|source| ServerError::Bind {
                path: path.clone(),
                source,
            })?;
    }
    Ok((listener, path))
}

/// Serve until `shutdown` fires; in-flight calls finish before this returns.
pub async fn serve(
    listener: UnixListener,
    service: EngineService,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    let incoming = UnixListenerStream::new(listener);
    tonic::transport::Server::builder()
        .add_service(
            EngineApiServer::new(service)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
        .await
        .map_err(ServerError::Serve)
}
