//! Target side: the table of registered segments, the per-connection request loop (generic
//! over the stream so that property tests drive it from memory), the notification queue, and the
//! TCP listener with one blocking thread per connection (its admission caps and handshake
//! deadline in `accept`). I/O boundary: the TCP listener and accepted sockets.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::auth::AuthKey;
use super::error::{TransferError, error_chain};
use super::frame::{self, ErrorCode, Header, Opcode};
use super::memory::{self, Segment, Span};
use super::metrics::TransferMetrics;
use super::rdma::RdmaProvider;
use super::rdma::datapath::{self, AcceptedPaths};
use super::rdma::handshake::ConnectRequest;
use super::wire::{self, WireError};

/// Checks a READ of `len` bytes at `offset` before they are served: `Err(reason)` refuses it
/// (issue 4: the agent's SSD segment verifies the block's checksum, so corrupt bytes are never
/// sent). Runs on the connection's thread.
pub type ReadCheck = Arc<dyn Fn(u64, u64) -> Result<(), String> + Send + Sync>;

/// Registered local segments, by handle and by name.
pub(crate) struct Registry {
    by_handle: RwLock<HashMap<u32, (String, Arc<Segment>)>>,
    by_name: RwLock<HashMap<String, u32>>,
    next: AtomicU32,
    /// This registry's random id (never 0), told in OPEN_OK's `status`: an initiator that
    /// sends it back in a READ or WRITE's `status` is refused (`unknown_segment`) by any other
    /// registry, such as the one of a restarted target whose handles start over.
    instance: u32,
    /// Read checks of the segments that have one, by handle.
    read_checks: RwLock<HashMap<u32, ReadCheck>>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            by_handle: RwLock::default(),
            by_name: RwLock::default(),
            next: AtomicU32::new(0),
            read_checks: RwLock::default(),
            instance: rand::random::<u32>().max(1),
        }
    }
}

impl Registry {
    pub(crate) fn insert(&self, name: &str, seg: Arc<Segment>) -> Option<u32> {
        let mut names = self.by_name.write();
        if names.contains_key(name) {
            return None;
        }
        let handle = self.next.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        names.insert(name.to_owned(), handle);
        self.by_handle
            .write()
            .insert(handle, (name.to_owned(), seg));
        Some(handle)
    }

    /// Check every READ of segment `handle` with `check` (see `TransferEngine::set_read_check`).
    pub(crate) fn set_read_check(&self, handle: u32, check: ReadCheck) {
        self.read_checks.write().insert(handle, check);
    }

    pub(crate) fn remove(&self, handle: u32) {
        self.read_checks.write().remove(&handle);
        let mut names = self.by_name.write();
        if let Some((name, _)) = self.by_handle.write().remove(&handle) {
            names.remove(&name);
        }
    }

    pub(crate) fn get(&self, handle: u32) -> Option<Arc<Segment>> {
        self.by_handle.read().get(&handle).map(|(_, s)| s.clone())
    }

    pub(crate) fn find(&self, name: &str) -> Option<(u32, Arc<Segment>)> {
        let handle = *self.by_name.read().get(name)?;
        self.get(handle).map(|s| (handle, s))
    }
}

/// A small message received from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Address of the sending connection.
    pub from: String,
    pub payload: Vec<u8>,
}

/// Bounded queue of received notifications; when full the oldest is dropped and counted.
pub(crate) struct NotificationQueue {
    queue: Mutex<VecDeque<Notification>>,
    cv: Condvar,
    capacity: usize,
}

impl NotificationQueue {
    pub(crate) fn new(capacity: usize) -> Self {
        NotificationQueue {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    fn push(&self, n: Notification, metrics: &TransferMetrics) {
        let mut q = self.queue.lock();
        if q.len() >= self.capacity {
            q.pop_front();
            metrics.notifications_dropped.inc();
        }
        q.push_back(n);
        self.cv.notify_one();
    }

    pub(crate) fn pop(&self, timeout: Duration) -> Option<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            if self.cv.wait_until(&mut q, deadline).timed_out() {
                return q.pop_front();
            }
        }
    }
}

