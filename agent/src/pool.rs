//! Pool mode: the agent as a member of a kvpool pool. The DRAM tier's own mappings (NUMA-bound,
//! huge pages and locked as configured) and the pool-mode SSD segment are registered with the
//! transfer engine by [`PoolRegistrar`] and mounted with the master by [`PoolLink`], which also
//! heartbeats, hands the master's tasks to [`crate::tasks::TaskRunner`], remounts after the
//! master declared the node dead, announces the SSD segment's durable index
//! ([`crate::ssd::pool`]) for adoption after each mount and fsyncs it once per pass, applies the
//! master's segment-event feed to that index and acknowledges it in the next heartbeat along with
//! the corrupt blocks found on read ([`crate::pool_feed`]), reports readiness (all segments
//! mounted, heartbeat accepted) and unmounts on shutdown. The master is the only allocator of those bytes: the agent never
//! carves them itself in pool mode. I/O boundary: the transfer-engine listener
//! ([`Member::start`]) and the master's gRPC channel ([`PoolLink::run`]); the bookkeeping in
//! [`PoolRegistrar`] is pure.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_client::pool::{LocalSegments, PoolClient, tcp_endpoint, transfer_name};
use kvpool_core::master::{AdoptItem, SegmentSpec, Tier};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer::{
    self as transfer, EngineConfig, LocalSegment, Segment, StaticDirectory, TcpServer,
    TransferEngine, TransferMetrics,
};
use parking_lot::Mutex;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::PoolConfig;
use crate::pool_feed::{self, FeedState, SsdGuard};
use crate::registrar::RegistrarError;
use crate::ssd::pool::{DropReason, PoolBlock, PoolSsdIndex};
use crate::tasks::TaskRunner;

