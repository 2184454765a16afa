//! RDMA data path of the engine: the narrow verbs interface ([`RdmaProvider`], [`RdmaDevice`],
//! [`QueuePairOps`]) that the libibverbs binding and the test fabric implement, the queue-pair
//! handshake on an authenticated TCP control connection (initiator and target side), and the
//! channel that stripes a request's slices over several NICs, posts signalled one-sided
//! WRITE/READ work requests, maps completions back to requests and slices from a poller thread,
//! retries a failed slice on another NIC and hands it to TCP (loudly) when no NIC is left.
//! I/O boundary: the control `TcpStream` and the calls through the verbs traits.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::address::{AddressError, PortAttr};
use super::handshake::{ConnectReply, ConnectRequest, HandshakeError, QpInfo, RegionInfo};
use super::plan::{self, Failover, Next, PlannedSlice};
use crate::auth::AuthKey;
use crate::batch::{RequestState, TransferOp};
use crate::error::Failure;
use crate::frame::{self, ErrorCode, Header, Opcode};
use crate::memory::Segment;
use crate::tcp::{Peer, Slice, SliceKind};
use crate::wire::{self, WireError};

/// Errors of the RDMA data path.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RdmaError {
    #[error("no usable RDMA device on this host")]
    NoDevice,
    #[error("{call} on RDMA device {device} failed")]
    Verbs {
        device: String,
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("invalid RDMA handshake payload")]
    Handshake(#[source] HandshakeError),
    #[error("{peer} does not serve RDMA: {reason}")]
    PeerUnsupported { peer: String, reason: String },
    #[error("RDMA control connection to {peer} failed")]
    Control {
        peer: String,
        #[source]
        source: WireError,
    },
    #[error("connecting to {peer} for the RDMA handshake failed")]
    Connect {
        peer: String,
        #[source]
        source: io::Error,
    },
    #[error("RDMA handshake with {peer} is inconsistent: {reason}")]
    Mismatch { peer: String, reason: String },
    #[error("RDMA device {device} cannot address its peer")]
    Address {
        device: String,
        #[source]
        source: AddressError,
    },
}

impl RdmaError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// A verbs call failure with a plain message (for implementations without an errno).
    pub fn verbs(device: &str, call: &'static str, reason: impl Into<String>) -> Self {
        RdmaError::Verbs {
            device: device.to_owned(),
            call,
            source: io::Error::other(reason.into()),
        }
    }
}

/// One-sided operation of a work request, seen from the poster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    /// Local memory -> remote memory.
    Write,
    /// Remote memory -> local memory.
    Read,
}

/// One signalled RDMA WRITE or READ between registered local memory and a remote region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    pub wr_id: u64,
    pub op: RdmaOp,
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A polled work completion: the work request id and `Err(verbs status string)` on failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub result: Result<(), String>,
}

/// The RDMA devices this process may use, best first (see `topology::rank_nics`).
pub trait RdmaProvider: Send + Sync {
    fn devices(&self) -> Vec<Arc<dyn RdmaDevice>>;
}

/// One opened device (context + protection domain) on one port.
pub trait RdmaDevice: Send + Sync {
    fn name(&self) -> &str;
    /// The port's link layer, LID and source GID (`ibv_query_port`, `ibv_query_gid`): queue
    /// pairs announce the LID and GID in the handshake and address the peer from them.
    fn port(&self) -> Result<PortAttr, RdmaError>;
    /// Register a segment for local and remote access. The registration keeps the segment
    /// alive until it is dropped.
    fn register(&self, segment: &Arc<Segment>) -> Result<Arc<dyn MemoryKeys>, RdmaError>;
    /// Create an RC queue pair (with its completion queue) in state INIT.
    fn create_qp(&self) -> Result<Arc<dyn QueuePairOps>, RdmaError>;
}

/// Keys and range of a registered segment.
pub trait MemoryKeys: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn addr(&self) -> u64;
    /// Length of the registered range in bytes.
    fn size(&self) -> u64;
}