/// What the session needs from the engine.
pub(crate) struct ServerCtx {
    pub(crate) registry: Arc<Registry>,
    pub(crate) key: AuthKey,
    pub(crate) max_slice: u64,
    pub(crate) timeout: Duration,
    /// The whole handshake of an accepted connection must finish within this.
    pub(crate) handshake_timeout: Duration,
    pub(crate) limits: AdmissionLimits,
    pub(crate) notifications: Arc<NotificationQueue>,
    pub(crate) metrics: TransferMetrics,
    /// RDMA devices to accept RDMA_CONNECT with (none: answered with ERROR(unsupported)).
    pub(crate) rdma: Option<Arc<dyn RdmaProvider>>,
    /// Per-frame integrity granted to (or required of) initiators.
    pub(crate) integrity: crate::Integrity,
    /// TLS on accepted connections: `off` refuses it, `allow` serves TLS and plaintext alike,
    /// `require` refuses plaintext (ERROR `tls`).
    pub(crate) tls: crate::TlsMode,
    /// The TLS server configuration (set unless `tls` is `off`).
    pub(crate) tls_server: Option<Arc<rustls::ServerConfig>>,
    /// Feature bits announced in OPEN_OK (`frame::FEATURES`, or 0 to serve as a target built
    /// before them would); READV and WRITEV are refused unless announced.
    pub(crate) features: u64,
}

