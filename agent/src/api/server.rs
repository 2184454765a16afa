//! Engine API server: serves put/get/exists/remove batches from the node's tiered store, or in
//! pool mode from the pool (`crate::pool_api`). I/O boundary: the Unix socket listener (tonic)
//! and the per-session staging files; each local batch runs on the blocking pool because the
//! store may touch the SSD.

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

use super::shm::{ShmError, Staging};
use crate::pool_api::PoolApi;
use crate::proto::engine_api_server::{EngineApi, EngineApiServer};
use crate::proto::{
    CloseSessionRequest, CloseSessionResponse, ExistsRequest, ExistsResponse, GetRequest,
    GetResponse, GetResult, OpenSessionRequest, OpenSessionResponse, PutRequest, PutResponse,
    RemoveRequest, RemoveResponse, Status,
};
use crate::store::{StoreError, TieredStore};

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

impl ServerError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

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
#[derive(Clone)]
pub struct EngineService {
    store: Arc<TieredStore>,
    sessions: Arc<Mutex<HashMap<u64, Session>>>,
    next_id: Arc<AtomicU64>,
    shm_dir: PathBuf,
    limits: ApiLimits,
    /// Pool mode: blocks go to and come from the pool, not the local store.
    pool: Option<Arc<PoolApi>>,
    /// Group staging files are handed to (`engine_api.client_group`).
    client_group: Option<u32>,
}

impl std::fmt::Debug for EngineService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineService")
            .field("shm_dir", &self.shm_dir)
            .finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> RpcStatus {
    RpcStatus::invalid_argument(msg.into())
}

impl EngineService {
    pub fn new(store: Arc<TieredStore>, shm_dir: PathBuf, limits: ApiLimits) -> Self {
        Self {
            store,
            sessions: Arc::new(Mutex::new(HashMap::new())),
            next_id: Arc::new(AtomicU64::new(1)),
            shm_dir,
            limits,
            pool: None,
            client_group: None,
        }
    }

    /// Hand staging files to `group` (mode 0660) so engines in that group can map them.
    #[must_use]
    pub fn with_client_group(mut self, group: Option<u32>) -> Self {
        self.client_group = group;
        self
    }

    /// Serve blocks from the pool instead of the local store (pool mode).
    pub fn with_pool(mut self, pool: PoolApi) -> Self {
        self.pool = Some(Arc::new(pool));
        self
    }

    fn observe(&self, op: &str, started: Instant) {
        self.store
            .metrics()
            .op_seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
    }

    /// Close every session (shutdown), removing the staging files.
    pub fn close_all(&self) {
        self.sessions.lock().clear();
        self.store.metrics().sessions.set(0);
        self.store.metrics().staging_bytes.set(0.0);
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
        let m = self.store.metrics();
        m.sessions.set(sessions.len() as i64);
        m.staging_bytes
            .set(sessions.values().map(|s| s.staging.size()).sum::<u64>() as f64);
    }

    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RpcStatus> {
        let started = Instant::now();
        let out = tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| RpcStatus::internal(format!("worker failed: {e}")))?;
        self.store
            .metrics()
            .op_seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        Ok(out)
    }
}