/// Errors of joining a pool.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum PoolError {
    #[error("reading the pool key for the transfer engine")]
    TransferKey(#[source] transfer::AuthError),
    #[error("reading the pool key for the master")]
    MasterKey(#[source] kvpool_proto::auth::AuthError),
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
}

impl PoolError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Master-side name of DRAM-tier segment `index`.
pub fn segment_name(index: u32) -> String {
    format!("dram{index}")
}

/// Master-side name of the pool-mode SSD segment.
pub const SSD_SEGMENT: &str = "ssd0";

/// The spec the master gets for segment `name` of `node`.
pub fn spec_for(
    node: &str,
    endpoint: &str,
    name: &str,
    tier: Tier,
    numa_node: u32,
    bytes: u64,
) -> SegmentSpec {
    SegmentSpec {
        node: node.to_owned(),
        name: name.to_owned(),
        tier,
        capacity_bytes: bytes,
        numa_node,
        failure_domain: String::new(),
        endpoints: vec![endpoint.to_owned()],
    }
}

/// Metrics of pool membership (`kvpool_agent_pool_` prefix).
#[derive(Clone, Debug)]
pub struct PoolMetrics {
    /// `kvpool_agent_pool_mounted_segments`
    pub mounted_segments: IntGauge,
    /// `kvpool_agent_pool_heartbeat_failures_total`
    pub heartbeat_failures: IntCounter,
    /// `kvpool_agent_pool_remounts_total`: the master had forgotten this node.
    pub remounts: IntCounter,
    /// `kvpool_agent_pool_tasks_total{kind, outcome}`
    pub tasks: IntCounterVec,
    /// `kvpool_agent_pool_tasks_running`
    pub tasks_running: IntGauge,
    /// `kvpool_agent_pool_task_bytes_total{kind}`: bytes copied by successful tasks.
    pub task_bytes: IntCounterVec,
    /// `kvpool_agent_pool_rdma_fallback`: 1 once the transfer engine reached a peer over TCP
    /// although RDMA was wanted.
    pub rdma_fallback: IntGauge,
    /// `kvpool_agent_pool_ssd_blocks_dropped_total{reason}`: indexed SSD blocks dropped
    /// (corrupt, truncated, out_of_bounds at start-up; refused by the master at adoption).
    pub ssd_blocks_dropped: IntCounterVec,
    /// `kvpool_agent_pool_ssd_blocks_adopted_total`: recovered SSD blocks the master adopted.
    pub ssd_blocks_adopted: IntCounter,
    /// `kvpool_agent_pool_ssd_index_blocks`: blocks in the durable SSD index as of its last
    /// sync.
    pub ssd_index_blocks: IntGauge,
    /// `kvpool_agent_pool_ssd_reads_checked_total{outcome}`: reads of the SSD segment checked
    /// before serving (ok, recent, unindexed, straddles, corrupt, truncated, error).
    pub ssd_reads_checked: IntCounterVec,
    /// `kvpool_agent_pool_ssd_feed_events_total{kind}`: master feed events applied to the SSD
    /// index (commit, free, reset, reset_done).
    pub ssd_feed_events: IntCounterVec,
    /// `kvpool_agent_pool_ssd_reports_dropped_total`: corrupt-block reports dropped because
    /// too many were waiting for the master.
    pub ssd_reports_dropped: IntCounter,
}

impl PoolMetrics {
    /// Create the metrics and register them into `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self {
            mounted_segments: IntGauge::new(
                "kvpool_agent_pool_mounted_segments",
                "Segments of this agent currently mounted with the master.",
            )?,
            heartbeat_failures: IntCounter::new(
                "kvpool_agent_pool_heartbeat_failures_total",
                "Heartbeats the master did not accept.",
            )?,
            remounts: IntCounter::new(
                "kvpool_agent_pool_remounts_total",
                "Times the master no longer knew this node and its segments were mounted again.",
            )?,
            tasks: IntCounterVec::new(
                Opts::new(
                    "kvpool_agent_pool_tasks_total",
                    "Master tasks finished, by kind and outcome.",
                ),
                &["kind", "outcome"],
            )?,
            tasks_running: IntGauge::new(
                "kvpool_agent_pool_tasks_running",
                "Master tasks accepted and not finished yet.",
            )?,
            task_bytes: IntCounterVec::new(
                Opts::new(
                    "kvpool_agent_pool_task_bytes_total",
                    "Bytes copied by successful master tasks.",
                ),
                &["kind"],
            )?,
            rdma_fallback: IntGauge::new(
                "kvpool_agent_pool_rdma_fallback",
                "1 when the transfer engine fell back from RDMA to TCP.",
            )?,
            ssd_blocks_dropped: IntCounterVec::new(
                Opts::new(
                    "kvpool_agent_pool_ssd_blocks_dropped_total",
                    "Indexed SSD blocks dropped, by reason (corrupt, truncated, out_of_bounds, \
                     refused).",
                ),
                &["reason"],
            )?,
            ssd_blocks_adopted: IntCounter::new(
                "kvpool_agent_pool_ssd_blocks_adopted_total",
                "Recovered SSD blocks the master adopted after a mount.",
            )?,
            ssd_index_blocks: IntGauge::new(
                "kvpool_agent_pool_ssd_index_blocks",
                "Blocks in the durable index of the pool-mode SSD segment.",
            )?,
            ssd_reads_checked: IntCounterVec::new(
                Opts::new(
                    "kvpool_agent_pool_ssd_reads_checked_total",
                    "Reads of the pool SSD segment checked before serving, by outcome.",
                ),
                &["outcome"],
            )?,
            ssd_feed_events: IntCounterVec::new(
                Opts::new(
                    "kvpool_agent_pool_ssd_feed_events_total",
                    "Master segment-feed events applied to the SSD index, by kind.",
                ),
                &["kind"],
            )?,
            ssd_reports_dropped: IntCounter::new(
                "kvpool_agent_pool_ssd_reports_dropped_total",
                "Corrupt-block reports dropped because too many were waiting for the master.",
            )?,
        };
        registry.register(Box::new(m.ssd_reads_checked.clone()))?;
        registry.register(Box::new(m.ssd_feed_events.clone()))?;
        registry.register(Box::new(m.ssd_reports_dropped.clone()))?;
        registry.register(Box::new(m.mounted_segments.clone()))?;
        registry.register(Box::new(m.ssd_blocks_dropped.clone()))?;
        registry.register(Box::new(m.ssd_blocks_adopted.clone()))?;
        registry.register(Box::new(m.ssd_index_blocks.clone()))?;
        registry.register(Box::new(m.heartbeat_failures.clone()))?;
        registry.register(Box::new(m.remounts.clone()))?;
        registry.register(Box::new(m.tasks.clone()))?;
        registry.register(Box::new(m.tasks_running.clone()))?;
        registry.register(Box::new(m.task_bytes.clone()))?;
        registry.register(Box::new(m.rdma_fallback.clone()))?;
        Ok(m)
    }
}

#[derive(Debug)]
struct Entry {
    /// Keeps the engine registration alive; dropping it unregisters the segment.
    local: LocalSegment,
    spec: SegmentSpec,
}

