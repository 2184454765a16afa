//! Transfer engine: moves bytes between registered memory segments on any two nodes, over TCP
//! (always), same-node shared memory, or RDMA (cargo feature `rdma`). The agent registers and
//! serves its DRAM-tier segments; the master hands out [`SegmentDescriptor`]s through a
//! [`Directory`]; clients open remote segments and submit batches of READ/WRITE requests.
//! I/O boundary: the transports' sockets (see `tcp`, `server`, `shm`) and memory mapping
//! (`memory`; with `rdma::verbs` and `cuda` the only modules with `unsafe`). Framing, auth
//! proofs, batching and the RDMA planning logic are pure and unit-tested.
//!
//! The crate's map: `engine` is the public [`TransferEngine`] (opening segments, submitting
//! batches), `config` its settings, `batch` completion tracking; `tcp` the initiator's lanes,
//! `server` the target side, `shm` the same-node transport, `rdma` the RDMA transport; `frame`
//! and `wire` the protocol, `auth` the handshake's proofs, `memory` registered memory.
//!
//! See docs/transfer.md for the API contract, the wire protocol and the threading model.

pub mod auth;
mod batch;
mod config;
pub mod descriptor;
mod engine;
mod error;
pub mod frame;
pub mod memory;
pub mod metrics;
pub mod rdma;
mod seal;
mod server;
mod shm;
mod tcp;
mod tls;
pub mod wire;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use auth::{AuthError, AuthKey};
pub use batch::{Batch, BatchFailed, RequestStatus, TransferOp};
pub use config::{EngineConfig, MAX_GID_INDEX};
pub use descriptor::{
    Directory, DirectoryError, Endpoint, MemoryKind, NicDescriptor, Protocol, SegmentDescriptor,
    StaticDirectory,
};
pub use engine::{LocalSegment, RemoteSegment, TransferEngine, TransferRequest};
pub use error::{Failure, TransferError};
pub use memory::{HostOptions, MemoryError, NumaNodeError, Segment, pci_numa_node};
pub use metrics::TransferMetrics;
pub use rdma::select::NicPolicy;
pub use rdma::{RdmaError, RdmaProvider};
pub use seal::{Integrity, IntegrityError, is_integrity};
pub use server::{MemoryTarget, Notification, Served, TcpServer};
pub use shm::ShmServer;
pub use tcp::{ExpectedReply, ReplyOutcome, ReplyReader};
pub use tls::{TlsMode, TransferTls};
