//! Rust client of the master (agents, engines, the conductor): single and batched calls,
//! authenticated with the pool key, following the leader across master replicas, and nearest
//! replica choice. Concurrent single-item `get`, `put_start`, `put_end` and lease releases are
//! coalesced into batched calls (one in flight per kind; what arrives meanwhile goes in the
//! next), and lease releases can be left to a background sender. I/O boundary: gRPC channels
//! to the masters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use kvpool_core::master::types::{
    AdoptItem, PutOptions, PutStarted, ReplicaInfo, SegmentSpec, Spread, Task, Tier,
};
use kvpool_proto::auth::{AuthKey, Signer};
use kvpool_proto::master::{self as proto, master_client::MasterClient as Grpc};
use kvpool_proto::master::{LEADER_HEADER, MAX_BATCH};

type GrpcClient = Grpc<InterceptedService<Channel, Signer>>;

/// Taken off a lease's lifetime as the client sees it: the master counts whole milliseconds.
pub const LEASE_MARGIN: Duration = Duration::from_millis(5);

/// One unary call through [`MasterClient::call`] (retries, leader following): the request is
/// cloned for each attempt.
macro_rules! rpc {
    ($client:expr, $method:ident, $req:expr) => {{
        let req = $req;
        $client
            .call(stringify!($method), move |mut c| {
                let req = req.clone();
                async move { c.$method(req).await }
            })
            .await
    }};
}

/// Errors of the master client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no master endpoint given")]
    NoEndpoints,
    #[error("invalid master endpoint {endpoint:?}")]
    Endpoint {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot connect to master {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("master call {method} failed")]
    Rpc {
        method: &'static str,
        #[source]
        source: tonic::Status,
    },
    #[error("master refused: {message} ({code:?})")]
    Refused {
        code: proto::ErrorCode,
        message: String,
    },
    #[error("malformed master answer: {0}")]
    Malformed(String),
    /// The batched call that carried this item failed as a whole.
    #[error("batched master call {method} failed")]
    Batch {
        method: &'static str,
        #[source]
        source: Arc<ClientError>,
    },
}

impl ClientError {
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::NoEndpoints => "no_endpoints",
            ClientError::Endpoint { .. } => "endpoint",
            ClientError::Connect { .. } => "connect",
            ClientError::Rpc { .. } => "rpc",
            ClientError::Refused { .. } => "refused",
            ClientError::Malformed(_) => "malformed",
            ClientError::Batch { source, .. } => source.category(),
        }
    }

    /// A copy of the error when its parts can be copied (transport errors cannot).
    fn try_clone(&self) -> Option<ClientError> {
        Some(match self {
            ClientError::NoEndpoints => ClientError::NoEndpoints,
            ClientError::Rpc { method, source } => ClientError::Rpc {
                method,
                source: source.clone(),
            },
            ClientError::Refused { code, message } => ClientError::Refused {
                code: *code,
                message: message.clone(),
            },
            ClientError::Malformed(m) => ClientError::Malformed(m.clone()),
            ClientError::Batch { method, source } => ClientError::Batch {
                method,
                source: source.clone(),
            },
            ClientError::Endpoint { .. } | ClientError::Connect { .. } => return None,
        })
    }

    /// The master's error code when the master refused the item.
    pub fn code(&self) -> Option<proto::ErrorCode> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

fn refused(e: proto::Error) -> ClientError {
    ClientError::Refused {
        code: proto::ErrorCode::try_from(e.code).unwrap_or(proto::ErrorCode::Unspecified),
        message: e.message,
    }
}

fn item(e: Option<proto::Error>) -> Result<(), ClientError> {
    e.map_or(Ok(()), |e| Err(refused(e)))
}

/// A read answer as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    pub size: u64,
    pub replicas: Vec<ReplicaInfo>,
    pub lease_id: u64,
    /// Lease lifetime left when the master answered.
    pub lease_ttl: Duration,
    /// Until when the lease surely holds (the call's start plus the TTL, less
    /// [`LEASE_MARGIN`]): a read that completes later may have raced eviction and must be
    /// discarded.
    pub lease_deadline: Instant,
}

impl Located {
    /// Whether the lease still surely holds.
    pub fn lease_held(&self) -> bool {
        Instant::now() < self.lease_deadline
    }
}

/// Tunables of the client.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// Calls answered UNAVAILABLE (standby, restarting leader) are retried this long.
    pub failover_budget: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            failover_budget: Duration::from_secs(15),
        }
    }
}

