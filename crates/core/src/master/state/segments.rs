//! Segments: mounting and unmounting the memory and SSD segments agents offer, adopting the
//! replicas an agent found in its persistent segment after a restart, and dropping what lived
//! in a segment that went away. Pure metadata; the agents own the bytes.

use smallvec::SmallVec;

use super::{LIVE, MasterError, MasterState, NodeState, PENDING, Rep, Segment};
use crate::master::alloc::{ExtentAllocator, PAGE_BYTES, pages_for};
use crate::master::types::{AdoptItem, JournalOp, SegmentSpec};

impl MasterState {
    /// Mount a segment. Mounting a name the node already has replaces the old segment (the
    /// agent restarted: its memory is new), dropping the replicas that lived there.
    pub fn mount(&mut self, spec: SegmentSpec) -> Result<u32, MasterError> {
        if spec.node.is_empty() || spec.name.is_empty() {
            return Err(MasterError::InvalidArgument(
                "segment node and name must not be empty".into(),
            ));
        }
        if spec.capacity_bytes < PAGE_BYTES {
            return Err(MasterError::InvalidArgument(format!(
                "segment {}/{} capacity {} is below one page ({PAGE_BYTES} bytes)",
                spec.node, spec.name, spec.capacity_bytes
            )));
        }
        let now = self.clock.now_ms();
        let node = match self.node_ids.get(&spec.node) {
            Some(n) => *n,
            None => {
                let n = u32::try_from(self.nodes.len())
                    .map_err(|_| MasterError::InvalidArgument("too many nodes".into()))?;
                self.nodes
                    .push(NodeState::new(spec.node.clone(), String::new(), now));
                self.node_ids.insert(spec.node.clone(), n);
                n
            }
        };
        let old = self.nodes[node as usize]
            .segments
            .iter()
            .copied()
            .find(|s| {
                self.segments
                    .get(s)
                    .is_some_and(|seg| seg.spec.name == spec.name)
            });
        if let Some(old) = old {
            self.remove_segment(old);
        }
        let id = self.next_segment;
        self.next_segment += 1;
        self.log(JournalOp::SegmentIdsUsed(self.next_segment));
        let alloc = ExtentAllocator::new(spec.capacity_bytes);
        let t = spec.tier.index();
        self.capacity_pages[t] += alloc.capacity_bytes() / PAGE_BYTES;
        let ns = &mut self.nodes[node as usize];
        ns.alive = true;
        ns.last_heartbeat_ms = now;
        ns.suspect_since_ms = None;
        ns.failure_domain = spec.failure_domain.clone();
        ns.segments.push(id);
        self.log(JournalOp::PutSegment(id, spec.clone()));
        let sealed = spec.persistent;
        self.segments
            .insert(id, Segment::new(spec, node, alloc, sealed));
        Ok(id)
    }

    /// Unmount one segment of `node`; its replicas are dropped as if the node had died.
    pub fn unmount(&mut self, node: &str, segment: u32) -> Result<(), MasterError> {
        let owned = self
            .node_ids
            .get(node)
            .zip(self.segments.get(&segment))
            .is_some_and(|(n, s)| s.node == *n);
        if !owned {
            return Err(MasterError::UnknownSegment {
                node: node.to_owned(),
                id: segment,
            });
        }
        self.remove_segment(segment);
        Ok(())
    }

    /// Adopt replicas that `node` found in its segment `segment` after a restart (the
    /// persistent SSD tier): each item becomes a committed replica there. A key the master
    /// already knows gets an extra replica when the sizes match; an unknown key becomes an
    /// object with this one replica. The item's pages are marked used so nothing else is
    /// allocated on them. One result per item, in order; a refused item (bad bounds or
    /// alignment, overlap with used space, size mismatch, a put in progress, a replica already
    /// on this segment) changes nothing. Fails as a whole only when the segment is not this
    /// node's. A persistent segment (`SegmentSpec::persistent`) is sealed from its mount until
    /// a call with `complete` (the agent's last batch, possibly empty): until then nothing else
    /// is placed in it, so no new replica can overwrite a block that is still to be adopted.
    pub fn adopt(
        &mut self,
        node: &str,
        segment: u32,
        items: &[AdoptItem],
        complete: bool,
    ) -> Result<Vec<Result<(), MasterError>>, MasterError> {
        let owned = self
            .node_ids
            .get(node)
            .zip(self.segments.get(&segment))
            .is_some_and(|(n, s)| s.node == *n && self.nodes[*n as usize].alive);
        if !owned {
            return Err(MasterError::UnknownSegment {
                node: node.to_owned(),
                id: segment,
            });
        }
        let results = items
            .iter()
            .map(|item| self.adopt_one(segment, item))
            .collect();
        if complete && let Some(s) = self.segments.get_mut(&segment) {
            s.sealed = false;
        }
        Ok(results)
    }

