//! The master's gRPC service: authenticates every call (see [`kvpool_proto::auth`]), answers only
//! while this master is the leader, applies calls to the [`MasterState`] behind a mutex and,
//! with HA on, waits until the changes a call made are persisted before answering.
//! I/O boundary: the gRPC listener; persistence goes through a bounded channel to `ha`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use super::metrics::MasterMetrics;
use kvpool_core::master::state::{JournalOp, MasterError, MasterState, TransportState};
use kvpool_core::master::types::{AdoptItem, ObjectKey, PutOptions, PutStarted, Spread};
use kvpool_proto::auth::Verifier;
use kvpool_proto::master::feed;
use kvpool_proto::master::{self as proto, master_server::MasterServer};
use kvpool_proto::master::{LEADER_HEADER, MAX_BATCH, MAX_KEY_BYTES};

/// Errors of running the service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("gRPC server failed")]
    Serve(#[source] tonic::transport::Error),
}

impl ServiceError {
    pub fn category(&self) -> &'static str {
        "serve"
    }
}

/// Changes of one call on their way to etcd; `done` is answered once they are durable.
#[derive(Debug)]
pub struct PersistBatch {
    pub ops: Vec<JournalOp>,
    pub done: Option<oneshot::Sender<Result<(), String>>>,
}

/// Leadership as the service sees it.
#[derive(Debug, Default)]
pub struct Role {
    leader: AtomicBool,
    leader_addr: Mutex<Option<String>>,
}

impl Role {
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::SeqCst);
    }
    pub fn set_leader_addr(&self, addr: Option<String>) {
        *self.leader_addr.lock() = addr;
    }
    pub fn leader_addr(&self) -> Option<String> {
        self.leader_addr.lock().clone()
    }
}

/// Everything the service and the background loops share.
#[derive(Debug)]
pub struct Core {
    pub state: Mutex<MasterState>,
    pub metrics: MasterMetrics,
    pub role: Role,
    persist: Mutex<Option<mpsc::Sender<PersistBatch>>>,
}

impl Core {
    /// A core that is leader from the start (the embedded, single-master mode).
    pub fn standalone(state: MasterState, metrics: MasterMetrics) -> Arc<Self> {
        let core = Self::new(state, metrics);
        core.role.set_leader(true);
        core.metrics.set_leader(true);
        core
    }

    pub fn new(state: MasterState, metrics: MasterMetrics) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(state),
            metrics,
            role: Role::default(),
            persist: Mutex::new(None),
        })
    }

    /// Route journal batches to `tx` from now on (HA leader).
    pub fn set_persist(&self, tx: Option<mpsc::Sender<PersistBatch>>) {
        *self.persist.lock() = tx;
    }

    fn persist_tx(&self) -> Option<mpsc::Sender<PersistBatch>> {
        self.persist.lock().clone()
    }

    fn not_leader(&self) -> Status {
        let mut status = Status::unavailable("this master is not the leader");
        if let Some(addr) = self.role.leader_addr()
            && let Ok(v) = addr.parse()
        {
            status.metadata_mut().insert(LEADER_HEADER, v);
        }
        status
    }

    /// Apply `f` to the state; with persistence on, wait until its changes are durable.
    pub async fn mutate<T>(&self, f: impl FnOnce(&mut MasterState) -> T) -> Result<T, Status> {
        if !self.role.is_leader() {
            return Err(self.not_leader());
        }
        let permit = match self.persist_tx() {
            Some(tx) => Some(
                tx.reserve_owned()
                    .await
                    .map_err(|_| Status::unavailable("persistence stopped"))?,
            ),
            None => None,
        };
        let (out, rx) = {
            let mut st = self.state.lock();
            if !self.role.is_leader() {
                return Err(self.not_leader());
            }
            let out = f(&mut st);
            let rx = permit.map(|p| {
                let (tx, rx) = oneshot::channel();
                p.send(PersistBatch {
                    ops: st.take_journal(),
                    done: Some(tx),
                });
                rx
            });
            (out, rx)
        };
        if let Some(rx) = rx {
            rx.await
                .map_err(|_| Status::unavailable("persistence stopped"))?
                .map_err(|e| Status::unavailable(format!("persisting failed: {e}")))?;
        }
        Ok(out)
    }

    pub fn ensure_leader(&self) -> Result<(), Status> {
        if self.role.is_leader() {
            Ok(())
        } else {
            Err(self.not_leader())
        }
    }

    /// Read-only access (still leader-only: a standby's state is stale).
    pub fn read<T>(&self, f: impl FnOnce(&MasterState) -> T) -> Result<T, Status> {
        if !self.role.is_leader() {
            return Err(self.not_leader());
        }
        Ok(f(&self.state.lock()))
    }

    /// One tick of the background loop: expiries, deaths, repairs, watermarks, metrics.
    pub async fn tick(&self) {
        if !self.role.is_leader() {
            return;
        }
        let permit = match self.persist_tx() {
            Some(tx) => match tx.reserve_owned().await {
                Ok(p) => Some(p),
                Err(_) => return,
            },
            None => None,
        };
        let mut st = self.state.lock();
        let report = st.tick();
        if !report.dead_nodes.is_empty() {
            tracing::warn!(
                nodes = ?report.dead_nodes,
                objects_lost = report.objects_lost,
                "agents stopped heartbeating and were declared dead"
            );
        }
        if let Some(p) = permit {
            let ops = st.take_journal();
            p.send(PersistBatch { ops, done: None });
        }
        self.metrics.refresh(&st.stats(), st.counters());
    }
}

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
) -> InterceptedService<MasterServer<MasterSvc>, Verifier> {
    MasterServer::with_interceptor(MasterSvc::new(core), verifier)
}

