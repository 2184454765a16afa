//! Target side: the table of registered segments, the per-connection protocol session (generic
//! over the stream so that property tests drive it from memory), the notification queue, and the
//! TCP listener with one blocking thread per connection.
//! I/O boundary: the TCP listener and accepted sockets.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::auth::AuthKey;
use super::error::{TransferError, error_chain};
use super::frame::{ErrorCode, Header, Opcode};
use super::memory::{self, Segment};
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
#[derive(Default)]
pub(crate) struct Registry {
    by_handle: RwLock<HashMap<u32, (String, Arc<Segment>)>>,
    by_name: RwLock<HashMap<String, u32>>,
    next: AtomicU32,
    /// Read checks of the segments that have one, by handle.
    read_checks: RwLock<HashMap<u32, ReadCheck>>,
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
    pub(crate) max_connections: usize,
    pub(crate) notifications: Arc<NotificationQueue>,
    pub(crate) metrics: TransferMetrics,
    /// RDMA devices to accept RDMA_CONNECT with (none: answered with ERROR(unsupported)).
    pub(crate) rdma: Option<Arc<dyn RdmaProvider>>,
}

/// A byte stream that can also move payloads straight between itself and segment memory.
pub(crate) trait DataStream: Read + Write {
    fn recv_into(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()>;
    fn send_from(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()>;
    /// A header followed by a payload from segment memory (sockets coalesce the two).
    fn send_with_header(
        &mut self,
        header: &[u8],
        seg: &Segment,
        offset: u64,
        len: usize,
    ) -> io::Result<()> {
        self.write_all(header)?;
        self.send_from(seg, offset, len)
    }
}

impl DataStream for TcpStream {
    fn recv_into(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()> {
        memory::recv_into(self.as_fd(), seg, offset, len, &mut wire::fail_on_timeout)
    }
    fn send_from(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()> {
        memory::send_from(self.as_fd(), seg, offset, len, &mut wire::fail_on_timeout)
    }
    fn send_with_header(
        &mut self,
        header: &[u8],
        seg: &Segment,
        offset: u64,
        len: usize,
    ) -> io::Result<()> {
        memory::send_prefixed(
            self.as_fd(),
            header,
            seg,
            offset,
            len,
            &mut wire::fail_on_timeout,
        )
    }
}

/// Read and throw away `len` payload bytes, keeping the stream in step after a rejected WRITE.
fn discard<S: Read + ?Sized>(s: &mut S, mut len: u64) -> Result<(), WireError> {
    let mut scratch = vec![0u8; 64 * 1024];
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        wire::read_full(s, &mut scratch[..n], &mut wire::fail_on_timeout)?;
        len -= n as u64;
    }
    Ok(())
}

/// Run one connection: handshake, then requests until the peer closes, sends something
/// invalid (answered with an ERROR frame, then the connection is closed), or `on_idle` stops it.
/// Bad offsets, lengths and handles get an ERROR reply and the connection carries on.
pub(crate) fn serve_session<S: DataStream>(
    s: &mut S,
    ctx: &ServerCtx,
    peer: &str,
    on_idle: &mut dyn FnMut(Duration) -> io::Result<()>,
) -> Result<(), WireError> {
    wire::server_handshake(s, &ctx.key)?;
    serve_requests(s, ctx, peer, on_idle)
}

/// The request loop of an authenticated connection.
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
                        s.recv_into(&seg, h.offset, h.length as usize)
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
                    s.send_with_header(&r.encode(), &seg, h.offset, h.length as usize)
                        .map_err(WireError::Io)?;
                }
                Err((code, reason)) => wire::write_error(s, id, code, &reason)?,
            },
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
    let seg = ctx.registry.get(h.handle).ok_or_else(|| {
        (
            ErrorCode::UnknownSegment,
            format!("segment handle {} is not registered", h.handle),
        )
    })?;
    seg.check_range(h.offset, h.length)
        .map_err(|e| (ErrorCode::OutOfBounds, e.to_string()))?;
    Ok(seg)
}

struct ServerShared {
    stop: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
}