#[derive(Debug, Default)]
struct Conn {
    /// Index into `endpoints` or an address learnt from a leader hint.
    addr: Option<String>,
    client: Option<GrpcClient>,
    next: usize,
}

/// Client of the master (cheap to clone; clones share the connection).
#[derive(Clone, Debug)]
pub struct MasterClient {
    endpoints: Arc<Vec<String>>,
    signer: Signer,
    config: ClientConfig,
    conn: Arc<Mutex<Conn>>,
    batch: Arc<Batchers>,
}

fn uri(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    }
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
        for e in &endpoints {
            Endpoint::from_shared(uri(e)).map_err(|source| ClientError::Endpoint {
                endpoint: e.clone(),
                source,
            })?;
        }
        Ok(Self {
            endpoints: Arc::new(endpoints),
            signer: Signer(key),
            config,
            conn: Arc::default(),
            batch: Arc::default(),
        })
    }

    async fn connection(&self) -> Result<(String, GrpcClient), ClientError> {
        let (addr, cached) = {
            let c = self.conn.lock();
            let addr = c.addr.clone().unwrap_or_else(|| {
                self.endpoints
                    .get(c.next % self.endpoints.len())
                    .cloned()
                    .unwrap_or_default()
            });
            (addr, c.client.clone())
        };
        if let Some(client) = cached {
            return Ok((addr, client));
        }
        let endpoint = Endpoint::from_shared(uri(&addr))
            .map_err(|source| ClientError::Endpoint {
                endpoint: addr.clone(),
                source,
            })?
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                endpoint: addr.clone(),
                source,
            })?;
        let client = Grpc::with_interceptor(channel, self.signer.clone())
            .max_decoding_message_size(64 << 20);
        let mut c = self.conn.lock();
        c.addr = Some(addr.clone());
        c.client = Some(client.clone());
        Ok((addr, client))
    }

    /// Forget the connection to `failed`; go to `hint` if given, else the next endpoint.
    fn fail_over(&self, failed: &str, hint: Option<String>) {
        let mut c = self.conn.lock();
        if c.addr.as_deref() != Some(failed) {
            return; // another call already moved on
        }
        c.client = None;
        c.addr = hint;
        if c.addr.is_none() {
            c.next = c.next.wrapping_add(1);
        }
    }

    /// The address the client currently talks to, if connected.
    pub fn current_endpoint(&self) -> Option<String> {
        self.conn.lock().addr.clone()
    }

    async fn call<T, F, Fut>(&self, method: &'static str, f: F) -> Result<T, ClientError>
    where
        F: Fn(GrpcClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.config.failover_budget;
        let mut backoff = Duration::from_millis(50);
        loop {
            let attempt: Result<(), ClientError> = match self.connection().await {
                Ok((addr, client)) => match f(client).await {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s) if retryable(&s) => {
                        let hint = s
                            .metadata()
                            .get(LEADER_HEADER)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                            .filter(|h| *h != addr);
                        self.fail_over(&addr, hint);
                        Err(ClientError::Rpc { method, source: s })
                    }
                    Err(s) => return Err(ClientError::Rpc { method, source: s }),
                },
                Err(e) => {
                    let mut c = self.conn.lock();
                    c.addr = None;
                    c.client = None;
                    c.next = c.next.wrapping_add(1);
                    Err(e)
                }
            };
            if let Err(e) = attempt {
                if tokio::time::Instant::now() + backoff > deadline {
                    return Err(e);
                }
                tracing::debug!(error = %e, "master unavailable, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }

    // ----- agents ------------------------------------------------------------------------

    pub async fn mount_segment(&self, spec: &SegmentSpec) -> Result<u32, ClientError> {
        let req = proto::MountSegmentRequest {
            segment: Some(spec.into()),
        };
        Ok(rpc!(self, mount_segment, req)?.segment_id)
    }

    pub async fn unmount_segment(&self, node: &str, segment_id: u32) -> Result<(), ClientError> {
        let req = proto::UnmountSegmentRequest {
            node: node.to_owned(),
            segment_id,
        };
        rpc!(self, unmount_segment, req)?;
        Ok(())
    }

    /// Heartbeat; returns the tasks the master queued for this node.
    pub async fn heartbeat(&self, node: &str) -> Result<Vec<Task>, ClientError> {
        self.heartbeat_with_transport(node, None).await
    }

    /// Heartbeat that also reports this node's transfer-engine transport state (the master
    /// keeps the last one per node and returns it in `Stats`).
    pub async fn heartbeat_with_transport(
        &self,
        node: &str,
        transport: Option<proto::TransportReport>,
    ) -> Result<Vec<Task>, ClientError> {
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            transport,
            ..Default::default()
        };
        tasks_of(&rpc!(self, heartbeat, req)?)
    }

    pub async fn complete_task(
        &self,
        node: &str,
        task_id: u64,
        ok: bool,
    ) -> Result<(), ClientError> {
        let req = proto::CompleteTaskRequest {
            node: node.to_owned(),
            task_id,
            ok,
        };
        rpc!(self, complete_task, req)?;
        Ok(())
    }

    /// Announce replicas this node holds in its mounted segment `segment_id` (after a
    /// restart); one result per item, in order.
    pub async fn adopt_replicas(
        &self,
        node: &str,
        segment_id: u32,
        items: &[AdoptItem],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::AdoptReplicasRequest {
            node: node.to_owned(),
            segment_id,
            items: items
                .iter()
                .map(|i| proto::AdoptItem {
                    key_digest: i.key.to_hex(),
                    offset: i.offset,
                    length: i.length,
                })
                .collect(),
        };
        item_results(rpc!(self, adopt_replicas, req)?, items.len())
    }

    // ----- objects -----------------------------------------------------------------------

    /// Start puts of `(key, size)` items in one call; one result per item.
    pub async fn put_start_batch(
        &self,
        items: &[(&[u8], u64)],
        opts: &PutOptions,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        let req = put_start_request(items.iter().map(|(k, size)| (k.to_vec(), *size)), opts);
        let r = rpc!(self, put_start, req)?;
        expect_len(r.results.len(), items.len())?;
        Ok(r.results.into_iter().map(put_started).collect())
    }

    /// Start one put. Concurrent calls with equal options share one `put_start` call.
    pub async fn put_start(
        &self,
        key: &[u8],
        size: u64,
        opts: &PutOptions,
    ) -> Result<PutStarted, ClientError> {
        match self
            .coalesced::<PutStartOp>((key.to_vec(), size, opts.clone()))
            .await?
        {
            PutStarted::AlreadyCommitted { .. } => Ok(PutStarted::AlreadyCommitted { size }),
            allocated => Ok(allocated),
        }
    }

    async fn end_batch(
        &self,
        items: Vec<proto::PutEndItem>,
        commit: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let n = items.len();
        let req = proto::PutEndRequest { items };
        let r = if commit {
            rpc!(self, put_end, req)?
        } else {
            rpc!(self, put_revoke, req)?
        };
        item_results(r, n)
    }

    /// Commit puts of `(key, put_id)` items in one call.
    pub async fn put_end_batch(
        &self,
        items: &[(&[u8], u64)],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        self.end_batch(
            end_items(items.iter().map(|(k, id)| (k.to_vec(), *id))),
            true,
        )
        .await
    }

    /// Commit one put. Concurrent calls share one `put_end` call.
    pub async fn put_end(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        self.coalesced::<PutEndOp>((key.to_vec(), put_id)).await
    }

    pub async fn put_revoke(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        first(
            self.end_batch(end_items([(key.to_vec(), put_id)]), false)
                .await?,
        )
    }

    /// Locate keys in one call, taking a read lease on each found one.
    pub async fn get_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        self.get_owned(keys.iter().map(|k| k.to_vec()).collect())
            .await
    }

    async fn get_owned(
        &self,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        let n = keys.len();
        // Taken before the call: the lease ends no earlier than this plus its TTL.
        let sent = Instant::now();
        let r = rpc!(self, get, proto::KeysRequest { keys })?;
        expect_len(r.results.len(), n)?;
        Ok(r.results.into_iter().map(|g| located(g, sent)).collect())
    }

    /// Locate one key with a read lease. Concurrent calls share one `get` call.
    pub async fn get(&self, key: &[u8]) -> Result<Located, ClientError> {
        self.coalesced::<GetOp>(key.to_vec()).await
    }

    /// Release leases in one call; one result per lease.
    pub async fn release_leases(
        &self,
        ids: &[u64],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::ReleaseLeasesRequest {
            lease_ids: ids.to_vec(),
        };
        item_results(rpc!(self, release_leases, req)?, ids.len())
    }

    /// Release one lease and wait for the answer. Concurrent calls share one call.
    pub async fn release_lease(&self, id: u64) -> Result<(), ClientError> {
        self.coalesced::<ReleaseOp>(id).await
    }

    /// Release a lease in the background: queued releases go to the master in batches, one
    /// call at a time, and a failed release is left to the lease's TTL. The caller must not
    /// touch the leased replicas any more. [`Self::flush_releases`] waits for the queue. Called
    /// outside a tokio runtime, the release leaves with the next call made from one.
    pub fn release_lease_later(&self, id: u64) {
        drop(self.enqueue::<ReleaseOp>(id, false));
    }

    /// Wait until every lease release queued so far (by this client and its clones) was sent
    /// and answered.
    pub async fn flush_releases(&self) {
        ReleaseOp::queue(&self.batch).idle().await;
    }

    pub async fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        let r = rpc!(self, exists, keys_req(keys))?;
        expect_len(r.exists.len(), keys.len())?;
        Ok(r.exists)
    }

    /// Number of leading keys that are cached.
    pub async fn longest_prefix(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        Ok(rpc!(self, longest_prefix, keys_req(keys))?.length as usize)
    }

    /// Remove keys. Leases this client released in the background are flushed first, so that
    /// its own finished reads never make the master refuse the remove.
    pub async fn remove_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        self.flush_releases().await;
        item_results(rpc!(self, remove, keys_req(keys))?, keys.len())
    }

    pub async fn remove(&self, key: &[u8]) -> Result<(), ClientError> {
        first(self.remove_batch(&[key]).await?)
    }

    /// Pin keys: `hard` never evicted; soft pins last `ttl` and are evicted last.
    pub async fn pin(
        &self,
        keys: &[&[u8]],
        hard: bool,
        ttl: Duration,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::PinRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            hard,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        };
        item_results(rpc!(self, pin, req)?, keys.len())
    }

    pub async fn unpin(&self, keys: &[&[u8]]) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        item_results(rpc!(self, unpin, keys_req(keys))?, keys.len())
    }

    pub async fn stats(&self) -> Result<proto::StatsResponse, ClientError> {
        rpc!(self, stats, proto::Empty {})
    }

    /// Heartbeat with the segment-event feed (agent, issue 4): acknowledges the events applied
    /// up to `acked` under `epoch` and reports corrupt blocks; returns the queued tasks, the
    /// master's feed epoch and the pending events.
    pub async fn heartbeat_feed(
        &self,
        node: &str,
        epoch: u64,
        acked: u64,
        corrupt: &[kvpool_core::master::state::CorruptBlock],
        transport: Option<proto::TransportReport>,
    ) -> Result<kvpool_core::master::state::HeartbeatReply, ClientError> {
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            feed_epoch: epoch,
            feed_acked: acked,
            corrupt: corrupt
                .iter()
                .map(|c| proto::SegmentBlock {
                    segment_id: c.segment_id,
                    key_digest: c.key.to_hex(),
                    offset: c.offset,
                })
                .collect(),
            transport,
        };
        let r = rpc!(self, heartbeat, req)?;
        let tasks = tasks_of(&r)?;
        let events = r
            .events
            .iter()
            .map(|e| {
                kvpool_proto::master::feed::event_from_proto(e)
                    .ok_or_else(|| ClientError::Malformed(format!("segment event {}", e.seq)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(kvpool_core::master::state::HeartbeatReply {
            tasks,
            feed_epoch: r.feed_epoch,
            events,
        })
    }

    // ----- coalescing --------------------------------------------------------------------

    /// Queue `item` for the next batched call of kind `B` and wait for its own result.
    async fn coalesced<B: BatchOp>(&self, item: B::Item) -> Result<B::Out, ClientError> {
        let Some(rx) = self.enqueue::<B>(item, true) else {
            return Err(ClientError::Malformed("no reply channel".into()));
        };
        rx.await.unwrap_or_else(|_| {
            Err(ClientError::Batch {
                method: B::METHOD,
                source: Arc::new(ClientError::Malformed("the batch task was dropped".into())),
            })
        })
    }

    /// Put `item` in the queue of `B`; start the queue's sender task unless one is running.
    fn enqueue<B: BatchOp>(&self, item: B::Item, reply: bool) -> Option<Reply<B::Out>> {
        let (tx, rx) = if reply {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let q = B::queue(&self.batch);
        if q.push(item, tx) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let this = self.clone();
                    rt.spawn(async move { this.drain::<B>().await });
                }
                // Outside a runtime (only `release_lease_later` can be called there): the item
                // waits for the next call made from one.
                Err(_) => q.state.lock().running = false,
            }
        }
        rx
    }

    /// The sender task of queue `B`: while items wait, send them as one call (at most
    /// `MAX_BATCH` items, `B::take` decides which) and hand each caller its result.
    async fn drain<B: BatchOp>(self) {
        let q = B::queue(&self.batch);
        while let Some(batch) = q.next(B::take) {
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            q.calls.fetch_add(1, Ordering::Relaxed);
            match B::send(&self, items).await {
                Ok(results) => {
                    for (r, tx) in results.into_iter().zip(replies) {
                        match tx {
                            Some(tx) => {
                                if let Err(Ok(out)) = tx.send(r) {
                                    B::orphaned(&self, out);
                                }
                            }
                            None => {
                                if let Err(e) = r {
                                    tracing::debug!(error = %e, method = B::METHOD,
                                        "background call refused an item");
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, method = B::METHOD, "batched master call failed");
                    // Every caller sees the call's own error where it can be copied (an RPC
                    // status, a refusal); a transport error is shared behind `Batch`.
                    let shared = Arc::new(e);
                    for tx in replies.into_iter().flatten() {
                        let _ = tx.send(Err(shared.try_clone().unwrap_or_else(|| {
                            ClientError::Batch {
                                method: B::METHOD,
                                source: shared.clone(),
                            }
                        })));
                    }
                }
            }
        }
    }

    /// Batched calls this client sent so far, by kind (`get`, `put_start`, `put_end`,
    /// `release_leases`): with concurrent callers, fewer than the operations they carried.
    pub fn batched_calls(&self) -> BatchedCalls {
        let n = |q: &AtomicU64| q.load(Ordering::Relaxed);
        BatchedCalls {
            get: n(&self.batch.get.calls),
            put_start: n(&self.batch.put_start.calls),
            put_end: n(&self.batch.put_end.calls),
            release_leases: n(&self.batch.release.calls),
        }
    }
}

/// Counts of batched calls, see [`MasterClient::batched_calls`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchedCalls {
    pub get: u64,
    pub put_start: u64,
    pub put_end: u64,
    pub release_leases: u64,
}

type ReplyTx<O> = oneshot::Sender<Result<O, ClientError>>;
type Reply<O> = oneshot::Receiver<Result<O, ClientError>>;
/// A queued item and where its result goes (nowhere for background releases).
type Pending<I, O> = (I, Option<ReplyTx<O>>);
/// Picks the items of the next call out of a queue.
type Take<I, O> = fn(&mut Vec<Pending<I, O>>) -> Vec<Pending<I, O>>;

/// One queue of items waiting for a batched call; at most one call per queue is in flight,
/// and items that arrive meanwhile go together in the next one (no timer: a lone item leaves
/// at once).
#[derive(Debug)]
struct Coalescer<I, O> {
    state: Mutex<Queue<I, O>>,
    idle: Notify,
    calls: AtomicU64,
}

#[derive(Debug)]
struct Queue<I, O> {
    items: Vec<Pending<I, O>>,
    /// A sender task is running (it stops only when it finds `items` empty).
    running: bool,
}

impl<I, O> Default for Coalescer<I, O> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                items: Vec::new(),
                running: false,
            }),
            idle: Notify::new(),
            calls: AtomicU64::new(0),
        }
    }
}

