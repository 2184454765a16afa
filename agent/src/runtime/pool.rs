//! Pool mode's data plane: the DRAM tier is mapped exactly as local-only mode would map it
//! (NUMA node, huge pages, lock) — or, with `dram.persistence`, as shared mappings of tmpfs or
//! hugetlbfs files whose durable indexes are checked first — and every mapping is given to the
//! pool; with an SSD tier, a
//! file of its capacity becomes the SSD segment, with its durable index and read guard. The
//! engine API serves from the pool ([`PoolApi`]); while serving, the [`Member`]'s link mounts,
//! heartbeats and runs tasks, and readiness follows it; on the way out the link unmounts before
//! the memory is withdrawn. I/O boundary: the DRAM mappings, the SSD segment's files and the
//! master (through `pool`).

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use kvpool_core::master::Tier;
use kvpool_runtime::admin::Readiness;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{DataPlane, RunError, blocking, map_dram, persist};
use crate::api::BlockStore;
use crate::config::{AgentConfig, SsdSettings};
use crate::dram;
use crate::memory::{self, MemoryError};
use crate::metrics::AgentMetrics;
use crate::numa_verify;
use crate::placement::{self, SegmentPlan};
use crate::pool::{Member, PoolApi, SSD_SEGMENT, SsdGuard, rdma_readiness_blocker, segment_name};
use crate::ssd::pool::PoolSsdIndex;

/// File of the pool-mode SSD segment inside `ssd.path`.
pub const POOL_SSD_FILE: &str = "pool-ssd.dat";

/// The pool's view for the engine API, and the link's tasks while it runs.
pub(super) struct PoolPlane<'a> {
    member: &'a Member,
    api: Arc<PoolApi>,
    /// `pool.transport: rdma`: not ready without an RDMA device.
    require_rdma: bool,
    link_stop: CancellationToken,
    link_task: Option<JoinHandle<()>>,
    ready_task: Option<JoinHandle<()>>,
}

impl<'a> PoolPlane<'a> {
    /// Give the planned `segments` (and the SSD segment) to the pool through `member`.
    pub(super) async fn open(
        cfg: &AgentConfig,
        segments: Vec<SegmentPlan>,
        member: &'a Member,
        metrics: &Arc<AgentMetrics>,
    ) -> Result<Self, RunError> {
        give_dram(cfg, segments, member, metrics).await?;
        if let Some(s) = &cfg.ssd {
            give_ssd(s, member, metrics).await?;
        }
        // The gauge exists in both modes; here the pool's blocks are the master's to count.
        metrics.blocks.with_label_values(&["dram"]).set(0.0);
        let api = PoolApi::new(
            member.client.clone(),
            cfg.node_name.clone(),
            member.replicas,
            Arc::clone(metrics),
        )
        .with_ssd_index(member.registrar.ssd_index());
        Ok(Self {
            member,
            api: Arc::new(api),
            require_rdma: cfg.pool.as_ref().is_some_and(|p| p.require_rdma),
            link_stop: CancellationToken::new(),
            link_task: None,
            ready_task: None,
        })
    }
}

