//! Same-node shared memory in pool mode: an agent announces its DRAM segments with a
//! `shm://socket` endpoint beside the TCP one; a client that opted in ([`PoolClient::
//! with_same_node_shm`]) and can reach that socket maps the segment's memfd and moves the
//! bytes with memory copies, no socket in the data path. Each segment is tried once per master
//! segment id: a mapping (or the failure to get one, which sends that segment to TCP) is kept
//! until the master gives the name a new id, which it does when the agent mounts it again (a
//! restarted agent's memory is new, so the old mapping must not be used). I/O boundary: the
//! socket's existence check and the transfer engine's shared-memory OPEN.

use std::collections::HashMap;

use kvpool_core::master::types::ReplicaInfo;
use kvpool_transfer::{Protocol, RemoteSegment, SegmentDescriptor, TransferEngine};
use parking_lot::Mutex;

use super::PoolClient;

/// Segments kept at most (all are dropped when full; they are opened again on use).
const MAX_KEPT: usize = 1024;

/// What one client (and its clones and forks) decided per segment.
#[derive(Debug, Default)]
pub(super) struct SameNode {
    enabled: bool,
    /// By transfer name: the master segment id it was decided for, and the mapping (`None`:
    /// this segment goes through TCP).
    kept: Mutex<HashMap<String, (u32, Option<RemoteSegment>)>>,
}

impl SameNode {
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            kept: Mutex::default(),
        }
    }

    /// The mapping of `r`'s segment when it is on this node and can be shared, else `None`
    /// (the caller opens it over TCP).
    fn segment(
        &self,
        engine: &TransferEngine,
        r: &ReplicaInfo,
        desc: &SegmentDescriptor,
    ) -> Option<RemoteSegment> {
        if !self.enabled {
            return None;
        }
        let path = desc.shm_endpoint()?;
        if let Some((id, seg)) = self.kept.lock().get(&desc.name)
            && *id == r.segment_id
        {
            return seg.clone();
        }
        // The socket is on this node's filesystem only when its agent is (in a cluster, the
        // agent's socket directory is mounted into engine pods); an agent elsewhere with the
        // same path refuses a segment name that is not its own, and the segment goes to TCP.
        let seg = if path.exists() {
            match engine.open_descriptor(desc, Some(Protocol::Shm)) {
                Ok(seg) => {
                    tracing::info!(segment = %desc.name, segment_id = r.segment_id,
                        socket = %path.display(), bytes = seg.len(),
                        "same-node segment mapped: copies instead of TCP");
                    Some(seg)
                }
                Err(e) => {
                    tracing::info!(segment = %desc.name, segment_id = r.segment_id,
                        socket = %path.display(), error = %e,
                        "same-node shared memory refused; this segment goes through TCP");
                    None
                }
            }
        } else {
            None
        };
        let mut kept = self.kept.lock();
        if kept.len() >= MAX_KEPT && !kept.contains_key(&desc.name) {
            kept.clear();
        }
        // A new id replaces the old entry, and with it the old mapping (once no transfer
        // holds it any more).
        kept.insert(desc.name.clone(), (r.segment_id, seg.clone()));
        seg
    }
}

impl PoolClient {
    /// Map replicas on this node's agent through its shared-memory socket when it announces
    /// one and this process can reach it (default: off; engines' clients turn it on). Shared
    /// with clones and forks made afterwards.
    #[must_use]
    pub fn with_same_node_shm(mut self, enabled: bool) -> Self {
        self.same_node = std::sync::Arc::new(SameNode::new(enabled));
        self
    }

    /// `r`'s segment, mapped, when it is on this node and shared (see [`SameNode`]).
    pub(super) fn same_node_segment(
        &self,
        r: &ReplicaInfo,
        desc: &SegmentDescriptor,
    ) -> Option<RemoteSegment> {
        self.same_node.segment(&self.engine, r, desc)
    }
}