impl<I, O> Coalescer<I, O> {
    /// Queue an item; true when the caller must start the sender task.
    fn push(&self, item: I, reply: Option<ReplyTx<O>>) -> bool {
        let mut q = self.state.lock();
        q.items.push((item, reply));
        !std::mem::replace(&mut q.running, true)
    }

    /// The next batch, or `None` (and the queue marked idle) when nothing waits.
    fn next(&self, take: Take<I, O>) -> Option<Vec<Pending<I, O>>> {
        let mut q = self.state.lock();
        if q.items.is_empty() {
            q.running = false;
            drop(q);
            self.idle.notify_waiters();
            return None;
        }
        Some(take(&mut q.items))
    }

    /// Wait until no item waits and no call is in flight.
    async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.state.lock().running {
                return;
            }
            notified.await;
        }
    }
}

/// The first `MAX_BATCH` items (the master refuses larger batches).
fn take_front<T>(items: &mut Vec<T>) -> Vec<T> {
    if items.len() <= MAX_BATCH {
        std::mem::take(items)
    } else {
        let rest = items.split_off(MAX_BATCH);
        std::mem::replace(items, rest)
    }
}

/// The queues of a client (shared by its clones).
#[derive(Debug, Default)]
struct Batchers {
    get: Coalescer<Vec<u8>, Located>,
    put_start: Coalescer<(Vec<u8>, u64, PutOptions), PutStarted>,
    put_end: Coalescer<(Vec<u8>, u64), ()>,
    release: Coalescer<u64, ()>,
}

