//! Replicas that live in the client's own process (an agent's registered tiers): the
//! [`LocalSegments`] a [`PoolClient`] may be given, and the plain memory copies that reach them
//! instead of a transport. I/O boundary: memory of this process only.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

use super::PoolClient;
use super::error::DataError;
use super::naming::{replica_name, transfer_name};
use kvpool_core::master::types::ReplicaInfo;
use kvpool_transfer::{self as transfer, MemoryError, Segment};

/// Segments that live in the client's own process (an agent's registered tiers), by transfer
/// name: a replica in one of them is written and read with a plain memory copy, not through a
/// transport. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct LocalSegments(Arc<RwLock<HashMap<String, Arc<Segment>>>>);

impl LocalSegments {
    pub fn insert(&self, name: &str, segment: Arc<Segment>) {
        self.0.write().insert(name.to_owned(), segment);
    }

    pub fn remove(&self, name: &str) {
        self.0.write().remove(name);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Segment>> {
        self.0.read().get(name).cloned()
    }
}

impl PoolClient {
    /// The segment of a replica when it lives in this process.
    pub(super) fn local_segment(&self, r: &ReplicaInfo) -> Option<Arc<Segment>> {
        if r.node != self.node {
            return None;
        }
        self.local.get(&transfer_name(&r.node, &r.segment))
    }
}

/// A failed copy to or from the local segment of replica `r`.
pub(super) fn local_error(r: &ReplicaInfo) -> impl FnOnce(MemoryError) -> DataError + '_ {
    |source| DataError::Local {
        name: replica_name(r),
        source,
    }
}

/// Copy `size` bytes from `src` at `src_offset` to `dst` at `dst_offset`, one of them the local
/// segment of replica `r`.
pub(super) fn copy_local(
    src: &Segment,
    src_offset: u64,
    dst: &Segment,
    dst_offset: u64,
    size: u64,
    r: &ReplicaInfo,
) -> Result<(), DataError> {
    let len = usize::try_from(size).map_err(|_| DataError::SizeMismatch {
        got: size,
        want: size,
    })?;
    transfer::memory::copy_between(src, src_offset, dst, dst_offset, len).map_err(local_error(r))
}
