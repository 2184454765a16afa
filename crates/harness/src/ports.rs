//! Loopback ports for children: one that was free a moment ago, several that are distinct
//! (held until all are chosen), and a wait until something accepts connections on one.
//! I/O boundary: binds and connects TCP sockets on 127.0.0.1.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::HarnessError;

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> Result<u16, HarnessError> {
    Ok(free_addr()?.port())
}

/// `127.0.0.1:<a port that was free a moment ago>`.
pub fn free_addr() -> Result<SocketAddr, HarnessError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(HarnessError::Port)?;
    l.local_addr().map_err(HarnessError::Port)
}

/// `n` distinct free ports: each is held until all are chosen, so that none repeats.
pub fn free_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .map_err(HarnessError::Port)?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<_, _>>()
        .map_err(HarnessError::Port)
}

/// Wait until something accepts TCP connections on `addr`; false when `timeout` passed first.
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