/// A kind of call that concurrent single-item calls share.
trait BatchOp: Send + Sync + 'static {
    type Item: Send + 'static;
    type Out: Send + 'static;
    const METHOD: &'static str;
    fn queue(b: &Batchers) -> &Coalescer<Self::Item, Self::Out>;
    /// Send `items` as one call; one result per item, in order.
    fn send(
        client: &MasterClient,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Result<Vec<Result<Self::Out, ClientError>>, ClientError>> + Send;
    /// Which queued items go in the next call.
    fn take(
        items: &mut Vec<Pending<Self::Item, Self::Out>>,
    ) -> Vec<Pending<Self::Item, Self::Out>> {
        take_front(items)
    }
    /// A result whose caller went away.
    fn orphaned(_client: &MasterClient, _out: Self::Out) {}
}

struct GetOp;
struct PutStartOp;
struct PutEndOp;
struct ReleaseOp;

impl BatchOp for GetOp {
    type Item = Vec<u8>;
    type Out = Located;
    const METHOD: &'static str = "get";
    fn queue(b: &Batchers) -> &Coalescer<Vec<u8>, Located> {
        &b.get
    }
    async fn send(
        client: &MasterClient,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        client.get_owned(keys).await
    }
    /// Nobody will read: give the lease back.
    fn orphaned(client: &MasterClient, out: Located) {
        client.release_lease_later(out.lease_id);
    }
}

