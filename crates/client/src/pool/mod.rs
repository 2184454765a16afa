//! Value bytes over the pool: `put` and `get` that drive the master (locations, commit, leases)
//! and the transfer engine (WRITE to every replica, READ from the nearest one). Also the naming
//! rules that tie a master segment to its transfer-engine registration. I/O boundary: the
//! master's gRPC channel and the transfer engine's connections; naming and endpoint parsing are
//! pure.
//!
//! - `put`, `get`: the two paths for plain values; `striped`: values cut into parts, and
//!   removal; `batch`: many zero-copy puts or gets in one master call and one transfer batch.
//! - `transport`: opening a replica's segment and one transfer to or from it; `local`:
//!   replicas in this process, reached by memory copy; `same_node`: replicas on this node's
//!   agent, reached through its shared memory; `staging`: registered buffers.
//! - `manifest`: the on-pool format of striped objects; `naming`: transfer names and
//!   endpoints; `error`: [`DataError`].

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::master::MasterClient;
use kvpool_transfer::TransferEngine;

mod batch;
mod error;
mod get;
mod local;
mod manifest;
mod naming;
mod put;
mod same_node;
mod staging;
mod striped;
mod transfer_tls;
mod transport;

pub use batch::BatchItem;
pub use error::DataError;
pub use local::LocalSegments;
pub use manifest::{MANIFEST_LEN, Manifest, StripeConfig, stripe_part_key};
pub use naming::{descriptor, parse_endpoints, tcp_endpoint, transfer_name};
pub use staging::DEFAULT_STAGING_CACHE_BYTES;
pub use transfer_tls::{
    TRANSFER_CA_FILE_ENV, TRANSFER_SERVER_NAME_ENV, TRANSFER_TLS_ENV, TransferTlsError,
    transfer_tls_from, transfer_tls_from_env,
};

/// Master client plus transfer engine: whole-value puts and gets. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PoolClient {
    master: MasterClient,
    engine: TransferEngine,
    /// The reader's node and NUMA node, for nearest-replica choice.
    node: String,
    numa_node: Option<u32>,
    staging_seq: Arc<AtomicU64>,
    staging_cache: Arc<staging::StagingCache>,
    stripe: StripeConfig,
    local: LocalSegments,
    /// Transfers run on the calling task's thread instead of the blocking pool (forks).
    inline: bool,
    /// Same-node segments mapped through their agent's shared memory.
    same_node: Arc<same_node::SameNode>,
}

impl PoolClient {
    pub fn new(
        master: MasterClient,
        engine: TransferEngine,
        node: String,
        numa_node: Option<u32>,
    ) -> Self {
        Self {
            master,
            engine,
            node,
            numa_node,
            staging_seq: Arc::default(),
            staging_cache: Arc::new(staging::StagingCache::new(DEFAULT_STAGING_CACHE_BYTES)),
            stripe: StripeConfig::default(),
            local: LocalSegments::default(),
            inline: false,
            same_node: Arc::default(),
        }
    }

    /// A client for one thread that drives its own calls on a current-thread runtime (for
    /// example a Python thread, with the GIL released): the master calls go on a connection
    /// of the fork's own ([`MasterClient::fork`]; lease releases go through this client, on
    /// `runtime`), and transfers run on the calling thread, small ones on a connection of
    /// their own (see `inline_max_bytes` of the transfer engine). A lone call then crosses no
    /// thread of this process. Shares the engine, staging and local segments.
    pub fn fork(&self, runtime: tokio::runtime::Handle) -> PoolClient {
        PoolClient {
            master: self.master.fork(runtime),
            inline: true,
            ..self.clone()
        }
    }

    /// Reach replicas in `local` (segments of this process) by memory copy.
    #[must_use]
    pub fn with_local_segments(mut self, local: LocalSegments) -> Self {
        self.local = local;
        self
    }

    /// Stripe values above `config.threshold` (see [`StripeConfig`]).
    #[must_use]
    pub fn with_striping(mut self, config: StripeConfig) -> Self {
        self.stripe = config;
        self
    }

    /// Keep at most `bytes` of idle staging memory for reuse (0 disables the cache).
    #[must_use]
    pub fn with_staging_cache(mut self, bytes: u64) -> Self {
        self.staging_cache = Arc::new(staging::StagingCache::new(bytes));
        self
    }

    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// Wait until the lease releases this client queued in the background reached the master.
    pub async fn flush_releases(&self) {
        self.master.flush_releases().await;
    }
}

#[cfg(test)]
mod tests;