/// An RC queue pair.
pub trait QueuePairOps: Send + Sync {
    /// What the peer needs to connect to this queue pair (fixed at creation).
    fn info(&self) -> QpInfo;
    /// Move to RTR then RTS towards `remote`, addressed by `address::address_for` (LID on
    /// InfiniBand, GID on RoCE).
    fn connect(&self, remote: &QpInfo) -> Result<(), RdmaError>;
    /// Post one signalled work request.
    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError>;
    /// Append up to `max` completions to `out`.
    fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<(), RdmaError>;
}

/// What the target keeps alive for one accepted handshake: its queue pairs and registrations.
pub(crate) struct AcceptedPaths {
    _qps: Vec<Arc<dyn QueuePairOps>>,
    _regions: Vec<Arc<dyn MemoryKeys>>,
}

/// Target side of RDMA_CONNECT: one queue pair per requested path (on the local devices, round
/// robin), connected to the initiator's, and the segment registered on each device used.
pub(crate) fn accept(
    provider: &dyn RdmaProvider,
    segment: &Arc<Segment>,
    req: &ConnectRequest,
) -> Result<(ConnectReply, AcceptedPaths), RdmaError> {
    let devices = provider.devices();
    if devices.is_empty() {
        return Err(RdmaError::NoDevice);
    }
    let mut regions: HashMap<usize, Arc<dyn MemoryKeys>> = HashMap::new();
    let mut qps = Vec::with_capacity(req.qps.len());
    let mut paths = Vec::with_capacity(req.qps.len());
    for (i, remote) in req.qps.iter().enumerate() {
        let d = i % devices.len();
        let Some(dev) = devices.get(d) else {
            return Err(RdmaError::NoDevice);
        };
        let mr = match regions.get(&d) {
            Some(mr) => mr.clone(),
            None => {
                let mr = dev.register(segment)?;
                regions.insert(d, mr.clone());
                mr
            }
        };
        let qp = dev.create_qp()?;
        qp.connect(remote)?;
        paths.push((
            qp.info(),
            RegionInfo {
                addr: mr.addr(),
                rkey: mr.rkey(),
                len: mr.size(),
            },
        ));
        qps.push(qp);
    }
    Ok((
        ConnectReply { paths },
        AcceptedPaths {
            _qps: qps,
            _regions: regions.into_values().collect(),
        },
    ))
}

/// How slices that no NIC can carry reach TCP.
pub(crate) struct TcpFallback {
    pub(crate) peer: Arc<Peer>,
    pub(crate) handle: u32,
    /// Called once per slice moved to TCP, with the reason (warn, count, raise the flag).
    pub(crate) on_fallback: Arc<dyn Fn(&str) + Send + Sync>,
}

/// Settings of a channel.
pub(crate) struct ChannelConfig {
    pub(crate) peer: SocketAddr,
    pub(crate) key: AuthKey,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) slice_size: u64,
    pub(crate) max_attempts: u32,
    /// Counts slices retried on another NIC (`kvpool_transfer_rdma_retries_total`).
    pub(crate) retry_metric: prometheus::IntCounter,
}

struct Path {
    device: Arc<dyn RdmaDevice>,
    qp: Arc<dyn QueuePairOps>,
    remote: RegionInfo,
    /// Local segments registered with this device, by address (the registration keeps the
    /// segment alive, so an address cannot be reused while it is cached).
    local: Mutex<HashMap<usize, Arc<dyn MemoryKeys>>>,
}

struct Inflight {
    req: Arc<RequestState>,
    op: TransferOp,
    local: Arc<Segment>,
    local_base: u64,
    remote_base: u64,
    slice: PlannedSlice,
    posted_at: Instant,
}

struct Shared {
    peer: String,
    paths: Vec<Path>,
    failover: Mutex<Failover>,
    inflight: Mutex<HashMap<u64, Inflight>>,
    wake: Condvar,
    next_wr: AtomicU64,
    next_nic: AtomicUsize,
    stop: AtomicBool,
    timeout: Duration,
    slice_size: u64,
    tcp: Option<TcpFallback>,
    retries: AtomicU64,
    retry_metric: prometheus::IntCounter,
    /// The control connection: the target keeps its queue pairs while it stays open.
    _control: TcpStream,
}

