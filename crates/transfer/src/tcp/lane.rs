//! One lane: a connection to a peer (connected and authenticated here), its sender and receiver
//! threads (`sender`, `receiver`), the state they share, and the bounded queue between
//! submitters and the sender (backpressure). I/O boundary: connecting the lane's TCP socket and
//! shutting it down.

mod io;
mod receiver;
mod sender;

use std::collections::VecDeque;
use std::io as stdio;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{DialError, LaneConfig, Slice};
use crate::error::{Failure, TransferError};
use crate::seal::{OpenReader, SealWriter};
use crate::wire;
use io::{LaneReader, LaneWriter};
use receiver::receiver_loop;
use sender::sender_loop;

/// Poll interval of blocked lane threads (deadline checks); not a timeout itself.
const TICK: Duration = Duration::from_millis(100);

/// A slice sent on the lane and waiting for its reply.
struct InFlight {
    slice: Slice,
    id: u64,
    sent_at: Instant,
}

/// What the two threads of a lane share: the socket, the slices in flight (in request order)
/// and the lane's death: the first failure resets the socket (dropping any unsent bytes) and
/// settles everything in flight.
struct LaneShared {
    stream: TcpStream,
    peer: SocketAddr,
    outstanding: Mutex<VecDeque<InFlight>>,
    cv: Condvar,
    dead: AtomicBool,
    reason: Mutex<Option<Failure>>,
    next_id: AtomicU64,
    cfg: LaneConfig,
}

impl LaneShared {
    /// Mark the lane dead (once), close the socket and fail everything in flight.
    fn fail(&self, failure: Failure) {
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
        let drained: Vec<InFlight> = self.outstanding.lock().drain(..).collect();
        if is_error || !drained.is_empty() {
            // Given up with frames possibly unsent: reset, so none of them is delivered late.
            wire::abort(&self.stream);
        } else {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        self.cv.notify_all();
        for f in drained {
            f.slice.settle(Err(failure.clone()));
        }
    }

    fn failure(&self) -> Failure {
        self.reason
            .lock()
            .clone()
            .unwrap_or_else(|| Failure::new("lane_closed", "connection closed"))
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Wait up to `limit` for the lane to die of another cause (the receiver reading the
    /// peer's ERROR reply or its close).
    fn wait_dead(&self, limit: Duration) {
        let until = Instant::now() + limit;
        let mut q = self.outstanding.lock();
        while !self.is_dead() && Instant::now() < until {
            self.cv.wait_for(&mut q, TICK.min(limit));
        }
    }
}

/// One connection to a peer with its two threads.
pub(super) struct Lane {
    shared: Arc<LaneShared>,
    tx: Option<SyncSender<Slice>>,
    threads: Vec<JoinHandle<()>>,
}

impl Lane {
    pub(super) fn connect(addr: SocketAddr, cfg: &LaneConfig) -> Result<Lane, TransferError> {
        let peer = addr.to_string();
        let connect_err = |source: stdio::Error| TransferError::Connect {
            peer: peer.clone(),
            source,
        };
        let conn = cfg.dialer.dial_lane(addr).map_err(|e| match e {
            DialError::Connect(source) => connect_err(source),
            DialError::Handshake(source) => {
                if let wire::WireError::Tls { reason, .. } = &source {
                    cfg.metrics
                        .tls_handshake_failures
                        .with_label_values(&["initiator", reason])
                        .inc();
                }
                TransferError::Handshake {
                    peer: peer.clone(),
                    source,
                }
            }
        })?;
        let stream = conn.stream;
        // From now on reads wake up every tick so that the receiver can apply per-slice
        // deadlines while the connection is otherwise idle.
        stream
            .set_read_timeout(Some(TICK.min(cfg.dialer.timeout)))
            .map_err(connect_err)?;
        let reader = stream.try_clone().map_err(connect_err)?;
        let writer = stream.try_clone().map_err(connect_err)?;
        let (reader, writer) = match (conn.tls, conn.keys) {
            (Some(tls), _) => {
                let (r, w) = crate::tls::split(tls, &stream).map_err(connect_err)?;
                (LaneReader::Tls(Box::new(r)), LaneWriter::Tls(Box::new(w)))
            }
            (None, Some(keys)) => {
                let (seal, open) = keys.initiator();
                (
                    LaneReader::Sealed(Box::new(OpenReader::new(reader, open))),
                    LaneWriter::Sealed(Box::new(SealWriter::new(writer, seal))),
                )
            }
            (None, None) => (LaneReader::Plain(reader), LaneWriter::Plain(writer)),
        };
        let shared = Arc::new(LaneShared {
            stream,
            peer: addr,
            outstanding: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            dead: AtomicBool::new(false),
            reason: Mutex::new(None),
            next_id: AtomicU64::new(1),
            cfg: cfg.clone(),
        });
        cfg.metrics.connections.inc();
        let (tx, rx) = sync_channel::<Slice>(cfg.window.max(1));
        let mut threads = Vec::new();
        let sh = shared.clone();
        let spawn_err = |source: stdio::Error| TransferError::Connect {
            peer: peer.clone(),
            source,
        };
        match std::thread::Builder::new()
            .name("kvpool-xfer-tx".into())
            .spawn(move || sender_loop(sh, writer, rx))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                shared.fail(Failure::new("io", "cannot spawn lane thread"));
                return Err(spawn_err(e));
            }
        }
        let sh = shared.clone();
        match std::thread::Builder::new()
            .name("kvpool-xfer-rx".into())
            .spawn(move || receiver_loop(sh, reader))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                shared.fail(Failure::new("io", "cannot spawn lane thread"));
                drop(tx);
                for t in threads {
                    let _ = t.join();
                }
                return Err(spawn_err(e));
            }
        }
        Ok(Lane {
            shared,
            tx: Some(tx),
            threads,
        })
    }

    pub(super) fn is_dead(&self) -> bool {
        self.shared.is_dead()
    }

    /// Queue a slice; blocks while the lane's queue is full (backpressure). A slice that cannot
    /// be queued is failed with the lane's reason.
    pub(super) fn send(&self, slice: Slice) {
        let Some(tx) = &self.tx else {
            slice.settle(Err(self.shared.failure()));
            return;
        };
        let mut slice = slice;
        loop {
            if self.is_dead() {
                slice.settle(Err(self.shared.failure()));
                return;
            }
            match tx.try_send(slice) {
                Ok(()) => return,
                Err(TrySendError::Full(s)) => {
                    slice = s;
                    // Wait for the sender thread to take something off the queue.
                    let mut q = self.shared.outstanding.lock();
                    self.shared.cv.wait_for(&mut q, TICK);
                }
                Err(TrySendError::Disconnected(s)) => {
                    s.settle(Err(self.shared.failure()));
                    return;
                }
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Closing a lane on purpose is not a failure (nothing is logged as one).
        self.shared.close(
            Failure::new("lane_closed", "connection closed by the initiator"),
            false,
        );
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
