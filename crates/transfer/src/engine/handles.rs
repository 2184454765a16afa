//! The handles the engine gives out: [`LocalSegment`] (a registration, undone when its last
//! clone drops), [`RemoteSegment`] (an opened remote segment and the route its bytes take) and
//! [`TransferRequest`] (one READ or WRITE of a batch). Plain data; the routes own the
//! connections.

use std::sync::{Arc, Weak};

use crate::batch::TransferOp;
use crate::descriptor::Protocol;
use crate::memory::Segment;
use crate::rdma::datapath::RdmaChannel;
use crate::server::Registry;
use crate::tcp::Peer;

/// A segment registered with the engine. Clones share the registration; when the last clone
/// drops the segment is unregistered (peers can no longer open or address it). The memory
/// itself lives until transfers still using it finish.
#[derive(Clone, Debug)]
pub struct LocalSegment {
    reg: Arc<Registration>,
}

#[derive(Debug)]
struct Registration {
    name: String,
    handle: u32,
    segment: Arc<Segment>,
    registry: Weak<Registry>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            r.remove(self.handle);
        }
    }
}

impl LocalSegment {
    /// The handle of `segment`, registered as `name` in `registry`.
    pub(super) fn new(
        name: &str,
        handle: u32,
        segment: Arc<Segment>,
        registry: Weak<Registry>,
    ) -> Self {
        LocalSegment {
            reg: Arc::new(Registration {
                name: name.to_owned(),
                handle,
                segment,
                registry,
            }),
        }
    }

    /// The registry's handle of this segment (what peers address it by).
    pub(super) fn handle(&self) -> u32 {
        self.reg.handle
    }

    pub fn name(&self) -> &str {
        &self.reg.name
    }
    pub fn segment(&self) -> &Arc<Segment> {
        &self.reg.segment
    }
    pub fn len(&self) -> u64 {
        self.reg.segment.len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.reg.segment.is_empty()
    }
}

#[derive(Clone)]
pub(super) enum Route {
    Tcp(Arc<Peer>),
    Shm(Arc<Segment>),
    /// RDMA queue pairs to the segment, with the TCP lanes for notify and fallback.
    Rdma {
        tcp: Arc<Peer>,
        channel: Arc<RdmaChannel>,
    },
}

/// An opened remote segment. Clones share the underlying connections.
#[derive(Clone)]
pub struct RemoteSegment {
    pub(super) name: Arc<str>,
    pub(super) size: u64,
    pub(super) handle: u32,
    /// The target's instance from OPEN_OK (0: none), sent back with every READ and WRITE.
    pub(super) instance: u32,
    /// The target serves vectored frames (OPEN_OK's feature bits).
    pub(super) vectored: bool,
    pub(super) route: Route,
}

impl std::fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("protocol", &self.protocol())
            .field("handle", &self.handle)
            .field("instance", &self.instance)
            .field("vectored", &self.vectored)
            .finish()
    }
}

impl RemoteSegment {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn len(&self) -> u64 {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    /// The transport this handle moves bytes with.
    pub fn protocol(&self) -> Protocol {
        match self.route {
            Route::Tcp(_) => Protocol::Tcp,
            Route::Shm(_) => Protocol::Shm,
            Route::Rdma { .. } => Protocol::Rdma,
        }
    }

    /// Local RDMA devices carrying this segment's transfers (empty unless it moves over RDMA).
    pub fn rdma_devices(&self) -> Vec<String> {
        match &self.route {
            Route::Rdma { channel, .. } => channel.devices(),
            _ => Vec::new(),
        }
    }

    /// Slices of this segment's transfers that were retried on another NIC.
    pub fn rdma_retries(&self) -> u64 {
        match &self.route {
            Route::Rdma { channel, .. } => channel.retries(),
            _ => 0,
        }
    }
}

/// One READ or WRITE of a batch.
#[derive(Clone, Debug)]
pub struct TransferRequest {
    pub op: TransferOp,
    pub local: LocalSegment,
    pub local_offset: u64,
    pub remote: RemoteSegment,
    pub remote_offset: u64,
    pub len: u64,
}
