//! The agent process: discovery, DRAM and SSD tiers, segment registration, the engine API and
//! the admin server, started in that order and stopped in reverse on cancellation. In pool mode
//! the tiers' memory goes to the pool (transfer engine + master, see `pool`) instead of the
//! local store, the engine API serves from the pool, and readiness follows the pool link.
//! I/O boundary: everything below it (sysfs, memory, files, sockets); this module sequences.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use kvpool_runtime::admin::{self, Readiness};
use parking_lot::RwLock;
use prometheus::Registry;
use tokio_util::sync::CancellationToken;

use crate::api::server::{self as api_server, EngineService, ServerError};
use crate::api::shm;
use crate::config::AgentConfig;
use crate::discovery::{self, DiscoveryError};
use crate::dram::{self, DramError, DramTier};
use crate::memory::{self, MemoryError};
use crate::metrics::{AgentMetrics, MetricsError};
use crate::placement::{self, PlacementError, PlacementRequest};
use crate::pool::{Member, SSD_SEGMENT, segment_name};
use crate::pool_api::PoolApi;
use crate::registrar::{AnnouncedTier, RegistrarError, SegmentRegistrar};
use crate::ssd::pool::{PoolIndexError, PoolSsdIndex};
use crate::ssd::{SsdError, SsdTier};
use crate::store::{StoreError, TieredStore};
use crate::topology::{NodeSummary, Topology, summarize};

