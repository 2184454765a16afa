//! HA persistence of the metadata: the write-through journal of changes (segments, committed
//! objects, reservations of space handed to writers, the segment-id high-water mark) and the
//! records a new leader restores the state from. Pure: the HA layer (`kvpool-master`) writes
//! the journal to etcd and reads the records back.

use smallvec::SmallVec;

use super::{HARD_PIN, LIVE, MasterState, NodeState, PENDING, Rep, SPREAD_DOMAINS, Segment};
use crate::master::alloc::{ExtentAllocator, PAGE_BYTES, pages_for};
use crate::master::types::{JournalOp, ObjectKey, ObjectRecord, SegmentSpec};

impl MasterState {
    /// Record changes for persistence from now on; drain them with [`Self::take_journal`].
    pub fn enable_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// Changes since the last call (empty when the journal is disabled).
    pub fn take_journal(&mut self) -> Vec<JournalOp> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    pub(super) fn log(&mut self, op: JournalOp) {
        if let Some(j) = self.journal.as_mut() {
            j.push(op);
        }
    }

    pub(super) fn log_object(&mut self, slot: u32) {
        if self.journal.is_none() {
            return;
        }
        let Some(e) = self.entries.get(slot as usize) else {
            return;
        };
        if !e.has(LIVE) || e.has(PENDING) {
            return;
        }
        let key = e.key;
        if let Some(rec) = self.object_record(&key) {
            self.log(JournalOp::PutObject(rec));
        }
    }

    pub(super) fn log_reserve(&mut self, r: Rep, pages: u32) {
        self.log(JournalOp::Reserve {
            seg: r.seg,
            offset: u64::from(r.page) * PAGE_BYTES,
            length: u64::from(pages) * PAGE_BYTES,
        });
    }

    pub(super) fn log_unreserve(&mut self, r: Rep) {
        self.log(JournalOp::Unreserve {
            seg: r.seg,
            offset: u64::from(r.page) * PAGE_BYTES,
        });
    }

    /// Never hand out segment ids below `n` (a new leader, from the persisted high-water mark).
    pub fn reserve_segment_ids(&mut self, n: u32) {
        self.next_segment = self.next_segment.max(n);
    }

    /// Next segment id to be handed out.
    pub fn next_segment_id(&self) -> u32 {
        self.next_segment
    }

    /// Mounted segments with their ids.
    pub fn segment_records(&self) -> Vec<(u32, SegmentSpec)> {
        let mut v: Vec<_> = self
            .segments
            .iter()
            .map(|(id, s)| (*id, s.spec.clone()))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// The committed object `key`, as the HA layer persists it.
    pub fn object_record(&self, key: &ObjectKey) -> Option<ObjectRecord> {
        let slot = self.find(key)?;
        let e = &self.entries[slot as usize];
        if e.has(PENDING) {
            return None;
        }
        Some(ObjectRecord {
            key: e.key,
            size: e.size,
            desired: e.desired,
            hard_pinned: e.has(HARD_PIN),
            spread_failure_domain: e.has(SPREAD_DOMAINS),
            replicas: e
                .replicas
                .iter()
                .map(|r| (r.seg, u64::from(r.page) * PAGE_BYTES))
                .collect(),
            event_name: self.event_name(slot),
        })
    }

    /// All committed objects.
    pub fn object_records(&self) -> Vec<ObjectRecord> {
        self.entries
            .iter()
            .filter(|e| e.has(LIVE) && !e.has(PENDING))
            .filter_map(|e| self.object_record(&e.key))
            .collect()
    }

    /// Rebuild state from persisted records (a new leader taking over). Agents count as
    /// alive from now and must heartbeat within the timeout. Records naming unknown
    /// segments or overlapping space are skipped and counted in the returned value.
    pub fn restore(
        &mut self,
        segments: Vec<(u32, SegmentSpec)>,
        objects: Vec<ObjectRecord>,
        reservations: Vec<(u32, u64, u64)>,
    ) -> usize {
        let now = self.clock.now_ms();
        self.evict_not_before_ms = now + self.config.lease_ttl_ms;
        let mut skipped = 0;
        for (id, spec) in segments {
            let node = match self.node_ids.get(&spec.node) {
                Some(n) => *n,
                None => {
                    let n = self.nodes.len() as u32;
                    self.nodes.push(NodeState::new(
                        spec.node.clone(),
                        spec.failure_domain.clone(),
                        now,
                    ));
                    self.node_ids.insert(spec.node.clone(), n);
                    n
                }
            };
            let alloc = ExtentAllocator::new(spec.capacity_bytes);
            self.capacity_pages[spec.tier.index()] += alloc.capacity_bytes() / PAGE_BYTES;
            self.nodes[node as usize].segments.push(id);
            self.next_segment = self.next_segment.max(id + 1);
            // Restored after a failover: its agent adopted long ago (or will remount).
            self.segments
                .insert(id, Segment::new(spec, node, alloc, false));
        }
        for rec in objects {
            if self.find(&rec.key).is_some() {
                skipped += 1;
                continue;
            }
            let Some(pages) = pages_for(rec.size) else {
                skipped += 1;
                continue;
            };
            let mut reps: SmallVec<[Rep; 2]> = SmallVec::new();
            for (seg, offset) in rec.replicas {
                let page = u32::try_from(offset / PAGE_BYTES).unwrap_or(u32::MAX);
                let Some(s) = self.segments.get_mut(&seg) else {
                    continue;
                };
                if s.alloc.claim(page, pages) {
                    self.used_pages[s.spec.tier.index()] += u64::from(pages);
                    reps.push(Rep { seg, page });
                }
            }
            if reps.is_empty() {
                skipped += 1;
                continue;
            }
            let short = reps.len() < usize::from(rec.desired);
            let slot = self.new_object(rec.key, rec.size, rec.desired.max(1), reps);
            if rec.spread_failure_domain {
                self.entries[slot as usize].flags |= SPREAD_DOMAINS;
            }
            if rec.hard_pinned {
                self.entries[slot as usize].flags |= HARD_PIN;
            }
            if let Some(name) = rec.event_name {
                self.set_event_name(slot, name);
            }
            if short {
                self.under.insert(slot);
            }
            self.sync_policy(slot);
        }
        self.restored_slots = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        let until = now + self.config.put_timeout_ms.max(self.config.task_timeout_ms);
        for (seg, offset, length) in reservations {
            let page = u32::try_from(offset / PAGE_BYTES).unwrap_or(u32::MAX);
            let Some(pages) = pages_for(length) else {
                skipped += 1;
                continue;
            };
            let claimed = self
                .segments
                .get_mut(&seg)
                .filter(|s| s.alloc.free_bytes() > 0)
                .and_then(|s| s.alloc.claim(page, pages).then_some(s.spec.tier));
            match claimed {
                Some(tier) => {
                    self.used_pages[tier.index()] += u64::from(pages);
                    self.quarantine.push((seg, page, pages, until));
                }
                None => skipped += 1,
            }
        }
        skipped
    }
}