/// Queue pairs to one remote segment over one or more NIC pairs, with a completion poller.
pub(crate) struct RdmaChannel {
    shared: Arc<Shared>,
    poller: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaChannel")
            .field("peer", &self.shared.peer)
            .field("paths", &self.shared.paths.len())
            .finish()
    }
}

/// Interpret the target's answer to RDMA_CONNECT.
fn read_reply(s: &mut TcpStream, peer: &str) -> Result<ConnectReply, RdmaError> {
    let control = |source| RdmaError::Control {
        peer: peer.to_owned(),
        source,
    };
    let h = wire::read_header(s, frame::DEFAULT_MAX_SLICE, &mut wire::fail_on_timeout)
        .map_err(control)?;
    let payload = wire::read_control_payload(s, &h).map_err(control)?;
    reply_from_frame(&h, &payload, peer)
}

/// Pure part of [`read_reply`]: an RDMA_CONNECT_OK payload, or an ERROR turned into the reason
/// why this peer cannot do RDMA.
pub(crate) fn reply_from_frame(
    h: &Header,
    payload: &[u8],
    peer: &str,
) -> Result<ConnectReply, RdmaError> {
    match h.opcode {
        Opcode::RdmaConnectOk => ConnectReply::decode(payload).map_err(RdmaError::Handshake),
        Opcode::Error => {
            let reason = String::from_utf8_lossy(payload).into_owned();
            let reason = match ErrorCode::from_u32(h.status) {
                // A target built before RDMA_CONNECT existed rejects the opcode as malformed.
                ErrorCode::Malformed => {
                    format!("the target predates RDMA_CONNECT (it answered: {reason})")
                }
                code => format!("{}: {reason}", code.as_str()),
            };
            Err(RdmaError::PeerUnsupported {
                peer: peer.to_owned(),
                reason,
            })
        }
        other => Err(RdmaError::Mismatch {
            peer: peer.to_owned(),
            reason: format!("{other:?} in answer to RDMA_CONNECT"),
        }),
    }
}