#[derive(Debug, Default)]
struct Book {
    /// Registered with the transfer engine, by master-side segment name.
    segments: BTreeMap<String, Entry>,
    /// Master segment ids of mounted segments, by segment name. Kept apart from `segments` so
    /// that a segment deregistered during shutdown is still unmounted.
    mounted: BTreeMap<String, u32>,
}

/// The segments this agent gives the pool: registered with the transfer engine (peers read and
/// write them), listed in [`LocalSegments`] (this process copies into them without a
/// transport), and described for the master.
#[derive(Debug)]
pub struct PoolRegistrar {
    engine: TransferEngine,
    node: String,
    endpoint: String,
    book: Mutex<Book>,
    local: LocalSegments,
    /// Durable index of the SSD segment, when there is one.
    ssd_index: OnceLock<SharedIndex>,
    /// Read checks of the SSD segment, when it has an index.
    ssd_guard: OnceLock<Arc<SsdGuard>>,
}

/// The SSD segment's index, shared by the task runner (records writes) and the link (syncs it,
/// announces it).
pub type SharedIndex = Arc<Mutex<PoolSsdIndex>>;

impl PoolRegistrar {
    /// `endpoint` is the transfer target peers reach this node's segments at.
    pub fn new(engine: TransferEngine, node: String, endpoint: String) -> Self {
        Self {
            engine,
            node,
            endpoint,
            book: Mutex::default(),
            local: LocalSegments::default(),
            ssd_index: OnceLock::new(),
            ssd_guard: OnceLock::new(),
        }
    }

    /// Check every read of the SSD segment with `guard`: reads by peers through the transfer
    /// engine (its read check) and this agent's own tasks. Call after registering the segment.
    pub fn set_ssd_guard(&self, guard: SsdGuard) -> Result<(), RegistrarError> {
        let guard = Arc::new(guard);
        let local = self
            .local(SSD_SEGMENT)
            .ok_or_else(|| RegistrarError::Unknown(SSD_SEGMENT.to_owned()))?;
        let check = Arc::clone(&guard);
        self.engine.set_read_check(
            &local,
            Arc::new(move |offset, len| check.check_read(offset, len)),
        );
        let _ = self.ssd_guard.set(guard);
        Ok(())
    }

    /// The SSD segment's read checks, if it has them.
    pub fn ssd_guard(&self) -> Option<Arc<SsdGuard>> {
        self.ssd_guard.get().cloned()
    }

