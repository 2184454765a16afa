//! Helpers for tests and benchmarks of the master: a throw-away etcd server on 127.0.0.1 and
//! free-port lookup. I/O boundary: child processes and sockets.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Errors of the test helpers.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TestingError {
    #[error("etcd binary not found (install the Debian package etcd-server)")]
    NoEtcd,
    #[error("cannot start etcd")]
    Spawn(#[source] std::io::Error),
    #[error("etcd did not accept connections within {0:?}")]
    NotReady(Duration),
    #[error("no free port")]
    Port(#[source] std::io::Error),
}

impl TestingError {
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> Result<u16, TestingError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(TestingError::Port)?;
    Ok(l.local_addr().map_err(TestingError::Port)?.port())
}

/// Wait until something accepts TCP connections on `addr`.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A single-member etcd on 127.0.0.1 with its data in `dir`; killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    pub client_url: String,
}

impl EtcdServer {
    /// Whether an `etcd` binary is on the PATH.
    pub fn available() -> bool {
        Command::new("etcd")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn start(dir: &Path) -> Result<Self, TestingError> {
        if !Self::available() {
            return Err(TestingError::NoEtcd);
        }
        let client = free_port()?;
        let peer = free_port()?;
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .arg("--name=kvpool-test")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=kvpool-test={peer_url}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(TestingError::Spawn)?;
        let mut server = Self { child, client_url };
        let timeout = Duration::from_secs(20);
        let addr = SocketAddr::from(([127, 0, 0, 1], client));
        if !wait_for_port(addr, timeout) {
            let _ = server.child.kill();
            return Err(TestingError::NotReady(timeout));
        }
        Ok(server)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
