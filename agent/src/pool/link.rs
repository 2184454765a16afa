//! The agent's link with the master in pool mode: [`PoolLink`] mounts the registered segments,
//! heartbeats (carrying the transport state, the feed acknowledgement and the corrupt blocks
//! found on read), hands the master's tasks to the task runner, remounts after the master
//! declared the node dead, announces the durable index of each persistent segment (`ssd0`, and
//! the DRAM segments kept in a file) for adoption after each mount and fsyncs them once per
//! pass, applies the master's segment-event feed to those indexes,
//! reports health (all segments mounted, heartbeat accepted) and unmounts on shutdown.
//! [`rdma_readiness_blocker`] adds the transport to readiness. I/O boundary: the master's gRPC
//! channel.

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_core::master::AdoptItem;
use kvpool_transfer::TransferEngine;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::feed::{self, FeedState};
use super::metrics::PoolMetrics;
use super::registrar::{PoolRegistrar, SSD_SEGMENT};
use super::tasks::TaskRunner;
use crate::config::PoolConfig;
use crate::ssd::pool::{DropReason, PoolBlock, SharedIndex};

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
    /// Per persistent segment (by name) whose recovered blocks are still to be announced: its
    /// master id and the offset from which blocks are still unanswered (a retry resumes there:
    /// announcing an adopted block again would be refused as a duplicate).
    adopt_pending: Arc<Mutex<BTreeMap<String, (u32, u64)>>>,
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
            adopt_pending: Arc::new(Mutex::new(BTreeMap::new())),
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
        self.sync_indexes().await;
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
                    if let Some(index) = self.registrar.index(&spec.name) {
                        // Commits not confirmed under the old id are not announced; their
                        // bytes are free space to the master now.
                        if let Err(e) = index.lock().discard_unconfirmed() {
                            tracing::warn!(segment = %spec.name, error = %e,
                                category = e.category(), "dropping unconfirmed blocks failed");
                        }
                        self.adopt_pending.lock().insert(spec.name.clone(), (id, 0));
                        // A new segment id: its feed starts from the announced index.
                        *self.feed.lock() = FeedState::default();
                    }
                }
                Err(e) => tracing::warn!(segment = %spec.name, error = %chain(&e),
                    category = e.category(), "mounting a segment failed; retrying"),
            }
        }
        self.announce().await;
        self.sync_indexes().await;
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
                    tracing::warn!(error = %chain(&e), category = e.category(), "heartbeat failed");
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

    /// Announce the durable indexes to the master after their segments were (re)mounted, so
    /// the blocks they hold become replicas again. Refused blocks are forgotten; a failed call
    /// is retried on the next pass.
    async fn announce(&self) {
        let pending: Vec<(String, (u32, u64))> = self
            .adopt_pending
            .lock()
            .iter()
            .map(|(n, p)| (n.clone(), *p))
            .collect();
        for (name, (id, done)) in pending {
            if let Some(index) = self.registrar.index(&name) {
                self.announce_one(&name, &index, id, done).await;
            }
        }
    }

    /// Announce the blocks of segment `name` (master id `id`) at offsets from `done` on.
    async fn announce_one(&self, name: &str, index: &SharedIndex, id: u32, done: u64) {
        let blocks: Vec<PoolBlock> = index
            .lock()
            .blocks()
            .into_iter()
            .filter(|b| b.offset >= done)
            .collect();
        let mut adopted = 0u64;
        let mut refused: Vec<PoolBlock> = Vec::new();
        let mut answered = done;
        // The last call says the announcement is complete (the master keeps a persistent
        // segment sealed until then), even when there is nothing to announce.
        let mut chunks: Vec<&[PoolBlock]> = blocks.chunks(ADOPT_BATCH).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let last = chunks.len() - 1;
        let mut finished = false;
        for (n, chunk) in chunks.into_iter().enumerate() {
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
                .adopt_replicas(self.registrar.node(), id, &items, n == last)
                .await
            {
                Ok(results) => {
                    if let Some(b) = chunk.last() {
                        answered = b.offset + 1;
                    }
                    finished = n == last;
                    for (b, r) in chunk.iter().zip(results) {
                        match r {
                            Ok(()) => adopted += 1,
                            Err(e) => {
                                tracing::warn!(segment = name, key = %b.key.to_hex(),
                                    offset = b.offset, error = %chain(&e),
                                    "the master refused a recovered block");
                                refused.push(*b);
                            }
                        }
                    }
                }
                Err(e) => {
                    // The next pass resumes after the answered batches. Unknown node: the next
                    // pass remounts (a new segment id) and announces everything again.
                    tracing::warn!(segment = name, error = %chain(&e), category = e.category(),
                        "announcing recovered blocks failed; retrying");
                    break;
                }
            }
        }
        {
            let mut pending = self.adopt_pending.lock();
            if pending.get(name) == Some(&(id, done)) {
                if finished {
                    pending.remove(name);
                } else {
                    pending.insert(name.to_owned(), (id, answered));
                }
            }
        }
        {
            let mut idx = index.lock();
            for b in &refused {
                if let Err(e) = idx.forget(b.key, b.offset) {
                    tracing::warn!(error = %chain(&e), "recording a refused block failed");
                }
            }
        }
        if let Some(m) = &self.metrics {
            let (adopted_total, dropped, _) = m.persistence(name);
            adopted_total.inc_by(adopted);
            dropped
                .with_label_values(&[DropReason::Refused.as_str()])
                .inc_by(refused.len() as u64);
        }
        tracing::info!(
            segment = name,
            id,
            adopted,
            refused = refused.len(),
            "recovered blocks announced to the master"
        );
    }

    /// Apply the master's feed events to the durable indexes of the mounted persistent
    /// segments (flushed before they are acknowledged).
    async fn apply_feed(
        &self,
        ssd_id: Option<u32>,
        epoch: u64,
        events: Vec<kvpool_core::master::state::SegmentEvent>,
        prev: FeedState,
    ) {
        let targets: Vec<(u32, SharedIndex)> = self
            .registrar
            .indexes()
            .into_iter()
            .filter_map(|(name, index)| Some((self.registrar.mounted_id(&name)?, index)))
            .collect();
        // An empty answer still confirms the commits of earlier answers.
        let unconfirmed = targets.iter().any(|(_, i)| i.lock().unconfirmed() > 0);
        if targets.is_empty() || (events.is_empty() && prev.epoch == epoch && !unconfirmed) {
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
            feed::apply_events(&targets, epoch, &events, prev, metrics.as_ref())
        })
        .await;
        let next = match applied {
            Ok(Ok(state)) => state,
            Ok(Err((state, e))) => {
                tracing::warn!(error = %chain(&e), category = e.category(),
                    "applying the master's segment events failed; the rest are sent again");
                state
            }
            Err(e) => {
                tracing::warn!(error = %chain(&e), "the segment event worker failed");
                prev
            }
        };
        let mut feed = self.feed.lock();
        // A remount meanwhile restarted the feed: keep that.
        if *feed == prev {
            *feed = next;
        }
    }

    /// Flush the durable indexes' new records (batched: once per pass).
    async fn sync_indexes(&self) {
        let indexes = self.registrar.indexes();
        if indexes.is_empty() {
            return;
        }
        let metrics = self.metrics.clone();
        let synced = tokio::task::spawn_blocking(move || sync_all(&indexes, metrics.as_ref()));
        match synced.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, category = e.category(), "syncing an index failed");
            }
            Err(e) => tracing::warn!(error = %e, "the index sync worker failed"),
        }
    }

    async fn unmount_all(&self) {
        for id in self.registrar.clear_mounted() {
            match self.client.unmount_segment(self.registrar.node(), id).await {
                Ok(()) => tracing::info!(id, "segment unmounted"),
                Err(e) => tracing::warn!(id, error = %chain(&e), "unmounting a segment failed"),
            }
        }
    }
}

