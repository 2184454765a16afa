//! Loopback ports for children: ports that were free a moment ago, several at once that are
//! distinct, and a wait until something accepts connections on one.
//!
//! Every port handed out lies below the kernel's ephemeral range, where no socket bound to port
//! 0 and no outgoing connection can take it between our choice and the child's bind (a port the
//! kernel chose for us and we released could be reused by any connect on the machine; under
//! parallel tests that happened). Ports are handed out from a cursor shared by every process of
//! this user on the machine (a small file under the temporary directory, advanced under an
//! exclusive lock), so two test processes never get the same port until the whole range has
//! gone round; a port that something already listens on is skipped.
//! I/O boundary: binds and connects TCP sockets on 127.0.0.1; reads and writes the cursor file.

use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::error::HarnessError;

/// Lowest port handed out.
const FLOOR: u32 = 10_000;

/// A port that was free a moment ago on 127.0.0.1, below the ephemeral range.
pub fn free_port() -> Result<u16, HarnessError> {
    Ok(free_addr()?.port())
}

/// `127.0.0.1:<a port that was free a moment ago>`, below the ephemeral range.
pub fn free_addr() -> Result<SocketAddr, HarnessError> {
    let port = free_ports(1)?[0];
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// `n` distinct free ports (consecutive, below the ephemeral range): see
/// [`free_ports_below_ephemeral`].
pub fn free_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
    free_ports_below_ephemeral(n)
}

/// `n` distinct ports chosen by the kernel (port 0), each held until all are chosen: the
/// fallback where the range below the ephemeral one is too small.
fn kernel_ports(n: usize) -> Result<Vec<u16>, HarnessError> {
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
/// until all are chosen. Real inference engines and parallel tests bind many port-0 sockets and
/// open many connections, and one of those can take a kernel-chosen port between its choice and
/// the child's bind; no port-0 socket takes a port below the range. Where the shared cursor
/// cannot be used, the start is drawn from the process id and the clock instead.
pub fn free_ports_below_ephemeral(n: usize) -> Result<Vec<u16>, HarnessError> {
    let (low, _) = ephemeral_range();
    let top = u32::from(low).saturating_sub(n as u32);
    if top <= FLOOR {
        return kernel_ports(n);
    }
    let span = top - FLOOR;
    let mut cursor = Cursor::open();
    let mut next = cursor
        .as_mut()
        .and_then(Cursor::read)
        .unwrap_or_else(random_offset)
        % span;
    // Each try moves past the ports it tried, so a busy stretch is left behind.
    for _ in 0..256 {
        let start = FLOOR + next;
        next = (next + n as u32) % span;
        let held: Option<Vec<TcpListener>> = (start..start + n as u32)
            .map(|p| TcpListener::bind(("127.0.0.1", p as u16)).ok())
            .collect();
        if let Some(held) = held {
            if let Some(c) = cursor.as_mut() {
                c.write(next);
            }
            return Ok(held
                .iter()
                .filter_map(|l| l.local_addr().ok().map(|a| a.port()))
                .collect());
        }
    }
    if let Some(c) = cursor.as_mut() {
        c.write(next);
    }
    kernel_ports(n)
}

fn random_offset() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
        ^ std::process::id().wrapping_mul(2_654_435_761)
}

/// The shared cursor file, locked while open (the lock goes with the file).
struct Cursor(std::fs::File);

impl Cursor {
    fn path() -> PathBuf {
        let uid = nix::unistd::getuid();
        std::env::temp_dir().join(format!("kvpool-ports-{uid}.cursor"))
    }

    /// The cursor, locked; None where the file cannot be opened or locked.
    fn open() -> Option<Cursor> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(Self::path())
            .ok()?;
        file.lock().ok()?;
        Some(Cursor(file))
    }

    /// The offset stored; None for a new or unreadable file.
    fn read(&mut self) -> Option<u32> {
        let mut text = String::new();
        self.0.seek(SeekFrom::Start(0)).ok()?;
        self.0.read_to_string(&mut text).ok()?;
        text.trim().parse().ok()
    }

    /// Stores `offset`; a failure only costs the next caller the shared order.
    fn write(&mut self, offset: u32) {
        let stored = self.0.set_len(0).is_ok()
            && self.0.seek(SeekFrom::Start(0)).is_ok()
            && write!(self.0, "{offset}").is_ok();
        if !stored {
            tracing::debug!(path = %Self::path().display(), "port cursor not stored");
        }
    }
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
        for &p in &ports {
            TcpListener::bind(("127.0.0.1", p)).expect("free");
        }
        // The next callers, here or in another process, get other ports.
        let more: Vec<u16> = (0..20).map(|_| free_port().expect("port")).collect();
        let mut all: Vec<u16> = ports.iter().copied().chain(more).collect();
        let count = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), count, "a port handed out twice: {all:?}");
    }

    #[test]
    fn a_listening_port_is_never_handed_out() {
        let (low, _) = ephemeral_range();
        let base = free_ports(1).expect("port")[0];
        // Hold the next port the cursor would give; the one after is handed out instead.
        let next = if u32::from(base) + 2 < u32::from(low) {
            base + 1
        } else {
            return;
        };
        let held = TcpListener::bind(("127.0.0.1", next));
        let got = free_port().expect("port");
        if held.is_ok() {
            assert_ne!(got, next);
        }
        assert!(
            TcpListener::bind(("127.0.0.1", got)).is_ok(),
            "{got} was busy"
        );
    }
}