/// A byte stream that can also move payloads straight between itself and segment memory.
pub(crate) trait DataStream: Read + Write {
    fn recv_into(&mut self, to: Span<'_>) -> io::Result<()>;
    fn send_from(&mut self, from: Span<'_>) -> io::Result<()>;
    /// A header followed by a payload from segment memory (sockets coalesce the two).
    fn send_with_header(&mut self, header: &[u8], from: Span<'_>) -> io::Result<()> {
        self.write_all(header)?;
        self.send_from(from)
    }
    /// Receive into several ranges, in order.
    fn recv_into_spans(&mut self, to: &[Span<'_>]) -> io::Result<()> {
        to.iter().try_for_each(|s| self.recv_into(*s))
    }
    /// A header followed by the bytes of several ranges, in order.
    fn send_spans_with_header(&mut self, header: &[u8], from: &[Span<'_>]) -> io::Result<()> {
        self.write_all(header)?;
        from.iter().try_for_each(|s| self.send_from(*s))
    }
}

impl DataStream for TcpStream {
    fn recv_into(&mut self, to: Span<'_>) -> io::Result<()> {
        to.recv(self.as_fd(), &mut wire::fail_on_timeout)
    }
    fn send_from(&mut self, from: Span<'_>) -> io::Result<()> {
        from.send(self.as_fd(), &mut wire::fail_on_timeout)
    }
    fn send_with_header(&mut self, header: &[u8], from: Span<'_>) -> io::Result<()> {
        from.send_prefixed(self.as_fd(), header, &mut wire::fail_on_timeout)
    }
    fn recv_into_spans(&mut self, to: &[Span<'_>]) -> io::Result<()> {
        memory::recv_spans(self.as_fd(), to, &mut wire::fail_on_timeout)
    }
    fn send_spans_with_header(&mut self, header: &[u8], from: &[Span<'_>]) -> io::Result<()> {
        memory::send_spans(self.as_fd(), header, from, &mut wire::fail_on_timeout)
    }
}

/// Read and throw away `len` payload bytes, keeping the stream in step after a rejected WRITE.
pub(super) fn discard<S: Read + ?Sized>(s: &mut S, mut len: u64) -> Result<(), WireError> {
    let mut scratch = vec![0u8; 64 * 1024];
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        wire::read_full(s, &mut scratch[..n], &mut wire::fail_on_timeout)?;
        len -= n as u64;
    }
    Ok(())
}

/// The request loop of an authenticated connection: requests until the peer closes, sends
/// something invalid (answered with an ERROR frame, then the connection is closed), or `on_idle`
/// stops it. Bad offsets, lengths and handles get an ERROR reply and the connection carries on.
pub(crate) fn serve_requests<S: DataStream>(
    s: &mut S,
    ctx: &ServerCtx,
    peer: &str,
    on_idle: &mut dyn FnMut(Duration) -> io::Result<()>,
) -> Result<(), WireError> {
    // Queue pairs accepted on this connection live as long as it stays open.
    let mut rdma_paths: Vec<AcceptedPaths> = Vec::new();
    loop {
        let idle_since = Instant::now();
        let holds_rdma = !rdma_paths.is_empty();
        // A connection that keeps queue pairs alive is never idle (only shutdown ends it).
        let mut idle = || {
            on_idle(if holds_rdma {
                Duration::ZERO
            } else {
                idle_since.elapsed()
            })
        };
        let h = match wire::read_header(s, ctx.max_slice, &mut idle) {
            Ok(h) => h,
            Err(WireError::Closed) => return Ok(()),
            Err(e @ WireError::Frame(_)) => {
                let _ = wire::write_error(s, 0, ErrorCode::Malformed, &e.to_string());
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let id = h.request_id;
        match h.opcode {
            Opcode::Open => {
                let name = wire::read_control_payload(s, &h)?;
                let name = String::from_utf8_lossy(&name);
                match ctx.registry.find(&name) {
                    Some((handle, seg)) => {
                        let mut r = Header::new(Opcode::OpenOk, id);
                        r.handle = handle;
                        r.length = seg.len() as u64;
                        r.status = ctx.registry.instance;
                        r.offset = ctx.features;
                        // OPEN_OK carries no payload; `length` is the segment size.
                        s.write_all(&r.encode()).map_err(WireError::Io)?;
                    }
                    None => wire::write_error(
                        s,
                        id,
                        ErrorCode::UnknownSegment,
                        &format!("no segment named {name:?} is registered here"),
                    )?,
                }
            }
            Opcode::Write => {
                let target = lookup(ctx, &h);
                match target {
                    Ok(seg) => {
                        s.recv_into(Span::new(&seg, h.offset, h.length as usize))
                            .map_err(WireError::Io)?;
                        // Counted before the ack, so an initiator that saw the ack sees the count.
                        ctx.metrics
                            .served_bytes
                            .with_label_values(&["write"])
                            .inc_by(h.length);
                        s.write_all(&Header::new(Opcode::WriteAck, id).encode())
                            .map_err(WireError::Io)?;
                    }
                    Err((code, reason)) => {
                        discard(s, h.length)?;
                        wire::write_error(s, id, code, &reason)?;
                    }
                }
            }
            Opcode::Read => match lookup(ctx, &h).and_then(|seg| {
                let check = ctx.registry.read_checks.read().get(&h.handle).cloned();
                match check {
                    Some(check) => check(h.offset, h.length)
                        .map(|()| seg)
                        .map_err(|reason| (ErrorCode::Internal, reason)),
                    None => Ok(seg),
                }
            }) {
                Ok(seg) => {
                    let mut r = Header::new(Opcode::ReadData, id);
                    r.length = h.length;
                    // Counted when sending starts (a send that then fails is still counted).
                    ctx.metrics
                        .served_bytes
                        .with_label_values(&["read"])
                        .inc_by(h.length);
                    s.send_with_header(&r.encode(), Span::new(&seg, h.offset, h.length as usize))
                        .map_err(WireError::Io)?;
                }
                Err((code, reason)) => wire::write_error(s, id, code, &reason)?,
            },
            Opcode::ReadV if ctx.features & frame::FEATURE_VECTORED != 0 => {
                vectored::serve_readv(s, ctx, &h)?;
            }
            Opcode::WriteV if ctx.features & frame::FEATURE_VECTORED != 0 => {
                vectored::serve_writev(s, ctx, &h)?;
            }
            Opcode::Notify => {
                let payload = wire::read_control_payload(s, &h)?;
                ctx.notifications.push(
                    Notification {
                        from: peer.to_owned(),
                        payload,
                    },
                    &ctx.metrics,
                );
                s.write_all(&Header::new(Opcode::NotifyAck, id).encode())
                    .map_err(WireError::Io)?;
            }
            Opcode::RdmaConnect => {
                let payload = wire::read_control_payload(s, &h)?;
                match accept_rdma(ctx, &payload) {
                    Ok((reply, paths)) => {
                        wire::write_frame(s, &Header::new(Opcode::RdmaConnectOk, id), &reply)?;
                        rdma_paths.push(paths);
                    }
                    Err((code, reason)) => wire::write_error(s, id, code, &reason)?,
                }
            }
            other => {
                let _ = wire::write_error(
                    s,
                    id,
                    ErrorCode::Unsupported,
                    &format!("{other:?} is not a request"),
                );
                return Err(WireError::Unexpected {
                    got: other,
                    expected: "a request (OPEN, READ, WRITE, NOTIFY)",
                });
            }
        }
    }
}

/// Answer RDMA_CONNECT: decode, find the segment, connect queue pairs on the local devices.
fn accept_rdma(
    ctx: &ServerCtx,
    payload: &[u8],
) -> Result<(Vec<u8>, AcceptedPaths), (ErrorCode, String)> {
    let req = ConnectRequest::decode(payload).map_err(|e| (ErrorCode::Malformed, e.to_string()))?;
    let Some(provider) = &ctx.rdma else {
        return Err((
            ErrorCode::Unsupported,
            "this target has no RDMA transport (built without feature rdma, or no device)".into(),
        ));
    };
    let (handle, seg) = ctx.registry.find(&req.segment).ok_or_else(|| {
        (
            ErrorCode::UnknownSegment,
            format!("no segment named {:?} is registered here", req.segment),
        )
    })?;
    if ctx.registry.read_checks.read().contains_key(&handle) {
        return Err((
            ErrorCode::Unsupported,
            format!(
                "segment {:?} checks every read; it is served over TCP only",
                req.segment
            ),
        ));
    }
    let (reply, paths) = datapath::accept(provider.as_ref(), &seg, &req)
        .map_err(|e| (ErrorCode::Unsupported, error_chain(&e)))?;
    let reply = reply
        .encode()
        .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
    Ok((reply, paths))
}

fn lookup(ctx: &ServerCtx, h: &Header) -> Result<Arc<Segment>, (ErrorCode, String)> {
    let seg = segment_of(ctx, h)?;
    seg.check_range(h.offset, h.length)
        .map_err(|e| (ErrorCode::OutOfBounds, e.to_string()))?;
    Ok(seg)
}

/// The registered segment a data request names, if it was opened on this run of the target.
pub(super) fn segment_of(ctx: &ServerCtx, h: &Header) -> Result<Arc<Segment>, (ErrorCode, String)> {
    // 0: an initiator that does not send the instance (or opened before it was told one).
    if h.status != 0 && h.status != ctx.registry.instance {
        return Err((
            ErrorCode::UnknownSegment,
            format!(
                "segment handle {} was opened on another run of this target",
                h.handle
            ),
        ));
    }
    let seg = ctx.registry.get(h.handle).ok_or_else(|| {
        (
            ErrorCode::UnknownSegment,
            format!("segment handle {} is not registered", h.handle),
        )
    })?;
    Ok(seg)
}

struct ServerShared {
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
    admission: accept::Admission,
}

/// A running TCP target. Dropping it closes the listener and every connection and joins all
/// threads: peers see their connections reset.
#[derive(derive_more::Debug)]
pub struct TcpServer {
    addr: SocketAddr,
    #[debug(skip)]
    shared: Arc<ServerShared>,
    #[debug(skip)]
    accept: Option<JoinHandle<()>>,
}

impl TcpServer {
    pub(crate) fn start(addr: SocketAddr, ctx: Arc<ServerCtx>) -> Result<Self, TransferError> {
        let listener = accept::listen(addr).map_err(|source| TransferError::Bind {
            what: format!("TCP listener on {addr}"),
            source,
        })?;
        let addr = listener
            .local_addr()
            .map_err(|source| TransferError::Bind {
                what: "TCP listener address".into(),
                source,
            })?;
        let shared = Arc::new(ServerShared {
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
            admission: accept::Admission::new(ctx.limits),
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kvpool-xfer-accept".into())
            .spawn(move || accept::accept_loop(listener, sh, ctx))
            .map_err(|source| TransferError::Bind {
                what: "accept thread".into(),
                source,
            })?;
        Ok(TcpServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections currently open on the target side.
    pub fn connection_count(&self) -> usize {
        self.shared.conns.lock().len()
    }

    /// Connections accepted and not yet through the handshake.
    pub fn handshake_count(&self) -> usize {
        self.shared.admission.handshaking()
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for (_, c) in self.shared.conns.lock().drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the blocking accept.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let workers: Vec<_> = self.shared.workers.lock().drain(..).collect();
        for w in workers {
            let _ = w.join();
        }
    }
}

mod accept;
mod memory_target;
mod sealed;
mod tls_target;
mod vectored;

pub(crate) use accept::AdmissionLimits;
pub use memory_target::{MemoryTarget, Served};

#[cfg(test)]
mod tests;