/// Map the DRAM tier and register every mapping as a pool segment on its NUMA node. With
/// `dram.persistence` each segment is a shared mapping of a tmpfs or hugetlbfs file whose
/// durable index was checked first: the segment is announced as persistent, and the blocks
/// that passed are announced for adoption after the mount.
async fn give_dram(
    cfg: &AgentConfig,
    segments: Vec<SegmentPlan>,
    member: &Member,
    metrics: &AgentMetrics,
) -> Result<(), RunError> {
    let requested: Vec<Option<u32>> = segments.iter().map(|p| p.numa_node).collect();
    let (mapped, indexes) = match cfg.dram.persistence.clone() {
        None => (
            if cfg.pool.as_ref().is_some_and(|p| p.shm.is_some()) {
                map_dram(cfg, segments, dram::map_shared_segments).await?
            } else {
                map_dram(cfg, segments, dram::map_segments).await?
            },
            Vec::new(),
        ),
        Some(p) => {
            let plans = segments.clone();
            let opened = {
                let p = p.clone();
                blocking(move || {
                    let page = persist::prepare(&p)?;
                    Ok::<_, persist::PersistError>((page, persist::open_indexes(&p, &plans)?))
                })
                .await?
                .map_err(RunError::DramPersistence)?
            };
            let (page, opened) = opened;
            let indexes = recovered_dram(opened, member);
            let mapped = map_dram(cfg, segments, move |plans, lock| {
                dram::map_segments_in(plans, lock, Some((&p.dir, page)), true)
            })
            .await?;
            (mapped, indexes)
        }
    };
    let announced: Vec<Option<u32>> = mapped.iter().map(|(i, _)| i.numa_node).collect();
    metrics
        .numa_binding_failures
        .inc_by(numa_verify::binding_failures(&requested, &announced));
    // In segment order, as the mappings.
    let mut indexes = indexes.into_iter();
    let mut per_node: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for (info, region) in mapped {
        let memory = region
            .into_transfer_segment()
            .map_err(RunError::PoolMemory)?
            .on_numa_node(info.numa_node);
        let numa = placement::numa_label(info.numa_node);
        tracing::info!(segment = info.index, numa_node = %numa, bytes = info.bytes,
            hugepage_size = ?info.hugepage_size, numa_bound = info.numa_bound,
            locked = info.locked, persistent = cfg.dram.persistence.is_some(),
            "DRAM segment given to the pool");
        let name = segment_name(info.index);
        if let Some(index) = indexes.next() {
            member.registrar.set_index(&name, index);
        }
        member
            .registrar
            .register(
                &name,
                Tier::Dram,
                info.numa_node
                    .unwrap_or(placement::MASTER_UNBOUND_NUMA_NODE),
                memory,
            )
            .map_err(RunError::Register)?;
        *per_node.entry(info.numa_node).or_default() += info.bytes;
    }
    for (node, bytes) in per_node {
        metrics
            .capacity_bytes
            .with_label_values(&["dram", &placement::numa_label(node)])
            .set(bytes as f64);
    }
    Ok(())
}

/// Log and count what the persistent DRAM tier's indexes recovered; the indexes, in segment
/// order.
fn recovered_dram(opened: Vec<persist::OpenedIndex>, member: &Member) -> Vec<PoolSsdIndex> {
    let mut kept = 0usize;
    let mut out = Vec::with_capacity(opened.len());
    for (i, o) in opened.into_iter().enumerate() {
        for w in &o.recovery.warnings {
            tracing::warn!(segment = i, "persistent DRAM index: {w}");
        }
        for (b, reason) in &o.recovery.dropped {
            tracing::warn!(segment = i, key = %b.key.to_hex(), offset = b.offset,
                length = b.length, reason = reason.as_str(),
                "dropped a block of the persistent DRAM tier");
            member
                .metrics
                .dram_blocks_dropped
                .with_label_values(&[reason.as_str()])
                .inc();
        }
        let bytes: u64 = o.recovery.blocks.iter().map(|b| b.length).sum();
        tracing::info!(
            segment = i,
            blocks = o.recovery.blocks.len(),
            bytes,
            dropped = o.recovery.dropped.len(),
            elapsed_ms = u64::try_from(o.elapsed.as_millis()).unwrap_or(u64::MAX),
            "persistent DRAM index recovered (every block's checksum verified)"
        );
        kept += o.index.len();
        out.push(o.index);
    }
    member
        .metrics
        .dram_index_blocks
        .set(i64::try_from(kept).unwrap_or(i64::MAX));
    out
}

