//! The transfer-engine side of a replica, shared by puts and gets: opening the replica's
//! segment, one request to or from it, the length checks a replica passes first, and running
//! the blocking transfers off the async runtime. I/O boundary: the transfer engine's
//! connections (opened in [`PoolClient::open`]).

use super::PoolClient;
use super::error::DataError;
use super::naming::descriptor;
use kvpool_core::master::types::ReplicaInfo;
use kvpool_transfer::{self as transfer, TransferOp, TransferRequest};

impl PoolClient {
    /// The replica's segment: mapped through its agent's shared memory when it is on this
    /// node and shared ([`PoolClient::with_same_node_shm`]), else opened through the transfer
    /// engine (once per segment: the engine keeps TCP handles, and runs a transfer refused for
    /// a stale one again).
    pub(super) fn open(&self, r: &ReplicaInfo) -> Result<transfer::RemoteSegment, DataError> {
        let desc = descriptor(r)?;
        if let Some(seg) = self.same_node_segment(r, &desc) {
            return Ok(seg);
        }
        self.engine
            .open_cached(&desc)
            .map_err(|source| DataError::Open {
                name: desc.name.clone(),
                source,
            })
    }

    /// A transfer (`op`) of `len` bytes between `local` at `local_offset` and replica `r`.
    pub(super) fn request(
        &self,
        op: TransferOp,
        local: &transfer::LocalSegment,
        local_offset: u64,
        r: &ReplicaInfo,
        len: u64,
    ) -> Result<TransferRequest, DataError> {
        Ok(request_on(
            op,
            local,
            local_offset,
            self.open(r)?,
            r.offset,
            len,
        ))
    }
}

/// A transfer (`op`) of `len` bytes between `local` at `local_offset` and the opened segment
/// `remote` at `remote_offset`.
pub(super) fn request_on(
    op: TransferOp,
    local: &transfer::LocalSegment,
    local_offset: u64,
    remote: transfer::RemoteSegment,
    remote_offset: u64,
    len: u64,
) -> TransferRequest {
    TransferRequest {
        op,
        local: local.clone(),
        local_offset,
        remote,
        remote_offset,
        len,
    }
}

/// A replica the master placed for a value of `size` bytes must be that long.
pub(super) fn check_length(r: &ReplicaInfo, size: u64) -> Result<(), DataError> {
    if r.length == size {
        Ok(())
    } else {
        Err(DataError::SizeMismatch {
            got: r.length,
            want: size,
        })
    }
}

/// A replica of part `part` of a striped object must be as long as the manifest says.
pub(super) fn check_part_length(r: &ReplicaInfo, part: u32, len: u64) -> Result<(), DataError> {
    if r.length == len {
        Ok(())
    } else {
        Err(DataError::StripeMismatch {
            part,
            got: r.length,
            want: len,
        })
    }
}

impl PoolClient {
    /// Run `f` (transfers, which block) on the blocking pool, or right here on a fork (whose
    /// runtime is its caller's thread, see [`PoolClient::fork`]).
    pub(super) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, DataError> + Send + 'static,
    ) -> Result<T, DataError> {
        if self.inline {
            return f();
        }
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| DataError::Join(e.to_string()))
            .and_then(|r| r)
    }
}
