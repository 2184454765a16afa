//! Transfers run by the calling thread itself: for a small batch to one peer, handing slices
//! to a lane's sender thread and waiting for its receiver thread costs more than the bytes
//! (two thread wake-ups each way on a busy machine). Here the caller takes an idle connection
//! of the peer (or dials one), writes the frames, reads the replies in order and gives the
//! connection back. The wire protocol is the lanes' own; the target cannot tell them apart.
//! I/O boundary: the peer's direct TCP sockets.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;

use parking_lot::Mutex;

use super::{DialError, LaneConfig, data_frame};
use crate::error::Failure;
use crate::frame::{ErrorCode, Header, Opcode};
use crate::memory::{self, Segment, Span};
use crate::wire::{self, WireError, is_timeout};

/// Idle direct connections kept per peer; more are closed when given back.
const MAX_IDLE: usize = 16;

/// One slice of an inline transfer: one range, or (with `more`) several ranges of the same
/// segment in one vectored frame.
pub(crate) struct InlineSlice<'a> {
    pub(crate) write: bool,
    pub(crate) local: &'a Segment,
    pub(crate) local_offset: u64,
    pub(crate) handle: u32,
    pub(crate) instance: u32,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    pub(crate) more: Vec<InlinePart<'a>>,
}

/// A further range of a vectored inline slice.
pub(crate) struct InlinePart<'a> {
    pub(crate) local: &'a Segment,
    pub(crate) local_offset: u64,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

impl InlineSlice<'_> {
    fn remote_ranges(&self) -> Vec<(u64, u64)> {
        std::iter::once((self.remote_offset, self.len))
            .chain(self.more.iter().map(|p| (p.remote_offset, p.len)))
            .collect()
    }

    fn local_spans(&self) -> Vec<Span<'_>> {
        std::iter::once(Span::new(self.local, self.local_offset, self.len as usize))
            .chain(
                self.more
                    .iter()
                    .map(|p| Span::new(p.local, p.local_offset, p.len as usize)),
            )
            .collect()
    }

    pub(crate) fn total_len(&self) -> u64 {
        self.len + self.more.iter().map(|p| p.len).sum::<u64>()
    }
}

/// The idle direct connections of one peer.
#[derive(Default)]
pub(crate) struct DirectConns {
    idle: Mutex<Vec<TcpStream>>,
}