/// Errors of the agent process.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RunError {
    #[error("metrics")]
    Metrics(#[source] MetricsError),
    #[error("admin server")]
    Admin(#[source] admin::AdminError),
    #[error("topology discovery")]
    Discovery(#[source] DiscoveryError),
    #[error("DRAM placement")]
    Placement(#[source] PlacementError),
    #[error("DRAM tier")]
    Dram(#[source] DramError),
    #[error("pool memory")]
    PoolMemory(#[source] MemoryError),
    #[error("SSD tier")]
    Ssd(#[source] SsdError),
    #[error("segment registration")]
    Register(#[source] RegistrarError),
    #[error("engine API")]
    Api(#[source] ServerError),
    #[error("persisting the SSD tier on shutdown")]
    Persist(#[source] StoreError),
    #[error("a start-up task failed: {0}")]
    Join(String),
    #[error("index of the pool-mode SSD segment")]
    PoolIndex(#[source] PoolIndexError),
}

impl RunError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// What the admin server shows beyond the standard endpoints.
#[derive(Clone, Default)]
struct TopologyView(Arc<RwLock<Option<(Topology, NodeSummary)>>>);

async fn topology_handler(State(view): State<TopologyView>) -> impl IntoResponse {
    match view.0.read().as_ref() {
        Some((topo, _)) => (StatusCode::OK, Json(serde_json::to_value(topo).ok())).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "discovery not done\n").into_response(),
    }
}

async fn summary_handler(State(view): State<TopologyView>) -> impl IntoResponse {
    match view.0.read().as_ref() {
        Some((_, summary)) => {
            (StatusCode::OK, Json(serde_json::to_value(summary).ok())).into_response()
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, "discovery not done\n").into_response(),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RunError::Join(e.to_string()))
}

/// Hooks for tests and embedding: where the admin server ended up.
#[derive(Debug, Default)]
pub struct Started {
    pub admin_addr: Option<std::net::SocketAddr>,
}

/// Where the tiers' memory goes.
pub enum Mode<'a> {
    /// Local-only: the agent's own store allocates; segments are recorded by the registrar.
    Local(Arc<dyn SegmentRegistrar>),
    /// Pool mode: the DRAM tier's mappings and the SSD segment go to the pool's transfer
    /// engine and master; the engine API serves from the pool.
    Pool(&'a Member),
}

/// Run the agent until `shutdown` is cancelled. Metrics go to `registry` (in pool mode the
/// transfer engine's are there already). `on_admin_bound` receives the admin address.
pub async fn run(
    cfg: AgentConfig,
    mode: Mode<'_>,
    registry: Registry,
    shutdown: CancellationToken,
    on_admin_bound: impl FnOnce(std::net::SocketAddr),
) -> Result<(), RunError> {
    tracing::info!(config = ?cfg, "effective configuration");
    let metrics = Arc::new(AgentMetrics::new(&registry).map_err(RunError::Metrics)?);
    let readiness = Readiness::new();
    let view = TopologyView::default();

    // Admin first (liveness during start-up), stopped last.
    let admin_stop = CancellationToken::new();
    let listener = admin::bind(cfg.admin_listen)
        .await
        .map_err(RunError::Admin)?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "admin server listening");
        on_admin_bound(addr);
    }
    let router = admin::router(registry.clone(), readiness.clone()).merge(
        Router::new()
            .route("/topology", get(topology_handler))
            .route("/topology/summary", get(summary_handler))
            .with_state(view.clone()),
    );
    let admin_task = tokio::spawn(admin::serve(listener, router, admin_stop.clone()));

    let result = serve_data_plane(&cfg, mode, shutdown, &metrics, &readiness, &view).await;
    readiness.set_ready(false);
    admin_stop.cancel();
    match admin_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "admin server failed"),
        Err(e) => tracing::warn!(error = %e, "admin server task failed"),
    }
    result
}

async fn serve_data_plane(
    cfg: &AgentConfig,
    mode: Mode<'_>,
    shutdown: CancellationToken,
    metrics: &Arc<AgentMetrics>,
    readiness: &Readiness,
    view: &TopologyView,
) -> Result<(), RunError> {
    // Discovery.
    let roots = cfg.roots.clone();
    let env: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with(discovery::DEVICE_PLUGIN_ENV_PREFIX))
        .collect();
    #[allow(unused_mut)]
    let mut topo = blocking(move || discovery::discover(&roots, &env))
        .await?
        .map_err(RunError::Discovery)?;
    #[cfg(feature = "cuda")]
    {
        topo = blocking(move || {
            crate::gpu_cuda::enrich(&mut topo);
            topo
        })
        .await?;
    }
    for w in &topo.warnings {
        tracing::warn!(path = %w.path, "discovery: {}", w.message);
    }
    metrics
        .discovery_warnings
        .set(i64::try_from(topo.warnings.len()).unwrap_or(i64::MAX));
    let summary = summarize(&topo);
    tracing::info!(
        node = %cfg.node_name,
        labels = ?summary.labels,
        numa_nodes = topo.numa_nodes.len(),
        gpus = topo.gpus.len(),
        rdma_devices = topo.rdma_devices.len(),
        "topology discovered"
    );

    // DRAM tier.
    let placement = placement::plan(
        &topo,
        &PlacementRequest {
            capacity: cfg.dram.capacity,
            policy: cfg.dram.policy.clone(),
            hugepage_size: cfg.dram.hugepage_size,
            max_segment: cfg.dram.max_segment,
        },
    )
    .map_err(RunError::Placement)?;
    *view.0.write() = Some((topo, summary));
    for w in &placement.warnings {
        tracing::warn!("DRAM placement: {w}");
    }
    let lock = cfg.dram.lock;
    let segments = placement.segments.clone();
    let (store, pool) = match mode {
        Mode::Local(registrar) => {
            let store = local_tiers(cfg, segments, Arc::clone(metrics)).await?;
            let segments = store.dram_segments();
            (store, LocalOrPool::Local(registrar, segments))
        }
        Mode::Pool(member) => {
            pool_tiers(cfg, segments, member, metrics).await?;
            // The local store stays empty: it only carries the API's metrics.
            let (empty, _) = DramTier::new(&[], lock).map_err(RunError::Dram)?;
            let store = Arc::new(TieredStore::new(empty, None, Arc::clone(metrics)));
            (store, LocalOrPool::Pool(member))
        }
    };
    if let LocalOrPool::Local(registrar, segments) = &pool {
        for seg in segments {
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
    }

    // Engine API.
    std::fs::create_dir_all(&cfg.api.shm_dir).map_err(|source| {
        RunError::Api(ServerError::SocketDir {
            path: cfg.api.shm_dir.clone(),
            source,
        })
    })?;
    let stale = shm::remove_stale(&cfg.api.shm_dir);
    if stale > 0 {
        tracing::info!(files = stale, "removed stale staging files");
    }
    let (listener, socket_path) =
        api_server::bind_for_group(&cfg.api.socket_dir, cfg.api.client_group)
            .map_err(RunError::Api)?;
    let mut service = EngineService::new(
        Arc::clone(&store),
        cfg.api.shm_dir.clone(),
        cfg.api.limits.clone(),
    )
    .with_client_group(cfg.api.client_group);
    if let LocalOrPool::Pool(member) = &pool {
        service = service.with_pool(
            PoolApi::new(
                member.client.clone(),
                cfg.node_name.clone(),
                member.replicas,
            )
            .with_ssd_index(member.registrar.ssd_index()),
        );
    }
    tracing::info!(socket = %socket_path.display(), "engine API listening");

    // Periodic flush of the SSD tier (local-only mode: the pool's SSD segment has no index).
    let sync_stop = shutdown.child_token();
    let local_ssd = cfg
        .ssd
        .as_ref()
        .filter(|_| matches!(pool, LocalOrPool::Local(..)));
    let sync_task = local_ssd.map(|s| {
        let store = Arc::clone(&store);
        let every = s.sync_interval;
        let stop = sync_stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {
                        let store = Arc::clone(&store);
                        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || store.sync()).await {
                            tracing::warn!(error = %e, "SSD sync failed");
                        }
                    }
                }
            }
        })
    });

    // Close sessions of engines that went away without closing them.
    let reaper = {
        let service = service.clone();
        let stop = sync_stop.clone();
        let idle = cfg.api.session_idle_timeout;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval((idle / 4).max(std::time::Duration::from_secs(1)));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => { service.reap_idle(idle); }
                }
            }
        })
    };

    // Pool mode: the link mounts, heartbeats and runs tasks until the API has drained; ready
    // only while the pool has every segment mounted.
    let link_stop = CancellationToken::new();
    let (link_task, ready_task) = match &pool {
        LocalOrPool::Local(..) => {
            readiness.set_ready(true);
            tracing::info!("agent ready");
            (None, None)
        }
        LocalOrPool::Pool(member) => {
            let link = tokio::spawn(member.link.clone().run(link_stop.clone()));
            let mut healthy = member.link.healthy();
            let readiness = readiness.clone();
            let stop = sync_stop.clone();
            // Devices are opened once at start: a node without the RDMA the pool requires
            // stays unready for its whole life (the operator's TransportDegraded says why).
            let blocker = crate::pool::rdma_readiness_blocker(
                cfg.pool.as_ref().is_some_and(|p| p.require_rdma),
                &member.engine.transport_status(),
            );
            if let Some(why) = &blocker {
                tracing::error!(reason = %why, "agent stays not ready");
            }
            let ready = tokio::spawn(async move {
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
            });
            (Some(link), Some(ready))
        }
    };
    let served = api_server::serve(listener, service.clone(), shutdown.clone()).await;
    // Shutdown: the listener is closed and in-flight calls have finished.
    readiness.set_ready(false);
    tracing::info!("engine API stopped; persisting");
    let _ = std::fs::remove_file(&socket_path);
    sync_stop.cancel();
    if let Some(t) = sync_task {
        let _ = t.await;
    }
    if let Some(t) = ready_task {
        let _ = t.await;
    }
    readiness.set_ready(false);
    // Unmount before the memory is withdrawn, so the master stops handing it out first.
    link_stop.cancel();
    if let Some(t) = link_task {
        let _ = t.await;
    }
    let _ = reaper.await;
    service.close_all();
    let persist_dram = cfg.ssd.as_ref().is_some_and(|s| s.persist_dram_on_shutdown);
    let store_for_persist = Arc::clone(&store);
    let demoted = blocking(move || store_for_persist.persist(persist_dram))
        .await?
        .map_err(RunError::Persist)?;
    tracing::info!(demoted, "SSD index persisted");
    match &pool {
        LocalOrPool::Local(registrar, segments) => {
            for seg in segments {
                if let Err(e) = registrar.deregister(seg.index) {
                    tracing::warn!(error = %e, "deregistering segment failed");
                }
            }
        }
        LocalOrPool::Pool(member) => {
            // Tasks that finished after the link stopped may have appended records.
            if let Some(index) = member.registrar.ssd_index() {
                blocking(move || index.lock().sync())
                    .await?
                    .map_err(RunError::PoolIndex)?;
                tracing::info!("pool SSD index synced");
            }
            for name in member.registrar.registered() {
                if let Err(e) = member.registrar.deregister(&name) {
                    tracing::warn!(error = %e, "deregistering segment failed");
                }
            }
        }
    }
    served.map_err(RunError::Api)
}

