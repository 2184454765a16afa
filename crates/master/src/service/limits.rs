//! Limits on the master's connections (issue 15): caps on open connections in total and per
//! source address, a deadline by which a gRPC connection must have made one authenticated
//! call, and an idle timeout that closes an authenticated connection on which no call started
//! for that long (the fast lane's deadline and idle timeout are in `fast`). I/O boundary: the
//! accepted streams (plain or TLS), wrapped for the gRPC server.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;
use tonic::transport::server::Connected;

use super::tls::MasterIo;
use kvpool_runtime::http::ConnectionSlot;

/// Connection limits of the master's port (gRPC and fast lane together).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// A new connection must authenticate within this: its first bytes, the fast lane's
    /// preface and first call's credential, or a gRPC connection's first authenticated call.
    pub handshake_timeout: Duration,
    /// Connections open at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub max_connections_per_source: usize,
    /// An authenticated connection on which no call started for this long is closed (clients
    /// reconnect on their next call). Longer than any one call may take.
    pub idle_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            handshake_timeout: Duration::from_secs(10),
            max_connections: 4096,
            max_connections_per_source: 512,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// Set once a call on the connection passed authentication, and stamped with each
/// authenticated call's start; the gRPC server hands it to every call as the connection's info.
#[derive(Clone, Debug, Default)]
pub(super) struct ConnAuth {
    authenticated: Arc<AtomicBool>,
    /// Milliseconds after `epoch` at which the last authenticated call started.
    last_call_ms: Arc<AtomicU64>,
    epoch: Arc<OnceInstant>,
}

/// The connection's creation time, the zero of `last_call_ms`.
#[derive(Debug)]
struct OnceInstant(tokio::time::Instant);

impl Default for OnceInstant {
    fn default() -> Self {
        OnceInstant(tokio::time::Instant::now())
    }
}

impl ConnAuth {
    fn is_set(&self) -> bool {
        self.authenticated.load(Ordering::SeqCst)
    }

    pub(super) fn mark_call(&self) {
        let ms = u64::try_from(self.epoch.0.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_call_ms.store(ms, Ordering::SeqCst);
        self.authenticated.store(true, Ordering::SeqCst);
    }

    /// When the connection counts as idle unless another call starts first.
    fn idle_at(&self, idle: Duration) -> tokio::time::Instant {
        self.epoch.0 + Duration::from_millis(self.last_call_ms.load(Ordering::SeqCst)) + idle
    }
}

/// A gRPC connection: its place under the caps, and a deadline that fails its reads unless a
/// call authenticated before it passed.
pub(super) struct GrpcConn {
    stream: MasterIo,
    auth: ConnAuth,
    /// Until the first authenticated call: the handshake deadline; after it: the idle timer.
    deadline: Option<Pin<Box<Sleep>>>,
    idle: Duration,
    /// Count the connection if the handshake deadline or the idle timeout cuts it.
    cut: prometheus::IntCounter,
    idle_cut: prometheus::IntCounter,
    _slot: ConnectionSlot,
}

impl GrpcConn {
    pub(super) fn new(
        stream: MasterIo,
        slot: ConnectionSlot,
        handshake: Duration,
        idle: Duration,
        cuts: [prometheus::IntCounter; 2],
    ) -> Self {
        let [cut, idle_cut] = cuts;
        GrpcConn {
            stream,
            auth: ConnAuth::default(),
            deadline: Some(Box::pin(tokio::time::sleep(handshake))),
            idle,
            cut,
            idle_cut,
            _slot: slot,
        }
    }

    /// Whether the connection's timer ended it: before authentication, the handshake deadline;
    /// after, no call started for `idle` (the timer is moved on while calls keep starting).
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        let authenticated = self.auth.is_set();
        let timer = self.deadline.as_mut()?;
        if authenticated {
            let idle_at = self.auth.idle_at(self.idle);
            if timer.deadline() != idle_at {
                timer.as_mut().reset(idle_at);
            }
        }
        timer.as_mut().poll(cx).is_ready().then(|| {
            self.deadline = None;
            if authenticated {
                self.idle_cut.inc();
                "no call on the connection for the idle timeout"
            } else {
                self.cut.inc();
                "no authenticated call before the deadline"
            }
        })
    }
}

impl Connected for GrpcConn {
    type ConnectInfo = ConnAuth;

    fn connect_info(&self) -> ConnAuth {
        self.auth.clone()
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(why) = this.expired(cx) {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