    /// Master id of the mounted segment `name`.
    pub fn mounted_id(&self, name: &str) -> Option<u32> {
        self.book.lock().mounted.get(name).copied()
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Give the SSD segment its durable index (once, before the link runs).
    pub fn set_ssd_index(&self, index: PoolSsdIndex) {
        let _ = self.ssd_index.set(Arc::new(Mutex::new(index)));
    }

    /// The SSD segment's durable index, if the agent has one.
    pub fn ssd_index(&self) -> Option<SharedIndex> {
        self.ssd_index.get().cloned()
    }

    /// The in-process view of the registered segments (for [`PoolClient`]).
    pub fn local_segments(&self) -> LocalSegments {
        self.local.clone()
    }

    /// Register `memory` as master segment `name` of `tier` on `numa_node`. The master will
    /// allocate inside all of it, so nothing else may use these bytes.
    pub fn register(
        &self,
        name: &str,
        tier: Tier,
        numa_node: u32,
        memory: Segment,
    ) -> Result<(), RegistrarError> {
        let mut book = self.book.lock();
        if book.segments.contains_key(name) {
            return Err(RegistrarError::Duplicate(name.to_owned()));
        }
        let bytes = memory.len() as u64;
        let full = transfer_name(&self.node, name);
        let local = self
            .engine
            .register(&full, Arc::new(memory))
            .map_err(|source| RegistrarError::Transfer {
                name: name.to_owned(),
                source,
            })?;
        // The SSD segment is read only through the transfer engine, whose read check verifies
        // each block; in-process readers would bypass it.
        if tier != Tier::Ssd {
            self.local.insert(&full, Arc::clone(local.segment()));
        }
        tracing::info!(segment = %full, bytes, tier = tier.as_str(), "pool segment registered");
        book.segments.insert(
            name.to_owned(),
            Entry {
                local,
                spec: spec_for(&self.node, &self.endpoint, name, tier, numa_node, bytes),
            },
        );
        Ok(())
    }

    /// Withdraw segment `name` from the transfer engine and the in-process view. The memory
    /// lives on until transfers still using it finish.
    pub fn deregister(&self, name: &str) -> Result<(), RegistrarError> {
        let removed = self.book.lock().segments.remove(name);
        match removed {
            Some(_) => {
                self.local.remove(&transfer_name(&self.node, name));
                Ok(())
            }
            None => Err(RegistrarError::Unknown(name.to_owned())),
        }
    }

    /// Names of the registered segments.
    pub fn registered(&self) -> Vec<String> {
        self.book.lock().segments.keys().cloned().collect()
    }

    /// The registration of segment `name` (for tasks that copy into it).
    pub fn local(&self, name: &str) -> Option<LocalSegment> {
        self.book.lock().segments.get(name).map(|e| e.local.clone())
    }

    /// Registered segments not mounted with the master yet.
    pub fn unmounted(&self) -> Vec<SegmentSpec> {
        let book = self.book.lock();
        book.segments
            .iter()
            .filter(|(n, _)| !book.mounted.contains_key(*n))
            .map(|(_, e)| e.spec.clone())
            .collect()
    }

    /// Record that segment `name` is mounted as master segment `id`.
    pub fn set_mounted(&self, name: &str, id: u32) {
        self.book.lock().mounted.insert(name.to_owned(), id);
    }

    /// Master segment ids currently mounted.
    pub fn mounted(&self) -> Vec<u32> {
        self.book.lock().mounted.values().copied().collect()
    }

    /// True when at least one segment is registered and every registered one is mounted.
    pub fn all_mounted(&self) -> bool {
        let book = self.book.lock();
        !book.segments.is_empty() && book.segments.keys().all(|n| book.mounted.contains_key(n))
    }

    /// Forget every mount (the master no longer knows this node): the next pass remounts.
    pub fn clear_mounted(&self) -> Vec<u32> {
        std::mem::take(&mut self.book.lock().mounted)
            .into_values()
            .collect()
    }
}

/// True when the master answered that it does not know this node (never mounted, or declared
/// dead): the agent must mount its segments again.
pub fn is_unknown_node(e: &ClientError) -> bool {
    match e {
        ClientError::Rpc { source, .. } => source.code() == tonic::Code::NotFound,
        ClientError::Refused { code, .. } => *code == kvpool_proto::master::ErrorCode::UnknownNode,
        _ => false,
    }
}

/// Recovered blocks announced per `AdoptReplicas` call.
const ADOPT_BATCH: usize = 4096;

/// Longest time shutdown spends unmounting (the pod's grace period is typically 30 s).
const UNMOUNT_BUDGET: Duration = Duration::from_secs(10);

/// Mounts, heartbeats, runs tasks and unmounts on behalf of a [`PoolRegistrar`].
#[derive(Clone, Debug)]
pub struct PoolLink {
    client: MasterClient,
    registrar: Arc<PoolRegistrar>,
    interval: Duration,
    tasks: Option<TaskRunner>,
    metrics: Option<PoolMetrics>,
    engine: Option<TransferEngine>,
    healthy: Arc<watch::Sender<bool>>,
    /// Master id of the SSD segment while its recovered blocks are still to be announced, and
    /// how many of them were already answered (a retry resumes there: announcing an adopted
    /// block again would be refused as a duplicate).
    adopt_pending: Arc<Mutex<Option<(u32, usize)>>>,
    /// Position in the master's segment-event feed, acknowledged by the next heartbeat.
    feed: Arc<Mutex<FeedState>>,
}

impl PoolLink {
    pub fn new(client: MasterClient, registrar: Arc<PoolRegistrar>, interval: Duration) -> Self {
        Self {
            client,
            registrar,
            interval,
            tasks: None,
            metrics: None,
            engine: None,
            healthy: Arc::new(watch::channel(false).0),
            adopt_pending: Arc::new(Mutex::new(None)),
            feed: Arc::new(Mutex::new(FeedState::default())),
        }
    }

    /// Execute the tasks heartbeats deliver with `runner` (without one they are left to time
    /// out at the master).
    pub fn with_tasks(mut self, runner: TaskRunner) -> Self {
        self.tasks = Some(runner);
        self
    }

    /// Count mounts, heartbeats and the engine's RDMA fallback in `metrics`.
    pub fn with_metrics(mut self, metrics: PoolMetrics, engine: TransferEngine) -> Self {
        self.metrics = Some(metrics);
        self.engine = Some(engine);
        self
    }

