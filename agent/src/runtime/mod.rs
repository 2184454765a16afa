//! The agent process: discovery, the data plane of its mode, the engine API and the admin
//! server, started in that order and stopped in reverse on cancellation. The two modes differ
//! only behind [`DataPlane`]: local-only mode ([`local`]) serves the engine API from the
//! agent's own tiers and records its segments with a registrar; pool mode ([`pool`]) gives the
//! tiers' memory to the pool (transfer engine + master), serves from the pool, and readiness
//! follows the pool link. I/O boundary: everything below it (sysfs, memory, files, sockets);
//! this module sequences.

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use futures::future::BoxFuture;
use kvpool_runtime::admin::{self, Readiness};
use prometheus::Registry;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::BlockStore;
use crate::api::server::{self as api_server, EngineService, ServerError};
use crate::api::shm;
use crate::config::AgentConfig;
use crate::discovery::{self, DiscoveryError};
use crate::dram::DramError;
use crate::memory::MemoryError;
use crate::metrics::{AgentMetrics, MetricsError};
use crate::node::{self, NodeMetrics};
use crate::placement::{self, PlacementError, PlacementRequest, SegmentPlan};
use crate::pool::Member;
use crate::registrar::{RegistrarError, SegmentRegistrar};
use crate::ssd::SsdError;
use crate::ssd::pool::PoolIndexError;
use crate::store::StoreError;
use crate::topology::{NodeSummary, summarize};

mod admin_view;
mod blocking;
mod local;
mod persist;
mod pool;

pub use blocking::run_blocking;
pub use persist::PersistError;
pub use pool::POOL_SSD_FILE;

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
    #[error("persistent DRAM tier")]
    DramPersistence(#[source] persist::PersistError),
}

kvpool_runtime::error_category!(RunError);

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RunError::Join(e.to_string()))
}

/// Map the DRAM tier's planned `segments` with `map` on the blocking pool (as the local tier,
/// or as bare mappings for the pool), logging what it warns about.
async fn map_dram<T: Send + 'static>(
    cfg: &AgentConfig,
    segments: Vec<SegmentPlan>,
    map: impl FnOnce(&[SegmentPlan], bool) -> Result<(T, Vec<String>), DramError> + Send + 'static,
) -> Result<T, RunError> {
    let lock = cfg.dram.lock;
    let (mapped, warnings) = blocking(move || map(&segments, lock))
        .await?
        .map_err(RunError::Dram)?;
    for w in &warnings {
        tracing::warn!("DRAM tier: {w}");
    }
    Ok(mapped)
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

/// What differs between the modes, behind the one sequence of [`run`]. Opening a plane maps
/// the tiers and announces their segments (each mode's `open`).
trait DataPlane: Send {
    /// Where the engine API puts and gets blocks.
    fn store(&self) -> Arc<dyn BlockStore>;
    /// Start what runs beside the engine API until `stop` fires, and report readiness.
    fn start(&mut self, readiness: &Readiness, stop: &CancellationToken);
    /// After the engine API stopped and `stop` fired: wait for that work to end.
    fn stop(&mut self) -> BoxFuture<'_, ()>;
    /// Persist what must survive a restart, then withdraw the node's memory.
    fn withdraw(&mut self) -> BoxFuture<'_, Result<(), RunError>>;
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
    let pool = cfg.pool.as_ref();
    tracing::info!(
        node = %cfg.node_name,
        mode = if pool.is_some() { "pool" } else { "local" },
        dram_bytes = cfg.dram.capacity,
        numa_policy = ?cfg.dram.policy,
        hugepage_bytes = cfg.dram.hugepage_size,
        ssd_bytes = cfg.ssd.as_ref().map(|s| s.tier.capacity),
        socket_dir = %cfg.api.socket_dir.display(),
        admin = %cfg.admin_listen,
        masters = ?pool.map(|p| &p.masters),
        transport = ?pool.map(|p| p.transport_listen),
        want_rdma = pool.is_some_and(|p| p.want_rdma),
        "effective configuration"
    );
    tracing::debug!(config = ?cfg, "effective configuration, every field");
    let metrics = Arc::new(AgentMetrics::new(&registry).map_err(RunError::Metrics)?);
    let node_metrics = NodeMetrics::new(&registry).map_err(|source| {
        RunError::Metrics(MetricsError::Register {
            name: "kvpool_agent_node_*",
            source,
        })
    })?;
    let readiness = Readiness::new();
    let view = admin_view::TopologyView::default();

    // Admin first (liveness during start-up), stopped last.
    let admin_stop = CancellationToken::new();
    let listener = admin::bind(cfg.admin_listen)
        .await
        .map_err(RunError::Admin)?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "admin server listening");
        on_admin_bound(addr);
    }
    let router = admin::router(registry.clone(), readiness.clone()).merge(view.router());
    let admin_task = tokio::spawn(admin::serve(listener, router, admin_stop.clone()));

    let result = serve_data_plane(
        &cfg,
        mode,
        shutdown,
        (&metrics, &node_metrics),
        &readiness,
        &view,
    )
    .await;
    readiness.set_ready(false);
    admin_stop.cancel();
    match admin_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %chain(&e), "admin server failed"),
        Err(e) => tracing::warn!(error = %chain(&e), "admin server task failed"),
    }
    result
}