/// Flush every index in `indexes`, then set the index gauges (so they count blocks that are
/// durably indexed).
fn sync_all(
    indexes: &[(String, SharedIndex)],
    metrics: Option<&PoolMetrics>,
) -> Result<(), crate::ssd::pool::PoolIndexError> {
    let mut dram = 0usize;
    for (name, index) in indexes {
        let mut idx = index.lock();
        idx.sync()?;
        if let Some(m) = metrics {
            if name == SSD_SEGMENT {
                m.ssd_index_blocks
                    .set(i64::try_from(idx.len()).unwrap_or(i64::MAX));
            } else {
                dram += idx.len();
            }
        }
    }
    if let Some(m) = metrics
        && indexes.iter().any(|(n, _)| n != SSD_SEGMENT)
    {
        m.dram_index_blocks
            .set(i64::try_from(dram).unwrap_or(i64::MAX));
    }
    Ok(())
}

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

/// The engine's transport state as the heartbeat carries it to the master.
fn transport_report(engine: &TransferEngine) -> kvpool_proto::master::TransportReport {
    let t = engine.transport_status();
    kvpool_proto::master::TransportReport {
        rdma_requested: t.rdma_requested,
        fallback: t.fallback,
        fallback_reason: t.reason.unwrap_or_default(),
        rdma_devices: t.devices,
    }
}

/// Client settings of the link: calls retried for three heartbeat periods (1 to 5 s).
pub(super) fn link_client_config(cfg: &PoolConfig) -> ClientConfig {
    let budget = (cfg.heartbeat_interval * 3).clamp(Duration::from_secs(1), Duration::from_secs(5));
    ClientConfig {
        failover_budget: budget,
        request_timeout: budget,
        tls: cfg.master_tls.clone(),
        ..ClientConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