    /// True while every registered segment is mounted and the master accepts heartbeats: the
    /// agent's part of the pool is usable. Feeds `/readyz`.
    pub fn healthy(&self) -> watch::Receiver<bool> {
        self.healthy.subscribe()
    }

    /// Every `interval` until `stop`: mount what is not mounted, then heartbeat. On `stop`,
    /// unmount everything mounted.
    pub async fn run(self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            // A pass can wait on an unreachable master for the client's failover budget:
            // shutdown must not wait for it.
            tokio::select! {
                _ = stop.cancelled() => break,
                () = self.step() => {}
            }
        }
        self.healthy.send_replace(false);
        self.sync_ssd_index().await;
        if tokio::time::timeout(UNMOUNT_BUDGET, self.unmount_all())
            .await
            .is_err()
        {
            tracing::warn!(
                "master unreachable while unmounting; it will declare this node dead instead"
            );
        }
        self.set_mounted_gauge();
    }

    fn set_mounted_gauge(&self) {
        if let Some(m) = &self.metrics {
            m.mounted_segments
                .set(i64::try_from(self.registrar.mounted().len()).unwrap_or(i64::MAX));
        }
    }

    /// One pass: mount, then heartbeat (handing its tasks to the runner), then update health.
    pub async fn step(&self) {
        for spec in self.registrar.unmounted() {
            match self.client.mount_segment(&spec).await {
                Ok(id) => {
                    tracing::info!(segment = %spec.name, id, "segment mounted with the master");
                    self.registrar.set_mounted(&spec.name, id);
                    if spec.name == SSD_SEGMENT && self.registrar.ssd_index().is_some() {
                        *self.adopt_pending.lock() = Some((id, 0));
                        // A new segment id: its feed starts from the announced index.
                        *self.feed.lock() = FeedState::default();
                    }
                }
                Err(e) => tracing::warn!(segment = %spec.name, error = %e,
                    category = e.category(), "mounting a segment failed; retrying"),
            }
        }
        self.announce_ssd().await;
        self.sync_ssd_index().await;
        let mut beat_ok = false;
        if !self.registrar.mounted().is_empty() {
            let ssd_id = self.registrar.mounted_id(SSD_SEGMENT);
            let guard = self.registrar.ssd_guard();
            let corrupt = match (&guard, ssd_id) {
                (Some(g), Some(id)) => g.take_reports(id),
                _ => Vec::new(),
            };
            let feed = *self.feed.lock();
            let transport = self.engine.as_ref().map(transport_report);
            let beat = self
                .client
                .heartbeat_feed(
                    self.registrar.node(),
                    feed.epoch,
                    feed.acked,
                    &corrupt,
                    transport,
                )
                .await;
            if beat.is_err()
                && let Some(g) = &guard
            {
                g.requeue(&corrupt);
            }
            match beat {
                Ok(reply) => {
                    beat_ok = true;
                    self.apply_feed(ssd_id, reply.feed_epoch, reply.events, feed)
                        .await;
                    let tasks = reply.tasks;
                    if !tasks.is_empty() {
                        match &self.tasks {
                            Some(runner) => runner.submit(tasks),
                            None => tracing::debug!(
                                tasks = tasks.len(),
                                "master tasks ignored: no task runner"
                            ),
                        }
                    }
                }
                Err(e) if is_unknown_node(&e) => {
                    let lost = self.registrar.clear_mounted();
                    *self.feed.lock() = FeedState::default();
                    if let Some(m) = &self.metrics {
                        m.remounts.inc();
                        m.heartbeat_failures.inc();
                    }
                    tracing::warn!(
                        segments = lost.len(),
                        "the master does not know this node (declared dead?); remounting"
                    );
                }
                Err(e) => {
                    if let Some(m) = &self.metrics {
                        m.heartbeat_failures.inc();
                    }
                    tracing::warn!(error = %e, category = e.category(), "heartbeat failed");
                }
            }
        }
        self.set_mounted_gauge();
        if let (Some(m), Some(engine)) = (&self.metrics, &self.engine) {
            m.rdma_fallback
                .set(i64::from(engine.transport_status().fallback));
        }
        let healthy = beat_ok && self.registrar.all_mounted();
        if self.healthy.send_replace(healthy) != healthy {
            tracing::info!(healthy, "pool membership changed");
        }
    }