/// Discovery, the node's object (topology labels, failure domain), the mode's data plane, the
/// engine API until `shutdown`, then the way back out.
async fn serve_data_plane(
    cfg: &AgentConfig,
    mode: Mode<'_>,
    shutdown: CancellationToken,
    (metrics, node_metrics): (&Arc<AgentMetrics>, &NodeMetrics),
    readiness: &Readiness,
    view: &admin_view::TopologyView,
) -> Result<(), RunError> {
    let (segments, summary) = discover_and_place(cfg, metrics, view).await?;
    let client = node::client_for(cfg, node_metrics).await;
    let failure_domain = node::prepare(cfg, &summary, client.as_ref(), node_metrics).await;
    let mut plane: Box<dyn DataPlane + '_> = match mode {
        Mode::Local(registrar) => {
            Box::new(local::LocalPlane::open(cfg, segments, Arc::clone(metrics), registrar).await?)
        }
        Mode::Pool(member) => {
            member.registrar.set_failure_domain(failure_domain);
            Box::new(pool::PoolPlane::open(cfg, segments, member, metrics).await?)
        }
    };

    // Engine API.
    let (listener, socket_path) = bind_engine_api(cfg)?;
    let service = EngineService::new(
        plane.store(),
        Arc::clone(metrics),
        cfg.api.shm_dir.clone(),
        cfg.api.limits.clone(),
    )
    .with_client_group(cfg.api.client_group);
    let allow = cfg
        .pool
        .as_ref()
        .map(|p| p.rdma_devices.clone())
        .unwrap_or_default();
    let service = match view.locality(&allow) {
        Some(l) => service.with_locality(l),
        None => service,
    };
    tracing::info!(socket = %socket_path.display(), "engine API listening");

    let stop = shutdown.child_token();
    let reaper = spawn_reaper(service.clone(), cfg.api.session_idle_timeout, stop.clone());
    plane.start(readiness, &stop);
    let served = api_server::serve(listener, service.clone(), shutdown.clone()).await;
    // Shutdown: the listener is closed and in-flight calls have finished.
    readiness.set_ready(false);
    tracing::info!("engine API stopped; persisting");
    let _ = std::fs::remove_file(&socket_path);
    stop.cancel();
    plane.stop().await;
    readiness.set_ready(false);
    let _ = reaper.await;
    service.close_all();
    plane.withdraw().await?;
    served.map_err(RunError::Api)
}

/// Discover the node's topology (publishing it on the admin server) and plan the DRAM tier's
/// segments on it; also the topology's node-label summary.
async fn discover_and_place(
    cfg: &AgentConfig,
    metrics: &AgentMetrics,
    view: &admin_view::TopologyView,
) -> Result<(Vec<SegmentPlan>, NodeSummary), RunError> {
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

    // DRAM tier. A persistent tier's files from the last run hold memory the tier takes again.
    let placement = placement::plan(
        &persist::credit_kept(&topo, cfg.dram.persistence.as_ref()),
        &PlacementRequest {
            capacity: cfg.dram.capacity,
            policy: cfg.dram.policy.clone(),
            hugepage_size: cfg.dram.hugepage_size,
            max_segment: cfg.dram.max_segment,
        },
    )
    .map_err(RunError::Placement)?;
    view.set(topo, summary.clone());
    for w in &placement.warnings {
        tracing::warn!("DRAM placement: {w}");
    }
    Ok((placement.segments, summary))
}

/// Prepare the staging directory (removing files of a previous run) and bind the socket.
fn bind_engine_api(cfg: &AgentConfig) -> Result<(UnixListener, PathBuf), RunError> {
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
    api_server::bind_for_group(&cfg.api.socket_dir, cfg.api.client_group).map_err(RunError::Api)
}

/// Close sessions of engines that went away without closing them, until `stop`.
fn spawn_reaper(
    service: EngineService,
    idle: std::time::Duration,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval((idle / 4).max(std::time::Duration::from_secs(1)));
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => { service.reap_idle(idle); }
            }
        }
    })
}
