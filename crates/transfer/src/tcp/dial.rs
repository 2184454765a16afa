//! Dialing a peer: a TCP connection with Nagle off and a timeout on every read and write, then
//! the initiator side of the handshake. The lanes and the RDMA control connection both start
//! this way. I/O boundary: the outgoing TCP socket.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use rustls::ClientConnection;

use crate::auth::AuthKey;
use crate::seal::{Integrity, SessionKeys};
use crate::tls::{self, ClientTls};
use crate::wire::{self, WireError};

/// How to reach and authenticate to a peer: the pool's key and the timeouts.
#[derive(Clone)]
pub(crate) struct Dialer {
    pub(crate) key: AuthKey,
    /// Every wait on the peer (reply, payload, handshake) gives up after this long.
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    /// `Require`: lanes ask for per-frame integrity (see `seal`).
    pub(crate) integrity: Integrity,
    /// TLS `require`: lanes dial targets over TLS verified by this.
    pub(crate) tls: Option<Arc<ClientTls>>,
}

/// A lane's authenticated connection: its socket, the TLS connection over it (TLS `require`)
/// and the session keys of per-frame integrity (when asked for and granted; never in TLS).
pub(crate) struct LaneConn {
    pub(crate) stream: TcpStream,
    pub(crate) tls: Option<ClientConnection>,
    pub(crate) keys: Option<SessionKeys>,
}

/// Why dialing failed.
#[derive(Debug)]
pub(crate) enum DialError {
    /// Connecting, or setting the socket's options.
    Connect(io::Error),
    /// The handshake.
    Handshake(WireError),
}

impl Dialer {
    /// An authenticated connection to `addr`, reads and writes bounded by `timeout`.
    pub(crate) fn dial(&self, addr: SocketAddr) -> Result<TcpStream, DialError> {
        let mut s = self.connect(addr)?;
        wire::client_handshake(&mut s, &self.key).map_err(DialError::Handshake)?;
        Ok(s)
    }

    /// [`Dialer::dial`] for a lane: over TLS when the engine requires it (then the transfer
    /// handshake runs inside TLS), else asking for per-frame integrity when the engine
    /// requires that, with the connection's session keys when it was granted.
    pub(crate) fn dial_lane(&self, addr: SocketAddr) -> Result<LaneConn, DialError> {
        let mut s = self.connect(addr)?;
        let Some(tls) = &self.tls else {
            let keys = wire::client_handshake_opts(
                &mut s,
                &self.key,
                self.integrity == Integrity::Require,
            )
            .map_err(DialError::Handshake)?;
            return Ok(LaneConn {
                stream: s,
                tls: None,
                keys,
            });
        };
        let mut conn = tls::client_connect(tls, addr, &mut s).map_err(|e| {
            DialError::Handshake(WireError::Tls {
                reason: tls::failure_reason(&e),
                detail: format!("TLS handshake with {addr}: {e}"),
            })
        })?;
        let keys = wire::client_handshake_opts(
            &mut rustls::Stream::new(&mut conn, &mut s),
            &self.key,
            false,
        )
        .map_err(DialError::Handshake)?;
        Ok(LaneConn {
            stream: s,
            tls: Some(conn),
            keys,
        })
    }

    fn connect(&self, addr: SocketAddr) -> Result<TcpStream, DialError> {
        let s =
            TcpStream::connect_timeout(&addr, self.connect_timeout).map_err(DialError::Connect)?;
        s.set_nodelay(true).map_err(DialError::Connect)?;
        s.set_read_timeout(Some(self.timeout))
            .map_err(DialError::Connect)?;
        s.set_write_timeout(Some(self.timeout))
            .map_err(DialError::Connect)?;
        Ok(s)
    }
}
