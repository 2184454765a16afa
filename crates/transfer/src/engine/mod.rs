//! The public [`TransferEngine`]: construction from an [`EngineConfig`], registering and
//! describing local segments, serving them (TCP and shared-memory targets), and what it reports
//! about its transport. Opening remote segments is in `open`, moving bytes in `submit`, the
//! handles it gives out in `handles`, its initiator connections in `peers`.
//! I/O boundary: none here; the servers, lanes and RDMA channels it starts do the I/O.

mod handles;
mod open;
mod peers;
mod submit;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

pub use handles::{LocalSegment, RemoteSegment, TransferRequest};

use crate::auth::AuthKey;
use crate::config::EngineConfig;
use crate::descriptor::{Directory, Endpoint, MemoryKind, SegmentDescriptor};
use crate::error::{TransferError, error_chain};
use crate::frame;
use crate::memory::Segment;
use crate::metrics::TransferMetrics;
use crate::rdma::{self, RdmaProvider};
use crate::server::{
    AdmissionLimits, Notification, NotificationQueue, ReadCheck, Registry, ServerCtx, TcpServer,
};
use crate::shm::ShmServer;
use crate::tcp::{Dialer, LaneConfig};
use peers::Peers;

struct Inner {
    config: EngineConfig,
    key: AuthKey,
    directory: Arc<dyn Directory>,
    registry: Arc<Registry>,
    peers: Peers,
    /// How initiator connections start (lanes and RDMA control connections).
    dialer: Dialer,
    notifications: Arc<NotificationQueue>,
    metrics: TransferMetrics,
    fallback_active: Arc<AtomicBool>,
    /// RDMA devices of this host (both directions), when RDMA is wanted and available.
    rdma: Option<Arc<dyn RdmaProvider>>,
    /// Why RDMA was last given up for TCP (see [`TransferEngine::transport_status`]).
    fallback_reason: Arc<Mutex<Option<String>>>,
    /// Segments opened over TCP, by name and target, for [`TransferEngine::open_cached`].
    opened: Mutex<std::collections::HashMap<(String, SocketAddr), RemoteSegment>>,
    /// The target side's TLS configuration (TLS `allow` or `require` with a certificate).
    tls_server: Option<Arc<rustls::ServerConfig>>,
}

/// The transfer engine. Cheap to clone (shared state); dropping the last clone closes all
/// initiator connections.
#[derive(Clone)]
pub struct TransferEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("node", &self.inner.config.node)
            .finish()
    }
}

impl TransferEngine {
    /// Create an engine. Metrics come from the caller's registry ([`TransferMetrics::new`]).
    /// With `want_rdma`, the host's RDMA devices are discovered and chosen by
    /// `config.rdma_nics` (`rdma::default_provider`);
    /// when there are none the engine still starts and falls back to TCP, loudly.
    pub fn new(
        config: EngineConfig,
        key: AuthKey,
        directory: Arc<dyn Directory>,
        metrics: TransferMetrics,
    ) -> Result<Self, TransferError> {
        let mut unavailable = None;
        let rdma = if config.want_rdma {
            match rdma::default_provider(&config.sysfs_root, &config.rdma_nics) {
                Ok(p) => Some(p),
                Err(e) => {
                    let reason = error_chain(&e);
                    tracing::warn!(error = %reason, "RDMA wanted but unavailable; transfers will use TCP");
                    unavailable = Some(reason);
                    None
                }
            }
        } else {
            None
        };
        let engine = Self::new_with_rdma(config, key, directory, metrics, rdma)?;
        *engine.inner.fallback_reason.lock() = unavailable;
        Ok(engine)
    }

