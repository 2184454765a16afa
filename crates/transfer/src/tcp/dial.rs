//! Dialing a peer: a TCP connection with Nagle off and a timeout on every read and write, then
//! the initiator side of the handshake. The lanes and the RDMA control connection both start
//! this way. I/O boundary: the outgoing TCP socket.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::auth::AuthKey;
use crate::seal::{Integrity, SessionKeys};
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

    /// [`Dialer::dial`] for a lane: asks for per-frame integrity when the engine requires it,
    /// and returns the connection's session keys when it was granted.
    pub(crate) fn dial_lane(
        &self,
        addr: SocketAddr,
    ) -> Result<(TcpStream, Option<SessionKeys>), DialError> {
        let mut s = self.connect(addr)?;
        let keys =
            wire::client_handshake_opts(&mut s, &self.key, self.integrity == Integrity::Require)
                .map_err(DialError::Handshake)?;
        Ok((s, keys))
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
