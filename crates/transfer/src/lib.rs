//! Transfer engine: moves bytes between registered memory segments on any two nodes, over TCP
//! (always), same-node shared memory, or RDMA (cargo feature `rdma`). The agent registers and
//! serves its DRAM-tier segments; the master hands out [`SegmentDescriptor`]s through a
//! [`Directory`]; clients open remote segments and submit batches of READ/WRITE requests.
//! I/O boundary: the transports' sockets (see `tcp`, `server`, `shm`) and memory mapping
//! (`memory`; with `rdma::verbs` and `cuda` the only modules with `unsafe`). Framing, auth proofs, batching and the RDMA
//! planning logic are pure and unit-tested.
//!
//! See docs/transfer.md for the API contract, the wire protocol and the threading model.

pub mod auth;
mod batch;
pub mod descriptor;
mod error;
pub mod frame;
pub mod memory;
pub mod metrics;
pub mod rdma;
mod server;
mod shm;
mod tcp;
pub mod wire;

#[cfg(feature = "cuda")]
pub mod cuda;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

pub use auth::{AuthError, AuthKey};
pub use batch::{Batch, BatchFailed, RequestStatus, TransferOp};
pub use descriptor::{
    Directory, DirectoryError, Endpoint, MemoryKind, NicDescriptor, Protocol, SegmentDescriptor,
    StaticDirectory,
};
pub use error::{Failure, TransferError};
pub use memory::{HostOptions, MemoryError, Segment};
pub use metrics::TransferMetrics;
pub use server::{Notification, TcpServer};
pub use shm::ShmServer;

use batch::BatchBuilder;
use rdma::datapath::{ChannelConfig, RdmaChannel, TcpFallback};
pub use rdma::{RdmaError, RdmaProvider};

/// Attempts of one RDMA slice (first post plus retries on other NICs) before it goes to TCP.
const RDMA_ATTEMPTS: u32 = 3;
use server::{NotificationQueue, Registry, ServerCtx};
use tcp::{LaneConfig, Peer, Slice, SliceKind};

/// Engine settings. `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Name of this node; segments whose descriptor names the same node are reached through
    /// shared memory when possible.
    pub node: String,
    /// TCP connections (lanes) per peer.
    pub lanes: usize,
    /// Requests larger than this are cut into slices spread over the lanes.
    pub slice_size: u64,
    /// Largest data frame accepted from a peer (target side); at least `slice_size`.
    pub max_slice: u64,
    /// Slices in flight per lane (pipelining depth).
    pub window: usize,
    /// Every wait on a peer (reply, payload, handshake) gives up after this long.
    pub timeout: Duration,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Reach same-node segments through shared memory.
    pub prefer_shm: bool,
    /// Want RDMA: when no RDMA path works the engine falls back to TCP, loudly.
    pub want_rdma: bool,
    /// Notifications kept until read.
    pub notification_capacity: usize,
    /// Target side: connections served at once; more are accepted and closed at once.
    pub max_connections: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            node: std::env::var("KVPOOL_NODE_NAME")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| "localhost".into()),
            lanes: 4,
            slice_size: 4 * 1024 * 1024,
            max_slice: frame::DEFAULT_MAX_SLICE,
            window: 8,
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            prefer_shm: true,
            want_rdma: false,
            notification_capacity: 4096,
            max_connections: 1024,
        }
    }
}

impl EngineConfig {
    fn validate(&self) -> Result<(), TransferError> {
        let bad = |m: &str| Err(TransferError::Config(m.to_owned()));
        if self.lanes == 0 || self.lanes > 64 {
            return bad("lanes must be between 1 and 64");
        }
        if self.slice_size == 0 || self.slice_size > self.max_slice {
            return bad("slice_size must be > 0 and <= max_slice");
        }
        if self.max_slice > (1 << 30) {
            return bad("max_slice must be <= 1 GiB");
        }
        if self.window == 0 || self.window > 1024 {
            return bad("window must be between 1 and 1024");
        }
        if self.max_connections == 0 {
            return bad("max_connections must be > 0");
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be > 0");
        }
        Ok(())
    }
}

