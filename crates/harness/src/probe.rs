//! Readiness probes of a child: its admin server answering 200 on a path (`/readyz`), a TCP
//! port accepting connections, or a Unix socket accepting connections. One check is one
//! attempt; [`crate::ChildProcess::wait_ready`] polls. I/O boundary: one connection per check.

use std::fmt;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::http;

/// What "ready" means for a child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `GET path` answers 200.
    Http { addr: SocketAddr, path: String },
    /// Something accepts TCP connections.
    Tcp(SocketAddr),
    /// Something accepts connections on the Unix socket.
    Unix(PathBuf),
}

impl Probe {
    /// The admin server's `/readyz` answers 200.
    pub fn readyz(admin: SocketAddr) -> Self {
        Probe::Http {
            addr: admin,
            path: "/readyz".into(),
        }
    }

    /// One attempt.
    pub fn check(&self) -> bool {
        match self {
            Probe::Http { addr, path } => http::get(*addr, path).is_some_and(|r| r.status == 200),
            Probe::Tcp(addr) => {
                TcpStream::connect_timeout(addr, Duration::from_millis(200)).is_ok()
            }
            Probe::Unix(path) => UnixStream::connect(path).is_ok(),
        }
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::Http { addr, path } => write!(f, "200 from GET http://{addr}{path}"),
            Probe::Tcp(addr) => write!(f, "a listener on {addr}"),
            Probe::Unix(path) => write!(f, "a listener on {}", path.display()),
        }
    }
}