impl RdmaChannel {
    /// Initiator side: authenticate a control connection to the target, create one queue pair
    /// per local device, exchange endpoints with RDMA_CONNECT, connect the queue pairs and start
    /// the completion poller. `remote_size` is the segment size from OPEN_OK.
    pub(crate) fn connect(
        provider: &dyn RdmaProvider,
        cfg: &ChannelConfig,
        segment: &str,
        remote_size: u64,
        tcp: Option<TcpFallback>,
    ) -> Result<RdmaChannel, RdmaError> {
        let peer = cfg.peer.to_string();
        let devices: Vec<_> = provider
            .devices()
            .into_iter()
            .take(super::handshake::MAX_QPS)
            .collect();
        if devices.is_empty() {
            return Err(RdmaError::NoDevice);
        }
        let io_err = |source| RdmaError::Connect {
            peer: peer.clone(),
            source,
        };
        let mut s = TcpStream::connect_timeout(&cfg.peer, cfg.connect_timeout).map_err(io_err)?;
        s.set_nodelay(true).map_err(io_err)?;
        s.set_read_timeout(Some(cfg.timeout)).map_err(io_err)?;
        s.set_write_timeout(Some(cfg.timeout)).map_err(io_err)?;
        wire::client_handshake(&mut s, &cfg.key).map_err(|source| RdmaError::Control {
            peer: peer.clone(),
            source,
        })?;
        let qps = devices
            .iter()
            .map(|d| d.create_qp())
            .collect::<Result<Vec<_>, _>>()?;
        let req = ConnectRequest {
            segment: segment.to_owned(),
            qps: qps.iter().map(|q| q.info()).collect(),
        };
        let payload = req.encode().map_err(RdmaError::Handshake)?;
        wire::write_frame(&mut s, &Header::new(Opcode::RdmaConnect, 1), &payload).map_err(
            |source| RdmaError::Control {
                peer: peer.clone(),
                source,
            },
        )?;
        let reply = read_reply(&mut s, &peer)?;
        if reply.paths.len() != qps.len() {
            return Err(RdmaError::Mismatch {
                peer,
                reason: format!(
                    "{} queue pairs offered, {} answered",
                    qps.len(),
                    reply.paths.len()
                ),
            });
        }
        let mut paths = Vec::with_capacity(qps.len());
        for ((device, qp), (remote_qp, region)) in devices.into_iter().zip(qps).zip(reply.paths) {
            if region.len < remote_size {
                return Err(RdmaError::Mismatch {
                    peer,
                    reason: format!(
                        "registered region of {} bytes is smaller than the segment ({remote_size})",
                        region.len
                    ),
                });
            }
            qp.connect(&remote_qp)?;
            paths.push(Path {
                device,
                qp,
                remote: region,
                local: Mutex::new(HashMap::new()),
            });
        }
        // The control connection now only keeps the target's queue pairs alive.
        s.set_read_timeout(None).map_err(io_err)?;
        let nics = paths.len();
        let shared = Arc::new(Shared {
            peer: peer.clone(),
            paths,
            // Every NIC gets a chance before a slice leaves RDMA.
            failover: Mutex::new(Failover::new(
                nics,
                cfg.max_attempts
                    .max(u32::try_from(nics).unwrap_or(u32::MAX)),
                tcp.is_some(),
            )),
            inflight: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            next_wr: AtomicU64::new(1),
            next_nic: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            timeout: cfg.timeout,
            slice_size: cfg.slice_size.clamp(1, u64::from(u32::MAX)),
            tcp,
            retries: AtomicU64::new(0),
            retry_metric: cfg.retry_metric.clone(),
            _control: s,
        });
        let sh = shared.clone();
        let poller = std::thread::Builder::new()
            .name("kvpool-rdma-cq".into())
            .spawn(move || poll_loop(&sh))
            .map_err(io_err)?;
        Ok(RdmaChannel {
            shared,
            poller: Some(poller),
        })
    }

    /// Number of NIC paths of this channel.
    pub(crate) fn nics(&self) -> usize {
        self.shared.paths.len()
    }

    /// Device names of the local NICs, in path order.
    pub(crate) fn devices(&self) -> Vec<String> {
        self.shared
            .paths
            .iter()
            .map(|p| p.device.name().to_owned())
            .collect()
    }

    /// Slices retried on another NIC so far.
    pub(crate) fn retries(&self) -> u64 {
        self.shared.retries.load(Ordering::Relaxed)
    }

    /// Cut a request of `len` bytes into slices striped over the NICs (consecutive requests
    /// start on different NICs).
    pub(crate) fn plan(&self, len: u64) -> Vec<PlannedSlice> {
        let first = self.shared.next_nic.fetch_add(1, Ordering::Relaxed);
        plan::stripe(len, self.shared.slice_size, self.nics(), first)
    }

    /// Post every slice of a request planned by [`Self::plan`]; `req` counts `plan.len()`
    /// slices. Returns once all are posted (completions arrive on the poller thread).
    pub(crate) fn submit(
        &self,
        req: &Arc<RequestState>,
        plan: Vec<PlannedSlice>,
        op: TransferOp,
        local: &Arc<Segment>,
        local_base: u64,
        remote_base: u64,
    ) {
        for slice in plan {
            self.shared.dispatch(Inflight {
                req: req.clone(),
                op,
                local: local.clone(),
                local_base,
                remote_base,
                slice,
                posted_at: Instant::now(),
            });
        }
    }
}

impl Shared {
    /// Post a slice on its NIC, or the next healthy one; failures go through [`Self::failed`].
    fn dispatch(&self, mut inf: Inflight) {
        let routed = self.failover.lock().route(inf.slice.nic);
        let Some(nic) = routed else {
            let next = self.failover.lock().exhausted(inf.slice);
            self.follow(next, inf, "no healthy RDMA NIC left".into());
            return;
        };
        inf.slice.nic = nic;
        if let Err((inf, reason)) = self.post(inf) {
            self.failed(inf, reason);
        }
    }