impl BatchOp for PutStartOp {
    type Item = (Vec<u8>, u64, PutOptions);
    type Out = PutStarted;
    const METHOD: &'static str = "put_start";
    fn queue(b: &Batchers) -> &Coalescer<Self::Item, PutStarted> {
        &b.put_start
    }
    async fn send(
        client: &MasterClient,
        items: Vec<Self::Item>,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        let n = items.len();
        let Some(opts) = items.first().map(|i| i.2.clone()) else {
            return Ok(Vec::new());
        };
        let req = put_start_request(items.into_iter().map(|(k, size, _)| (k, size)), &opts);
        let r = rpc!(client, put_start, req)?;
        expect_len(r.results.len(), n)?;
        Ok(r.results.into_iter().map(put_started).collect())
    }
    /// One call carries one set of options: the leading run of items that share them.
    fn take(
        items: &mut Vec<Pending<Self::Item, PutStarted>>,
    ) -> Vec<Pending<Self::Item, PutStarted>> {
        let same = match items.first() {
            Some(((_, _, opts), _)) => items
                .iter()
                .take(MAX_BATCH)
                .take_while(|((_, _, o), _)| o == opts)
                .count(),
            None => 0,
        };
        let rest = items.split_off(same);
        std::mem::replace(items, rest)
    }
}