fn store_status(err: &StoreError) -> Status {
    match err {
        StoreError::BadKey(_) | StoreError::TooLarge { .. } => Status::Invalid,
        StoreError::NoSpace(_) => Status::NoSpace,
        StoreError::Ssd(_) => Status::Internal,
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
        let staging =
            Staging::create_for_group(&self.shm_dir, &name, req.staging_bytes, self.client_group)
                .map_err(|e: ShmError| {
                self.store
                    .metrics()
                    .errors
                    .with_label_values(&[e.category()])
                    .inc();
                RpcStatus::resource_exhausted(format!("{e}: {}", source_text(&e)))
            })?;
        let path = staging.path().to_string_lossy().into_owned();
        tracing::info!(session = id, client = %req.client_name, bytes = req.staging_bytes, "session opened");
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
        if req.items.len() > MAX_BATCH {
            return Err(invalid(format!("batch larger than {MAX_BATCH}")));
        }
        let staging = self.staging(req.session_id)?;
        if let Some(pool) = &self.pool {
            let started = Instant::now();
            let items: Vec<_> = req
                .items
                .into_iter()
                .map(|i| (i.key, i.offset, i.length))
                .collect();
            let statuses = pool
                .put(&staging, items, req.numa_hint, self.store.metrics())
                .await;
            self.observe("put", started);
            return Ok(Response::new(PutResponse { statuses }));
        }
        let store = Arc::clone(&self.store);
        let statuses = self
            .blocking("put", move || {
                req.items
                    .iter()
                    .map(|item| {
                        if !staging.contains(item.offset, item.length) {
                            return Status::Invalid as i32;
                        }
                        let mut copy_err = None;
                        let res = store.put_with(&item.key, item.length, req.numa_hint, |dst| {
                            copy_err = staging.read_into(item.offset, dst).err();
                        });
                        match (res, copy_err) {
                            (Ok(()), None) => Status::Ok as i32,
                            (Ok(()), Some(_)) => {
                                let _ = store.remove(&item.key);
                                Status::Invalid as i32
                            }
                            (Err(e), _) => {
                                store
                                    .metrics()
                                    .errors
                                    .with_label_values(&[e.category()])
                                    .inc();
                                store_status(&e) as i32
                            }
                        }
                    })
                    .collect()
            })
            .await?;
        Ok(Response::new(PutResponse { statuses }))
    }

    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, RpcStatus> {
        let req = request.into_inner();
        if req.items.len() > MAX_BATCH {
            return Err(invalid(format!("batch larger than {MAX_BATCH}")));
        }
        let staging = self.staging(req.session_id)?;
        if let Some(pool) = &self.pool {
            let started = Instant::now();
            let items: Vec<_> = req
                .items
                .into_iter()
                .map(|i| (i.key, i.offset, i.capacity))
                .collect();
            let results = pool.get(&staging, items, self.store.metrics()).await;
            self.observe("get", started);
            return Ok(Response::new(GetResponse { results }));
        }
        let store = Arc::clone(&self.store);
        let results = self
            .blocking("get", move || {
                req.items
                    .iter()
                    .map(|item| {
                        let result = |status: Status, length: u64| GetResult {
                            status: status as i32,
                            length,
                        };
                        if !staging.contains(item.offset, item.capacity) {
                            return result(Status::Invalid, 0);
                        }
                        let got = store.get_with(&item.key, |bytes| {
                            let len = bytes.len() as u64;
                            if len > item.capacity {
                                return result(Status::BufferTooSmall, len);
                            }
                            match staging.write_from(item.offset, bytes) {
                                Ok(()) => result(Status::Ok, len),
                                Err(_) => result(Status::Invalid, 0),
                            }
                        });
                        match got {
                            Ok(Some((r, _))) => r,
                            Ok(None) => result(Status::NotFound, 0),
                            Err(e) => {
                                store
                                    .metrics()
                                    .errors
                                    .with_label_values(&[e.category()])
                                    .inc();
                                result(store_status(&e), 0)
                            }
                        }
                    })
                    .collect()
            })
            .await?;
        Ok(Response::new(GetResponse { results }))
    }

    async fn exists(
        &self,
        request: Request<ExistsRequest>,
    ) -> Result<Response<ExistsResponse>, RpcStatus> {
        let keys = request.into_inner().keys;
        if keys.len() > MAX_BATCH {
            return Err(invalid(format!("batch larger than {MAX_BATCH}")));
        }
        if let Some(pool) = &self.pool {
            let started = Instant::now();
            let present = pool
                .exists(&keys)
                .await
                .map_err(|e| RpcStatus::unavailable(format!("master: {e}")))?;
            self.observe("exists", started);
            return Ok(Response::new(ExistsResponse { present }));
        }
        let store = Arc::clone(&self.store);
        let present = self
            .blocking("exists", move || {
                keys.iter().map(|k| store.exists(k)).collect()
            })
            .await?;
        Ok(Response::new(ExistsResponse { present }))
    }

    async fn remove(
        &self,
        request: Request<RemoveRequest>,
    ) -> Result<Response<RemoveResponse>, RpcStatus> {
        let keys = request.into_inner().keys;
        if keys.len() > MAX_BATCH {
            return Err(invalid(format!("batch larger than {MAX_BATCH}")));
        }
        if let Some(pool) = &self.pool {
            let started = Instant::now();
            let removed = pool
                .remove(&keys)
                .await
                .map_err(|e| RpcStatus::unavailable(format!("master: {e}")))?;
            self.observe("remove", started);
            return Ok(Response::new(RemoveResponse { removed }));
        }
        let store = Arc::clone(&self.store);
        let removed = self
            .blocking("remove", move || {
                keys.iter()
                    .map(|k| store.remove(k).unwrap_or(false))
                    .collect()
            })
            .await?;
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
