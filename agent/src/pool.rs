//! Pool mode: the agent as a member of a kvpool pool. [`PoolRegistrar`] gives every DRAM-tier
//! segment pool memory registered with the transfer engine (served by the agent's
//! authenticated TCP target) and a [`SegmentSpec`] for the master; [`PoolLink`] mounts those
//! specs with the master, heartbeats, remounts after the master declared the node dead, and
//! unmounts on shutdown. I/O boundary: the transfer-engine listener ([`Member::start`]) and the
//! master's gRPC channel ([`PoolLink::run`]); the bookkeeping in [`PoolRegistrar`] is pure.
//!
//! The pool memory is separate from the DRAM tier's own blocks (same size and NUMA node as the
//! tier segment it stands for): the master allocates inside it, the agent's local allocator
//! never does, so the two allocators cannot hand out the same bytes. See docs/agent.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvpool::master::auth::AuthKey as MasterKey;
use kvpool::master::client::{ClientConfig, ClientError, MasterClient};
use kvpool::master::data::{tcp_endpoint, transfer_name};
use kvpool::master::{SegmentSpec, Tier};
use kvpool::transfer::{
    self, EngineConfig, HostOptions, LocalSegment, Segment, StaticDirectory, TcpServer,
    TransferEngine, TransferMetrics,
};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::PoolConfig;
use crate::dram::SegmentInfo;
use crate::registrar::{AnnouncedTier, RegistrarError, SegmentRegistrar};

/// Errors of joining a pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("reading the pool key for the transfer engine")]
    TransferKey(#[source] transfer::AuthError),
    #[error("reading the pool key for the master")]
    MasterKey(#[source] kvpool::master::auth::AuthError),
    #[error("transfer-engine metrics")]
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
        match self {
            PoolError::TransferKey(_) => "transfer_key",
            PoolError::MasterKey(_) => "master_key",
            PoolError::Metrics(_) => "metrics",
            PoolError::Engine(_) => "engine",
            PoolError::Listen { .. } => "listen",
            PoolError::Client(_) => "client",
        }
    }
}

/// Master-side name of the pool segment standing for DRAM-tier segment `index`.
pub fn segment_name(index: u32) -> String {
    format!("dram{index}")
}

/// The spec the master gets for DRAM-tier segment `seg` of `node`.
pub fn spec_for(node: &str, endpoint: &str, seg: &SegmentInfo) -> SegmentSpec {
    SegmentSpec {
        node: node.to_owned(),
        name: segment_name(seg.index),
        tier: Tier::Dram,
        capacity_bytes: seg.bytes,
        numa_node: seg.numa_node,
        failure_domain: String::new(),
        endpoints: vec![endpoint.to_owned()],
    }
}

#[derive(Debug)]
struct Entry {
    /// Keeps the engine registration alive; dropping it unregisters the segment.
    _local: LocalSegment,
    spec: SegmentSpec,
}

#[derive(Debug, Default)]
struct Book {
    /// Registered with the transfer engine, by DRAM-tier segment index.
    segments: BTreeMap<u32, Entry>,
    /// Master segment ids of mounted segments, by DRAM-tier segment index. Kept apart from
    /// `segments` so that a segment deregistered during shutdown is still unmounted.
    mounted: BTreeMap<u32, u32>,
}

/// [`SegmentRegistrar`] of pool mode.
#[derive(Debug)]
pub struct PoolRegistrar {
    engine: TransferEngine,
    node: String,
    endpoint: String,
    book: Mutex<Book>,
    announced: AtomicU64,
}

