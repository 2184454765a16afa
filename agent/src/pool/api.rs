//! Engine-API requests in pool mode: [`PoolApi`] is the engine API's [`BlockStore`], serving
//! put/get/exists/remove batches from the pool through [`PoolClient`] (the master allocates and
//! locates, bytes move by the transfer engine or, for replicas in this agent's own segments, by
//! an in-process copy). The engine's staging area is the source of puts and the destination of
//! gets, as in local-only mode. I/O boundary: the master's gRPC channel and the transfer engine
//! (inside [`PoolClient`]); the mapping from pool errors to per-item statuses ([`put_status`],
//! [`get_status`]) is pure.

use kvpool_runtime::telemetry::chain;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use futures::stream::{self, StreamExt};
use kvpool_client::master::ClientError;
use kvpool_client::pool::{BatchItem, DataError, PoolClient};
use kvpool_core::master::{ObjectKey, PutOptions, ReplicaInfo, Spread};
use kvpool_proto::master::ErrorCode;
use kvpool_transfer::{LocalSegment, Segment};
use parking_lot::Mutex;

use super::feed;
use super::registrar::SSD_SEGMENT;
use crate::api::block_store::{Batch, BatchError, BlockStore};
use crate::api::shm::Staging;
use crate::metrics::AgentMetrics;
use crate::proto::{GetItem, GetResult, PutItem, PutRequest, Status};
use crate::ssd::MAX_KEY_LEN as MAX_KEY_BYTES;
use crate::ssd::pool::SharedIndex;

/// Put items of one batch moved at once (each is a master round trip plus a transfer).
pub const PARALLEL_ITEMS: usize = 8;

/// Staging areas registered with the transfer engine, each with its area.
type Registrations = Vec<(Weak<Staging>, LocalSegment)>;

/// The engine API's view of the pool.
#[derive(Clone, Debug)]
pub struct PoolApi {
    client: PoolClient,
    node: String,
    replicas: u8,
    /// Index of this node's SSD segment: puts that land there are recorded in it.
    ssd_index: Option<SharedIndex>,
    /// The engine API's metrics (hits, misses, bytes and errors of the pool).
    metrics: Arc<AgentMetrics>,
    /// Staging areas registered with the client's transfer engine, so that puts and gets move
    /// bytes straight between the engine's staging memory and the wire (one copy, by the
    /// kernel). Each registration holds its area's mapping; it is dropped once the session is
    /// closed and no call uses the area any more.
    registered: Arc<Mutex<Registrations>>,
    /// Put and get batches in flight: one alone, of one block, runs on a fork (`take_fork`).
    in_flight: Arc<AtomicUsize>,
    /// Forks of the client kept for lone calls.
    forks: Arc<Mutex<Vec<Fork>>>,
}

/// Forks kept for reuse; lone calls rarely need more than one or two.
const MAX_FORKS: usize = 4;

/// A fork of the client with the current-thread runtime that drives it.
#[derive(Debug)]
struct Fork {
    /// Always `Some` but in `drop`.
    runtime: Option<tokio::runtime::Runtime>,
    api: PoolApi,
}

impl Fork {
    fn block_on<F: std::future::Future>(&self, f: F) -> Option<F::Output> {
        self.runtime.as_ref().map(|rt| rt.block_on(f))
    }
}

impl Drop for Fork {
    fn drop(&mut self) {
        // Forks may be dropped from async code (the agent shutting down), where a runtime
        // must not block on its own shutdown.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A batch counted in flight until dropped.
struct Calls<'a> {
    n: &'a AtomicUsize,
    /// No other batch was in flight when this one started.
    alone: bool,
}

impl Drop for Calls<'_> {
    fn drop(&mut self) {
        self.n.fetch_sub(1, Ordering::AcqRel);
    }
}

fn code_of(e: &DataError) -> Option<ErrorCode> {
    match e {
        DataError::Master(c) => c.code(),
        _ => None,
    }
}

/// Status of a failed put.
pub fn put_status(e: &DataError) -> Status {
    match code_of(e) {
        Some(ErrorCode::NoSpace) => Status::NoSpace,
        Some(ErrorCode::TooLarge | ErrorCode::InvalidArgument | ErrorCode::SizeConflict) => {
            Status::Invalid
        }
        Some(ErrorCode::NoSegments) => Status::Unavailable,
        None if matches!(e, DataError::Master(c) if c.is_unavailable()) => Status::Unavailable,
        _ => Status::Internal,
    }
}

/// Status of a failed get.
pub fn get_status(e: &DataError) -> Status {
    match code_of(e) {
        Some(ErrorCode::UnknownKey) => Status::NotFound,
        Some(ErrorCode::InvalidArgument) => Status::Invalid,
        _ => Status::Internal,
    }
}