    fn post(&self, mut inf: Inflight) -> Result<(), (Inflight, String)> {
        let Some(path) = self.paths.get(inf.slice.nic) else {
            let reason = format!("no NIC path {}", inf.slice.nic);
            return Err((inf, reason));
        };
        let mr = {
            let key = inf.local.addr();
            let mut cache = path.local.lock();
            match cache.get(&key) {
                Some(mr) => mr.clone(),
                None => match path.device.register(&inf.local) {
                    Ok(mr) => {
                        cache.insert(key, mr.clone());
                        mr
                    }
                    Err(e) => {
                        let reason = format!("{}: {}", path.device.name(), chain(&e));
                        return Err((inf, reason));
                    }
                },
            }
        };
        // Bounds were checked against both segment sizes by `submit`; the region lengths are
        // checked again here so that a wrong registration cannot address outside it.
        let local_off = inf.local_base + inf.slice.offset;
        let remote_off = inf.remote_base + inf.slice.offset;
        let len = inf.slice.len;
        if local_off.checked_add(len).is_none_or(|e| e > mr.size())
            || remote_off
                .checked_add(len)
                .is_none_or(|e| e > path.remote.len)
        {
            let reason = format!("slice at {local_off}/{remote_off}+{len} is outside a region");
            return Err((inf, reason));
        }
        let Ok(len32) = u32::try_from(len) else {
            return Err((inf, format!("slice of {len} bytes exceeds 4 GiB")));
        };
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let wr = WorkRequest {
            wr_id,
            op: match inf.op {
                TransferOp::Read => RdmaOp::Read,
                TransferOp::Write => RdmaOp::Write,
            },
            local_addr: mr.addr() + local_off,
            lkey: mr.lkey(),
            len: len32,
            remote_addr: path.remote.addr + remote_off,
            rkey: path.remote.rkey,
        };
        inf.posted_at = Instant::now();
        // In the table before posting: the completion may arrive at once.
        let mut table = self.inflight.lock();
        table.insert(wr_id, inf);
        let posted = path.qp.post(&wr);
        match posted {
            Ok(()) => {
                drop(table);
                self.wake.notify_one();
                Ok(())
            }
            Err(e) => {
                let reason = format!("{}: {}", path.device.name(), chain(&e));
                match table.remove(&wr_id) {
                    Some(inf) => Err((inf, reason)),
                    None => Ok(()),
                }
            }
        }
    }

    /// A slice failed on its NIC: mark the NIC down and retry elsewhere, move to TCP, or fail.
    fn failed(&self, inf: Inflight, reason: String) {
        tracing::debug!(peer = %self.peer, nic = inf.slice.nic, %reason, "RDMA slice failed");
        let next = self.failover.lock().on_failure(inf.slice);
        self.follow(next, inf, reason);
    }

    fn follow(&self, next: Next, mut inf: Inflight, reason: String) {
        match next {
            Next::Retry(s) => {
                self.retries.fetch_add(1, Ordering::Relaxed);
                self.retry_metric.inc();
                inf.slice = s;
                self.dispatch(inf);
            }
            Next::FallbackTcp(s) => match &self.tcp {
                Some(tcp) => {
                    (tcp.on_fallback)(&reason);
                    tcp.peer.dispatch(Slice {
                        req: Some(inf.req),
                        kind: match inf.op {
                            TransferOp::Read => SliceKind::Read,
                            TransferOp::Write => SliceKind::Write,
                        },
                        local: Some(inf.local),
                        local_offset: inf.local_base + s.offset,
                        handle: tcp.handle,
                        remote_offset: inf.remote_base + s.offset,
                        len: s.len,
                    });
                }
                None => inf.req.slice_done(Err(self.failure(&reason))),
            },
            Next::Fail => inf.req.slice_done(Err(self.failure(&reason))),
        }
    }