impl BatchOp for PutEndOp {
    type Item = (Vec<u8>, u64);
    type Out = ();
    const METHOD: &'static str = "put_end";
    fn queue(b: &Batchers) -> &Coalescer<(Vec<u8>, u64), ()> {
        &b.put_end
    }
    async fn send(
        client: &MasterClient,
        items: Vec<(Vec<u8>, u64)>,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        client.end_batch(end_items(items), true).await
    }
}

impl BatchOp for ReleaseOp {
    type Item = u64;
    type Out = ();
    const METHOD: &'static str = "release_leases";
    fn queue(b: &Batchers) -> &Coalescer<u64, ()> {
        &b.release
    }
    async fn send(
        client: &MasterClient,
        ids: Vec<u64>,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        client.release_leases(&ids).await
    }
}

fn put_start_request(
    items: impl Iterator<Item = (Vec<u8>, u64)>,
    opts: &PutOptions,
) -> proto::PutStartRequest {
    proto::PutStartRequest {
        items: items
            .map(|(key, size)| proto::PutItem { key, size })
            .collect(),
        replicas: u32::from(opts.replicas),
        writer_node: opts.writer_node.clone().unwrap_or_default(),
        numa_hint: opts.numa_hint,
        spread: match opts.spread {
            Spread::Node => proto::Spread::Node,
            Spread::FailureDomain => proto::Spread::FailureDomain,
        } as i32,
        tier: opts.tier.map(|t| proto::Tier::from(t) as i32),
    }
}

