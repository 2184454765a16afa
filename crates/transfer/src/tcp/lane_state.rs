//! What the two threads of one lane share: the socket, the slices in flight (in request
//! order), and the lane's death: the first failure closes the socket and settles everything in
//! flight. I/O boundary: shutting the lane's socket down.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{LaneConfig, Slice};
use crate::error::Failure;

/// Poll interval of blocked lane threads (deadline checks); not a timeout itself.
pub(super) const TICK: Duration = Duration::from_millis(100);

/// A slice sent on the lane and waiting for its reply.
pub(super) struct InFlight {
    pub(super) slice: Slice,
    pub(super) id: u64,
    pub(super) sent_at: Instant,
}

pub(super) struct LaneShared {
    pub(super) stream: TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) outstanding: Mutex<VecDeque<InFlight>>,
    pub(super) cv: Condvar,
    pub(super) dead: AtomicBool,
    pub(super) reason: Mutex<Option<Failure>>,
    pub(super) next_id: AtomicU64,
    pub(super) cfg: LaneConfig,
}

impl LaneShared {
    /// Mark the lane dead (once), close the socket and fail everything in flight.
    pub(super) fn fail(&self, failure: Failure) {
        self.close(failure, true);
    }

    fn close(&self, failure: Failure, is_error: bool) {
        {
            // The reason is recorded before `dead` is raised, so whoever sees `dead` also sees
            // why; the first caller wins.
            let mut reason = self.reason.lock();
            if reason.is_some() {
                return;
            }
            *reason = Some(failure.clone());
        }
        self.dead.store(true, Ordering::SeqCst);
        if is_error {
            tracing::warn!(peer = %self.peer, reason = %failure, "transfer lane failed");
        } else {
            tracing::debug!(peer = %self.peer, "transfer lane closed");
        }
        self.cfg.metrics.connections.dec();
        let _ = self.stream.shutdown(Shutdown::Both);
        let drained: Vec<InFlight> = self.outstanding.lock().drain(..).collect();
        self.cv.notify_all();
        for f in drained {
            f.slice.settle(Err(failure.clone()));
        }
    }

    pub(super) fn failure(&self) -> Failure {
        self.reason
            .lock()
            .clone()
            .unwrap_or_else(|| Failure::new("lane_closed", "connection closed"))
    }

    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
}

/// Whether a socket error is a `SO_RCVTIMEO`/`SO_SNDTIMEO` timeout.
pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