    fn failure(&self, reason: &str) -> Failure {
        Failure::new("rdma", format!("RDMA to {}: {reason}", self.peer))
    }

    fn complete(&self, c: WorkCompletion) {
        let Some(inf) = self.inflight.lock().remove(&c.wr_id) else {
            // Completion of a request already given up on (timed out and retried).
            tracing::debug!(peer = %self.peer, wr_id = c.wr_id, "stale RDMA completion");
            return;
        };
        match c.result {
            Ok(()) => inf.req.slice_done(Ok(())),
            Err(status) => {
                let device = self
                    .paths
                    .get(inf.slice.nic)
                    .map_or("?", |p| p.device.name());
                let reason = format!("{device}: work completion failed: {status}");
                self.failed(inf, reason);
            }
        }
    }

    /// Give up on every slice of NIC `nic` (its completion queue failed), or on every slice
    /// older than the timeout when `nic` is `None`.
    fn expire(&self, nic: Option<usize>, reason: &str) {
        let expired: Vec<Inflight> = {
            let mut table = self.inflight.lock();
            let ids: Vec<u64> = table
                .iter()
                .filter(|(_, i)| match nic {
                    Some(n) => i.slice.nic == n,
                    None => i.posted_at.elapsed() > self.timeout,
                })
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| table.remove(id)).collect()
        };
        for inf in expired {
            let device = self
                .paths
                .get(inf.slice.nic)
                .map_or("?", |p| p.device.name());
            self.failed(inf, format!("{device}: {reason}"));
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Queue pairs first (the hardware stops touching memory), then settle what is left.
        let paths = std::mem::take(&mut self.paths);
        drop(paths);
        for (_, inf) in self.inflight.get_mut().drain() {
            inf.req.slice_done(Err(Failure::new(
                "rdma",
                format!("RDMA channel to {} closed", self.peer),
            )));
        }
    }
}

impl Drop for RdmaChannel {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
    }
}

/// Empty polls spent spinning, then yielding, before the poller starts to sleep.
const SPIN_POLLS: u32 = 32;
const YIELD_POLLS: u32 = 32;
/// Longest sleep between polls while work is in flight.
const MAX_BACKOFF: Duration = Duration::from_millis(1);
/// How often in-flight work requests are checked against the timeout.
const DEADLINE_TICK: Duration = Duration::from_millis(50);

