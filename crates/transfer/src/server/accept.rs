//! The TCP target's front door: which accepted connections are served (a total cap, a cap per
//! source address, and a separate, lower cap on connections still in the handshake, where the
//! oldest unauthenticated one makes room for a newcomer), the whole-handshake deadline, TLS or
//! plaintext (told apart by a connection's first byte, see `tls`), and the thread per
//! connection. I/O boundary: the listener and the accepted sockets.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use socket2::{Domain, Protocol, Socket, Type};

use super::sealed::SealedStream;
use super::tls_target::TlsTarget;
use super::{ServerCtx, ServerShared, serve_requests};
use crate::frame::ErrorCode;
use crate::seal::SessionKeys;
use crate::tls::{self, TLS_HANDSHAKE_RECORD};
use crate::wire::{self, WireError};
use crate::{Integrity, TlsMode};

/// Connections idle (between frames) longer than this are closed by the target.
const IDLE_LIMIT: Duration = Duration::from_secs(600);

/// Connections the kernel queues for the accept thread (capped by `net.core.somaxconn`). std's
/// `TcpListener::bind` asks for 128: when a burst of peers (every node's lanes after a restart)
/// outran the accept thread, the kernel dropped the extra SYNs and those peers waited a whole
/// SYN retransmission (1 s, then 3 s) before they were even queued.
const LISTEN_BACKLOG: i32 = 1024;

/// A listener on `addr` with [`LISTEN_BACKLOG`]; otherwise what `TcpListener::bind` makes
/// (`SO_REUSEADDR`, close-on-exec).
pub(crate) fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// The caps the front door applies (from [`crate::EngineConfig`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdmissionLimits {
    /// Connections open at once, authenticated or not.
    pub(crate) max_connections: usize,
    /// Connections open at once from one source address.
    pub(crate) max_per_source: usize,
    /// Connections still in the handshake; at the cap, the oldest of them is closed to make
    /// room, so a real peer gets in even while unauthenticated ones pile up.
    pub(crate) max_handshakes: usize,
}

/// Why a connection was closed as soon as it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    MaxConnections,
    PerSource,
}

impl Refused {
    /// Label of `kvpool_transfer_target_refused_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Refused::MaxConnections => "max_connections",
            Refused::PerSource => "per_source",
        }
    }
}

#[derive(Default)]
struct AdmissionState {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
    /// Ids of connections still in the handshake; ids grow, so the first is the oldest.
    handshaking: BTreeSet<u64>,
}

/// Counts of open connections, kept by the accept loop and the connection threads.
pub(crate) struct Admission {
    limits: AdmissionLimits,
    state: Mutex<AdmissionState>,
}

impl Admission {
    pub(crate) fn new(limits: AdmissionLimits) -> Self {
        Admission {
            limits,
            state: Mutex::default(),
        }
    }

    /// Admit connection `id` from `source`, or say why not. `Ok(Some(old))`: admitted, and the
    /// handshaking connection `old` must be closed to make room for it.
    pub(crate) fn admit(&self, id: u64, source: IpAddr) -> Result<Option<u64>, Refused> {
        let mut st = self.state.lock();
        if st.total >= self.limits.max_connections {
            return Err(Refused::MaxConnections);
        }
        let from_source = st.by_source.get(&source).copied().unwrap_or(0);
        if from_source >= self.limits.max_per_source {
            return Err(Refused::PerSource);
        }
        let evict = if st.handshaking.len() >= self.limits.max_handshakes {
            st.handshaking.pop_first()
        } else {
            None
        };
        st.total += 1;
        *st.by_source.entry(source).or_default() += 1;
        st.handshaking.insert(id);
        Ok(evict)
    }

    /// Connection `id` finished its handshake; false if it had been evicted meanwhile.
    pub(crate) fn authenticated(&self, id: u64) -> bool {
        self.state.lock().handshaking.remove(&id)
    }

    /// Connection `id` from `source` is gone.
    pub(crate) fn release(&self, id: u64, source: IpAddr) {
        let mut st = self.state.lock();
        st.handshaking.remove(&id);
        st.total = st.total.saturating_sub(1);
        if let Some(n) = st.by_source.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                st.by_source.remove(&source);
            }
        }
    }

    /// Connections still in the handshake.
    pub(crate) fn handshaking(&self) -> usize {
        self.state.lock().handshaking.len()
    }
}

/// A stream whose every read and write gives up at one instant: the handshake as a whole has a
/// deadline, so a peer trickling a byte at a time cannot hold its connection past it. `sock`
/// is the socket under `stream` (the same one, or the one TLS runs over).
struct Deadline<'a, S> {
    stream: &'a mut S,
    sock: &'a TcpStream,
    until: Instant,
}

impl<S> Deadline<'_, S> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        Ok(left)
    }
}

impl<S: Read> Read for Deadline<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl<S: Write> Write for Deadline<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.sock.set_write_timeout(Some(left))?;
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

