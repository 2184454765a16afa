//! Limits on the master's connections before they authenticate (issue 15): caps on open
//! connections in total and per source address, and a deadline by which a gRPC connection
//! must have made one authenticated call (the fast lane's deadline is in `fast`). I/O
//! boundary: the accepted TCP streams, wrapped for the gRPC server.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tonic::service::Interceptor;
use tonic::transport::server::Connected;

use kvpool_proto::auth::Verifier;
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
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            handshake_timeout: Duration::from_secs(10),
            max_connections: 4096,
            max_connections_per_source: 512,
        }
    }
}

/// Set once a call on the connection passed authentication; the gRPC server hands it to every
/// call as the connection's info.
#[derive(Clone, Debug)]
pub(super) struct ConnAuth {
    authenticated: Arc<AtomicBool>,
}

impl ConnAuth {
    fn is_set(&self) -> bool {
        self.authenticated.load(Ordering::SeqCst)
    }
}

/// A gRPC connection: its place under the caps, and a deadline that fails its reads unless a
/// call authenticated before it passed.
pub(super) struct GrpcConn {
    stream: TcpStream,
    auth: ConnAuth,
    deadline: Option<Pin<Box<Sleep>>>,
    /// Counts the connection if the deadline cuts it.
    cut: prometheus::IntCounter,
    _slot: ConnectionSlot,
}

impl GrpcConn {
    pub(super) fn new(
        stream: TcpStream,
        slot: ConnectionSlot,
        handshake: Duration,
        cut: prometheus::IntCounter,
    ) -> Self {
        GrpcConn {
            stream,
            auth: ConnAuth {
                authenticated: Arc::default(),
            },
            deadline: Some(Box::pin(tokio::time::sleep(handshake))),
            cut,
            _slot: slot,
        }
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
        if this.deadline.is_some() && this.auth.is_set() {
            this.deadline = None;
        }
        if let Some(deadline) = &mut this.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            this.deadline = None;
            this.cut.inc();
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no authenticated call before the deadline",
            )));
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

/// The gRPC API's check of every call's credential, which also marks the call's connection
/// as authenticated (lifting its deadline).
#[derive(Clone, Debug)]
pub struct MarkingVerifier(pub Verifier);

impl Interceptor for MarkingVerifier {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let req = self.0.call(req)?;
        if let Some(auth) = req.extensions().get::<ConnAuth>() {
            auth.authenticated.store(true, Ordering::SeqCst);
        }
        Ok(req)
    }
}