    /// Announce the SSD index to the master after the SSD segment was (re)mounted, so the
    /// blocks it holds become replicas again. Refused blocks are forgotten; a failed call is
    /// retried on the next pass.
    async fn announce_ssd(&self) {
        let Some((id, done)) = *self.adopt_pending.lock() else {
            return;
        };
        let Some(index) = self.registrar.ssd_index() else {
            return;
        };
        let blocks = index.lock().blocks();
        let mut adopted = 0u64;
        let mut refused: Vec<PoolBlock> = Vec::new();
        let mut answered = done;
        for chunk in blocks.get(done..).unwrap_or_default().chunks(ADOPT_BATCH) {
            let items: Vec<AdoptItem> = chunk
                .iter()
                .map(|b| AdoptItem {
                    key: b.key,
                    offset: b.offset,
                    length: b.length,
                })
                .collect();
            match self
                .client
                .adopt_replicas(self.registrar.node(), id, &items)
                .await
            {
                Ok(results) => {
                    answered += chunk.len();
                    for (b, r) in chunk.iter().zip(results) {
                        match r {
                            Ok(()) => adopted += 1,
                            Err(e) => {
                                tracing::warn!(key = %b.key.to_hex(), offset = b.offset,
                                    error = %e, "the master refused a recovered SSD block");
                                refused.push(*b);
                            }
                        }
                    }
                }
                Err(e) => {
                    // The next pass resumes after the answered batches. Unknown node: the next
                    // pass remounts (a new segment id) and announces everything again.
                    tracing::warn!(error = %e, category = e.category(),
                        "announcing recovered SSD blocks failed; retrying");
                    break;
                }
            }
        }
        {
            let mut pending = self.adopt_pending.lock();
            if *pending == Some((id, done)) {
                *pending = (answered < blocks.len()).then_some((id, answered));
            }
        }
        {
            let mut idx = index.lock();
            for b in &refused {
                if let Err(e) = idx.forget(b.key, b.offset) {
                    tracing::warn!(error = %e, "recording a refused SSD block failed");
                }
            }
        }
        if let Some(m) = &self.metrics {
            m.ssd_blocks_adopted.inc_by(adopted);
            m.ssd_blocks_dropped
                .with_label_values(&[DropReason::Refused.as_str()])
                .inc_by(refused.len() as u64);
            m.ssd_index_blocks
                .set(i64::try_from(index.lock().len()).unwrap_or(i64::MAX));
        }
        tracing::info!(
            segment = id,
            adopted,
            refused = refused.len(),
            "recovered SSD blocks announced to the master"
        );
    }

    /// Apply the master's feed events to the SSD index (flushed before they are acknowledged).
    async fn apply_feed(
        &self,
        ssd_id: Option<u32>,
        epoch: u64,
        events: Vec<kvpool_core::master::state::SegmentEvent>,
        prev: FeedState,
    ) {
        let Some(index) = self.registrar.ssd_index() else {
            return;
        };
        if events.is_empty() && prev.epoch == epoch {
            return;
        }
        let metrics = self.metrics.clone();
        let guard = self.registrar.ssd_guard();
        let applied = tokio::task::spawn_blocking(move || {
            if let Some(g) = &guard {
                let mine: Vec<_> = events
                    .iter()
                    .filter(|e| Some(e.segment_id) == ssd_id)
                    .copied()
                    .collect();
                g.settle(&mine);
            }
            pool_feed::apply_events(&index, ssd_id, epoch, &events, prev, metrics.as_ref())
        })
        .await;
        let next = match applied {
            Ok(Ok(state)) => state,
            Ok(Err((state, e))) => {
                tracing::warn!(error = %e, category = e.category(),
                    "applying the master's SSD events failed; the rest are sent again");
                state
            }
            Err(e) => {
                tracing::warn!(error = %e, "the SSD event worker failed");
                prev
            }
        };
        let mut feed = self.feed.lock();
        // A remount meanwhile restarted the feed: keep that.
        if *feed == prev {
            *feed = next;
        }
    }

    /// Flush the SSD index's new records (batched: once per pass).
    async fn sync_ssd_index(&self) {
        let Some(index) = self.registrar.ssd_index() else {
            return;
        };
        let metrics = self.metrics.clone();
        let synced = tokio::task::spawn_blocking(move || {
            let mut idx = index.lock();
            idx.sync()?;
            // Set after the sync: the gauge counts blocks that are durably indexed.
            if let Some(m) = &metrics {
                m.ssd_index_blocks
                    .set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            }
            Ok::<(), crate::ssd::pool::PoolIndexError>(())
        })
        .await;
        match synced {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, category = e.category(),
                "syncing the SSD index failed"),
            Err(e) => tracing::warn!(error = %e, "the SSD index sync worker failed"),
        }
    }

    async fn unmount_all(&self) {
        for id in self.registrar.clear_mounted() {
            match self.client.unmount_segment(self.registrar.node(), id).await {
                Ok(()) => tracing::info!(id, "segment unmounted"),
                Err(e) => tracing::warn!(id, error = %e, "unmounting a segment failed"),
            }
        }
    }
}

