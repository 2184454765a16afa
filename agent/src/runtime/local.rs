//! Local-only mode's data plane: the agent's own tiered store (the DRAM tier with its allocator,
//! the SSD tier with its index) serves the engine API; the DRAM segments are recorded and the
//! recovered SSD blocks re-announced by the [`SegmentRegistrar`]; the SSD tier is flushed
//! periodically while serving, and persisted (optionally with the DRAM blocks) before the
//! segments are withdrawn. I/O boundary: the DRAM mappings and the SSD tier's files (through
//! `dram` and `ssd`).

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use kvpool_runtime::admin::Readiness;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{DataPlane, RunError, blocking, map_dram};
use crate::api::BlockStore;
use crate::config::AgentConfig;
use crate::dram::{DramTier, SegmentInfo};
use crate::metrics::AgentMetrics;
use crate::placement::SegmentPlan;
use crate::registrar::{AnnouncedTier, SegmentRegistrar};
use crate::ssd::SsdTier;
use crate::store::TieredStore;

/// The tiered store and where its segments are announced.
pub(super) struct LocalPlane {
    store: Arc<TieredStore>,
    registrar: Arc<dyn SegmentRegistrar>,
    segments: Vec<SegmentInfo>,
    /// How often the SSD tier is flushed (no SSD tier: never).
    sync_every: Option<Duration>,
    /// Demote DRAM blocks to SSD on shutdown.
    persist_dram: bool,
    sync_task: Option<JoinHandle<()>>,
}

impl LocalPlane {
    /// Open the tiers on the planned `segments`, register the DRAM segments and re-announce the
    /// blocks the SSD tier recovered.
    pub(super) async fn open(
        cfg: &AgentConfig,
        segments: Vec<SegmentPlan>,
        metrics: Arc<AgentMetrics>,
        registrar: Arc<dyn SegmentRegistrar>,
    ) -> Result<Self, RunError> {
        let store = open_tiers(cfg, segments, metrics).await?;
        let segments = store.dram_segments();
        for seg in &segments {
            registrar.register(seg).map_err(RunError::Register)?;
        }
        let recovered = store.ssd_keys();
        if !recovered.is_empty() {
            registrar
                .announce(&recovered, AnnouncedTier::Ssd)
                .map_err(RunError::Register)?;
            tracing::info!(
                blocks = recovered.len(),
                "re-announced recovered SSD blocks"
            );
        }
        Ok(Self {
            store,
            registrar,
            segments,
            sync_every: cfg.ssd.as_ref().map(|s| s.sync_interval),
            persist_dram: cfg.ssd.as_ref().is_some_and(|s| s.persist_dram_on_shutdown),
            sync_task: None,
        })
    }
}

/// The DRAM tier with its allocator, the SSD tier with its index.
async fn open_tiers(
    cfg: &AgentConfig,
    segments: Vec<SegmentPlan>,
    metrics: Arc<AgentMetrics>,
) -> Result<Arc<TieredStore>, RunError> {
    let requested: Vec<Option<u32>> = segments.iter().map(|p| p.numa_node).collect();
    let dram = map_dram(cfg, segments, DramTier::new).await?;
    let announced: Vec<Option<u32>> = dram.segments().iter().map(|i| i.numa_node).collect();
    metrics
        .numa_binding_failures
        .inc_by(crate::numa_verify::binding_failures(&requested, &announced));
    let ssd = match &cfg.ssd {
        Some(s) => {
            let tier_cfg = s.tier.clone();
            let (tier, recovery) = blocking(move || SsdTier::open(&tier_cfg))
                .await?
                .map_err(RunError::Ssd)?;
            for w in &recovery.warnings {
                tracing::warn!("SSD tier: {w}");
            }
            tracing::info!(
                blocks = recovery.blocks,
                bytes = recovery.bytes,
                direct_io = tier.direct_io(),
                "SSD tier opened"
            );
            Some(tier)
        }
        None => None,
    };
    Ok(Arc::new(TieredStore::new(dram, ssd, metrics)))
}

/// Flush the SSD tier every `every` until `stop`.
fn spawn_sync(store: Arc<TieredStore>, every: Duration, stop: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {
                    let store = Arc::clone(&store);
                    if let Ok(Err(e)) = tokio::task::spawn_blocking(move || store.sync()).await {
                        tracing::warn!(error = %chain(&e), "SSD sync failed");
                    }
                }
            }
        }
    })
}

impl DataPlane for LocalPlane {
    fn store(&self) -> Arc<dyn BlockStore> {
        Arc::clone(&self.store) as Arc<dyn BlockStore>
    }

    fn start(&mut self, readiness: &Readiness, stop: &CancellationToken) {
        self.sync_task = self
            .sync_every
            .map(|every| spawn_sync(Arc::clone(&self.store), every, stop.clone()));
        readiness.set_ready(true);
        tracing::info!("agent ready");
    }

    fn stop(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(t) = self.sync_task.take() {
                let _ = t.await;
            }
        })
    }

    fn withdraw(&mut self) -> BoxFuture<'_, Result<(), RunError>> {
        Box::pin(async move {
            let store = Arc::clone(&self.store);
            let persist_dram = self.persist_dram;
            let demoted = blocking(move || store.persist(persist_dram))
                .await?
                .map_err(RunError::Persist)?;
            tracing::info!(demoted, "SSD index persisted");
            for seg in &self.segments {
                if let Err(e) = self.registrar.deregister(seg.index) {
                    tracing::warn!(error = %chain(&e), "deregistering segment failed");
                }
            }
            Ok(())
        })
    }
}