    /// Whether segment `id` is sealed (mounted persistent, its adoption not complete yet).
    pub fn sealed(&self, id: u32) -> bool {
        self.segments.get(&id).is_some_and(|s| s.sealed)
    }

    fn adopt_one(&mut self, seg_id: u32, item: &AdoptItem) -> Result<(), MasterError> {
        let hex = item.key.to_hex();
        let bad = |why: String| Err(MasterError::InvalidArgument(format!("adopt {hex}: {why}")));
        if item.length == 0 {
            return bad("length must be > 0".into());
        }
        if !item.offset.is_multiple_of(PAGE_BYTES) {
            return bad(format!(
                "offset {} is not aligned to {PAGE_BYTES} bytes",
                item.offset
            ));
        }
        let Some(seg) = self.segments.get(&seg_id) else {
            return Err(MasterError::UnknownSegment {
                node: String::new(),
                id: seg_id,
            });
        };
        let capacity = seg.alloc.capacity_bytes();
        let (Some(pages), Some(end)) =
            (pages_for(item.length), item.offset.checked_add(item.length))
        else {
            return bad(format!("length {} is too large", item.length));
        };
        if end > capacity {
            return bad(format!(
                "bytes {}..{end} are outside the segment ({capacity} bytes)",
                item.offset
            ));
        }
        let page = u32::try_from(item.offset / PAGE_BYTES)
            .map_err(|_| MasterError::InvalidArgument(format!("adopt {hex}: offset too large")))?;
        let tier = seg.spec.tier;
        let existing = self.find(&item.key);
        if let Some(slot) = existing {
            let e = &self.entries[slot as usize];
            if e.has(PENDING) {
                return Err(MasterError::PutInProgress(hex));
            }
            if e.size != item.length {
                return Err(MasterError::SizeConflict {
                    key: hex,
                    existing: e.size,
                    requested: item.length,
                });
            }
            if e.replicas.iter().any(|r| r.seg == seg_id) {
                return bad(format!("it already has a replica on segment {seg_id}"));
            }
        }
        let claimed = self
            .segments
            .get_mut(&seg_id)
            .is_some_and(|s| s.alloc.claim(page, pages));
        if !claimed {
            return bad(format!(
                "bytes {}..{end} overlap space already in use on segment {seg_id}",
                item.offset
            ));
        }
        self.used_pages[tier.index()] += u64::from(pages);
        let rep = Rep { seg: seg_id, page };
        let slot = match existing {
            Some(slot) => {
                let e = &mut self.entries[slot as usize];
                e.replicas.push(rep);
                if e.replicas.len() >= usize::from(e.desired) {
                    self.under.remove(&slot);
                }
                slot
            }
            None => {
                let mut reps = SmallVec::new();
                reps.push(rep);
                self.new_object(item.key, item.length, 1, reps)
            }
        };
        self.sync_policy(slot);
        self.log_object(slot);
        Ok(())
    }

    pub(super) fn remove_segment(&mut self, id: u32) {
        let Some(seg) = self.segments.remove(&id) else {
            return;
        };
        let t = seg.spec.tier.index();
        self.capacity_pages[t] -= seg.alloc.capacity_bytes() / PAGE_BYTES;
        self.used_pages[t] -= seg.alloc.used_bytes() / PAGE_BYTES;
        self.log(JournalOp::DelSegment(id));
        // Held-back space on it goes with it (and out of the journal).
        let held: Vec<u32> = self
            .quarantine
            .iter()
            .filter(|q| q.0 == id)
            .map(|q| q.1)
            .collect();
        self.quarantine.retain(|q| q.0 != id);
        for page in held {
            self.log_unreserve(Rep { seg: id, page });
        }
        if let Some(ns) = self.nodes.get_mut(seg.node as usize) {
            ns.segments.retain(|s| *s != id);
            ns.feed.retain(|e| e.segment_id != id);
        }
        // Tasks touching the segment fail; their surviving allocations are freed.
        let doomed: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.source.seg == id || t.target.seg == id)
            .map(|(k, _)| *k)
            .collect();
        for task in doomed {
            self.finish_task(task, false);
        }
        for slot in 0..self.entries.len() as u32 {
            let e = &mut self.entries[slot as usize];
            if !e.has(LIVE) || !e.replicas.iter().any(|r| r.seg == id) {
                continue;
            }
            let lost: SmallVec<[Rep; 2]> =
                e.replicas.iter().copied().filter(|r| r.seg == id).collect();
            e.replicas.retain(|r| r.seg != id);
            let (pending, empty, short) = (
                e.has(PENDING),
                e.replicas.is_empty(),
                e.replicas.len() < usize::from(e.desired),
            );
            if pending {
                // put_end will see the loss and fail or commit on the survivors.
                for r in lost {
                    self.log_unreserve(r);
                }
                continue;
            }
            if empty {
                self.counters.objects_lost += 1;
                self.drop_object(slot);
                continue;
            }
            if short {
                self.under.insert(slot);
            }
            self.sync_policy(slot);
            self.log_object(slot);
        }
    }
}