/// Busy-poll every queue pair's completion queue with backoff: spin, then yield, then sleep
/// (doubling up to 1 ms); park while nothing is in flight.
fn poll_loop(sh: &Shared) {
    let mut buf = Vec::with_capacity(64);
    let mut idle: u32 = 0;
    let mut backoff = Duration::from_micros(10);
    let mut last_deadline = Instant::now();
    while !sh.stop.load(Ordering::SeqCst) {
        let mut got = 0;
        for (nic, path) in sh.paths.iter().enumerate() {
            buf.clear();
            if let Err(e) = path.qp.poll(32, &mut buf) {
                sh.expire(
                    Some(nic),
                    &format!("polling completions failed: {}", chain(&e)),
                );
            }
            got += buf.len();
            for c in buf.drain(..) {
                sh.complete(c);
            }
        }
        if last_deadline.elapsed() >= DEADLINE_TICK {
            last_deadline = Instant::now();
            sh.expire(None, &format!("no completion within {:?}", sh.timeout));
        }
        if got > 0 {
            idle = 0;
            backoff = Duration::from_micros(10);
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < SPIN_POLLS {
            std::hint::spin_loop();
        } else if idle < SPIN_POLLS + YIELD_POLLS {
            std::thread::yield_now();
        } else {
            let mut table = sh.inflight.lock();
            if table.is_empty() {
                sh.wake.wait_for(&mut table, DEADLINE_TICK);
                idle = 0;
            } else {
                drop(table);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    crate::error::error_chain(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostOptions;
    use crate::rdma::fake::{FakeFabric, Faults};

    fn hdr(opcode: Opcode, status: u32) -> Header {
        let mut h = Header::new(opcode, 1);
        h.status = status;
        h
    }

    #[test]
    fn an_old_target_is_reported_as_predating_rdma_connect() {
        let e = reply_from_frame(
            &hdr(Opcode::Error, ErrorCode::Malformed as u32),
            b"unknown opcode 14",
            "10.0.0.1:7400",
        )
        .unwrap_err();
        assert_eq!(e.category(), "peer_unsupported");
        let text = e.to_string();
        assert!(
            text.contains("predates RDMA_CONNECT") && text.contains("unknown opcode 14"),
            "{text}"
        );
        let e = reply_from_frame(
            &hdr(Opcode::Error, ErrorCode::Unsupported as u32),
            b"no device",
            "p",
        )
        .unwrap_err();
        assert!(e.to_string().contains("unsupported: no device"), "{e}");
        let e = reply_from_frame(&hdr(Opcode::WriteAck, 0), b"", "p").unwrap_err();
        assert_eq!(e.category(), "mismatch");
        let e = reply_from_frame(&hdr(Opcode::RdmaConnectOk, 0), b"\x01", "p").unwrap_err();
        assert_eq!(e.category(), "handshake");
    }

    fn qp_pair(fabric: &FakeFabric) -> (Arc<dyn QueuePairOps>, Arc<dyn QueuePairOps>) {
        let devs = fabric.provider(&["a", "b"]).devices();
        let a = devs[0].create_qp().unwrap();
        let b = devs[1].create_qp().unwrap();
        a.connect(&b.info()).unwrap();
        b.connect(&a.info()).unwrap();
        (a, b)
    }

    #[test]
    fn accept_connects_one_queue_pair_per_request_round_robin_over_devices() {
        let fabric = FakeFabric::new();
        let seg = Arc::new(Segment::host(1 << 16, HostOptions::default()).unwrap());
        let initiator = fabric.provider(&["i0", "i1", "i2"]).devices();
        let qps: Vec<_> = initiator.iter().map(|d| d.create_qp().unwrap()).collect();
        let req = ConnectRequest {
            segment: "s".into(),
            qps: qps.iter().map(|q| q.info()).collect(),
        };
        let target = fabric.provider(&["t0", "t1"]);
        let (reply, kept) = accept(target.as_ref(), &seg, &req).unwrap();
        let devices: Vec<_> = reply.paths.iter().map(|(q, _)| q.device.as_str()).collect();
        assert_eq!(devices, ["t0", "t1", "t0"]);
        // One registration per target device used, covering the whole segment.
        assert_eq!(fabric.registered_regions(), 2);
        assert!(
            reply
                .paths
                .iter()
                .all(|(_, r)| r.len == 1 << 16 && r.addr == seg.addr() as u64)
        );
        drop(kept);
        assert_eq!(fabric.registered_regions(), 0);
        let none = FakeFabric::new().provider(&[]);
        assert!(matches!(
            accept(none.as_ref(), &seg, &req),
            Err(RdmaError::NoDevice)
        ));
    }

    #[test]
    fn fake_queue_pairs_copy_bounds_check_and_complete_out_of_order() {
        let fabric = FakeFabric::new();
        fabric.set_faults(Faults {
            reverse_completions: true,
            ..Faults::default()
        });
        let (a, _b) = qp_pair(&fabric);
        let dev = &fabric.provider(&["a"]).devices()[0];
        let src = Arc::new(Segment::host(8192, HostOptions::default()).unwrap());
        let dst = Arc::new(Segment::host(8192, HostOptions::default()).unwrap());
        src.write_at(0, b"0123456789").unwrap();
        let (ms, md) = (dev.register(&src).unwrap(), dev.register(&dst).unwrap());
        let wr = |wr_id, off: u64, len| WorkRequest {
            wr_id,
            op: RdmaOp::Write,
            local_addr: ms.addr() + off,
            lkey: ms.lkey(),
            len,
            remote_addr: md.addr() + off,
            rkey: md.rkey(),
        };
        a.post(&wr(1, 0, 5)).unwrap();
        a.post(&wr(2, 5, 5)).unwrap();
        a.post(&wr(3, 8190, 5)).unwrap(); // crosses the end of the region
        let mut out = Vec::new();
        a.poll(16, &mut out).unwrap();
        let ids: Vec<_> = out.iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [3, 2, 1], "completions come back out of order");
        assert!(
            out[0]
                .result
                .as_ref()
                .is_err_and(|e| e.contains("REM_ACCESS"))
        );
        assert!(out[1].result.is_ok() && out[2].result.is_ok());
        let mut got = [0u8; 10];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(&got, b"0123456789");
    }

    #[test]
    fn a_failing_nic_errors_its_queue_pair_and_flushes_what_follows() {
        let fabric = FakeFabric::new();
        fabric.set_faults(Faults {
            failing_completions: ["a".to_owned()].into(),
            ..Faults::default()
        });
        let (a, _b) = qp_pair(&fabric);
        let dev = &fabric.provider(&["a"]).devices()[0];
        let seg = Arc::new(Segment::host(4096, HostOptions::default()).unwrap());
        let m = dev.register(&seg).unwrap();
        let wr = WorkRequest {
            wr_id: 1,
            op: RdmaOp::Read,
            local_addr: m.addr(),
            lkey: m.lkey(),
            len: 16,
            remote_addr: m.addr() + 64,
            rkey: m.rkey(),
        };
        a.post(&wr).unwrap();
        a.post(&WorkRequest { wr_id: 2, ..wr }).unwrap();
        let mut out = Vec::new();
        a.poll(16, &mut out).unwrap();
        assert!(
            out[0]
                .result
                .as_ref()
                .is_err_and(|e| e.contains("RETRY_EXC"))
        );
        assert!(out[1].result.as_ref().is_err_and(|e| e.contains("FLUSH")));
        let e = a.post(&wr).unwrap_err();
        assert!(e.to_string().contains("ibv_post_send"), "{e}");
    }

    #[test]
    fn fake_ports_connect_by_lid_on_infiniband_and_by_gid_on_roce() {
        use crate::rdma::address::LinkLayer;
        let fabric = FakeFabric::new();
        let ib = fabric.provider_ib(&[("ib0", 5), ("ib1", 6)]).devices();
        let port = ib[0].port().unwrap();
        assert_eq!((port.link_layer, port.lid), (LinkLayer::InfiniBand, 5));
        let (a, b) = (ib[0].create_qp().unwrap(), ib[1].create_qp().unwrap());
        assert_eq!(
            (a.info().lid, b.info().lid),
            (5, 6),
            "the handshake carries the LID"
        );
        a.connect(&b.info()).unwrap();
        b.connect(&a.info()).unwrap();

        // A LID that names another port does not reach the queue pair.
        let c = ib[1].create_qp().unwrap();
        let wrong = QpInfo { lid: 5, ..c.info() };
        let e = a.connect(&wrong).unwrap_err();
        assert!(e.to_string().contains("ibv_modify_qp"), "{e}");
        // An InfiniBand peer that sent LID 0 is refused with the reason.
        let e = a.connect(&QpInfo { lid: 0, ..c.info() }).unwrap_err();
        assert_eq!(e.category(), "address");
        assert!(chain(&e).contains("sent LID 0"), "{}", chain(&e));

        // RoCE: no LID, routed by GID; a RoCE port cannot reach an InfiniBand one.
        let roce = fabric.provider(&["r0", "r1"]).devices();
        assert_eq!(roce[0].port().unwrap().link_layer, LinkLayer::Ethernet);
        let (x, y) = (roce[0].create_qp().unwrap(), roce[1].create_qp().unwrap());
        assert_eq!(x.info().lid, 0);
        x.connect(&y.info()).unwrap();
        let e = x.connect(&c.info()).unwrap_err();
        assert!(chain(&e).contains("another link layer"), "{}", chain(&e));
        let e = x
            .connect(&QpInfo {
                gid: [0; 16],
                ..y.info()
            })
            .unwrap_err();
        assert!(chain(&e).contains("all-zero GID"), "{}", chain(&e));
    }
}
