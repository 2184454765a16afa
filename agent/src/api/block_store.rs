//! The seam between the engine API and where blocks live. Each RPC of the server validates its
//! request (batch size, session) and hands the batch to one [`BlockStore`]: in local-only mode
//! the node's tiered store (`store::TieredStore`, each batch on the blocking pool because it
//! may touch the SSD), in pool mode the pool (`pool::PoolApi`, through the master and the
//! transfer engine). A store answers one status per item, in order, and counts its own hits,
//! misses and errors; the server times the batch. I/O boundary: none here; each
//! implementation names its own.

use std::sync::Arc;

use futures::future::BoxFuture;
use kvpool_client::master::ClientError;

use crate::api::shm::Staging;
use crate::proto::{GetItem, GetResult, PutRequest};

/// Why a whole batch failed (per-item failures are statuses, not errors).
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum BatchError {
    /// The blocking task running a local batch panicked or was cancelled.
    #[error("worker failed: {0}")]
    Worker(String),
    /// The pool's master did not answer.
    #[error("master: {0}")]
    Master(#[source] ClientError),
}

kvpool_runtime::error_category!(BatchError);

impl BatchError {
    /// The gRPC status the engine gets: `internal` for a failed worker, `unavailable` while the
    /// master is unreachable.
    pub fn to_status(&self) -> tonic::Status {
        match self {
            BatchError::Worker(_) => tonic::Status::internal(self.to_string()),
            BatchError::Master(_) => tonic::Status::unavailable(self.to_string()),
        }
    }
}

/// A batch in flight: one answer per item, in order, or the whole batch failed.
pub type Batch<T> = BoxFuture<'static, Result<Vec<T>, BatchError>>;

/// Where the engine API puts and gets blocks. Methods take `self: Arc<Self>` so that an
/// implementation may move itself onto another task (the blocking pool).
pub trait BlockStore: Send + Sync + 'static {
    /// Store each item's `length` bytes at `offset` of `staging` (the request's session) under
    /// its key, near the request's NUMA hint where the store can; one `proto::Status` per item,
    /// in order.
    fn put_batch(self: Arc<Self>, staging: Arc<Staging>, req: PutRequest) -> Batch<i32>;

    /// Copy the block of each item's key to `offset` of `staging` when it fits `capacity`; one
    /// result (status and the block's length) per item, in order.
    fn get_batch(self: Arc<Self>, staging: Arc<Staging>, items: Vec<GetItem>) -> Batch<GetResult>;

    /// Whether each key is held.
    fn exists_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool>;

    /// Drop each key; true for each key that was held.
    fn remove_batch(self: Arc<Self>, keys: Vec<Vec<u8>>) -> Batch<bool>;
}