/// Serve the authenticated service on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    core: Arc<Core>,
    verifier: Verifier,
    shutdown: CancellationToken,
) -> Result<(), ServiceError> {
    tonic::transport::Server::builder()
        .add_service(authenticated(core, verifier))
        .serve_with_incoming_shutdown(
            // No Nagle: a reply's frames must not wait for the client's delayed ACK (40 ms on
            // Linux) when few calls are in flight, as with coalesced client calls.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(ServiceError::Serve)
}

fn err(e: &MasterError) -> Option<proto::Error> {
    Some(e.into())
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

fn check_batch(n: usize) -> Result<(), Status> {
    if n > MAX_BATCH {
        return Err(invalid(format!("batch of {n} items exceeds {MAX_BATCH}")));
    }
    Ok(())
}

fn keys_of(keys: &[Vec<u8>]) -> Result<Vec<ObjectKey>, Status> {
    check_batch(keys.len())?;
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            if k.is_empty() || k.len() > MAX_KEY_BYTES {
                Err(invalid(format!(
                    "key {i} has {} bytes; keys must have 1..={MAX_KEY_BYTES}",
                    k.len()
                )))
            } else {
                Ok(ObjectKey::from_bytes(k))
            }
        })
        .collect()
}

fn item_results(results: Vec<Result<(), MasterError>>) -> proto::ItemResults {
    proto::ItemResults {
        results: results
            .iter()
            .map(|r| proto::ItemResult {
                error: r.as_ref().err().and_then(err),
            })
            .collect(),
    }
}

/// Metric label for a call's outcome.
fn outcome<T>(r: &Result<Response<T>, Status>, first_item_error: Option<&'static str>) -> String {
    match r {
        Err(s) => format!("{:?}", s.code()).to_lowercase(),
        Ok(_) => first_item_error.unwrap_or("ok").to_owned(),
    }
}

impl MasterSvc {
    fn record<T>(
        &self,
        method: &str,
        start: Instant,
        r: &Result<Response<T>, Status>,
        item_error: Option<&'static str>,
    ) {
        self.core.metrics.observe_call(
            method,
            &outcome(r, item_error),
            start.elapsed().as_secs_f64(),
        );
    }
}

fn first_error<T>(results: &[Result<T, MasterError>]) -> Option<&'static str> {
    results
        .iter()
        .find_map(|r| r.as_ref().err().map(MasterError::category))
}