/// Client settings of the link: calls retried for three heartbeat periods (1 to 5 s).
/// The engine's transport state as the heartbeat carries it to the master.
/// Why an agent that must use RDMA (`pool.transport: rdma`) is not ready, or `None`: it opened
/// at least one RDMA device, or it was not asked for RDMA only. Such an agent still joins the
/// pool over TCP (peers and the condition see the fallback), but a node without the fabric the
/// pool asked for does not count as ready. Pure.
pub fn rdma_readiness_blocker(
    require_rdma: bool,
    status: &kvpool_transfer::rdma::TransportStatus,
) -> Option<String> {
    if !require_rdma || !status.devices.is_empty() {
        return None;
    }
    Some(format!(
        "transport.protocol is rdma but this node has no usable RDMA device ({})",
        status
            .reason
            .as_deref()
            .unwrap_or("no device opened by the transfer engine")
    ))
}

fn transport_report(engine: &TransferEngine) -> kvpool_proto::master::TransportReport {
    let t = engine.transport_status();
    kvpool_proto::master::TransportReport {
        rdma_requested: t.rdma_requested,
        fallback: t.fallback,
        fallback_reason: t.reason.unwrap_or_default(),
        rdma_devices: t.devices,
    }
}

fn link_client_config(cfg: &PoolConfig) -> ClientConfig {
    let budget = (cfg.heartbeat_interval * 3).clamp(Duration::from_secs(1), Duration::from_secs(5));
    ClientConfig {
        failover_budget: budget,
        request_timeout: budget,
        ..ClientConfig::default()
    }
}

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
    /// The announced endpoint (`tcp://ip:port`).
    pub endpoint: String,
    /// Replicas of each block engines put through this agent.
    pub replicas: u8,
    /// Pool metrics (also used by the link and the task runner).
    pub metrics: PoolMetrics,
}

