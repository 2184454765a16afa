//! The RDMA channel to one remote segment: its settings, its NIC paths (queue pair, remote
//! region, local registrations), the table of work requests in flight, the slicing of a request
//! over the NICs, and teardown (queue pairs first, then whatever is still in flight fails).
//! The handshake that sets a channel up is in `connect`, posting work requests and failover in
//! `post`, the completion poller in `poll`. I/O boundary: none here.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

mod connect;
mod poll;
mod post;

use super::{MemoryKeys, QueuePairOps, RdmaDevice};
use crate::batch::{RequestState, TransferOp};
use crate::error::Failure;
use crate::memory::Segment;
use crate::rdma::handshake::RegionInfo;
use crate::rdma::plan::{self, Failover, PlannedSlice};
use crate::rdma::select;
use crate::tcp::{Dialer, Peer};

/// How slices that no NIC can carry reach TCP.
pub(crate) struct TcpFallback {
    pub(crate) peer: Arc<Peer>,
    pub(crate) handle: u32,
    /// Called once per slice moved to TCP, with the reason (warn, count, raise the flag).
    pub(crate) on_fallback: Arc<dyn Fn(&str) + Send + Sync>,
}

/// Settings of a channel.
pub(crate) struct ChannelConfig {
    pub(crate) peer: SocketAddr,
    /// How the control connection starts; its timeout also bounds every work request.
    pub(crate) dialer: Dialer,
    pub(crate) slice_size: u64,
    pub(crate) max_attempts: u32,
    /// Counts slices retried on another NIC (`kvpool_transfer_rdma_retries_total`).
    pub(crate) retry_metric: prometheus::IntCounter,
}

/// One NIC pair: a local device's queue pair connected to the target's, and the region it
/// addresses there.
struct Path {
    device: Arc<dyn RdmaDevice>,
    qp: Arc<dyn QueuePairOps>,
    remote: RegionInfo,
    /// Local segments registered with this device, by address (the registration keeps the
    /// segment alive, so an address cannot be reused while it is cached).
    local: Mutex<HashMap<usize, Arc<dyn MemoryKeys>>>,
}

/// A slice of a request on its way: posted, or about to be (re)posted or handed to TCP.
struct Inflight {
    req: Arc<RequestState>,
    op: TransferOp,
    local: Arc<Segment>,
    local_base: u64,
    remote_base: u64,
    slice: PlannedSlice,
    posted_at: Instant,
}

/// What the channel, its poller thread and the failover share.
struct Shared {
    peer: String,
    paths: Vec<Path>,
    failover: Mutex<Failover>,
    inflight: Mutex<HashMap<u64, Inflight>>,
    wake: Condvar,
    next_wr: AtomicU64,
    next_nic: AtomicUsize,
    stop: AtomicBool,
    timeout: Duration,
    slice_size: u64,
    tcp: Option<TcpFallback>,
    retries: AtomicU64,
    retry_metric: prometheus::IntCounter,
    /// The control connection: the target keeps its queue pairs while it stays open.
    _control: TcpStream,
}

/// Queue pairs to one remote segment over one or more NIC pairs, with a completion poller.
pub(crate) struct RdmaChannel {
    shared: Arc<Shared>,
    poller: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RdmaChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaChannel")
            .field("peer", &self.shared.peer)
            .field("paths", &self.shared.paths.len())
            .finish()
    }
}

impl RdmaChannel {
    /// Device names of the local NICs, in path order.
    pub(crate) fn devices(&self) -> Vec<String> {
        self.shared
            .paths
            .iter()
            .map(|p| p.device.name().to_owned())
            .collect()
    }

    /// Slices retried on another NIC so far.
    pub(crate) fn retries(&self) -> u64 {
        self.shared.retries.load(Ordering::Relaxed)
    }

    /// Cut a request of `len` bytes of local memory on NUMA node `local_numa` into slices
    /// striped over the NICs on that node, or over all NICs when none is there
    /// (`select::local_nics`); consecutive requests start on different NICs. A slice whose NIC
    /// fails moves to any healthy NIC.
    pub(crate) fn plan(&self, len: u64, local_numa: Option<u32>) -> Vec<PlannedSlice> {
        let numas: Vec<Option<u32>> = self
            .shared
            .paths
            .iter()
            .map(|p| p.device.numa_node())
            .collect();
        let nics = select::local_nics(&numas, local_numa);
        let first = self.shared.next_nic.fetch_add(1, Ordering::Relaxed);
        let mut slices = plan::stripe(len, self.shared.slice_size, nics.len(), first);
        for s in &mut slices {
            s.nic = nics[s.nic];
        }
        slices
    }

    /// Post every slice of a request planned by [`Self::plan`]; `req` counts `plan.len()`
    /// slices. Returns once all are posted (completions arrive on the poller thread).
    pub(crate) fn submit(
        &self,
        req: &Arc<RequestState>,
        plan: Vec<PlannedSlice>,
        op: TransferOp,
        local: &Arc<Segment>,
        local_base: u64,
        remote_base: u64,
    ) {
        for slice in plan {
            self.shared.dispatch(Inflight {
                req: req.clone(),
                op,
                local: local.clone(),
                local_base,
                remote_base,
                slice,
                posted_at: Instant::now(),
            });
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Queue pairs first (the hardware stops touching memory), then settle what is left.
        let paths = std::mem::take(&mut self.paths);
        drop(paths);
        for (_, inf) in self.inflight.get_mut().drain() {
            inf.req.slice_done(Err(Failure::new(
                "rdma",
                format!("RDMA channel to {} closed", self.peer),
            )));
        }
    }
}

impl Drop for RdmaChannel {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
        if let Some(t) = self.poller.take() {
            let _ = t.join();
        }
    }
}