enum LocalOrPool<'a> {
    Local(Arc<dyn SegmentRegistrar>, Vec<crate::dram::SegmentInfo>),
    Pool(&'a Member),
}

/// Local-only mode: the DRAM tier with its allocator, the SSD tier with its index.
async fn local_tiers(
    cfg: &AgentConfig,
    segments: Vec<placement::SegmentPlan>,
    metrics: Arc<AgentMetrics>,
) -> Result<Arc<TieredStore>, RunError> {
    let lock = cfg.dram.lock;
    let (dram, dram_warnings) = blocking(move || DramTier::new(&segments, lock))
        .await?
        .map_err(RunError::Dram)?;
    for w in &dram_warnings {
        tracing::warn!("DRAM tier: {w}");
    }
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

/// File of the pool-mode SSD segment inside `ssd.path`.
pub const POOL_SSD_FILE: &str = "pool-ssd.dat";

/// Pool mode: map the DRAM tier exactly as local-only mode would (NUMA node, huge pages,
/// lock) and give every mapping to the pool; with an SSD tier, a file of its capacity becomes
/// the SSD segment. The master allocates inside all of them.
async fn pool_tiers(
    cfg: &AgentConfig,
    segments: Vec<placement::SegmentPlan>,
    member: &Member,
    metrics: &AgentMetrics,
) -> Result<(), RunError> {
    let lock = cfg.dram.lock;
    let (mapped, warnings) = blocking(move || dram::map_segments(&segments, lock))
        .await?
        .map_err(RunError::Dram)?;
    for w in &warnings {
        tracing::warn!("DRAM tier: {w}");
    }
    let mut per_node: BTreeMap<Option<u32>, u64> = BTreeMap::new();
    for (info, region) in mapped {
        let memory = region
            .into_transfer_segment()
            .map_err(RunError::PoolMemory)?;
        let numa = placement::numa_label(info.numa_node);
        tracing::info!(segment = info.index, numa_node = %numa, bytes = info.bytes,
            hugepage_size = ?info.hugepage_size, numa_bound = info.numa_bound,
            locked = info.locked, "DRAM segment given to the pool");
        member
            .registrar
            .register(
                &segment_name(info.index),
                kvpool_core::master::Tier::Dram,
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
    if let Some(s) = &cfg.ssd {
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
        let (index, recovery) = blocking(move || PoolSsdIndex::open(&dir, &data, capacity))
            .await?
            .map_err(RunError::PoolIndex)?;
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
            .register(SSD_SEGMENT, kvpool_core::master::Tier::Ssd, 0, memory)
            .map_err(RunError::Register)?;
        if let Some(index) = member.registrar.ssd_index() {
            let guard = crate::pool_feed::SsdGuard::new(index, member.metrics.clone())
                .map_err(RunError::PoolIndex)?;
            member
                .registrar
                .set_ssd_guard(guard)
                .map_err(RunError::Register)?;
        }
        metrics
            .capacity_bytes
            .with_label_values(&["ssd", "all"])
            .set(capacity as f64);
    }
    Ok(())
}