#[tonic::async_trait]
impl proto::master_server::Master for MasterSvc {
    async fn mount_segment(
        &self,
        req: Request<proto::MountSegmentRequest>,
    ) -> Result<Response<proto::MountSegmentResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let seg = req
                .into_inner()
                .segment
                .ok_or_else(|| invalid("segment is required"))?;
            let spec = seg
                .to_spec()
                .ok_or_else(|| invalid(format!("unknown tier {}", seg.tier)))?;
            let node = spec.node.clone();
            let id = self
                .core
                .mutate(|st| st.mount(spec))
                .await?
                .map_err(|e| proto::status_of(&e))?;
            tracing::info!(node = %node, segment = id, "segment mounted");
            Ok(Response::new(proto::MountSegmentResponse {
                segment_id: id,
            }))
        }
        .await;
        self.record("mount_segment", start, &r, None);
        r
    }

    async fn unmount_segment(
        &self,
        req: Request<proto::UnmountSegmentRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let start = Instant::now();
        let req = req.into_inner();
        let r = async {
            self.core
                .mutate(|st| st.unmount(&req.node, req.segment_id))
                .await?
                .map_err(|e| proto::status_of(&e))?;
            Ok(Response::new(proto::Empty {}))
        }
        .await;
        self.record("unmount_segment", start, &r, None);
        r
    }

    async fn heartbeat(
        &self,
        req: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        let start = Instant::now();
        let req = req.into_inner();
        let r = async {
            let transport = req.transport.as_ref().map(transport_state);
            let corrupt = feed::corrupt_blocks(&req.corrupt)?;
            let reply = self
                .core
                .mutate(|st| {
                    let reply =
                        st.heartbeat_feed(&req.node, req.feed_epoch, req.feed_acked, &corrupt)?;
                    if let Some(t) = transport {
                        st.record_transport(&req.node, t)?;
                    }
                    Ok::<_, MasterError>(reply)
                })
                .await?
                .map_err(|e| proto::status_of(&e))?;
            Ok(Response::new(proto::HeartbeatResponse {
                tasks: reply.tasks.iter().map(Into::into).collect(),
                feed_epoch: reply.feed_epoch,
                events: reply.events.iter().map(feed::event_to_proto).collect(),
            }))
        }
        .await;
        self.record("heartbeat", start, &r, None);
        r
    }

    async fn complete_task(
        &self,
        req: Request<proto::CompleteTaskRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let start = Instant::now();
        let req = req.into_inner();
        let r = async {
            self.core
                .mutate(|st| st.complete_task(&req.node, req.task_id, req.ok))
                .await?
                .map_err(|e| proto::status_of(&e))?;
            Ok(Response::new(proto::Empty {}))
        }
        .await;
        self.record("complete_task", start, &r, None);
        r
    }

    async fn adopt_replicas(
        &self,
        req: Request<proto::AdoptReplicasRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let start = Instant::now();
        let req = req.into_inner();
        let mut item_error = None;
        let r = async {
            check_batch(req.items.len())?;
            let items = req
                .items
                .iter()
                .enumerate()
                .map(|(i, it)| {
                    let key = ObjectKey::from_hex(&it.key_digest).ok_or_else(|| {
                        invalid(format!(
                            "item {i}: key digest {:?} is not 32 hex digits",
                            it.key_digest
                        ))
                    })?;
                    Ok(AdoptItem {
                        key,
                        offset: it.offset,
                        length: it.length,
                    })
                })
                .collect::<Result<Vec<_>, Status>>()?;
            let results = self
                .core
                .mutate(|st| st.adopt(&req.node, req.segment_id, &items))
                .await?
                .map_err(|e| proto::status_of(&e))?;
            item_error = first_error(&results);
            let adopted = results.iter().filter(|r| r.is_ok()).count();
            tracing::info!(node = %req.node, segment = req.segment_id, adopted,
                refused = results.len() - adopted, "replicas adopted");
            Ok(Response::new(item_results(results)))
        }
        .await;
        self.record("adopt_replicas", start, &r, item_error);
        r
    }

    async fn put_start(
        &self,
        req: Request<proto::PutStartRequest>,
    ) -> Result<Response<proto::PutStartResponse>, Status> {
        let start = Instant::now();
        let req = req.into_inner();
        let mut item_error = None;
        let r = async {
            check_batch(req.items.len())?;
            let replicas = u8::try_from(req.replicas)
                .map_err(|_| invalid(format!("replicas {} out of range", req.replicas)))?;
            let spread = match proto::Spread::try_from(req.spread) {
                Ok(proto::Spread::Node) => Spread::Node,
                Ok(proto::Spread::FailureDomain) => Spread::FailureDomain,
                Err(_) => return Err(invalid(format!("unknown spread {}", req.spread))),
            };
            let tier = match req.tier {
                Some(t) => Some(
                    proto::tier_from_i32(t).ok_or_else(|| invalid(format!("unknown tier {t}")))?,
                ),
                None => None,
            };
            let opts = PutOptions {
                replicas,
                writer_node: (!req.writer_node.is_empty()).then(|| req.writer_node.clone()),
                numa_hint: req.numa_hint,
                spread,
                tier,
            };
            let keys: Vec<Vec<u8>> = req.items.iter().map(|i| i.key.clone()).collect();
            let keys = keys_of(&keys)?;
            let results = self
                .core
                .mutate(|st| {
                    keys.iter()
                        .zip(&req.items)
                        .map(|(k, item)| st.put_start(*k, item.size, &opts))
                        .collect::<Vec<_>>()
                })
                .await?;
            item_error = first_error(&results);
            Ok(Response::new(proto::PutStartResponse {
                results: results
                    .into_iter()
                    .map(|r| match r {
                        Ok(PutStarted::Allocated { put_id, replicas }) => proto::PutStartResult {
                            error: None,
                            already_committed: false,
                            put_id,
                            replicas: replicas.iter().map(Into::into).collect(),
                        },
                        Ok(PutStarted::AlreadyCommitted { .. }) => proto::PutStartResult {
                            already_committed: true,
                            ..Default::default()
                        },
                        Err(e) => proto::PutStartResult {
                            error: err(&e),
                            ..Default::default()
                        },
                    })
                    .collect(),
            }))
        }
        .await;
        self.record("put_start", start, &r, item_error);
        r
    }

    async fn put_end(
        &self,
        req: Request<proto::PutEndRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        self.end_or_revoke("put_end", req, true).await
    }

    async fn put_revoke(
        &self,
        req: Request<proto::PutEndRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        self.end_or_revoke("put_revoke", req, false).await
    }

    async fn get(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::GetResponse>, Status> {
        let start = Instant::now();
        let mut item_error = None;
        let r = async {
            let keys = keys_of(&req.into_inner().keys)?;
            // Leases and recency are not persisted: no need to wait for etcd.
            self.core.ensure_leader()?;
            let (results, now) = {
                let mut st = self.core.state.lock();
                let now = st.now_ms();
                (keys.iter().map(|k| st.get(*k)).collect::<Vec<_>>(), now)
            };
            item_error = first_error(&results);
            Ok(Response::new(proto::GetResponse {
                results: results
                    .into_iter()
                    .map(|r| match r {
                        Ok(g) => proto::GetResult {
                            error: None,
                            size: g.size,
                            replicas: g.replicas.iter().map(Into::into).collect(),
                            lease_id: g.lease.id,
                            lease_ttl_ms: g.lease.expires_ms.saturating_sub(now),
                        },
                        Err(e) => proto::GetResult {
                            error: err(&e),
                            ..Default::default()
                        },
                    })
                    .collect(),
            }))
        }
        .await;
        self.record("get", start, &r, item_error);
        r
    }

    async fn release_leases(
        &self,
        req: Request<proto::ReleaseLeasesRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let start = Instant::now();
        let mut item_error = None;
        let r = async {
            let ids = req.into_inner().lease_ids;
            check_batch(ids.len())?;
            self.core.ensure_leader()?;
            let results: Vec<_> = {
                let mut st = self.core.state.lock();
                ids.iter().map(|id| st.release_lease(*id)).collect()
            };
            item_error = first_error(&results);
            Ok(Response::new(item_results(results)))
        }
        .await;
        self.record("release_leases", start, &r, item_error);
        r
    }

    async fn exists(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ExistsResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let keys = keys_of(&req.into_inner().keys)?;
            let exists = self.core.read(|st| st.exists(&keys))?;
            Ok(Response::new(proto::ExistsResponse { exists }))
        }
        .await;
        self.record("exists", start, &r, None);
        r
    }

    async fn longest_prefix(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::LongestPrefixResponse>, Status> {
        let start = Instant::now();
        let r = async {
            let keys = keys_of(&req.into_inner().keys)?;
            let n = self.core.read(|st| st.longest_prefix(&keys))?;
            Ok(Response::new(proto::LongestPrefixResponse {
                length: u32::try_from(n).unwrap_or(u32::MAX),
            }))
        }
        .await;
        self.record("longest_prefix", start, &r, None);
        r
    }

    async fn remove(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let keys = req.into_inner().keys;
        self.per_key("remove", &keys, |st, k| st.remove(k)).await
    }

    async fn pin(
        &self,
        req: Request<proto::PinRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let req = req.into_inner();
        let (hard, ttl_ms) = (req.hard, req.ttl_ms);
        self.per_key("pin", &req.keys, move |st, k| st.pin(k, hard, ttl_ms))
            .await
    }

    async fn unpin(
        &self,
        req: Request<proto::KeysRequest>,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let keys = req.into_inner().keys;
        self.per_key("unpin", &keys, |st, k| st.unpin(k)).await
    }

    async fn stats(
        &self,
        _req: Request<proto::Empty>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        let start = Instant::now();
        let r = self
            .core
            .read(|st| (st.stats(), st.transports()))
            .map(|(s, t)| {
                Response::new(proto::StatsResponse {
                    objects: s.objects,
                    pending_puts: s.pending_puts,
                    used_bytes: s.used_bytes.to_vec(),
                    capacity_bytes: s.capacity_bytes.to_vec(),
                    leases: s.leases,
                    under_replicated: s.under_replicated,
                    tasks: s.tasks,
                    nodes_alive: s.nodes_alive,
                    segments: s.segments,
                    leader: true,
                    transport: t.into_iter().map(node_transport).collect(),
                })
            });
        self.record("stats", start, &r, None);
        r
    }
}