    /// Create an engine that uses `rdma` as its RDMA devices, for both serving RDMA_CONNECT and
    /// opening segments over RDMA (`want_rdma` or `Protocol::Rdma`). Tests pass a
    /// [`rdma::fake::FakeFabric`] provider here.
    pub fn new_with_rdma(
        config: EngineConfig,
        key: AuthKey,
        directory: Arc<dyn Directory>,
        metrics: TransferMetrics,
        rdma: Option<Arc<dyn RdmaProvider>>,
    ) -> Result<Self, TransferError> {
        config.validate()?;
        let tls = config.tls.load()?;
        let dialer = Dialer {
            key: key.clone(),
            timeout: config.timeout,
            connect_timeout: config.connect_timeout,
            integrity: config.integrity,
            tls: tls.client,
        };
        let lane_cfg = LaneConfig {
            dialer: dialer.clone(),
            window: config.window,
            max_slice: config.max_slice,
            spin_wait: config.spin_wait,
            metrics: metrics.clone(),
        };
        Ok(TransferEngine {
            inner: Arc::new(Inner {
                notifications: Arc::new(NotificationQueue::new(config.notification_capacity)),
                peers: Peers::new(config.lanes, lane_cfg),
                dialer,
                config,
                key,
                directory,
                registry: Arc::new(Registry::default()),
                metrics,
                fallback_active: Arc::new(AtomicBool::new(false)),
                rdma,
                fallback_reason: Arc::new(Mutex::new(None)),
                opened: Mutex::default(),
                tls_server: tls.server,
            }),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn metrics(&self) -> &TransferMetrics {
        &self.inner.metrics
    }

    /// Register `segment` under a pool-wide unique `name`.
    pub fn register(
        &self,
        name: &str,
        segment: Arc<Segment>,
    ) -> Result<LocalSegment, TransferError> {
        let handle = self
            .inner
            .registry
            .insert(name, segment.clone())
            .ok_or_else(|| TransferError::Duplicate(name.to_owned()))?;
        Ok(LocalSegment::new(
            name,
            handle,
            segment,
            Arc::downgrade(&self.inner.registry),
        ))
    }

    /// Check every READ that peers send for `seg` with `check` before serving it (a refused
    /// read is answered with an ERROR frame). A checked segment is not offered to one-sided
    /// RDMA, which would bypass the check: peers reach it over TCP.
    pub fn set_read_check(&self, seg: &LocalSegment, check: ReadCheck) {
        self.inner.registry.set_read_check(seg.handle(), check);
    }

    /// The descriptor of a local segment, to publish in the directory: its NUMA node, whether
    /// it is a GPU's memory, and the RDMA NICs that serve it (those on its NUMA node, or all
    /// of this engine's NICs when the node is unknown or has none; the same choice the target
    /// side of the RDMA handshake makes).
    pub fn describe(&self, seg: &LocalSegment, endpoints: Vec<Endpoint>) -> SegmentDescriptor {
        let segment = seg.segment();
        let gpu_device = segment.gpu_device();
        SegmentDescriptor {
            name: seg.name().to_owned(),
            node: self.inner.config.node.clone(),
            size: seg.len(),
            numa_node: segment.numa_node(),
            memory: if gpu_device.is_some() {
                MemoryKind::Gpu
            } else {
                MemoryKind::Host
            },
            gpu_device,
            endpoints,
            nics: self
                .inner
                .rdma
                .as_deref()
                .map(|p| rdma::datapath::segment_nics(p, segment.numa_node()))
                .unwrap_or_default(),
        }
    }

    fn server_ctx(&self) -> Arc<ServerCtx> {
        Arc::new(ServerCtx {
            registry: self.inner.registry.clone(),
            key: self.inner.key.clone(),
            max_slice: self.inner.config.max_slice,
            timeout: self.inner.config.timeout,
            handshake_timeout: self.inner.config.handshake_timeout,
            limits: AdmissionLimits {
                max_connections: self.inner.config.max_connections,
                max_per_source: self.inner.config.max_connections_per_source,
                max_handshakes: self.inner.config.max_handshakes,
            },
            notifications: self.inner.notifications.clone(),
            metrics: self.inner.metrics.clone(),
            rdma: self.inner.rdma.clone(),
            integrity: self.inner.config.integrity,
            tls: self.inner.config.tls.mode,
            tls_server: self.inner.tls_server.clone(),
            features: if self.inner.config.vectored {
                frame::FEATURES
            } else {
                0
            },
        })
    }

    /// Serve registered segments over TCP on `addr` (port 0 picks one).
    pub fn listen_tcp(&self, addr: SocketAddr) -> Result<TcpServer, TransferError> {
        if self.inner.config.tls.mode != crate::TlsMode::Off && self.inner.tls_server.is_none() {
            return Err(TransferError::Config(format!(
                "transfer TLS {}: serving needs a certificate and a key (cert_file, key_file)",
                self.inner.config.tls.mode.as_str()
            )));
        }
        TcpServer::start(addr, self.server_ctx())
    }

    /// Serve memfd-backed segments to same-node peers on a Unix socket at `path`.
    pub fn listen_shm(&self, path: &Path) -> Result<ShmServer, TransferError> {
        ShmServer::start(
            path,
            self.inner.registry.clone(),
            self.inner.key.clone(),
            self.inner.config.timeout,
        )
    }

    /// What this engine reports about its transport (the agent sends it to the master with
    /// its heartbeat): RDMA wanted, fallen back to TCP (a fallback event, or RDMA wanted with
    /// no device at all), why, and the RDMA devices it opened.
    pub fn transport_status(&self) -> rdma::TransportStatus {
        let cfg = &self.inner.config;
        let devices = self
            .inner
            .rdma
            .as_ref()
            .map(|p| p.devices().iter().map(|d| d.name().to_owned()).collect())
            .unwrap_or_default();
        rdma::TransportStatus::new(
            cfg.want_rdma,
            self.inner.rdma.is_some(),
            self.fallback_active(),
            self.inner.fallback_reason.lock().clone(),
            devices,
        )
    }

    /// True once RDMA was wanted but a peer or a slice had to use TCP (no device, a peer that
    /// cannot do RDMA, every NIC failed). Each such event also logs a warning and increments
    /// `kvpool_transfer_fallback_total`. The agent surfaces it as a condition.
    pub fn fallback_active(&self) -> bool {
        self.inner.fallback_active.load(Ordering::SeqCst)
    }

    /// Alias of [`Self::fallback_active`].
    pub fn rdma_fallback(&self) -> bool {
        self.fallback_active()
    }

    /// Whether this engine has RDMA devices to move data with.
    pub fn rdma_available(&self) -> bool {
        self.inner.rdma.is_some()
    }

    /// Take the oldest received notification, waiting up to `timeout`.
    pub fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        self.inner.notifications.pop(timeout)
    }

    /// Close every initiator connection (they reopen on next use).
    pub fn close_connections(&self) {
        self.inner.peers.close_all();
    }

    /// Default path of the shared-memory socket for a node-local agent.
    pub fn default_shm_path() -> PathBuf {
        PathBuf::from("/run/kvpool/transfer.sock")
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.peers.close_all();
    }
}