pub(super) fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>, ctx: Arc<ServerCtx>) {
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
        let Ok(source) = stream.peer_addr().map(|a| a.ip()) else {
            continue;
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let evict = match shared.admission.admit(id, source) {
            Ok(evict) => evict,
            Err(why) => {
                // Bounded: refuse instead of spawning without limit.
                if why == Refused::MaxConnections {
                    ctx.metrics
                        .failures
                        .with_label_values(&["tcp", "too_many_connections"])
                        .inc();
                }
                ctx.metrics
                    .target_refused
                    .with_label_values(&[why.label()])
                    .inc();
                tracing::debug!(%source, reason = why.label(), "refusing a transfer connection");
                let _ = stream.shutdown(Shutdown::Both);
                continue;
            }
        };
        if let Some(old) = evict {
            if let Some(s) = shared.conns.lock().get(&old) {
                let _ = s.shutdown(Shutdown::Both);
            }
            ctx.metrics
                .target_closed
                .with_label_values(&["evicted"])
                .inc();
        }
        ctx.metrics
            .target_handshakes
            .set(shared.admission.handshaking() as i64);
        let Ok(clone) = stream.try_clone() else {
            shared.admission.release(id, source);
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
                serve_tcp_conn(stream, &cx, &sh, id);
                sh.conns.lock().remove(&id);
                sh.admission.release(id, source);
                cx.metrics
                    .target_handshakes
                    .set(sh.admission.handshaking() as i64);
                cx.metrics.target_connections.dec();
            });
        let mut workers = shared.workers.lock();
        workers.retain(|w| !w.is_finished());
        match spawned {
            Ok(h) => workers.push(h),
            Err(e) => {
                tracing::warn!(error = %e, "cannot spawn a connection thread");
                shared.conns.lock().remove(&id);
                shared.admission.release(id, source);
            }
        }
    }
}