fn put_started(res: proto::PutStartResult) -> Result<PutStarted, ClientError> {
    if let Some(e) = res.error {
        return Err(refused(e));
    }
    if res.already_committed {
        return Ok(PutStarted::AlreadyCommitted { size: 0 });
    }
    Ok(PutStarted::Allocated {
        put_id: res.put_id,
        replicas: replica_infos(&res.replicas)?,
    })
}

fn replica_infos(replicas: &[proto::Replica]) -> Result<Vec<ReplicaInfo>, ClientError> {
    replicas
        .iter()
        .map(|r| {
            r.to_info()
                .ok_or_else(|| ClientError::Malformed("replica tier".into()))
        })
        .collect()
}

/// A get answer; `sent` is when the call left, so `sent + ttl` is no later than the master's
/// own expiry of the lease.
fn located(g: proto::GetResult, sent: Instant) -> Result<Located, ClientError> {
    if let Some(e) = g.error {
        return Err(refused(e));
    }
    let ttl = Duration::from_millis(g.lease_ttl_ms);
    Ok(Located {
        size: g.size,
        replicas: replica_infos(&g.replicas)?,
        lease_id: g.lease_id,
        lease_ttl: ttl,
        lease_deadline: sent + ttl.saturating_sub(LEASE_MARGIN),
    })
}

fn end_items(items: impl IntoIterator<Item = (Vec<u8>, u64)>) -> Vec<proto::PutEndItem> {
    items
        .into_iter()
        .map(|(key, put_id)| proto::PutEndItem { key, put_id })
        .collect()
}

fn item_results(
    r: proto::ItemResults,
    want: usize,
) -> Result<Vec<Result<(), ClientError>>, ClientError> {
    expect_len(r.results.len(), want)?;
    Ok(r.results.into_iter().map(|i| item(i.error)).collect())
}

/// The tasks of a heartbeat answer; a malformed one fails the call.
fn tasks_of(r: &proto::HeartbeatResponse) -> Result<Vec<Task>, ClientError> {
    r.tasks
        .iter()
        .map(|t| {
            t.to_task()
                .ok_or_else(|| ClientError::Malformed(format!("task {}", t.id)))
        })
        .collect()
}

/// Calls worth retrying on another connection: the master is a standby or going away, or the
/// connection broke (a crashed leader). A retried mutating call may find its first attempt
/// applied (`put_start` then answers PUT_IN_PROGRESS, `remove` UNKNOWN_KEY).
fn retryable(s: &tonic::Status) -> bool {
    use std::error::Error as _;
    match s.code() {
        Code::Unavailable | Code::Cancelled => true,
        Code::Unknown => s
            .source()
            .is_some_and(|e| e.is::<tonic::transport::Error>()),
        _ => false,
    }
}

fn keys_req(keys: &[&[u8]]) -> proto::KeysRequest {
    proto::KeysRequest {
        keys: keys.iter().map(|k| k.to_vec()).collect(),
    }
}

fn expect_len(got: usize, want: usize) -> Result<(), ClientError> {
    if got == want {
        Ok(())
    } else {
        Err(ClientError::Malformed(format!(
            "{got} results for {want} items"
        )))
    }
}

fn first<T>(mut v: Vec<Result<T, ClientError>>) -> Result<T, ClientError> {
    v.pop()
        .unwrap_or_else(|| Err(ClientError::Malformed("empty answer".into())))
}