struct Inner {
    config: EngineConfig,
    key: AuthKey,
    directory: Arc<dyn Directory>,
    registry: Arc<Registry>,
    peers: Mutex<HashMap<SocketAddr, Arc<Peer>>>,
    notifications: Arc<NotificationQueue>,
    metrics: TransferMetrics,
    lane_cfg: LaneConfig,
    fallback_active: Arc<AtomicBool>,
    /// RDMA devices of this host (both directions), when RDMA is wanted and available.
    rdma: Option<Arc<dyn RdmaProvider>>,
    /// Why RDMA was last given up for TCP (see [`TransferEngine::transport_status`]).
    fallback_reason: Arc<Mutex<Option<String>>>,
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

/// A segment registered with the engine. Clones share the registration; when the last clone
/// drops the segment is unregistered (peers can no longer open or address it). The memory
/// itself lives until transfers still using it finish.
#[derive(Clone, Debug)]
pub struct LocalSegment {
    reg: Arc<Registration>,
}

#[derive(Debug)]
struct Registration {
    name: String,
    handle: u32,
    segment: Arc<Segment>,
    registry: std::sync::Weak<Registry>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            r.remove(self.handle);
        }
    }
}

impl LocalSegment {
    pub fn name(&self) -> &str {
        &self.reg.name
    }
    pub fn segment(&self) -> &Arc<Segment> {
        &self.reg.segment
    }
    pub fn len(&self) -> u64 {
        self.reg.segment.len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.reg.segment.is_empty()
    }
}

#[derive(Clone)]
enum Route {
    Tcp(Arc<Peer>),
    Shm(Arc<Segment>),
    /// RDMA queue pairs to the segment, with the TCP lanes for notify and fallback.
    Rdma {
        tcp: Arc<Peer>,
        channel: Arc<RdmaChannel>,
    },
}

/// An opened remote segment. Clones share the underlying connections.
#[derive(Clone)]
pub struct RemoteSegment {
    name: Arc<str>,
    size: u64,
    handle: u32,
    route: Route,
}

impl std::fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("protocol", &self.protocol())
            .finish()
    }
}

impl RemoteSegment {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn len(&self) -> u64 {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    /// The transport this handle moves bytes with.
    pub fn protocol(&self) -> Protocol {
        match self.route {
            Route::Tcp(_) => Protocol::Tcp,
            Route::Shm(_) => Protocol::Shm,
            Route::Rdma { .. } => Protocol::Rdma,
        }
    }

    /// Local RDMA devices carrying this segment's transfers (empty unless it moves over RDMA).
    pub fn rdma_devices(&self) -> Vec<String> {
        match &self.route {
            Route::Rdma { channel, .. } => channel.devices(),
            _ => Vec::new(),
        }
    }

