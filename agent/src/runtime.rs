//! The agent process: discovery, DRAM and SSD tiers, segment registration, the engine API and
//! the admin server, started in that order and stopped in reverse on cancellation.
//! I/O boundary: everything below it (sysfs, memory, files, sockets); this module sequences.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use kvpool::admin::{self, Readiness};
use parking_lot::RwLock;
use prometheus::Registry;
use tokio_util::sync::CancellationToken;

use crate::api::server::{self as api_server, EngineService, ServerError};
use crate::api::shm;
use crate::config::AgentConfig;
use crate::discovery::{self, DiscoveryError};
use crate::dram::{DramError, DramTier};
use crate::metrics::{AgentMetrics, MetricsError};
use crate::placement::{self, PlacementError, PlacementRequest};
use crate::registrar::{AnnouncedTier, RegistrarError, SegmentRegistrar};
use crate::ssd::{SsdError, SsdTier};
use crate::store::{StoreError, TieredStore};
use crate::topology::{NodeSummary, Topology, summarize};

/// Errors of the agent process.
#[derive(Debug, thiserror::Error)]
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
}

impl RunError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            RunError::Metrics(_) => "metrics",
            RunError::Admin(_) => "admin",
            RunError::Discovery(_) => "discovery",
            RunError::Placement(_) => "placement",
            RunError::Dram(_) => "dram",
            RunError::Ssd(_) => "ssd",
            RunError::Register(_) => "register",
            RunError::Api(_) => "api",
            RunError::Persist(_) => "persist",
            RunError::Join(_) => "join",
        }
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

/// Run the agent until `shutdown` is cancelled. `on_admin_bound` receives the admin address.
pub async fn run(
    cfg: AgentConfig,
    registrar: Arc<dyn SegmentRegistrar>,
    shutdown: CancellationToken,
    on_admin_bound: impl FnOnce(std::net::SocketAddr),
) -> Result<(), RunError> {
    tracing::info!(config = ?cfg, "effective configuration");
    let registry = Registry::new();
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

    let result = serve_data_plane(&cfg, registrar, shutdown, &metrics, &readiness, &view).await;
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
    registrar: Arc<dyn SegmentRegistrar>,
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
    let (dram, dram_warnings) = blocking(move || DramTier::new(&segments, lock))
        .await?
        .map_err(RunError::Dram)?;
    for w in &dram_warnings {
        tracing::warn!("DRAM tier: {w}");
    }

    // SSD tier.
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
    let store = Arc::new(TieredStore::new(dram, ssd, Arc::clone(metrics)));

    // Registration (transfer engine segments, master announcements).
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
    let (listener, socket_path) = api_server::bind(&cfg.api.socket_dir).map_err(RunError::Api)?;
    let service = EngineService::new(
        Arc::clone(&store),
        cfg.api.shm_dir.clone(),
        cfg.api.limits.clone(),
    );
    tracing::info!(socket = %socket_path.display(), "engine API listening");

    // Periodic flush of the SSD tier.
    let sync_stop = shutdown.child_token();
    let sync_task = cfg.ssd.as_ref().map(|s| {
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

    readiness.set_ready(true);
    tracing::info!("agent ready");
    let served = api_server::serve(listener, service.clone(), shutdown.clone()).await;
    // Shutdown: the listener is closed and in-flight calls have finished.
    readiness.set_ready(false);
    tracing::info!("engine API stopped; persisting");
    let _ = std::fs::remove_file(&socket_path);
    sync_stop.cancel();
    if let Some(t) = sync_task {
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
    for seg in &segments {
        if let Err(e) = registrar.deregister(seg.index) {
            tracing::warn!(error = %e, "deregistering segment failed");
        }
    }
    served.map_err(RunError::Api)
}