impl Member {
    /// Read the pool key, start the transfer engine (its metrics and the pool metrics go to
    /// `registry`) and its TCP target, build the master client (it connects on first use).
    pub fn start(cfg: &PoolConfig, node: &str, registry: &Registry) -> Result<Self, PoolError> {
        let transfer_key =
            transfer::AuthKey::from_file(&cfg.auth_key_file).map_err(PoolError::TransferKey)?;
        let master_key = MasterKey::from_file(&cfg.auth_key_file).map_err(PoolError::MasterKey)?;
        let engine = TransferEngine::new(
            EngineConfig {
                node: node.to_owned(),
                want_rdma: cfg.want_rdma,
                ..EngineConfig::default()
            },
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
        let registrar = Arc::new(PoolRegistrar::new(
            engine.clone(),
            node.to_owned(),
            endpoint.clone(),
        ));
        let master = MasterClient::new(
            cfg.masters.clone(),
            master_key.clone(),
            ClientConfig::default(),
        )
        .map_err(PoolError::Client)?;
        // The link's own client gives up quickly, so that a lost master shows in readiness
        // within a few heartbeat periods (the next pass tries again anyway).
        let link_client =
            MasterClient::new(cfg.masters.clone(), master_key, link_client_config(cfg))
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
            endpoint,
            replicas: cfg.replicas,
            metrics,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_transfer::HostOptions;

    #[test]
    fn rdma_only_pools_need_a_device_to_be_ready() {
        use kvpool_transfer::rdma::TransportStatus;
        let no_device = TransportStatus::new(true, false, false, None, Vec::new());
        let why = rdma_readiness_blocker(true, &no_device).expect("blocked");
        assert!(why.contains("transport.protocol is rdma"), "{why}");
        assert!(why.contains("RDMA device"), "names the cause: {why}");
        // `auto` and `tcp` never block; a device opened never blocks.
        assert_eq!(rdma_readiness_blocker(false, &no_device), None);
        let with_device = TransportStatus::new(true, true, false, None, vec!["mlx5_0".to_owned()]);
        assert_eq!(rdma_readiness_blocker(true, &with_device), None);
        // A later fallback on a node with a device is a condition, not unreadiness.
        let fell_back = TransportStatus::new(
            true,
            true,
            true,
            Some("peer x: QP handshake timed out".to_owned()),
            vec!["mlx5_0".to_owned()],
        );
        assert_eq!(rdma_readiness_blocker(true, &fell_back), None);
    }

    fn engine(node: &str) -> TransferEngine {
        TransferEngine::new(
            EngineConfig {
                node: node.into(),
                ..EngineConfig::default()
            },
            transfer::AuthKey::new(b"0123456789abcdef0123456789abcdef".to_vec()).expect("key"),
            Arc::new(StaticDirectory::new()),
            TransferMetrics::unregistered().expect("metrics"),
        )
        .expect("engine")
    }

    fn memory(len: usize) -> Segment {
        Segment::host(len, HostOptions::default()).expect("segment")
    }

    #[test]
    fn specs_name_node_numa_capacity_and_endpoint() {
        let spec = spec_for("n1", "tcp://10.0.0.1:7000", "dram2", Tier::Dram, 1, 1 << 20);
        assert_eq!(spec.node, "n1");
        assert_eq!(spec.name, "dram2");
        assert_eq!(spec.tier, Tier::Dram);
        assert_eq!(spec.capacity_bytes, 1 << 20);
        assert_eq!(spec.numa_node, 1);
        assert_eq!(spec.endpoints, vec!["tcp://10.0.0.1:7000".to_owned()]);
        assert_eq!(segment_name(3), "dram3");
    }

    #[test]
    fn registrar_tracks_registration_and_mounts() {
        let e = engine("n1");
        let r = PoolRegistrar::new(e.clone(), "n1".into(), "tcp://127.0.0.1:1".into());
        assert!(!r.all_mounted(), "nothing registered is not healthy");
        r.register("dram0", Tier::Dram, 0, memory(1 << 16))
            .expect("register 0");
        r.register(SSD_SEGMENT, Tier::Ssd, 0, memory(1 << 16))
            .expect("register ssd");
        assert_eq!(
            r.register("dram0", Tier::Dram, 0, memory(4096))
                .expect_err("dup")
                .category(),
            "duplicate"
        );
        // The engine refuses a second registration under the same name: proof it holds ours.
        assert!(e.register("n1/dram0", Arc::new(memory(4096))).is_err());
        // The in-process view holds the very same memory.
        let seg = r.local_segments().get("n1/dram0").expect("local view");
        assert!(Arc::ptr_eq(
            &seg,
            r.local("dram0").expect("registration").segment()
        ));
        let specs: Vec<_> = r
            .unmounted()
            .into_iter()
            .map(|s| (s.name, s.tier))
            .collect();
        assert_eq!(
            specs,
            [("dram0".into(), Tier::Dram), ("ssd0".into(), Tier::Ssd)]
        );
        r.set_mounted("dram0", 17);
        assert_eq!(r.unmounted().len(), 1);
        assert!(!r.all_mounted());
        r.set_mounted(SSD_SEGMENT, 18);
        assert!(r.all_mounted());
        assert_eq!(r.mounted(), vec![17, 18]);
        // Deregistering releases the engine name but keeps the mount for the unmount pass.
        r.deregister("dram0").expect("deregister");
        assert_eq!(
            r.deregister("dram0").expect_err("gone").category(),
            "unknown"
        );
        assert!(r.local_segments().get("n1/dram0").is_none());
        e.register("n1/dram0", Arc::new(memory(4096)))
            .expect("name free again");
        assert_eq!(r.clear_mounted(), vec![17, 18]);
        assert!(r.mounted().is_empty());
        assert_eq!(r.registered(), vec![SSD_SEGMENT.to_owned()]);
    }

    #[test]
    fn unknown_node_answers_trigger_remount() {
        let nf = ClientError::Rpc {
            method: "heartbeat",
            source: tonic::Status::not_found("unknown node"),
        };
        assert!(is_unknown_node(&nf));
        let other = ClientError::Rpc {
            method: "heartbeat",
            source: tonic::Status::unavailable("down"),
        };
        assert!(!is_unknown_node(&other));
    }

    #[test]
    fn metrics_register_once() {
        let registry = Registry::new();
        PoolMetrics::new(&registry).expect("metrics");
        assert!(
            PoolMetrics::new(&registry).is_err(),
            "duplicate names refused"
        );
    }
}
