//! RDMA data path of the engine: the narrow verbs interface ([`RdmaProvider`], [`RdmaDevice`],
//! [`QueuePairOps`]) that the libibverbs binding and the test fabric implement, and its errors.
//! The rest lives in the submodules: the target side of the queue-pair handshake (`accept`), and
//! the initiator's channel (`channel`), which sets its queue pairs up on an authenticated TCP
//! control connection (`channel::connect`), stripes a request's slices over several NICs, posts
//! signalled one-sided WRITE/READ work requests and fails them over (`channel::post`), maps
//! completions back to requests and slices from a poller thread (`channel::poll`), retries a
//! failed slice on another NIC and hands it to TCP (loudly) when no NIC is left. I/O boundary: the control `TcpStream` and the calls through the verbs
//! traits.

mod accept;
mod channel;

use std::io;
use std::sync::Arc;

pub(crate) use accept::{AcceptedPaths, accept, segment_nics};
pub(crate) use channel::{ChannelConfig, RdmaChannel, TcpFallback};

use super::address::{AddressError, PortAttr};
use super::handshake::{HandshakeError, QpInfo};
use crate::memory::Segment;
use crate::wire::WireError;

/// Errors of the RDMA data path.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RdmaError {
    #[error("no usable RDMA device on this host")]
    NoDevice,
    #[error("the pool's transport settings leave no RDMA NIC to use")]
    Selection(#[source] super::select::SelectError),
    #[error("{call} on RDMA device {device} failed")]
    Verbs {
        device: String,
        call: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("invalid RDMA handshake payload")]
    Handshake(#[source] HandshakeError),
    #[error("{peer} does not serve RDMA: {reason}")]
    PeerUnsupported { peer: String, reason: String },
    #[error("RDMA control connection to {peer} failed")]
    Control {
        peer: String,
        #[source]
        source: WireError,
    },
    #[error("connecting to {peer} for the RDMA handshake failed")]
    Connect {
        peer: String,
        #[source]
        source: io::Error,
    },
    #[error("RDMA handshake with {peer} is inconsistent: {reason}")]
    Mismatch { peer: String, reason: String },
    #[error("RDMA device {device} cannot address its peer")]
    Address {
        device: String,
        #[source]
        source: AddressError,
    },
}

impl RdmaError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// A verbs call failure with a plain message (for implementations without an errno).
    pub fn verbs(device: &str, call: &'static str, reason: impl Into<String>) -> Self {
        RdmaError::Verbs {
            device: device.to_owned(),
            call,
            source: io::Error::other(reason.into()),
        }
    }
}

/// One-sided operation of a work request, seen from the poster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    /// Local memory -> remote memory.
    Write,
    /// Remote memory -> local memory.
    Read,
}

/// One signalled RDMA WRITE or READ between registered local memory and a remote region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    pub wr_id: u64,
    pub op: RdmaOp,
    pub local_addr: u64,
    pub lkey: u32,
    pub len: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A polled work completion: the work request id and `Err(verbs status string)` on failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub result: Result<(), String>,
}

/// The RDMA devices this process may use, best first (see `select::select`).
pub trait RdmaProvider: Send + Sync {
    fn devices(&self) -> Vec<Arc<dyn RdmaDevice>>;
}

/// One opened device (context + protection domain) on one port.
pub trait RdmaDevice: Send + Sync {
    fn name(&self) -> &str;
    /// NUMA node of the NIC (`None`: unknown). A transfer of memory on a node goes out through
    /// that node's NICs when the channel has any (`select::local_nics`).
    fn numa_node(&self) -> Option<u32> {
        None
    }
    /// The port number (1-based) this device's queue pairs use.
    fn port_num(&self) -> u8 {
        1
    }
    /// The port's link layer, LID and source GID (`ibv_query_port`, `ibv_query_gid`): queue
    /// pairs announce the LID and GID in the handshake and address the peer from them.
    fn port(&self) -> Result<PortAttr, RdmaError>;
    /// Register a segment for local and remote access. The registration keeps the segment
    /// alive until it is dropped.
    fn register(&self, segment: &Arc<Segment>) -> Result<Arc<dyn MemoryKeys>, RdmaError>;
    /// Create an RC queue pair (with its completion queue) in state INIT.
    fn create_qp(&self) -> Result<Arc<dyn QueuePairOps>, RdmaError>;
}

/// Keys and range of a registered segment.
pub trait MemoryKeys: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn addr(&self) -> u64;
    /// Length of the registered range in bytes.
    fn size(&self) -> u64;
}

/// An RC queue pair.
pub trait QueuePairOps: Send + Sync {
    /// What the peer needs to connect to this queue pair (fixed at creation).
    fn info(&self) -> QpInfo;
    /// Move to RTR then RTS towards `remote`, addressed by `address::address_for` (LID on
    /// InfiniBand, GID on RoCE).
    fn connect(&self, remote: &QpInfo) -> Result<(), RdmaError>;
    /// Post one signalled work request.
    fn post(&self, wr: &WorkRequest) -> Result<(), RdmaError>;
    /// Append up to `max` completions to `out`.
    fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<(), RdmaError>;
}

#[cfg(test)]
mod tests;