impl MasterSvc {
    /// Apply `op` to every key of a batch in one state mutation and answer per key: the shared
    /// shape of `remove`, `pin` and `unpin`.
    async fn per_key(
        &self,
        method: &str,
        raw_keys: &[Vec<u8>],
        op: impl Fn(&mut MasterState, ObjectKey) -> Result<(), MasterError> + Send,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let start = Instant::now();
        let mut item_error = None;
        let r = async {
            let keys = keys_of(raw_keys)?;
            let results = self
                .core
                .mutate(|st| keys.iter().map(|k| op(st, *k)).collect::<Vec<_>>())
                .await?;
            item_error = first_error(&results);
            Ok(Response::new(item_results(results)))
        }
        .await;
        self.record(method, start, &r, item_error);
        r
    }

    async fn end_or_revoke(
        &self,
        method: &str,
        req: Request<proto::PutEndRequest>,
        commit: bool,
    ) -> Result<Response<proto::ItemResults>, Status> {
        let start = Instant::now();
        let mut item_error = None;
        let r = async {
            let items = req.into_inner().items;
            let raw: Vec<Vec<u8>> = items.iter().map(|i| i.key.clone()).collect();
            let keys = keys_of(&raw)?;
            let results = self
                .core
                .mutate(|st| {
                    keys.iter()
                        .zip(&items)
                        .map(|(k, i)| {
                            if commit {
                                st.put_end(*k, i.put_id)
                            } else {
                                st.put_revoke(*k, i.put_id)
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .await?;
            item_error = first_error(&results);
            Ok(Response::new(item_results(results)))
        }
        .await;
        self.record(method, start, &r, item_error);
        r
    }
}

/// Longest fallback reason kept per node, in characters.
const MAX_TRANSPORT_REASON: usize = 512;
/// Most RDMA device names kept per node, and the longest name.
const MAX_TRANSPORT_DEVICES: usize = 16;
const MAX_DEVICE_NAME: usize = 64;

/// Transfer engine: a heartbeat's transport report as the state keeps it, cut to bounded sizes
/// (it comes from the network and is kept per node).
fn transport_state(r: &proto::TransportReport) -> TransportState {
    let cut = |s: &str, n: usize| s.chars().take(n).collect::<String>();
    TransportState {
        rdma_requested: r.rdma_requested,
        fallback: r.fallback,
        fallback_reason: cut(&r.fallback_reason, MAX_TRANSPORT_REASON),
        rdma_devices: r
            .rdma_devices
            .iter()
            .take(MAX_TRANSPORT_DEVICES)
            .map(|d| cut(d, MAX_DEVICE_NAME))
            .collect(),
    }
}

/// Transfer engine: one node's transport state as Stats returns it.
fn node_transport((node, t): (String, TransportState)) -> proto::NodeTransport {
    proto::NodeTransport {
        node,
        report: Some(proto::TransportReport {
            rdma_requested: t.rdma_requested,
            fallback: t.fallback,
            fallback_reason: t.fallback_reason,
            rdma_devices: t.rdma_devices,
        }),
    }
}