/// Recover the SSD segment's index, map its file and register it, with reads checked by the
/// index.
async fn give_ssd(
    s: &SsdSettings,
    member: &Member,
    metrics: &AgentMetrics,
) -> Result<(), RunError> {
    let path = s.tier.dir.join(POOL_SSD_FILE);
    let capacity = s.tier.capacity;
    std::fs::create_dir_all(&s.tier.dir).map_err(|source| {
        RunError::PoolMemory(MemoryError::File {
            path: s.tier.dir.clone(),
            len: capacity,
            source,
        })
    })?;
    // The index is checked against the file before the file is mapped (and resized).
    let (dir, data) = (s.tier.dir.clone(), path.clone());
    let (mut index, recovery) = blocking(move || PoolSsdIndex::open(&dir, &data, capacity))
        .await?
        .map_err(RunError::PoolIndex)?;
    // Records that find the filesystem full wait for room; the gauge says so meanwhile.
    index.set_full_gauge(metrics.ssd_full.clone());
    for w in &recovery.warnings {
        tracing::warn!("pool SSD index: {w}");
    }
    for (b, reason) in &recovery.dropped {
        tracing::warn!(key = %b.key.to_hex(), offset = b.offset, length = b.length,
            reason = reason.as_str(), "dropped a block of the pool SSD segment");
        member
            .metrics
            .ssd_blocks_dropped
            .with_label_values(&[reason.as_str()])
            .inc();
    }
    tracing::info!(
        blocks = recovery.blocks.len(),
        dropped = recovery.dropped.len(),
        "pool SSD index recovered"
    );
    member
        .metrics
        .ssd_index_blocks
        .set(i64::try_from(index.len()).unwrap_or(i64::MAX));
    let memory = blocking(move || memory::map_file_segment(&path, capacity))
        .await?
        .map_err(RunError::PoolMemory)?;
    member.registrar.set_ssd_index(index);
    member
        .registrar
        .register(SSD_SEGMENT, Tier::Ssd, 0, memory)
        .map_err(RunError::Register)?;
    if let Some(index) = member.registrar.ssd_index() {
        let guard = SsdGuard::new(index, member.metrics.clone()).map_err(RunError::PoolIndex)?;
        member
            .registrar
            .set_ssd_guard(guard)
            .map_err(RunError::Register)?;
    }
    metrics
        .capacity_bytes
        .with_label_values(&["ssd", "all"])
        .set(capacity as f64);
    Ok(())
}

impl DataPlane for PoolPlane<'_> {
    fn store(&self) -> Arc<dyn BlockStore> {
        Arc::clone(&self.api) as Arc<dyn BlockStore>
    }

    /// The link mounts, heartbeats and runs tasks until the engine API has drained; the agent
    /// is ready only while the pool has every segment mounted.
    fn start(&mut self, readiness: &Readiness, stop: &CancellationToken) {
        let member = self.member;
        self.link_task = Some(tokio::spawn(
            member.link.clone().run(self.link_stop.clone()),
        ));
        let mut healthy = member.link.healthy();
        let readiness = readiness.clone();
        let stop = stop.clone();
        // Devices are opened once at start: a node without the RDMA the pool requires stays
        // unready for its whole life (the operator's TransportDegraded says why).
        let blocker = rdma_readiness_blocker(self.require_rdma, &member.engine.transport_status());
        if let Some(why) = &blocker {
            tracing::error!(reason = %why, "agent stays not ready");
        }
        self.ready_task = Some(tokio::spawn(async move {
            loop {
                let now = *healthy.borrow_and_update() && blocker.is_none();
                if now != readiness.is_ready() {
                    tracing::info!(ready = now, "agent readiness (pool membership)");
                }
                readiness.set_ready(now);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    changed = healthy.changed() => if changed.is_err() { break },
                }
            }
            readiness.set_ready(false);
        }));
    }

    /// Readiness stops following the link, then the link unmounts (before the memory is
    /// withdrawn, so the master stops handing it out first).
    fn stop(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(t) = self.ready_task.take() {
                let _ = t.await;
            }
            self.link_stop.cancel();
            if let Some(t) = self.link_task.take() {
                let _ = t.await;
            }
        })
    }

    fn withdraw(&mut self) -> BoxFuture<'_, Result<(), RunError>> {
        Box::pin(async move {
            let registrar = &self.member.registrar;
            // Tasks that finished after the link stopped may have appended records.
            for (name, index) in registrar.indexes() {
                blocking(move || index.lock().sync())
                    .await?
                    .map_err(RunError::PoolIndex)?;
                tracing::info!(segment = %name, "durable segment index synced");
            }
            for name in registrar.registered() {
                if let Err(e) = registrar.deregister(&name) {
                    tracing::warn!(error = %chain(&e), "deregistering segment failed");
                }
            }
            Ok(())
        })
    }
}