/// A running TCP target. Dropping it closes the listener and every connection and joins all
/// threads: peers see their connections reset.
pub struct TcpServer {
    addr: SocketAddr,
    shared: Arc<ServerShared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpServer {
    pub(crate) fn start(addr: SocketAddr, ctx: Arc<ServerCtx>) -> Result<Self, TransferError> {
        let listener = TcpListener::bind(addr).map_err(|source| TransferError::Bind {
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
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kvpool-xfer-accept".into())
            .spawn(move || accept_loop(listener, sh, ctx))
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

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>, ctx: Arc<ServerCtx>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a transfer connection failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.conns.lock().len() >= ctx.max_connections {
            // Bounded: refuse instead of spawning without limit (unauthenticated peers could
            // otherwise hold a thread each until their handshake times out).
            ctx.metrics
                .failures
                .with_label_values(&["too_many_connections"])
                .inc();
            tracing::warn!(
                limit = ctx.max_connections,
                "refusing a transfer connection"
            );
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        shared.conns.lock().insert(id, clone);
        if shared.stop.load(Ordering::SeqCst) {
            // Raced with Drop, which may already have drained `conns`.
            let _ = stream.shutdown(Shutdown::Both);
            break;
        }
        let sh = shared.clone();
        let cx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("kvpool-xfer-conn".into())
            .spawn(move || {
                cx.metrics.target_connections.inc();
                serve_tcp_conn(stream, &cx, &sh);
                sh.conns.lock().remove(&id);
                cx.metrics.target_connections.dec();
            });
        let mut workers = shared.workers.lock();
        workers.retain(|w| !w.is_finished());
        match spawned {
            Ok(h) => workers.push(h),
            Err(e) => {
                tracing::warn!(error = %e, "cannot spawn a connection thread");
                shared.conns.lock().remove(&id);
            }
        }
    }
}

/// Connections idle (between frames) longer than this are closed by the target.
const IDLE_LIMIT: Duration = Duration::from_secs(600);

fn serve_tcp_conn(mut stream: TcpStream, ctx: &ServerCtx, shared: &ServerShared) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown".into());
    let _ = stream.set_nodelay(true);
    // The handshake and every payload use the full timeout; idle waits between frames are
    // allowed up to IDLE_LIMIT (connection reuse). Shutdown closes the socket to wake us.
    if stream.set_read_timeout(Some(ctx.timeout)).is_err()
        || stream.set_write_timeout(Some(ctx.timeout)).is_err()
    {
        return;
    }
    let mut on_idle = |idle: Duration| {
        if shared.stop.load(Ordering::SeqCst) {
            return Err(io::Error::other("target shutting down"));
        }
        if idle > IDLE_LIMIT {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "idle connection"));
        }
        Ok(())
    };
    match serve_session(&mut stream, ctx, &peer, &mut on_idle) {
        Ok(()) => tracing::debug!(%peer, "transfer connection closed by peer"),
        Err(e) => tracing::debug!(%peer, error = %e, "transfer connection ended"),
    }
    let _ = stream.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{HEADER_LEN, MAX_CONTROL_PAYLOAD};
    use crate::memory::HostOptions;
    use proptest::prelude::*;
    use std::io::Cursor;

    /// An in-memory connection: scripted input, captured output.
    struct MemStream {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for MemStream {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for MemStream {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl DataStream for MemStream {
        fn recv_into(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()> {
            let mut tmp = vec![0u8; len];
            self.input.read_exact(&mut tmp)?;
            seg.write_at(offset, &tmp)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
        }
        fn send_from(&mut self, seg: &Segment, offset: u64, len: usize) -> io::Result<()> {
            let mut tmp = vec![0u8; len];
            seg.read_at(offset, &mut tmp)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            self.output.extend_from_slice(&tmp);
            Ok(())
        }
    }

    const SEG: u64 = 64 * 1024;
    const MAX: u64 = 1024 * 1024;

    fn ctx() -> (ServerCtx, u32) {
        let registry = Arc::new(Registry::default());
        let seg = Arc::new(Segment::host(SEG as usize, HostOptions::default()).unwrap());
        let handle = registry.insert("seg", seg).unwrap();
        let ctx = ServerCtx {
            registry,
            key: AuthKey::new(*b"0123456789abcdef").unwrap(),
            max_slice: MAX,
            timeout: Duration::from_secs(1),
            max_connections: 4,
            notifications: Arc::new(NotificationQueue::new(4)),
            metrics: TransferMetrics::unregistered().unwrap(),
            rdma: None,
        };
        (ctx, handle)
    }

    /// One chunk of hostile input.
    #[derive(Debug, Clone)]
    enum Chunk {
        Frame {
            opcode: u8,
            valid_handle: bool,
            handle: u32,
            offset: u64,
            length: u64,
            payload: Vec<u8>,
        },
        Garbage(Vec<u8>),
        Truncated(usize),
    }

    fn chunk() -> impl Strategy<Value = Chunk> {
        let length = prop_oneof![
            0u64..64,
            Just(SEG),
            SEG - 8..SEG + 8,
            MAX - 1..MAX + 2,
            Just(MAX_CONTROL_PAYLOAD + 1),
            any::<u64>(),
        ];
        let offset = prop_oneof![0u64..SEG, SEG - 16..SEG + 16, any::<u64>()];
        prop_oneof![
            6 => (0u8..=15, any::<bool>(), any::<u32>(), offset, length,
                  proptest::collection::vec(any::<u8>(), 0..96))
                .prop_map(|(opcode, valid_handle, handle, offset, length, payload)| Chunk::Frame {
                    opcode, valid_handle, handle, offset, length, payload
                }),
            1 => proptest::collection::vec(any::<u8>(), 1..80).prop_map(Chunk::Garbage),
            1 => (1usize..HEADER_LEN).prop_map(Chunk::Truncated),
        ]
    }

    fn encode(chunks: &[Chunk], real_handle: u32) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            match c {
                Chunk::Frame {
                    opcode,
                    valid_handle,
                    handle,
                    offset,
                    length,
                    payload,
                } => {
                    let mut h = Header::new(Opcode::Read, i as u64 + 1);
                    h.handle = if *valid_handle { real_handle } else { *handle };
                    h.offset = *offset;
                    h.length = *length;
                    let mut b = h.encode();
                    b[5] = *opcode;
                    out.extend_from_slice(&b);
                    out.extend_from_slice(payload);
                }
                Chunk::Garbage(g) => out.extend_from_slice(g),
                Chunk::Truncated(n) => {
                    out.extend_from_slice(&Header::new(Opcode::Write, 9).encode()[..*n])
                }
            }
        }
        out
    }

    /// Parse what the server wrote: it must be a sequence of well-formed replies.
    fn replies(mut out: &[u8]) -> Vec<Header> {
        let mut v = Vec::new();
        while !out.is_empty() {
            let h = Header::decode(out, MAX).expect("server wrote a malformed header");
            let payload = match h.opcode {
                Opcode::ReadData | Opcode::Error => h.length as usize,
                _ => 0,
            };
            assert!(
                matches!(
                    h.opcode,
                    Opcode::ReadData
                        | Opcode::Error
                        | Opcode::WriteAck
                        | Opcode::OpenOk
                        | Opcode::NotifyAck
                ),
                "server sent a {:?}",
                h.opcode
            );
            assert!(out.len() >= HEADER_LEN + payload, "reply payload cut short");
            out = &out[HEADER_LEN + payload..];
            v.push(h);
        }
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn hostile_request_streams_get_error_replies_or_a_close_never_a_panic(
            chunks in proptest::collection::vec(chunk(), 1..12)
        ) {
            let (ctx, handle) = ctx();
            let mut s = MemStream { input: Cursor::new(encode(&chunks, handle)), output: Vec::new() };
            let _ = serve_requests(&mut s, &ctx, "test", &mut |_| {
                Err(io::Error::other("no idle waits in memory"))
            });
            for h in replies(&s.output) {
                if h.opcode == Opcode::ReadData {
                    // Data is only ever served from inside the segment.
                    prop_assert!(h.length <= SEG);
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_pass_the_handshake(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let (ctx, _) = ctx();
            let mut s = MemStream { input: Cursor::new(bytes), output: Vec::new() };
            prop_assert!(wire::server_handshake(&mut s, &ctx.key).is_err());
            for h in replies(&s.output) {
                prop_assert!(matches!(h.opcode, Opcode::Challenge | Opcode::Error));
            }
        }
    }

    #[test]
    fn out_of_bounds_and_unknown_handles_get_errors_and_the_connection_goes_on() {
        let (ctx, handle) = ctx();
        let mut input = Vec::new();
        let mut push =
            |op: Opcode, id: u64, handle: u32, offset: u64, length: u64, payload: &[u8]| {
                let mut h = Header::new(op, id);
                h.handle = handle;
                h.offset = offset;
                h.length = length;
                input.extend_from_slice(&h.encode());
                input.extend_from_slice(payload);
            };
        push(Opcode::Write, 1, handle, SEG - 2, 4, b"abcd"); // crosses the end
        push(Opcode::Read, 2, handle + 1, 0, 4, b""); // unknown handle
        push(Opcode::Read, 3, handle, u64::MAX - 1, 4, b""); // offset overflow
        push(Opcode::Write, 4, handle, 10, 4, b"wxyz"); // fine
        push(Opcode::Read, 5, handle, 10, 4, b""); // fine
        let mut s = MemStream {
            input: Cursor::new(input),
            output: Vec::new(),
        };
        serve_requests(&mut s, &ctx, "t", &mut |_| Err(io::Error::other("eof"))).unwrap();
        let r = replies(&s.output);
        let kinds: Vec<_> = r
            .iter()
            .map(|h| (h.request_id, h.opcode, h.status))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (1, Opcode::Error, ErrorCode::OutOfBounds as u32),
                (2, Opcode::Error, ErrorCode::UnknownSegment as u32),
                (3, Opcode::Error, ErrorCode::OutOfBounds as u32),
                (4, Opcode::WriteAck, 0),
                (5, Opcode::ReadData, 0),
            ]
        );
        assert!(s.output.ends_with(b"wxyz"));
        let seg = ctx.registry.get(handle).unwrap();
        let mut tail = [0u8; 2];
        seg.read_at(SEG - 2, &mut tail).unwrap();
        assert_eq!(tail, [0, 0], "rejected write left no bytes behind");
    }

    #[test]
    fn rdma_connect_gets_unsupported_or_malformed_and_the_connection_goes_on() {
        use crate::rdma::handshake::{ConnectRequest, MTU_1024, QpInfo};
        let (ctx, handle) = ctx();
        let good = ConnectRequest {
            segment: "seg".into(),
            qps: vec![QpInfo {
                device: "mlx5_0".into(),
                qp_num: 9,
                psn: 1,
                lid: 0,
                gid: [0; 16],
                mtu: MTU_1024,
            }],
        }
        .encode()
        .unwrap();
        let mut input = Vec::new();
        let mut push = |op: Opcode, id: u64, payload: &[u8]| {
            let mut h = Header::new(op, id);
            h.handle = handle;
            h.length = payload.len() as u64;
            input.extend_from_slice(&h.encode());
            input.extend_from_slice(payload);
        };
        push(Opcode::RdmaConnect, 1, &good); // no RDMA provider here
        push(Opcode::RdmaConnect, 2, b"\x07garbage"); // bad handshake version
        let mut read = Header::new(Opcode::Read, 3);
        read.handle = handle;
        read.length = 4;
        input.extend_from_slice(&read.encode());
        let mut s = MemStream {
            input: Cursor::new(input),
            output: Vec::new(),
        };
        serve_requests(&mut s, &ctx, "test", &mut |_| Ok(())).unwrap();
        let got: Vec<_> = replies(&s.output)
            .iter()
            .map(|h| (h.request_id, h.opcode, h.status))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, Opcode::Error, ErrorCode::Unsupported as u32),
                (2, Opcode::Error, ErrorCode::Malformed as u32),
                (3, Opcode::ReadData, 0),
            ]
        );
    }

    #[test]
    fn wrong_key_fails_both_sides_of_the_handshake() {
        use std::os::unix::net::UnixStream;
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let key = AuthKey::new(*b"0123456789abcdef").unwrap();
            wire::server_handshake(&mut b, &key)
        });
        let wrong = AuthKey::new(*b"fedcba9876543210").unwrap();
        let client = wire::client_handshake(&mut a, &wrong);
        assert!(matches!(client, Err(WireError::Auth(_))), "{client:?}");
        drop(a);
        assert!(t.join().unwrap().is_err());
    }
}