/// The first byte of a new connection, left unread; `Ok(None)`: closed before one came.
fn first_byte(stream: &TcpStream, until: Instant) -> io::Result<Option<u8>> {
    let mut b = [0u8; 1];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.peek(&mut b) {
            Ok(0) => return Ok(None),
            Ok(_) => return Ok(Some(b[0])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Count a refused or failed TLS handshake on the target side and make it an error.
fn tls_failure(ctx: &ServerCtx, reason: &'static str, detail: String) -> WireError {
    ctx.metrics
        .tls_handshake_failures
        .with_label_values(&["target", reason])
        .inc();
    WireError::Tls { reason, detail }
}

/// The whole handshake of an accepted connection, within `until`: TLS (when its first byte
/// starts a TLS handshake record and TLS is not `off`) and then the transfer handshake. The
/// TLS stream when TLS is on, the session keys when per-frame integrity was agreed (never
/// inside TLS).
fn handshake(
    stream: &mut TcpStream,
    ctx: &ServerCtx,
    until: Instant,
) -> Result<(Option<Box<TlsTarget>>, Option<SessionKeys>), WireError> {
    let Some(first) = first_byte(stream, until).map_err(WireError::Io)? else {
        return Err(WireError::Closed);
    };
    let sock = stream.try_clone().map_err(WireError::Io)?;
    let is_tls = first == TLS_HANDSHAKE_RECORD;
    match (is_tls, ctx.tls, &ctx.tls_server) {
        (true, TlsMode::Off, _) | (true, _, None) => Err(tls_failure(
            ctx,
            "tls_off",
            "a TLS handshake to a target whose transfer TLS is off".into(),
        )),
        (false, TlsMode::Require, _) => {
            let reason = "this target requires TLS on transfer connections: set the \
                          initiator's transfer TLS to require";
            let refused = tls_failure(ctx, "plaintext_refused", reason.into());
            let _ = wire::write_error(
                &mut Deadline {
                    stream: &mut *stream,
                    sock: &sock,
                    until,
                },
                0,
                ErrorCode::Tls,
                reason,
            );
            linger(stream);
            Err(refused)
        }
        (true, _, Some(config)) => {
            let tls_sock = stream.try_clone().map_err(WireError::Io)?;
            let mut tls = TlsTarget::accept(
                config,
                tls_sock,
                &mut Deadline {
                    stream: &mut *stream,
                    sock: &sock,
                    until,
                },
            )
            .map_err(|e| {
                tls_failure(ctx, tls::failure_reason(&e), format!("TLS handshake: {e}"))
            })?;
            // Inside TLS every byte is protected already: no sealed records.
            let keys = wire::server_handshake_opts(
                &mut Deadline {
                    stream: &mut tls,
                    sock: &sock,
                    until,
                },
                &ctx.key,
                Integrity::Off,
            )?;
            Ok((Some(Box::new(tls)), keys))
        }
        (false, _, _) => {
            let keys = wire::server_handshake_opts(
                &mut Deadline {
                    stream: &mut *stream,
                    sock: &sock,
                    until,
                },
                &ctx.key,
                ctx.integrity,
            )?;
            Ok((None, keys))
        }
    }
}

fn serve_tcp_conn(mut stream: TcpStream, ctx: &ServerCtx, shared: &ServerShared, id: u64) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown".into());
    let _ = stream.set_nodelay(true);
    // The handshake as a whole (TLS included) must finish within `handshake_timeout`.
    let until = Instant::now() + ctx.handshake_timeout;
    let shook = handshake(&mut stream, ctx, until);
    let still_admitted = shared.admission.authenticated(id);
    ctx.metrics
        .target_handshakes
        .set(shared.admission.handshaking() as i64);
    let (tls, keys) = match shook {
        Ok(shook) => shook,
        Err(e) => {
            // An evicted connection was already counted when it was evicted.
            if still_admitted {
                let reason = match (&e, e.category()) {
                    (
                        WireError::Tls {
                            reason: "timeout", ..
                        },
                        _,
                    )
                    | (_, "timeout") => "handshake_timeout",
                    (_, "peer_closed" | "io") => "handshake_aborted",
                    _ => "handshake_failed",
                };
                ctx.metrics.target_closed.with_label_values(&[reason]).inc();
            }
            tracing::debug!(%peer, error = %e, "transfer handshake failed");
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    if !still_admitted {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    // Every payload uses the full timeout; idle waits between frames are allowed up to
    // IDLE_LIMIT (connection reuse). Shutdown closes the socket to wake us.
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
    let served = match (tls, keys) {
        (Some(mut tls), _) => {
            let served = serve_requests(&mut *tls, ctx, &peer, &mut on_idle);
            let _ = tls.socket().shutdown(Shutdown::Both);
            served
        }
        (None, None) => serve_requests(&mut stream, ctx, &peer, &mut on_idle),
        (None, Some(keys)) => match SealedStream::new(&stream, &keys) {
            Ok(mut sealed) => {
                let served = serve_requests(&mut sealed, ctx, &peer, &mut on_idle);
                if let Err(e) = &served
                    && e.category() == "integrity"
                {
                    // Tell the initiator why before closing (its own direction is intact).
                    let _ = wire::write_error(
                        &mut sealed,
                        0,
                        ErrorCode::Integrity,
                        &crate::error::error_chain(e),
                    );
                    linger(&stream);
                }
                served
            }
            Err(e) => Err(WireError::Io(e)),
        },
    };
    match served {
        Ok(()) => tracing::debug!(%peer, "transfer connection closed by peer"),
        Err(e) if e.category() == "integrity" => {
            ctx.metrics
                .integrity_failures
                .with_label_values(&["target"])
                .inc();
            tracing::warn!(%peer, error = %crate::error::error_chain(&e), "closing a transfer connection");
        }
        Err(e) => tracing::debug!(%peer, error = %e, "transfer connection ended"),
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// After a connection-level ERROR: stop sending and read what the initiator still sends for a
/// short while, so that the ERROR reaches it before the close resets the connection (a close
/// with unread bytes sends RST, which may discard the reply in flight).
fn linger(stream: &TcpStream) {
    const LINGER: Duration = Duration::from_secs(1);
    const MAX_DRAIN: usize = 64 * 1024 * 1024;
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(LINGER));
    let until = Instant::now() + LINGER;
    let mut scratch = vec![0u8; 64 * 1024];
    let mut drained = 0usize;
    let mut s = stream;
    while Instant::now() < until && drained < MAX_DRAIN {
        match s.read(&mut scratch) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            max_connections: 5,
            max_per_source: 3,
            max_handshakes: 2,
        }
    }

    #[test]
    fn caps_apply_per_source_and_in_total() {
        let a = Admission::new(limits());
        let (x, y): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        for id in 0..3 {
            assert!(a.admit(id, x).is_ok());
            assert!(a.authenticated(id));
        }
        assert_eq!(a.admit(3, x), Err(Refused::PerSource));
        assert_eq!(a.admit(4, y), Ok(None));
        assert_eq!(a.admit(5, y), Ok(None));
        assert_eq!(a.admit(6, y), Err(Refused::MaxConnections));
        a.release(0, x);
        assert_eq!(
            a.admit(7, x),
            Ok(Some(4)),
            "the oldest handshake makes room"
        );
        assert!(!a.authenticated(4));
        assert!(a.authenticated(5));
        assert_eq!(a.handshaking(), 1);
    }

    /// The kernel queues at least 300 connects the accept thread has not taken yet. With
    /// std's backlog of 128 the 130th connect would wait for a SYN retransmission (1 s, then
    /// 3 s: nothing accepts here), past the 2 s timeout.
    #[test]
    fn listener_queues_a_burst_of_connects() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .expect("read net.core.somaxconn")
            .trim()
            .parse()
            .expect("net.core.somaxconn is a number");
        let burst = somaxconn.min(300);
        assert!(
            burst > 200,
            "net.core.somaxconn is {somaxconn}: the kernel caps every backlog below what this test needs"
        );
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let held: Vec<TcpStream> = (0..burst)
            .map(|i| {
                TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                    .unwrap_or_else(|e| panic!("connect {i} of {burst} was not queued: {e}"))
            })
            .collect();
        assert_eq!(held.len(), burst);
    }
}
