//! All lanes to one peer address: slices go round robin over them, a dead lane is reconnected
//! on next use, and a failed connect makes further slices fail fast for a while instead of
//! each waiting for its own connect timeout. I/O boundary: through `lane`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::inline::{DirectConns, InlineSlice};
use super::lane::Lane;
use super::{LaneConfig, Slice};
use crate::error::{Failure, TransferError, error_chain};

/// All lanes to one peer address, reconnected lazily when a lane has died.
pub(crate) struct Peer {
    addr: SocketAddr,
    lanes: Vec<Mutex<Option<Lane>>>,
    next: AtomicUsize,
    /// Connections driven by calling threads themselves (small batches, see `inline`).
    direct: DirectConns,
    cfg: LaneConfig,
    /// The last failed connect attempt: while it is recent, slices fail at once instead of
    /// each waiting for its own connect timeout.
    last_connect_failure: Mutex<Option<(Instant, Failure)>>,
}

/// How long a failed connect attempt makes further attempts to the same peer fail fast.
const CONNECT_HOLDOFF: Duration = Duration::from_millis(500);

impl Peer {
    pub(crate) fn new(addr: SocketAddr, lanes: usize, cfg: LaneConfig) -> Self {
        Peer {
            addr,
            lanes: (0..lanes.max(1)).map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            direct: DirectConns::default(),
            cfg,
            last_connect_failure: Mutex::new(None),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queue a slice on the next lane (round robin), connecting it first if needed.
    pub(crate) fn dispatch(&self, slice: Slice) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.lanes.len();
        self.dispatch_on(i, slice);
    }

    pub(crate) fn dispatch_on(&self, lane: usize, slice: Slice) {
        let Some(slot) = self.lanes.get(lane % self.lanes.len()) else {
            return;
        };
        let mut slot = slot.lock();
        if slot.as_ref().is_none_or(Lane::is_dead) {
            // Drop (and join) a dead lane before replacing it.
            *slot = None;
            if let Some((at, f)) = &*self.last_connect_failure.lock()
                && at.elapsed() < CONNECT_HOLDOFF
            {
                slice.settle(Err(f.clone()));
                return;
            }
            match Lane::connect(self.addr, &self.cfg) {
                Ok(l) => {
                    *self.last_connect_failure.lock() = None;
                    *slot = Some(l);
                }
                Err(e) => {
                    let f = Failure::new(e.category(), error_chain(&e));
                    *self.last_connect_failure.lock() = Some((Instant::now(), f.clone()));
                    slice.settle(Err(f));
                    return;
                }
            }
        }
        if let Some(l) = slot.as_ref() {
            l.send(slice);
        }
    }

    /// Connect every lane now (used by `open` so that connection errors surface early).
    pub(crate) fn connect_first(&self) -> Result<(), TransferError> {
        let Some(slot) = self.lanes.first() else {
            return Ok(());
        };
        let mut slot = slot.lock();
        if slot.as_ref().is_none_or(Lane::is_dead) {
            *slot = None;
            *slot = Some(Lane::connect(self.addr, &self.cfg)?);
        }
        Ok(())
    }

    /// Run `slices` from the calling thread on a direct connection; `settle(i, result)` is
    /// called once per slice, in order. Fails fast like the lanes while a connect to this
    /// peer failed recently.
    pub(crate) fn run_inline(
        &self,
        slices: &[InlineSlice<'_>],
        settle: &mut dyn FnMut(usize, Result<(), Failure>),
    ) {
        if let Some((at, f)) = &*self.last_connect_failure.lock()
            && at.elapsed() < CONNECT_HOLDOFF
        {
            for i in 0..slices.len() {
                settle(i, Err(f.clone()));
            }
            return;
        }
        self.direct.run(self.addr, &self.cfg, slices, settle);
    }

    /// Close all lanes and direct connections.
    pub(crate) fn close(&self) {
        for l in &self.lanes {
            *l.lock() = None;
        }
        self.direct.close(&self.cfg);
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.direct.close(&self.cfg);
    }
}