fn bad_key(key: &[u8]) -> bool {
    key.is_empty() || key.len() > MAX_KEY_BYTES
}

impl PoolApi {
    /// Puts go to `replicas` nodes, the first preferably this one (`node`); outcomes are
    /// counted in `metrics`.
    pub fn new(client: PoolClient, node: String, replicas: u8, metrics: Arc<AgentMetrics>) -> Self {
        Self {
            client,
            node,
            replicas,
            ssd_index: None,
            metrics,
            registered: Arc::default(),
            in_flight: Arc::default(),
            forks: Arc::default(),
        }
    }

    fn enter(&self) -> Calls<'_> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        Calls {
            n: &self.in_flight,
            alone: before == 0,
        }
    }

    /// A fork of the client for a lone call (kept from an earlier one, or made now): it runs on
    /// a blocking thread, on a current-thread runtime of its own, with the master's fast lane
    /// and transfers on that thread, the way the Python client runs a lone call; so an engine
    /// waiting for one block crosses no other thread of the agent. `None` when no runtime can
    /// be started (the call then runs as any other).
    fn take_fork(&self) -> Option<Fork> {
        if let Some(f) = self.forks.lock().pop() {
            return Some(f);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        // The fork's own fork list stays empty: sharing ours would make a cycle.
        let api = PoolApi {
            client: self.client.fork(tokio::runtime::Handle::current()),
            in_flight: Arc::default(),
            forks: Arc::default(),
            ..self.clone()
        };
        Some(Fork {
            runtime: Some(runtime),
            api,
        })
    }

    /// A lone call (`calls.alone`) of one item runs `run` on a fork (see [`Self::take_fork`])
    /// on a blocking thread; `failed` when that thread or the fork's runtime fails. `None` when
    /// the call is not alone, has more than one item, or no fork can be had: the caller then
    /// runs the batch as any other.
    async fn on_fork<I, T>(
        &self,
        calls: &Calls<'_>,
        items: &[I],
        failed: T,
        run: impl AsyncFnOnce(&PoolApi, &I) -> T + Send + 'static,
    ) -> Option<T>
    where
        I: Clone + Send + 'static,
        T: Copy + Send + 'static,
    {
        let ([item], true) = (items, calls.alone) else {
            return None;
        };
        let fork = self.take_fork()?;
        let (item, forks) = (item.clone(), self.forks.clone());
        let joined = tokio::task::spawn_blocking(move || {
            let out = fork.block_on(run(&fork.api, &item)).unwrap_or(failed);
            Self::give_back(&forks, fork);
            out
        })
        .await;
        Some(joined.unwrap_or(failed))
    }

    fn give_back(forks: &Mutex<Vec<Fork>>, fork: Fork) {
        let mut kept = forks.lock();
        if kept.len() < MAX_FORKS {
            kept.push(fork);
        }
    }

    /// `staging` as memory of the client's transfer engine (registered on first use).
    fn registered(&self, staging: &Arc<Staging>) -> Result<LocalSegment, DataError> {
        let mut regs = self.registered.lock();
        // A closed session's area is held by its registration alone: let both go.
        regs.retain(|(w, _)| w.strong_count() > 1);
        if let Some((_, seg)) = regs
            .iter()
            .find(|(w, _)| w.as_ptr() == Arc::as_ptr(staging))
        {
            return Ok(seg.clone());
        }
        let len = usize::try_from(staging.size()).unwrap_or(usize::MAX);
        let ptr = NonNull::new(staging.as_ptr()).ok_or_else(|| DataError::Staging {
            size: staging.size(),
            source: kvpool_transfer::MemoryError::InvalidSize { size: 0, max: 0 },
        })?;
        let keep = Arc::clone(staging);
        // SAFETY: the mapping covers `len` bytes from `ptr` and stays mapped while `keep`
        // lives, which the release closure holds until the segment's last reference drops.
        // The bytes are only touched through raw pointers (the engine's syscalls, the
        // staging's own copies), never through Rust references.
        let seg = unsafe { Segment::from_raw_parts(ptr, len, Some(Box::new(move || drop(keep)))) }
            .map_err(|source| DataError::Staging {
                size: staging.size(),
                source,
            })?
            .on_numa_node(staging.numa_node());
        let local = self.client.register_memory(Arc::new(seg))?;
        regs.push((Arc::downgrade(staging), local.clone()));
        Ok(local)
    }

    /// Record puts that land in this node's SSD segment in its durable index.
    pub fn with_ssd_index(mut self, index: Option<SharedIndex>) -> Self {
        self.ssd_index = index;
        self
    }

    /// Index the replicas of `key` that landed in this node's SSD segment (flushing the data
    /// first); a failure only costs the block's persistence across a restart.
    async fn record_ssd(
        &self,
        key: &[u8],
        staging: &Staging,
        offset: u64,
        length: u64,
        replicas: &[ReplicaInfo],
    ) {
        let Some(index) = self.ssd_index.clone() else {
            return;
        };
        let mine: Vec<(u64, u64)> = replicas
            .iter()
            .filter(|r| r.node == self.node && r.segment == SSD_SEGMENT)
            .map(|r| (r.offset, r.length))
            .collect();
        if mine.is_empty() {
            return;
        }
        // Only a replica on this node's SSD needs the value's checksum (and so its bytes).
        let mut value = vec![0u8; usize::try_from(length).unwrap_or(0)];
        if staging.read_into(offset, &mut value).is_err() {
            return;
        }
        let (object, crc) = (ObjectKey::from_bytes(key), crc32c::crc32c(&value));
        feed::update_index(
            index,
            "recording a put in the SSD index failed",
            "the SSD index worker failed",
            move |idx| {
                mine.into_iter()
                    .try_for_each(|(offset, length)| idx.record(object, offset, length, crc))
            },
        )
        .await;
    }

    fn count_error(&self, e: &DataError) {
        self.metrics
            .errors
            .with_label_values(&[&format!("pool_{}", e.category())])
            .inc();
    }

    /// Put every `(key, offset, length)` of `staging`; one status per item, in order. Up to
    /// [`PARALLEL_ITEMS`] items are in flight at once.
    pub async fn put(
        &self,
        staging: &Arc<Staging>,
        items: Vec<PutItem>,
        numa_hint: Option<u32>,
    ) -> Vec<i32> {
        let opts = PutOptions {
            replicas: self.replicas,
            writer_node: Some(self.node.clone()),
            numa_hint,
            spread: Spread::Node,
            tier: None,
            ..PutOptions::default()
        };
        let calls = self.enter();
        let (lone_staging, lone_opts) = (staging.clone(), opts.clone());
        let lone = async move |api: &PoolApi, item: &PutItem| {
            api.put_one(&lone_staging, item, &lone_opts).await
        };
        if let Some(status) = self.on_fork(&calls, &items, Status::Internal, lone).await {
            return vec![status as i32];
        }
        let opts = &opts;
        stream::iter(items)
            .map(|item| async move { self.put_one(staging, &item, opts).await })
            .buffered(PARALLEL_ITEMS)
            .map(|s| s as i32)
            .collect()
            .await
    }

    async fn put_one(&self, staging: &Arc<Staging>, item: &PutItem, opts: &PutOptions) -> Status {
        let (key, offset, length) = (item.key.as_slice(), item.offset, item.length);
        if bad_key(key) || length == 0 || !staging.contains(offset, length) {
            return Status::Invalid;
        }
        // The bytes go from the engine's staging area to the replicas with no copy of ours.
        let put = match self.registered(staging) {
            Ok(area) => self.client.put_from(key, &area, offset, length, opts).await,
            Err(e) => Err(e),
        };
        match put {
            Ok(replicas) => {
                self.record_ssd(key, staging, offset, length, &replicas)
                    .await;
                self.metrics
                    .bytes_written
                    .with_label_values(&["pool"])
                    .inc_by(length);
                Status::Ok
            }
            Err(e) => {
                self.count_error(&e);
                tracing::debug!(error = %chain(&e), "pool put failed");
                put_status(&e)
            }
        }
    }

    /// Get every `(key, offset, capacity)` into `staging`; one result per item, in order. A
    /// batch of several is one batch of the pool client (one master call locates every key,
    /// one blocking step moves every value: copies from this agent's own tiers, transfers from
    /// the other agents).
    pub async fn get(&self, staging: &Arc<Staging>, items: Vec<GetItem>) -> Vec<GetResult> {
        let calls = self.enter();
        let lone_staging = staging.clone();
        let lone =
            async move |api: &PoolApi, item: &GetItem| api.get_one(&lone_staging, item).await;
        if let Some((status, length)) = self
            .on_fork(&calls, &items, (Status::Internal, 0), lone)
            .await
        {
            return vec![GetResult {
                status: status as i32,
                length,
            }];
        }
        let area = match self.registered(staging) {
            Ok(area) => area,
            Err(e) => {
                let status = self.got(Err(e));
                return items.iter().map(|_| result(status)).collect();
            }
        };
        // Items that name a key and a range of the staging area go in the batch; the others
        // are refused.
        let valid: Vec<bool> = items
            .iter()
            .map(|i| !bad_key(&i.key) && staging.contains(i.offset, i.capacity))
            .collect();
        // Received straight into the engine's staging area (a value that does not fit is
        // refused before any byte moves).
        let batch: Vec<BatchItem<'_>> = items
            .iter()
            .zip(&valid)
            .filter(|(_, ok)| **ok)
            .map(|(i, _)| BatchItem::one(&i.key, &area, i.offset, i.capacity))
            .collect();
        let mut got = self.client.get_many_to(&batch).await.into_iter();
        valid
            .iter()
            .map(|&ok| {
                result(if ok {
                    got.next().map_or((Status::Internal, 0), |r| self.got(r))
                } else {
                    (Status::Invalid, 0)
                })
            })
            .collect()
    }

    async fn get_one(&self, staging: &Arc<Staging>, item: &GetItem) -> (Status, u64) {
        let (key, offset, capacity) = (item.key.as_slice(), item.offset, item.capacity);
        if bad_key(key) || !staging.contains(offset, capacity) {
            return (Status::Invalid, 0);
        }
        // Received straight into the engine's staging area (a value that does not fit is
        // refused before any byte moves).
        let got = match self.registered(staging) {
            Ok(area) => {
                self.client
                    .get_to_within(key, &area, offset, capacity)
                    .await
            }
            Err(e) => Err(e),
        };
        self.got(got)
    }

    /// The status and length of one get, counted in the metrics.
    fn got(&self, got: Result<u64, DataError>) -> (Status, u64) {
        match got {
            Ok(len) => {
                self.metrics.hits.with_label_values(&["pool"]).inc();
                self.metrics
                    .bytes_read
                    .with_label_values(&["pool"])
                    .inc_by(len);
                (Status::Ok, len)
            }
            Err(DataError::BufferTooSmall { size, .. }) => (Status::BufferTooSmall, size),
            Err(e) => {
                let status = get_status(&e);
                if status == Status::NotFound {
                    self.metrics.misses.inc();
                } else {
                    self.count_error(&e);
                    tracing::debug!(error = %chain(&e), "pool get failed");
                }
                (status, 0)
            }
        }
    }

    /// Which keys the pool holds (committed objects).
    pub async fn exists(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>, ClientError> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        self.client.master().exists(&refs).await
    }

    /// Remove keys from the pool; true for each key that was there.
    pub async fn remove(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>, ClientError> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let results = self.client.master().remove_batch(&refs).await?;
        Ok(results.iter().map(Result::is_ok).collect())
    }
}

