//! Initiator side of the TCP transport: a peer is a set of lanes (connections), each driven by
//! a sender thread and a receiver thread so that slices are pipelined; payloads move straight
//! between sockets and segment memory. I/O boundary: the outgoing TCP sockets.
//!
//! Every slice is settled exactly once: by its reply, by the failure of its lane, or — if it
//! is dropped anywhere on the way (a queue torn down, a thread gone) — by its `Drop`, which
//! fails it. So no request can stay pending forever.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::auth::AuthKey;
use super::batch::RequestState;
use super::error::{Failure, TransferError, error_chain};
use super::frame::{ErrorCode, Header, Opcode};
use super::memory::{self, Segment};
use super::metrics::TransferMetrics;
use super::wire::{self, WireError};

/// What a slice does.
pub(crate) enum SliceKind {
    Read,
    Write,
    /// A control request (OPEN, NOTIFY) with its payload; the reply header is stored in `reply`.
    Control {
        opcode: Opcode,
        payload: Vec<u8>,
        reply: Arc<Mutex<Option<Header>>>,
    },
}

/// One unit of work on one lane: a piece of a request.
pub(crate) struct Slice {
    pub(crate) req: Option<Arc<RequestState>>,
    pub(crate) kind: SliceKind,
    pub(crate) local: Option<Arc<Segment>>,
    pub(crate) local_offset: u64,
    pub(crate) handle: u32,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

impl Slice {
    /// Settle the slice. The segment reference is released before the request is told, so a
    /// caller that sees its batch finish also sees every transfer's hold on its memory gone.
    fn settle(mut self, result: Result<(), Failure>) {
        self.local = None;
        if let Some(req) = self.req.take() {
            req.slice_done(result);
        }
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.local = None;
        if let Some(req) = self.req.take() {
            req.slice_done(Err(Failure::new(
                "lane_closed",
                "the connection carrying this request closed before it completed",
            )));
        }
    }
}

struct InFlight {
    slice: Slice,
    id: u64,
    sent_at: Instant,
}

/// Settings shared by all lanes of an engine.
#[derive(Clone)]
pub(crate) struct LaneConfig {
    pub(crate) key: AuthKey,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) window: usize,
    pub(crate) max_slice: u64,
    pub(crate) metrics: TransferMetrics,
}

struct LaneShared {
    stream: TcpStream,
    peer: SocketAddr,
    outstanding: Mutex<VecDeque<InFlight>>,
    cv: Condvar,
    dead: AtomicBool,
    reason: Mutex<Option<Failure>>,
    next_id: AtomicU64,
    cfg: LaneConfig,
}

impl LaneShared {
    /// Mark the lane dead (once), close the socket and fail everything in flight.
    fn fail(&self, failure: Failure) {
        self.close(failure, true);
    }

    fn close(&self, failure: Failure, is_error: bool) {
        {
            // The reason is recorded before `dead` is raised, so whoever sees `dead` also sees
            // why; the first caller wins.
            let mut reason = self.reason.lock();
            if reason.is_some() {
                return;
            }
            *reason = Some(failure.clone());
        }
        self.dead.store(true, Ordering::SeqCst);
        if is_error {
            tracing::warn!(peer = %self.peer, reason = %failure, "transfer lane failed");
        } else {
            tracing::debug!(peer = %self.peer, "transfer lane closed");
        }
        self.cfg.metrics.connections.dec();
        let _ = self.stream.shutdown(Shutdown::Both);
        let drained: Vec<InFlight> = self.outstanding.lock().drain(..).collect();
        self.cv.notify_all();
        for f in drained {
            f.slice.settle(Err(failure.clone()));
        }
    }