    /// Slices of this segment's transfers that were retried on another NIC.
    pub fn rdma_retries(&self) -> u64 {
        match &self.route {
            Route::Rdma { channel, .. } => channel.retries(),
            _ => 0,
        }
    }
}

/// One READ or WRITE of a batch.
#[derive(Clone, Debug)]
pub struct TransferRequest {
    pub op: TransferOp,
    pub local: LocalSegment,
    pub local_offset: u64,
    pub remote: RemoteSegment,
    pub remote_offset: u64,
    pub len: u64,
}

impl TransferEngine {
    /// Create an engine. Metrics come from the caller's registry ([`TransferMetrics::new`]).
    /// With `want_rdma`, the host's RDMA devices are discovered (`rdma::default_provider`);
    /// when there are none the engine still starts and falls back to TCP, loudly.
    pub fn new(
        config: EngineConfig,
        key: AuthKey,
        directory: Arc<dyn Directory>,
        metrics: TransferMetrics,
    ) -> Result<Self, TransferError> {
        let mut unavailable = None;
        let rdma = if config.want_rdma {
            match rdma::default_provider() {
                Ok(p) => Some(p),
                Err(e) => {
                    let reason = tcp::error_chain(&e);
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
        let lane_cfg = LaneConfig {
            key: key.clone(),
            timeout: config.timeout,
            connect_timeout: config.connect_timeout,
            window: config.window,
            max_slice: config.max_slice,
            metrics: metrics.clone(),
        };
        Ok(TransferEngine {
            inner: Arc::new(Inner {
                notifications: Arc::new(NotificationQueue::new(config.notification_capacity)),
                config,
                key,
                directory,
                registry: Arc::new(Registry::default()),
                peers: Mutex::new(HashMap::new()),
                metrics,
                lane_cfg,
                fallback_active: Arc::new(AtomicBool::new(false)),
                rdma,
                fallback_reason: Arc::new(Mutex::new(None)),
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
        Ok(LocalSegment {
            reg: Arc::new(Registration {
                name: name.to_owned(),
                handle,
                segment,
                registry: Arc::downgrade(&self.inner.registry),
            }),
        })
    }

    /// The descriptor of a local segment, to publish in the directory.
    pub fn describe(&self, seg: &LocalSegment, endpoints: Vec<Endpoint>) -> SegmentDescriptor {
        SegmentDescriptor {
            name: seg.name().to_owned(),
            node: self.inner.config.node.clone(),
            size: seg.len(),
            numa_node: None,
            memory: MemoryKind::Host,
            endpoints,
            nics: Vec::new(),
        }
    }

    fn server_ctx(&self) -> Arc<ServerCtx> {
        Arc::new(ServerCtx {
            registry: self.inner.registry.clone(),
            key: self.inner.key.clone(),
            max_slice: self.inner.config.max_slice,
            timeout: self.inner.config.timeout,
            max_connections: self.inner.config.max_connections,
            notifications: self.inner.notifications.clone(),
            metrics: self.inner.metrics.clone(),
            rdma: self.inner.rdma.clone(),
        })
    }

    /// Serve registered segments over TCP on `addr` (port 0 picks one).
    pub fn listen_tcp(&self, addr: SocketAddr) -> Result<TcpServer, TransferError> {
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

    /// Open a remote segment by name through the directory, choosing the transport.
    pub fn open(&self, name: &str) -> Result<RemoteSegment, TransferError> {
        let desc = self
            .inner
            .directory
            .lookup(name)
            .map_err(|source| TransferError::Lookup {
                name: name.to_owned(),
                source,
            })?;
        self.open_descriptor(&desc, None)
    }

    /// Open a segment from its descriptor; `protocol` forces a transport (else: shared memory
    /// for same-node segments, RDMA when wanted and available, TCP otherwise).
    pub fn open_descriptor(
        &self,
        desc: &SegmentDescriptor,
        protocol: Option<Protocol>,
    ) -> Result<RemoteSegment, TransferError> {
        let cfg = &self.inner.config;
        let same_node = desc.node == cfg.node;
        match protocol {
            Some(Protocol::Shm) => return self.open_shm(desc),
            Some(Protocol::Tcp) => return self.open_tcp(desc),
            Some(Protocol::Rdma) if self.inner.rdma.is_none() => {
                return Err(TransferError::Unsupported(Protocol::Rdma));
            }
            Some(Protocol::Rdma) | None => {}
        }
        let rdma_wanted = cfg.want_rdma || protocol == Some(Protocol::Rdma);
        if protocol.is_none() && same_node && cfg.prefer_shm && desc.shm_endpoint().is_some() {
            match self.open_shm(desc) {
                Ok(r) => return Ok(r),
                Err(e) => tracing::warn!(
                    segment = %desc.name,
                    error = %tcp::error_chain(&e),
                    "same-node shared memory unavailable, using TCP"
                ),
            }
        }
        let tcp = self.open_tcp(desc)?;
        if !rdma_wanted {
            return Ok(tcp);
        }
        let Some(provider) = self.inner.rdma.clone() else {
            self.note_fallback(&desc.name, "no RDMA device on this host");
            return Ok(tcp);
        };
        let Route::Tcp(peer) = &tcp.route else {
            return Ok(tcp);
        };
        match self.connect_rdma(provider.as_ref(), desc, peer, &tcp) {
            Ok(channel) => Ok(RemoteSegment {
                route: Route::Rdma {
                    tcp: peer.clone(),
                    channel: Arc::new(channel),
                },
                ..tcp
            }),
            Err(e) => {
                self.note_fallback(&desc.name, &tcp::error_chain(&e));
                Ok(tcp)
            }
        }
    }

    fn connect_rdma(
        &self,
        provider: &dyn RdmaProvider,
        desc: &SegmentDescriptor,
        peer: &Arc<Peer>,
        tcp: &RemoteSegment,
    ) -> Result<RdmaChannel, RdmaError> {
        let cfg = &self.inner.config;
        let metrics = self.inner.metrics.clone();
        let flag = self.inner.fallback_active.clone();
        let last_reason = self.inner.fallback_reason.clone();
        let segment = desc.name.clone();
        let on_fallback: Arc<dyn Fn(&str) + Send + Sync> = Arc::new(move |reason: &str| {
            tracing::warn!(%segment, %reason, "RDMA slice falling back to TCP");
            metrics.fallback.inc();
            flag.store(true, Ordering::SeqCst);
            *last_reason.lock() = Some(format!("{segment}: {reason}"));
        });
        RdmaChannel::connect(
            provider,
            &ChannelConfig {
                peer: peer.addr(),
                key: self.inner.key.clone(),
                timeout: cfg.timeout,
                connect_timeout: cfg.connect_timeout,
                slice_size: cfg.slice_size,
                max_attempts: RDMA_ATTEMPTS,
                retry_metric: self.inner.metrics.rdma_retries.clone(),
            },
            &desc.name,
            tcp.size,
            Some(TcpFallback {
                peer: peer.clone(),
                handle: tcp.handle,
                on_fallback,
            }),
        )
    }

    fn note_fallback(&self, segment: &str, reason: &str) {
        tracing::warn!(%segment, %reason, "falling back from RDMA to TCP");
        self.inner.metrics.fallback.inc();
        self.inner.fallback_active.store(true, Ordering::SeqCst);
        *self.inner.fallback_reason.lock() = Some(format!("{segment}: {reason}"));
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

    fn open_shm(&self, desc: &SegmentDescriptor) -> Result<RemoteSegment, TransferError> {
        let path = desc
            .shm_endpoint()
            .ok_or_else(|| TransferError::NoEndpoint {
                name: desc.name.clone(),
                protocol: Protocol::Shm,
            })?;
        let seg = shm::open_shared(path, &desc.name, &self.inner.key, self.inner.config.timeout)?;
        Ok(RemoteSegment {
            name: desc.name.as_str().into(),
            size: seg.len() as u64,
            handle: 0,
            route: Route::Shm(Arc::new(seg)),
        })
    }

    fn peer(&self, addr: SocketAddr) -> Arc<Peer> {
        self.inner
            .peers
            .lock()
            .entry(addr)
            .or_insert_with(|| {
                Arc::new(Peer::new(
                    addr,
                    self.inner.config.lanes,
                    self.inner.lane_cfg.clone(),
                ))
            })
            .clone()
    }

    fn open_tcp(&self, desc: &SegmentDescriptor) -> Result<RemoteSegment, TransferError> {
        let addr = desc
            .tcp_endpoint()
            .ok_or_else(|| TransferError::NoEndpoint {
                name: desc.name.clone(),
                protocol: Protocol::Tcp,
            })?;
        let peer = self.peer(addr);
        peer.connect_first()?;
        let reply = self
            .control(&peer, Opcode::Open, desc.name.as_bytes().to_vec())
            .map_err(|f| TransferError::Open {
                name: desc.name.clone(),
                reason: f.to_string(),
            })?;
        Ok(RemoteSegment {
            name: desc.name.as_str().into(),
            size: reply.length,
            handle: reply.handle,
            route: Route::Tcp(peer),
        })
    }

    /// Send a control request on lane 0 and wait for its reply header.
    fn control(
        &self,
        peer: &Peer,
        opcode: Opcode,
        payload: Vec<u8>,
    ) -> Result<frame::Header, Failure> {
        let mut b = BatchBuilder::new(1, self.inner.metrics.clone());
        let req = b.request("tcp", "control", 0, 1);
        let batch = b.finish();
        let reply = Arc::new(Mutex::new(None));
        peer.dispatch_on(
            0,
            Slice {
                req: Some(req),
                kind: SliceKind::Control {
                    opcode,
                    payload,
                    reply: reply.clone(),
                },
                local: None,
                local_offset: 0,
                handle: 0,
                remote_offset: 0,
                len: 0,
            },
        );
        batch
            .wait_ok(self.inner.config.timeout + self.inner.config.connect_timeout)
            .map_err(|e| e.failure)?;
        let h = *reply.lock();
        h.ok_or_else(|| Failure::new("protocol", "reply missing"))
    }

    /// Submit a batch. Requests are validated (bounds on both sides) before anything is sent;
    /// an invalid request fails the whole submission. Returns once everything is queued.
    pub fn submit(&self, requests: Vec<TransferRequest>) -> Result<Batch, TransferError> {
        for (index, r) in requests.iter().enumerate() {
            let invalid = |source| TransferError::InvalidRequest { index, source };
            r.local
                .segment()
                .check_range(r.local_offset, r.len)
                .map_err(invalid)?;
            if r.remote_offset
                .checked_add(r.len)
                .is_none_or(|e| e > r.remote.size)
            {
                return Err(invalid(MemoryError::OutOfBounds {
                    offset: r.remote_offset,
                    len: r.len,
                    size: r.remote.size as usize,
                }));
            }
        }
        let slice_size = self.inner.config.slice_size;
        let mut builder = BatchBuilder::new(requests.len(), self.inner.metrics.clone());
        for r in requests {
            match &r.remote.route {
                Route::Shm(remote) => {
                    let req = builder.request("shm", r.op.as_str(), r.len, 1);
                    let (src, so, dst, dof) = match r.op {
                        TransferOp::Read => (
                            &**remote,
                            r.remote_offset,
                            &**r.local.segment(),
                            r.local_offset,
                        ),
                        TransferOp::Write => (
                            &**r.local.segment(),
                            r.local_offset,
                            &**remote,
                            r.remote_offset,
                        ),
                    };
                    let result = memory::copy_between(src, so, dst, dof, r.len as usize)
                        .map_err(|e| Failure::new(e.category(), e.to_string()));
                    req.slice_done(result);
                }
                Route::Rdma { channel, .. } => {
                    let plan = channel.plan(r.len);
                    let req = builder.request("rdma", r.op.as_str(), r.len, plan.len());
                    channel.submit(
                        &req,
                        plan,
                        r.op,
                        r.local.segment(),
                        r.local_offset,
                        r.remote_offset,
                    );
                }
                Route::Tcp(peer) => {
                    let n = r.len.div_ceil(slice_size).max(1);
                    let req = builder.request("tcp", r.op.as_str(), r.len, n as usize);
                    for i in 0..n {
                        let off = i * slice_size;
                        let len = slice_size.min(r.len - off);
                        peer.dispatch(Slice {
                            req: Some(req.clone()),
                            kind: match r.op {
                                TransferOp::Read => SliceKind::Read,
                                TransferOp::Write => SliceKind::Write,
                            },
                            local: Some(r.local.segment().clone()),
                            local_offset: r.local_offset + off,
                            handle: r.remote.handle,
                            remote_offset: r.remote_offset + off,
                            len,
                        });
                    }
                }
            }
        }
        Ok(builder.finish())
    }

    /// Submit and wait for a batch, failing on the first failed request.
    pub fn transfer(&self, requests: Vec<TransferRequest>) -> Result<(), BatchFailed> {
        let batch = self.submit(requests).map_err(|e| BatchFailed {
            index: None,
            failure: Failure::new(e.category(), tcp::error_chain(&e)),
        })?;
        // Each slice is bounded by the per-connection timeout; this outer bound only guards
        // against a bug: it is generous on purpose.
        batch.wait_ok(self.inner.config.timeout * 4 + self.inner.config.connect_timeout)
    }

    /// Send a small message (at most 64 KiB) to the owner of `remote`; returns once the peer
    /// queued it.
    pub fn notify(&self, remote: &RemoteSegment, payload: &[u8]) -> Result<(), TransferError> {
        let (Route::Tcp(peer) | Route::Rdma { tcp: peer, .. }) = &remote.route else {
            return Err(TransferError::Notify {
                peer: remote.name.to_string(),
                reason: "notify needs a TCP route; open the segment with Protocol::Tcp".into(),
            });
        };
        if payload.len() as u64 > frame::MAX_CONTROL_PAYLOAD {
            return Err(TransferError::Notify {
                peer: peer.addr().to_string(),
                reason: format!("message of {} bytes exceeds 64 KiB", payload.len()),
            });
        }
        self.control(peer, Opcode::Notify, payload.to_vec())
            .map(|_| ())
            .map_err(|f| TransferError::Notify {
                peer: peer.addr().to_string(),
                reason: f.to_string(),
            })
    }

    /// Take the oldest received notification, waiting up to `timeout`.
    pub fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        self.inner.notifications.pop(timeout)
    }

    /// Close every initiator connection (they reopen on next use).
    pub fn close_connections(&self) {
        let peers: Vec<_> = self.inner.peers.lock().drain().map(|(_, p)| p).collect();
        for p in peers {
            p.close();
        }
    }

    /// Default path of the shared-memory socket for a node-local agent.
    pub fn default_shm_path() -> PathBuf {
        PathBuf::from("/run/kvpool/transfer.sock")
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, p) in self.peers.lock().drain() {
            p.close();
        }
    }
}

use frame::Opcode;
