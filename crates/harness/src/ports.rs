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

/// The kernel's range of ports for sockets bound to port 0 (`ip_local_port_range`; Linux's
/// default when it cannot be read).
pub fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

/// `n` free consecutive ports below the kernel's ephemeral range (from 10000 up), each held
/// until all are chosen: ports for children that are not taken by any process binding port 0
/// meanwhile. Real inference engines bind many port-0 sockets while they start, and one of
/// them can take a port [`free_ports`] chose for another child between its choice and that
/// child's bind. The start is drawn from the process id and the clock, so concurrent callers
/// spread out; a range with a busy port is skipped.
pub fn free_ports_below_ephemeral(n: usize) -> Result<Vec<u16>, HarnessError> {
    let (low, _) = ephemeral_range();
    let floor: u32 = 10_000;
    let top = u32::from(low).saturating_sub(n as u32);
    if top <= floor {
        return free_ports(n);
    }
    let span = top - floor;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
        ^ std::process::id().wrapping_mul(2_654_435_761);
    for attempt in 0..64u32 {
        let start = floor + (seed.wrapping_add(attempt.wrapping_mul(7919)) % span);
        let held: Option<Vec<TcpListener>> = (start..start + n as u32)
            .map(|p| TcpListener::bind(("127.0.0.1", p as u16)).ok())
            .collect();
        if let Some(held) = held {
            return Ok(held
                .iter()
                .filter_map(|l| l.local_addr().ok().map(|a| a.port()))
                .collect());
        }
    }
    free_ports(n)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_below_the_ephemeral_range_are_consecutive_free_and_below_it() {
        let (low, high) = ephemeral_range();
        assert!(low <= high);
        let ports = free_ports_below_ephemeral(6).expect("ports");
        assert_eq!(ports.len(), 6);
        assert!(ports.windows(2).all(|w| w[1] == w[0] + 1), "{ports:?}");
        if low > 10_006 {
            assert!(
                ports.iter().all(|&p| (10_000..low).contains(&p)),
                "{ports:?}"
            );
        }
        // Released: each can be bound again.
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).expect("free");
        }
    }
}