    fn failure(&self) -> Failure {
        self.reason
            .lock()
            .clone()
            .unwrap_or_else(|| Failure::new("lane_closed", "connection closed"))
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
}

/// One connection to a peer with its two threads.
pub(crate) struct Lane {
    shared: Arc<LaneShared>,
    tx: Option<SyncSender<Slice>>,
    threads: Vec<JoinHandle<()>>,
}

/// Poll interval of blocked lane threads (deadline checks); not a timeout itself.
const TICK: Duration = Duration::from_millis(100);

impl Lane {
    fn connect(addr: SocketAddr, cfg: &LaneConfig) -> Result<Lane, TransferError> {
        let peer = addr.to_string();
        let connect_err = |source: io::Error| TransferError::Connect {
            peer: peer.clone(),
            source,
        };
        let mut stream =
            TcpStream::connect_timeout(&addr, cfg.connect_timeout).map_err(connect_err)?;
        stream.set_nodelay(true).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(cfg.timeout))
            .map_err(connect_err)?;
        stream
            .set_write_timeout(Some(cfg.timeout))
            .map_err(connect_err)?;
        wire::client_handshake(&mut stream, &cfg.key).map_err(|source| {
            TransferError::Handshake {
                peer: peer.clone(),
                source,
            }
        })?;
        // From now on reads wake up every tick so that the receiver can apply per-slice
        // deadlines while the connection is otherwise idle.
        stream
            .set_read_timeout(Some(TICK.min(cfg.timeout)))
            .map_err(connect_err)?;
        let reader = stream.try_clone().map_err(connect_err)?;
        let writer = stream.try_clone().map_err(connect_err)?;
        let shared = Arc::new(LaneShared {
            stream,
            peer: addr,
            outstanding: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            next_id: AtomicU64::new(1),
            cfg: cfg.clone(),
        });
        cfg.metrics.connections.inc();
        let (tx, rx) = sync_channel::<Slice>(cfg.window.max(1));
        let mut threads = Vec::new();
        let sh = shared.clone();
        let spawn_err = |source: io::Error| TransferError::Connect {
            peer: peer.clone(),
            source,
        };
        match std::thread::Builder::new()
            .name("kvpool-xfer-tx".into())
            .spawn(move || sender_loop(sh, writer, rx))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                shared.fail(Failure::new("io", "cannot spawn lane thread"));
                return Err(spawn_err(e));
            }
        }
        let sh = shared.clone();
        match std::thread::Builder::new()
            .name("kvpool-xfer-rx".into())
            .spawn(move || receiver_loop(sh, reader))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                shared.fail(Failure::new("io", "cannot spawn lane thread"));
                drop(tx);
                for t in threads {
                    let _ = t.join();
                }
                return Err(spawn_err(e));
            }
        }
        Ok(Lane {
            shared,
            tx: Some(tx),
            threads,
        })
    }

    fn is_dead(&self) -> bool {
        self.shared.is_dead()
    }

    /// Queue a slice; blocks while the lane's queue is full (backpressure). A slice that cannot
    /// be queued is failed with the lane's reason.
    fn send(&self, slice: Slice) {
        let Some(tx) = &self.tx else {
            slice.settle(Err(self.shared.failure()));
            return;
        };
        let mut slice = slice;
        loop {
            if self.is_dead() {
                slice.settle(Err(self.shared.failure()));
                return;
            }
            match tx.try_send(slice) {
                Ok(()) => return,
                Err(TrySendError::Full(s)) => {
                    slice = s;
                    // Wait for the sender thread to take something off the queue.
                    let mut q = self.shared.outstanding.lock();
                    self.shared.cv.wait_for(&mut q, TICK);
                }
                Err(TrySendError::Disconnected(s)) => {
                    s.settle(Err(self.shared.failure()));
                    return;
                }
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.shared.fail(Failure::new(
            "lane_closed",
            "connection closed by the initiator",
        ));
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn sender_loop(sh: Arc<LaneShared>, mut stream: TcpStream, rx: Receiver<Slice>) {
    loop {
        let slice = match rx.recv_timeout(TICK) {
            Ok(s) => s,
            Err(RecvTimeoutError::Timeout) if sh.is_dead() => break,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        // A queue slot freed: wake a submitter blocked in `Lane::send`.
        sh.cv.notify_all();
        if sh.is_dead() {
            slice.settle(Err(sh.failure()));
            continue;
        }
        {
            let mut q = sh.outstanding.lock();
            while q.len() >= sh.cfg.window && !sh.is_dead() {
                sh.cv.wait_for(&mut q, TICK);
            }
        }
        if sh.is_dead() {
            slice.settle(Err(sh.failure()));
            continue;
        }
        let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
        let mut header;
        let mut payload: Option<(Arc<Segment>, u64, usize)> = None;
        let mut control: Vec<u8> = Vec::new();
        match &slice.kind {
            SliceKind::Read => {
                header = Header::new(Opcode::Read, id);
                header.length = slice.len;
            }
            SliceKind::Write => {
                header = Header::new(Opcode::Write, id);
                header.length = slice.len;
                if let Some(seg) = &slice.local {
                    payload = Some((seg.clone(), slice.local_offset, slice.len as usize));
                }
            }
            SliceKind::Control {
                opcode, payload: p, ..
            } => {
                header = Header::new(*opcode, id);
                header.length = p.len() as u64;
                control = p.clone();
            }
        }
        header.handle = slice.handle;
        header.offset = slice.remote_offset;
        {
            // Check `dead` under the queue lock: `fail` sets it before draining under the same
            // lock, so a slice is either drained by `fail` or never queued on a dead lane.
            let mut q = sh.outstanding.lock();
            if sh.is_dead() {
                drop(q);
                slice.settle(Err(sh.failure()));
                continue;
            }
            q.push_back(InFlight {
                slice,
                id,
                sent_at: Instant::now(),
            });
        }
        let result = send_frame(&mut stream, &header, &control, payload);
        if let Err(e) = result {
            sh.fail(Failure::new(
                if is_timeout(&e) { "timeout" } else { "io" },
                format!("sending to {} failed: {e}", sh.peer),
            ));
        }
    }
    // Anything still queued is failed by Slice::drop when `rx` drops here.
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn send_frame(
    stream: &mut TcpStream,
    header: &Header,
    control: &[u8],
    payload: Option<(Arc<Segment>, u64, usize)>,
) -> io::Result<()> {
    use std::io::Write;
    if let Some((seg, off, len)) = payload {
        return memory::send_prefixed(
            stream.as_fd(),
            &header.encode(),
            &seg,
            off,
            len,
            &mut wire::fail_on_timeout,
        );
    }
    let mut buf = Vec::with_capacity(super::frame::HEADER_LEN + control.len());
    buf.extend_from_slice(&header.encode());
    buf.extend_from_slice(control);
    stream.write_all(&buf)
}

fn receiver_loop(sh: Arc<LaneShared>, mut stream: TcpStream) {
    let timeout = sh.cfg.timeout;
    let mut deadline_check = || -> io::Result<()> {
        if sh.is_dead() {
            return Err(io::Error::other("lane closed"));
        }
        let q = sh.outstanding.lock();
        match q.front() {
            Some(f) if f.sent_at.elapsed() > timeout => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no reply from {} within {timeout:?}", sh.peer),
            )),
            _ => Ok(()),
        }
    };
    loop {
        let header = match wire::read_header(&mut stream, sh.cfg.max_slice, &mut deadline_check) {
            Ok(h) => h,
            Err(e) => {
                let failure = match &e {
                    WireError::Closed => {
                        Failure::new("peer_closed", format!("{} closed the connection", sh.peer))
                    }
                    WireError::Io(io) if is_timeout(io) => Failure::new("timeout", io.to_string()),
                    other => Failure::from(other),
                };
                sh.fail(failure);
                return;
            }
        };
        let Some(inflight) = sh.outstanding.lock().pop_front() else {
            sh.fail(Failure::new(
                "protocol",
                format!("unsolicited {:?} from {}", header.opcode, sh.peer),
            ));
            return;
        };
        sh.cv.notify_all();
        // Replies come in order; only a connection-level ERROR (request id 0) may name no request.
        let connection_error = header.opcode == Opcode::Error && header.request_id == 0;
        if inflight.id != header.request_id && !connection_error {
            sh.fail(Failure::new(
                "protocol",
                format!(
                    "reply for request {} while {} was expected",
                    header.request_id, inflight.id
                ),
            ));
            inflight.slice.settle(Err(sh.failure()));
            return;
        }
        let slice = inflight.slice;
        let outcome: Result<Result<(), Failure>, Failure> = match (header.opcode, &slice.kind) {
            (Opcode::WriteAck, SliceKind::Write) => Ok(Ok(())),
            (Opcode::ReadData, SliceKind::Read) => {
                if header.length != slice.len {
                    Err(Failure::new(
                        "protocol",
                        format!(
                            "READ of {} bytes answered with {}",
                            slice.len, header.length
                        ),
                    ))
                } else if let Some(seg) = &slice.local {
                    let sent_at = inflight.sent_at;
                    let mut payload_deadline = || -> io::Result<()> {
                        if sent_at.elapsed() > timeout {
                            Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "read payload stalled",
                            ))
                        } else {
                            Ok(())
                        }
                    };
                    match memory::recv_into(
                        stream.as_fd(),
                        seg,
                        slice.local_offset,
                        slice.len as usize,
                        &mut payload_deadline,
                    ) {
                        Ok(()) => Ok(Ok(())),
                        Err(e) => Err(Failure::new(
                            if is_timeout(&e) { "timeout" } else { "io" },
                            format!("receiving from {} failed: {e}", sh.peer),
                        )),
                    }
                } else {
                    Err(Failure::new("protocol", "read slice without local memory"))
                }
            }
            (
                op @ (Opcode::OpenOk | Opcode::NotifyAck),
                SliceKind::Control { opcode, reply, .. },
            ) if (op == Opcode::OpenOk) == (*opcode == Opcode::Open) => {
                *reply.lock() = Some(header);
                Ok(Ok(()))
            }
            (Opcode::Error, _) => match wire::read_control_payload(&mut stream, &header) {
                Ok(reason) => {
                    let code = ErrorCode::from_u32(header.status);
                    let reason = String::from_utf8_lossy(&reason).into_owned();
                    if header.request_id == 0 {
                        // Connection-level error (malformed frame): the peer closes.
                        Err(Failure::new("remote", reason))
                    } else {
                        Ok(Err(Failure::new(code.as_str(), reason)))
                    }
                }
                Err(e) => Err(Failure::from(&e)),
            },
            (op, _) => Err(Failure::new(
                "protocol",
                format!("unexpected {op:?} from {}", sh.peer),
            )),
        };
        match outcome {
            Ok(result) => slice.settle(result),
            Err(lane_failure) => {
                slice.settle(Err(lane_failure.clone()));
                sh.fail(lane_failure);
                return;
            }
        }
    }
}

/// All lanes to one peer address, reconnected lazily when a lane has died.
pub(crate) struct Peer {
    addr: SocketAddr,
    lanes: Vec<Mutex<Option<Lane>>>,
    next: AtomicUsize,
    cfg: LaneConfig,
    /// The last failed connect attempt: while it is recent, slices fail at once instead of
    /// each waiting for its own connect timeout.
    last_connect_failure: Mutex<Option<(Instant, Failure)>>,
}

/// How long a failed connect attempt makes further attempts to the same peer fail fast.
const CONNECT_HOLDOFF: Duration = Duration::from_millis(500);

impl Peer {
    pub(crate) fn new(addr: SocketAddr, lanes: usize, cfg: LaneConfig) -> Self {
        Peer {
            addr,
            lanes: (0..lanes.max(1)).map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            cfg,
            last_connect_failure: Mutex::new(None),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queue a slice on the next lane (round robin), connecting it first if needed.
    pub(crate) fn dispatch(&self, slice: Slice) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        self.dispatch_on(i, slice);
    }

    pub(crate) fn dispatch_on(&self, lane: usize, slice: Slice) {
        let Some(slot) = self.lanes.get(lane % self.lanes.len()) else {
            return;
        };
        let mut slot = slot.lock();
        if slot.as_ref().is_none_or(Lane::is_dead) {
            // Drop (and join) a dead lane before replacing it.
            *slot = None;
            if let Some((at, f)) = &*self.last_connect_failure.lock()
                && at.elapsed() < CONNECT_HOLDOFF
            {
                slice.settle(Err(f.clone()));
                return;
            }
            match Lane::connect(self.addr, &self.cfg) {
                Ok(l) => {
                    *self.last_connect_failure.lock() = None;
                    *slot = Some(l);
                }
                Err(e) => {
                    let f = Failure::new(e.category(), error_chain(&e));
                    *self.last_connect_failure.lock() = Some((Instant::now(), f.clone()));
                    slice.settle(Err(f));
                    return;
                }
            }
        }
        if let Some(l) = slot.as_ref() {
            l.send(slice);
        }
    }

    /// Connect every lane now (used by `open` so that connection errors surface early).
    pub(crate) fn connect_first(&self) -> Result<(), TransferError> {
        let Some(slot) = self.lanes.first() else {
            return Ok(());
        };
        let mut slot = slot.lock();
        if slot.as_ref().is_none_or(Lane::is_dead) {
            *slot = None;
            *slot = Some(Lane::connect(self.addr, &self.cfg)?);
        }
        Ok(())
    }

    /// Close all lanes.
    pub(crate) fn close(&self) {
        for l in &self.lanes {
            *l.lock() = None;
        }
    }
}