impl DirectConns {
    /// Run `slices` on a direct connection to `addr`; `settle(i, result)` is called once for
    /// every slice, in order. A pooled connection that turns out dead before any reply is
    /// replaced by a fresh one once (the target may have closed it while it was idle).
    pub(crate) fn run(
        &self,
        addr: std::net::SocketAddr,
        cfg: &LaneConfig,
        slices: &[InlineSlice<'_>],
        settle: &mut dyn FnMut(usize, Result<(), Failure>),
    ) {
        let mut done = 0usize;
        let mut retried = false;
        while done < slices.len() {
            let pooled = self.idle.lock().pop();
            let fresh = pooled.is_none();
            let mut stream = match pooled {
                Some(s) => s,
                None => match dial(addr, cfg) {
                    Ok(s) => s,
                    Err(f) => {
                        for i in done..slices.len() {
                            settle(i, Err(f.clone()));
                        }
                        return;
                    }
                },
            };
            let before = done;
            match run_on(&mut stream, addr, cfg, &slices[done..], &mut |i, r| {
                settle(before + i, r);
                done = before + i + 1;
            }) {
                Ok(()) => {
                    let mut idle = self.idle.lock();
                    if idle.len() < MAX_IDLE {
                        idle.push(stream);
                    } else {
                        cfg.metrics.direct_connections.dec();
                    }
                    return;
                }
                Err(f) => {
                    cfg.metrics.direct_connections.dec();
                    // Reset: a frame left unsent must not reach the target later.
                    wire::abort(&stream);
                    drop(stream);
                    // A stale pooled connection fails before its first reply: try once more
                    // on a fresh one (slices are idempotent: the same bytes at the same place).
                    if !fresh && !retried && done == before {
                        retried = true;
                        continue;
                    }
                    for i in done..slices.len() {
                        settle(i, Err(f.clone()));
                    }
                    return;
                }
            }
        }
    }

    /// Close every idle connection.
    pub(crate) fn close(&self, cfg: &LaneConfig) {
        let idle = std::mem::take(&mut *self.idle.lock());
        for _ in &idle {
            cfg.metrics.direct_connections.dec();
        }
    }
}

fn dial(addr: std::net::SocketAddr, cfg: &LaneConfig) -> Result<TcpStream, Failure> {
    let stream = cfg.dialer.dial(addr).map_err(|e| match e {
        DialError::Connect(source) => Failure::new(
            if is_timeout(&source) {
                "timeout"
            } else {
                "connect"
            },
            format!("connecting to {addr} failed: {source}"),
        ),
        DialError::Handshake(source) => Failure::new(
            "handshake",
            format!("handshake with {addr} failed: {source}"),
        ),
    })?;
    cfg.metrics.direct_connections.inc();
    Ok(stream)
}

/// Send the slices and read their replies, at most a window of them in flight. Mixed
/// directions go one at a time: a READ's payload could otherwise fill the socket while this
/// thread is still writing a WRITE's payload, and neither side would read.
fn run_on(
    stream: &mut TcpStream,
    addr: std::net::SocketAddr,
    cfg: &LaneConfig,
    slices: &[InlineSlice<'_>],
    settle: &mut dyn FnMut(usize, Result<(), Failure>),
) -> Result<(), Failure> {
    let mixed = slices.iter().any(|s| s.write) && slices.iter().any(|s| !s.write);
    let window = if mixed { 1 } else { cfg.window.max(1) };
    let io_failure = |e: io::Error, what: &str| {
        Failure::new(wire::io_category(&e), format!("{what} {addr} failed: {e}"))
    };
    for (chunk_no, chunk) in slices.chunks(window).enumerate() {
        let first = chunk_no * window;
        for (i, s) in chunk.iter().enumerate() {
            let id = (first + i) as u64 + 1;
            let head = data_frame(s.write, id, s.handle, s.instance, &s.remote_ranges());
            if !s.more.is_empty() {
                cfg.metrics.vectored_frames.inc();
                cfg.metrics
                    .vectored_requests
                    .inc_by(1 + s.more.len() as u64);
            }
            let sent = if s.write {
                memory::send_spans(
                    stream.as_fd(),
                    &head,
                    &s.local_spans(),
                    &mut wire::fail_on_timeout,
                )
            } else {
                use std::io::Write;
                stream.write_all(&head)
            };
            sent.map_err(|e| io_failure(e, "sending to"))?;
        }
        for (i, s) in chunk.iter().enumerate() {
            let id = (first + i) as u64 + 1;
            let result = read_reply(stream, addr, (cfg.max_slice, cfg.spin_wait), s, id)?;
            settle(first + i, result);
        }
    }
    Ok(())
}

/// Read the reply to slice `s` (request `id`): the slice's own result, or a connection failure.
pub(super) fn read_reply<S: io::Read + AsFd>(
    stream: &mut S,
    addr: std::net::SocketAddr,
    (max_slice, spin_wait): (u64, std::time::Duration),
    s: &InlineSlice<'_>,
    id: u64,
) -> Result<Result<(), Failure>, Failure> {
    // The outer error: the connection is unusable; the inner one: this slice failed.
    let conn = |f: Failure| f;
    wire::spin_until_readable(stream.as_fd(), spin_wait);
    let header = wire::read_header(stream, max_slice, &mut wire::fail_on_timeout).map_err(|e| {
        conn(match &e {
            WireError::Closed => {
                Failure::new("peer_closed", format!("{addr} closed the connection"))
            }
            WireError::Io(io) if is_timeout(io) => Failure::new("timeout", io.to_string()),
            other => Failure::from(other),
        })
    })?;
    if header.opcode == Opcode::Error {
        let reason =
            wire::read_control_payload(stream, &header).map_err(|e| conn(Failure::from(&e)))?;
        let reason = String::from_utf8_lossy(&reason).into_owned();
        if header.request_id == 0 {
            return Err(conn(Failure::new("remote", reason)));
        }
        if header.request_id != id {
            return Err(conn(unexpected(addr, &header, id)));
        }
        return Ok(Err(Failure::new(
            ErrorCode::from_u32(header.status).as_str(),
            reason,
        )));
    }
    if header.request_id != id {
        return Err(conn(unexpected(addr, &header, id)));
    }
    match (header.opcode, s.write) {
        (Opcode::WriteAck, true) => Ok(Ok(())),
        (Opcode::ReadData, false) if header.length == s.total_len() => {
            memory::recv_spans(stream.as_fd(), &s.local_spans(), &mut wire::fail_on_timeout)
                .map_err(|e| {
                    conn(Failure::new(
                        wire::io_category(&e),
                        format!("receiving from {addr} failed: {e}"),
                    ))
                })?;
            Ok(Ok(()))
        }
        (Opcode::ReadData, false) => Err(conn(Failure::new(
            "protocol",
            format!(
                "READ of {} bytes answered with {}",
                s.total_len(),
                header.length
            ),
        ))),
        (op, _) => Err(conn(Failure::new(
            "protocol",
            format!("unexpected {op:?} from {addr}"),
        ))),
    }
}

fn unexpected(addr: std::net::SocketAddr, header: &Header, id: u64) -> Failure {
    Failure::new(
        "protocol",
        format!(
            "reply for request {} while {id} was expected from {addr}",
            header.request_id
        ),
    )
}
