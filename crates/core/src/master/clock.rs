//! Time source for the master: every expiry (heartbeats, leases, pins, pending puts, tasks) is
//! computed from an injected [`Clock`], so the metadata core is deterministic under test.
//! I/O boundary: [`SystemClock`] reads the monotonic OS clock; [`FakeClock`] reads nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Milliseconds on a monotonic time line private to one master process.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> u64;
}

/// Monotonic wall time since the clock was created.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock that only moves when told to; clones share the same time line.
#[derive(Clone, Debug, Default)]
pub struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    pub fn new(start_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ms)))
    }
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
    pub fn set_ms(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_clock_moves_only_when_told_and_clones_share_time() {
        let clock = FakeClock::new(5);
        let other = clock.clone();
        assert_eq!(clock.now_ms(), 5);
        other.advance_ms(10);
        assert_eq!(clock.now_ms(), 15);
        clock.set_ms(1);
        assert_eq!(other.now_ms(), 1);
    }
}