/// The replica to read: on `node` and `numa_node`, else on `node`, else the first DRAM one,
/// else the first.
pub fn pick_nearest<'a>(
    replicas: &'a [ReplicaInfo],
    node: &str,
    numa_node: Option<u32>,
) -> Option<&'a ReplicaInfo> {
    // `max_by_key` keeps the last of equal candidates; reversing keeps the master's order.
    replicas.iter().rev().max_by_key(|r| {
        let same_node = r.node == node;
        (
            same_node,
            same_node && numa_node == Some(r.numa_node),
            r.tier == Tier::Dram,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rep(node: &str, numa: u32, tier: Tier) -> ReplicaInfo {
        ReplicaInfo {
            node: node.into(),
            segment_id: 1,
            segment: "s".into(),
            tier,
            numa_node: numa,
            endpoints: vec![],
            offset: 0,
            length: 1,
        }
    }

    #[test]
    fn nearest_replica_prefers_node_then_numa_then_dram() {
        let reps = vec![
            rep("b", 0, Tier::Ssd),
            rep("c", 0, Tier::Dram),
            rep("a", 0, Tier::Dram),
            rep("a", 1, Tier::Dram),
        ];
        let pick =
            |n: &str, numa| pick_nearest(&reps, n, numa).map(|r| (r.node.clone(), r.numa_node));
        assert_eq!(pick("a", Some(1)), Some(("a".into(), 1)));
        assert_eq!(pick("a", Some(0)), Some(("a".into(), 0)));
        assert_eq!(pick("b", None), Some(("b".into(), 0)));
        assert_eq!(pick("z", None), Some(("c".into(), 0)), "DRAM before SSD");
        assert_eq!(pick_nearest(&[], "a", None), None);
    }

    #[test]
    fn batches_stop_at_the_master_limit_and_put_starts_group_by_options() {
        let mut items: Vec<u32> = (0..(MAX_BATCH as u32 + 5)).collect();
        let first = take_front(&mut items);
        assert_eq!(first.len(), MAX_BATCH);
        assert_eq!(
            items,
            (MAX_BATCH as u32..MAX_BATCH as u32 + 5).collect::<Vec<_>>()
        );
        assert_eq!(take_front(&mut items).len(), 5);
        assert!(items.is_empty());

        let two = PutOptions {
            replicas: 2,
            ..PutOptions::default()
        };
        let item = |k: &str, o: &PutOptions| ((k.as_bytes().to_vec(), 1, o.clone()), None);
        let mut queue = vec![
            item("a", &PutOptions::default()),
            item("b", &PutOptions::default()),
            item("c", &two),
            item("d", &PutOptions::default()),
        ];
        type Queued = Pending<<PutStartOp as BatchOp>::Item, PutStarted>;
        let keys =
            |v: &[Queued]| -> Vec<Vec<u8>> { v.iter().map(|((k, _, _), _)| k.clone()).collect() };
        let batch = PutStartOp::take(&mut queue);
        assert_eq!(keys(&batch), vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(keys(&PutStartOp::take(&mut queue)), vec![b"c".to_vec()]);
        assert_eq!(keys(&PutStartOp::take(&mut queue)), vec![b"d".to_vec()]);
        assert!(queue.is_empty());
    }

    #[tokio::test]
    async fn a_queue_has_one_sender_and_is_idle_only_when_drained() {
        let q: Coalescer<u64, ()> = Coalescer::default();
        q.idle().await; // idle from the start
        assert!(q.push(1, None), "the first item starts a sender");
        assert!(!q.push(2, None), "a running sender takes the next items");
        let batch = q.next(take_front).expect("two items wait");
        assert_eq!(batch.len(), 2);
        assert!(!q.push(3, None), "still running while a call is in flight");
        assert_eq!(q.next(take_front).map(|b| b.len()), Some(1));
        assert!(q.next(take_front).is_none(), "drained: the sender stops");
        q.idle().await;
        assert!(q.push(4, None), "a new item after that starts a new sender");
    }

    #[test]
    fn a_release_queued_outside_a_runtime_leaves_with_the_next_call() {
        let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
        let client = MasterClient::new(vec!["127.0.0.1:1".into()], key, ClientConfig::default())
            .expect("client");
        client.release_lease_later(5); // no runtime here: must not panic
        let q = &client.batch.release;
        assert!(!q.state.lock().running);
        assert_eq!(q.state.lock().items.len(), 1, "kept for the next call");
    }

    #[tokio::test]
    async fn a_failed_batched_call_reaches_every_caller() {
        let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
        let config = ClientConfig {
            connect_timeout: Duration::from_millis(200),
            request_timeout: Duration::from_secs(1),
            failover_budget: Duration::from_millis(100),
        };
        // Nothing listens on port 1.
        let client = MasterClient::new(vec!["127.0.0.1:1".into()], key, config).expect("client");
        let (a, b, c) = tokio::join!(client.get(b"x"), client.get(b"y"), client.put_end(b"z", 7));
        for e in [a.map(|_| ()), b.map(|_| ()), c] {
            let e = e.expect_err("no master");
            assert_eq!(e.category(), "connect", "{e}");
        }
        // The failed calls were sent as batches: both gets in one.
        assert_eq!(client.batched_calls().get, 1);
        client.flush_releases().await;
    }

    #[test]
    fn bad_endpoints_are_refused_up_front() {
        let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
        assert!(matches!(
            MasterClient::new(vec![], key.clone(), ClientConfig::default()),
            Err(ClientError::NoEndpoints)
        ));
        assert!(matches!(
            MasterClient::new(
                vec!["http://bad host:1".into()],
                key,
                ClientConfig::default()
            ),
            Err(ClientError::Endpoint { .. })
        ));
    }
}