impl PoolRegistrar {
    /// `endpoint` is the transfer target peers reach this node's segments at.
    pub fn new(engine: TransferEngine, node: String, endpoint: String) -> Self {
        Self {
            engine,
            node,
            endpoint,
            book: Mutex::default(),
            announced: AtomicU64::new(0),
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Registered segments not mounted with the master yet.
    pub fn unmounted(&self) -> Vec<(u32, SegmentSpec)> {
        let book = self.book.lock();
        book.segments
            .iter()
            .filter(|(i, _)| !book.mounted.contains_key(i))
            .map(|(i, e)| (*i, e.spec.clone()))
            .collect()
    }

    /// Record that segment `index` is mounted as master segment `id`.
    pub fn set_mounted(&self, index: u32, id: u32) {
        self.book.lock().mounted.insert(index, id);
    }

    /// Master segment ids currently mounted.
    pub fn mounted(&self) -> Vec<u32> {
        self.book.lock().mounted.values().copied().collect()
    }

    /// Forget every mount (the master no longer knows this node): the next pass remounts.
    pub fn clear_mounted(&self) -> Vec<u32> {
        std::mem::take(&mut self.book.lock().mounted)
            .into_values()
            .collect()
    }

    /// Blocks announced so far (announcing to the master is not implemented yet).
    pub fn announced(&self) -> u64 {
        self.announced.load(Ordering::Relaxed)
    }
}

impl SegmentRegistrar for PoolRegistrar {
    fn register(&self, seg: &SegmentInfo) -> Result<(), RegistrarError> {
        let mut book = self.book.lock();
        if book.segments.contains_key(&seg.index) {
            return Err(RegistrarError::Duplicate(seg.index));
        }
        let len = usize::try_from(seg.bytes).map_err(|_| RegistrarError::Memory {
            index: seg.index,
            source: transfer::MemoryError::InvalidSize {
                size: usize::MAX,
                max: transfer::memory::MAX_SEGMENT_SIZE,
            },
        })?;
        let memory = Segment::host(len, HostOptions::default()).map_err(|source| {
            RegistrarError::Memory {
                index: seg.index,
                source,
            }
        })?;
        let name = transfer_name(&self.node, &segment_name(seg.index));
        let local = self
            .engine
            .register(&name, Arc::new(memory))
            .map_err(|source| RegistrarError::Transfer {
                index: seg.index,
                source,
            })?;
        tracing::info!(segment = %name, bytes = seg.bytes, "pool segment registered");
        book.segments.insert(
            seg.index,
            Entry {
                _local: local,
                spec: spec_for(&self.node, &self.endpoint, seg),
            },
        );
        Ok(())
    }

    fn deregister(&self, index: u32) -> Result<(), RegistrarError> {
        self.book
            .lock()
            .segments
            .remove(&index)
            .map(|_| ())
            .ok_or(RegistrarError::Unknown(index))
    }

    fn announce(&self, keys: &[Vec<u8>], tier: AnnouncedTier) -> Result<(), RegistrarError> {
        // The master has no call to adopt blocks an agent already holds; they stay local.
        tracing::debug!(
            blocks = keys.len(),
            ?tier,
            "block announcement not sent to the master"
        );
        self.announced
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// True when the master answered that it does not know this node (never mounted, or declared
/// dead): the agent must mount its segments again.
pub fn is_unknown_node(e: &ClientError) -> bool {
    match e {
        ClientError::Rpc { source, .. } => source.code() == tonic::Code::NotFound,
        ClientError::Refused { code, .. } => *code == kvpool::master::proto::ErrorCode::UnknownNode,
        _ => false,
    }
}

/// Longest time shutdown spends unmounting (the pod's grace period is typically 30 s).
const UNMOUNT_BUDGET: Duration = Duration::from_secs(10);

/// Mounts, heartbeats and unmounts on behalf of a [`PoolRegistrar`].
#[derive(Clone, Debug)]
pub struct PoolLink {
    client: MasterClient,
    registrar: Arc<PoolRegistrar>,
    interval: Duration,
}

impl PoolLink {
    pub fn new(client: MasterClient, registrar: Arc<PoolRegistrar>, interval: Duration) -> Self {
        Self {
            client,
            registrar,
            interval,
        }
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
        if tokio::time::timeout(UNMOUNT_BUDGET, self.unmount_all())
            .await
            .is_err()
        {
            tracing::warn!(
                "master unreachable while unmounting; it will declare this node dead instead"
            );
        }
    }

    /// One pass: mount, then heartbeat.
    pub async fn step(&self) {
        for (index, spec) in self.registrar.unmounted() {
            match self.client.mount_segment(&spec).await {
                Ok(id) => {
                    tracing::info!(segment = %spec.name, id, "segment mounted with the master");
                    self.registrar.set_mounted(index, id);
                }
                Err(e) => tracing::warn!(segment = %spec.name, error = %e,
                    category = e.category(), "mounting a segment failed; retrying"),
            }
        }
        if self.registrar.mounted().is_empty() {
            return;
        }
        match self.client.heartbeat(self.registrar.node()).await {
            Ok(tasks) => {
                if !tasks.is_empty() {
                    tracing::debug!(
                        tasks = tasks.len(),
                        "master tasks ignored: repair and demotion are not implemented"
                    );
                }
            }
            Err(e) if is_unknown_node(&e) => {
                let lost = self.registrar.clear_mounted();
                tracing::warn!(
                    segments = lost.len(),
                    "the master does not know this node (declared dead?); remounting"
                );
            }
            Err(e) => tracing::warn!(error = %e, category = e.category(), "heartbeat failed"),
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

/// Everything pool mode runs: the transfer engine and its TCP target, the registrar, the link.
pub struct Member {
    pub engine: TransferEngine,
    pub registrar: Arc<PoolRegistrar>,
    pub link: PoolLink,
    /// Serves the registered segments until dropped.
    pub server: TcpServer,
    /// The announced endpoint (`tcp://ip:port`).
    pub endpoint: String,
}

impl Member {
    /// Read the pool key, start the transfer engine and its TCP target, build the master
    /// client (it connects on first use).
    pub fn start(cfg: &PoolConfig, node: &str) -> Result<Self, PoolError> {
        let transfer_key =
            transfer::AuthKey::from_file(&cfg.auth_key_file).map_err(PoolError::TransferKey)?;
        let master_key = MasterKey::from_file(&cfg.auth_key_file).map_err(PoolError::MasterKey)?;
        let engine = TransferEngine::new(
            EngineConfig {
                node: node.to_owned(),
                ..EngineConfig::default()
            },
            transfer_key,
            Arc::new(StaticDirectory::new()),
            TransferMetrics::unregistered().map_err(PoolError::Metrics)?,
        )
        .map_err(PoolError::Engine)?;
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
        let client = MasterClient::new(cfg.masters.clone(), master_key, ClientConfig::default())
            .map_err(PoolError::Client)?;
        let link = PoolLink::new(client, Arc::clone(&registrar), cfg.heartbeat_interval);
        Ok(Self {
            engine,
            registrar,
            link,
            server,
            endpoint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(index: u32, bytes: u64) -> SegmentInfo {
        SegmentInfo {
            index,
            numa_node: 1,
            addr: 0,
            bytes,
            hugepage_size: None,
            numa_bound: false,
            locked: false,
        }
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

    #[test]
    fn specs_name_node_numa_capacity_and_endpoint() {
        let spec = spec_for("n1", "tcp://10.0.0.1:7000", &info(2, 1 << 20));
        assert_eq!(spec.node, "n1");
        assert_eq!(spec.name, "dram2");
        assert_eq!(spec.tier, Tier::Dram);
        assert_eq!(spec.capacity_bytes, 1 << 20);
        assert_eq!(spec.numa_node, 1);
        assert_eq!(spec.endpoints, vec!["tcp://10.0.0.1:7000".to_owned()]);
    }

    #[test]
    fn registrar_tracks_registration_and_mounts() {
        let e = engine("n1");
        let r = PoolRegistrar::new(e.clone(), "n1".into(), "tcp://127.0.0.1:1".into());
        r.register(&info(0, 1 << 16)).expect("register 0");
        r.register(&info(1, 1 << 16)).expect("register 1");
        assert_eq!(
            r.register(&info(1, 1 << 16)).expect_err("dup").category(),
            "duplicate"
        );
        // The engine refuses a second registration under the same name: proof it holds ours.
        let clash = e.register(
            "n1/dram0",
            Arc::new(Segment::host(4096, HostOptions::default()).expect("seg")),
        );
        assert!(clash.is_err());
        let names: Vec<_> = r.unmounted().into_iter().map(|(_, s)| s.name).collect();
        assert_eq!(names, ["dram0", "dram1"]);
        r.set_mounted(0, 17);
        assert_eq!(r.unmounted().len(), 1);
        assert_eq!(r.mounted(), vec![17]);
        // Deregistering releases the engine name but keeps the mount for the unmount pass.
        r.deregister(0).expect("deregister");
        assert_eq!(r.deregister(0).expect_err("gone").category(), "unknown");
        e.register(
            "n1/dram0",
            Arc::new(Segment::host(4096, HostOptions::default()).expect("seg")),
        )
        .expect("name free again");
        assert_eq!(r.clear_mounted(), vec![17]);
        assert!(r.mounted().is_empty());
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