/// The engine API's result of one get.
fn result((status, length): (Status, u64)) -> GetResult {
    GetResult {
        status: status as i32,
        length,
    }
}

impl BlockStore for PoolApi {
    fn put_batch(self: Arc<Self>, staging: Arc<Staging>, req: PutRequest) -> Batch<i32> {
        Box::pin(async move { Ok(self.put(&staging, req.items, req.numa_hint).await) })
    }

    fn get_batch(self: Arc<Self>, staging: Arc<Staging>, items: Vec<GetItem>) -> Batch<GetResult> {
        Box::pin(async move { Ok(self.get(&staging, items).await) })
    }

    fn exists_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool> {
        Box::pin(async move { self.exists(&keys).await.map_err(BatchError::Master) })
    }

    fn remove_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool> {
        Box::pin(async move { self.remove(&keys).await.map_err(BatchError::Master) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(code: ErrorCode) -> DataError {
        DataError::Master(ClientError::Refused {
            code,
            message: String::new(),
        })
    }

    #[test]
    fn pool_errors_map_to_engine_statuses() {
        let puts = [
            (refused(ErrorCode::NoSpace), Status::NoSpace),
            (refused(ErrorCode::NoSegments), Status::Unavailable),
            (refused(ErrorCode::TooLarge), Status::Invalid),
            (refused(ErrorCode::SizeConflict), Status::Invalid),
            (refused(ErrorCode::PutInProgress), Status::Internal),
            (DataError::NoReplica, Status::Internal),
        ];
        for (e, want) in &puts {
            assert_eq!(put_status(e), *want, "put: {e}");
        }
        let gets = [
            (refused(ErrorCode::UnknownKey), Status::NotFound),
            (refused(ErrorCode::InvalidArgument), Status::Invalid),
            (DataError::NoReplica, Status::Internal),
        ];
        for (e, want) in &gets {
            assert_eq!(get_status(e), *want, "get: {e}");
        }
    }

    #[test]
    fn keys_are_bounded() {
        assert!(bad_key(b""));
        assert!(bad_key(&vec![1u8; MAX_KEY_BYTES + 1]));
        assert!(!bad_key(b"k"));
    }
}
