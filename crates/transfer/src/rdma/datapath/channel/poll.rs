//! The completion poller: one thread per channel busy-polls every queue pair's completion
//! queue with backoff, settles the slice of each completion, and expires work requests that
//! got no completion within the timeout (or whose NIC's queue failed).
//! I/O boundary: `poll` through the verbs traits.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Inflight, Shared};
use crate::error::error_chain;
use crate::rdma::datapath::WorkCompletion;

impl Shared {
    fn complete(&self, c: WorkCompletion) {
        let Some(inf) = self.inflight.lock().remove(&c.wr_id) else {
            // Completion of a request already given up on (timed out and retried).
            tracing::debug!(peer = %self.peer, wr_id = c.wr_id, "stale RDMA completion");
            return;
        };
        match c.result {
            Ok(()) => inf.req.slice_done(Ok(())),
            Err(status) => {
                let device = self
                    .paths
                    .get(inf.slice.nic)
                    .map_or("?", |p| p.device.name());
                let reason = format!("{device}: work completion failed: {status}");
                self.failed(inf, reason);
            }
        }
    }

    /// Give up on every slice of NIC `nic` (its completion queue failed), or on every slice
    /// older than the timeout when `nic` is `None`.
    fn expire(&self, nic: Option<usize>, reason: &str) {
        let expired: Vec<Inflight> = {
            let mut table = self.inflight.lock();
            let ids: Vec<u64> = table
                .iter()
                .filter(|(_, i)| match nic {
                    Some(n) => i.slice.nic == n,
                    None => i.posted_at.elapsed() > self.timeout,
                })
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| table.remove(id)).collect()
        };
        for inf in expired {
            let device = self
                .paths
                .get(inf.slice.nic)
                .map_or("?", |p| p.device.name());
            self.failed(inf, format!("{device}: {reason}"));
        }
    }
}

/// Empty polls spent spinning, then yielding, before the poller starts to sleep.
const SPIN_POLLS: u32 = 32;
const YIELD_POLLS: u32 = 32;
/// Longest sleep between polls while work is in flight.
const MAX_BACKOFF: Duration = Duration::from_millis(1);
/// How often in-flight work requests are checked against the timeout.
const DEADLINE_TICK: Duration = Duration::from_millis(50);

/// Busy-poll every queue pair's completion queue with backoff: spin, then yield, then sleep
/// (doubling up to 1 ms); park while nothing is in flight.
pub(super) fn poll_loop(sh: &Shared) {
    let mut buf = Vec::with_capacity(64);
    let mut idle: u32 = 0;
    let mut backoff = Duration::from_micros(10);
    let mut last_deadline = Instant::now();
    while !sh.stop.load(Ordering::SeqCst) {
        let mut got = 0;
        for (nic, path) in sh.paths.iter().enumerate() {
            buf.clear();
            if let Err(e) = path.qp.poll(32, &mut buf) {
                sh.expire(
                    Some(nic),
                    &format!("polling completions failed: {}", error_chain(&e)),
                );
            }
            got += buf.len();
            for c in buf.drain(..) {
                sh.complete(c);
            }
        }
        if last_deadline.elapsed() >= DEADLINE_TICK {
            last_deadline = Instant::now();
            sh.expire(None, &format!("no completion within {:?}", sh.timeout));
        }
        if got > 0 {
            idle = 0;
            backoff = Duration::from_micros(10);
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < SPIN_POLLS {
            std::hint::spin_loop();
        } else if idle < SPIN_POLLS + YIELD_POLLS {
            std::thread::yield_now();
        } else {
            let mut table = sh.inflight.lock();
            if table.is_empty() {
                sh.wake.wait_for(&mut table, DEADLINE_TICK);
                idle = 0;
            } else {
                drop(table);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
