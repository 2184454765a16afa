//! The object index: the dense slab of entries and its hash table, creating and forgetting
//! objects, freeing replicas, keeping the per-tier eviction policies in step with where an
//! object has replicas, and the lookups (`exists`, `longest_prefix`, replica locations).
//! Pure; no I/O.

use smallvec::SmallVec;

use super::{Entry, IN_POLICY, LIVE, MasterError, MasterState, PENDING, Rep};
use crate::master::alloc::PAGE_BYTES;
use crate::master::types::{JournalOp, ObjectKey, ReplicaInfo, Tier};

impl MasterState {
    pub(super) fn find(&self, key: &ObjectKey) -> Option<u32> {
        let entries = &self.entries;
        self.index
            .find(key.lo, |s| {
                entries.get(*s as usize).is_some_and(|e| e.key == *key)
            })
            .copied()
    }

    pub(super) fn new_object(
        &mut self,
        key: ObjectKey,
        size: u64,
        desired: u8,
        reps: SmallVec<[Rep; 2]>,
    ) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.entries.push(Entry {
                    key,
                    size: 0,
                    replicas: SmallVec::new(),
                    generation: 0,
                    leases: 0,
                    desired: 0,
                    flags: 0,
                });
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[slot as usize];
        e.key = key;
        e.size = size;
        e.replicas = reps;
        e.generation = e.generation.wrapping_add(1);
        e.leases = 0;
        e.desired = desired;
        e.flags = LIVE;
        let entries = &self.entries;
        self.index.insert_unique(key.lo, slot, |s| {
            entries.get(*s as usize).map_or(0, |e| e.key.lo)
        });
        self.live_objects += 1;
        slot
    }

    /// Free every replica of `slot` and forget the object (a pending put's space is held back
    /// for the reuse delay: its writes may still be on their way).
    pub(super) fn drop_object(&mut self, slot: u32) {
        self.forget_object(slot, true);
    }

    /// [`Self::drop_object`]; `writes_may_follow`: whether a pending put's space is held back.
    pub(super) fn forget_object(&mut self, slot: u32, writes_may_follow: bool) {
        let Some(e) = self.entries.get_mut(slot as usize) else {
            return;
        };
        if !e.has(LIVE) {
            return;
        }
        self.unpublish(slot);
        let e = &mut self.entries[slot as usize];
        let key = e.key;
        let pages = e.pages();
        let was_pending = e.has(PENDING);
        let reps = std::mem::take(&mut e.replicas);
        e.flags = 0;
        e.leases = 0;
        e.generation = e.generation.wrapping_add(1);
        for r in reps {
            self.feed_free(r, key);
            if was_pending && writes_may_follow {
                // The put's writes may still be on their way.
                self.abandon(r, pages);
            } else if was_pending {
                self.log_unreserve(r);
                self.free_rep(r, pages);
            } else {
                self.free_rep(r, pages);
            }
        }
        if !was_pending {
            self.log(JournalOp::DelObject(key));
        }
        for t in Tier::ALL {
            self.policies[t.index()].remove(slot);
        }
        if let Ok(found) = self.index.find_entry(key.lo, |s| *s == slot) {
            found.remove();
        }
        self.pending.remove(&slot);
        self.soft_pins.remove(&slot);
        self.hot.remove(&slot);
        self.under.remove(&slot);
        self.free_slots.push(slot);
        self.live_objects -= 1;
    }

    /// Give back the reserved space of an abandoned write: held back (and still reserved in
    /// the journal) for `reuse_delay_ms`, then freed by the tick; a write that arrives late
    /// lands on space no object uses. Freed at once without a delay or a segment.
    pub(super) fn abandon(&mut self, r: Rep, pages: u32) {
        let delay = self.config.reuse_delay_ms;
        if delay == 0 || !self.segments.contains_key(&r.seg) {
            self.log_unreserve(r);
            self.free_rep(r, pages);
            return;
        }
        let until = self.clock.now_ms().saturating_add(delay);
        self.quarantine.push((r.seg, r.page, pages, until));
        self.counters.reuse_deferred += 1;
    }

    pub(super) fn free_rep(&mut self, r: Rep, pages: u32) {
        if let Some(seg) = self.segments.get_mut(&r.seg)
            && seg.alloc.free(r.page, pages)
        {
            self.used_pages[seg.spec.tier.index()] -= u64::from(pages);
        }
    }

    pub(super) fn tier_of(&self, r: Rep) -> Option<Tier> {
        self.segments.get(&r.seg).map(|s| s.spec.tier)
    }

    /// After `slot` lost or gained replicas: forget it when none is left, else bring its policy
    /// membership and its journal record up to date.
    pub(super) fn settle(&mut self, slot: u32) {
        if self.entries[slot as usize].replicas.is_empty() {
            self.drop_object(slot);
        } else {
            self.sync_policy(slot);
            self.log_object(slot);
        }
    }

    /// Make policy membership match the tiers the committed object has replicas in.
    pub(super) fn sync_policy(&mut self, slot: u32) {
        let Some(e) = self.entries.get(slot as usize) else {
            return;
        };
        let committed = e.has(LIVE) && !e.has(PENDING);
        let key = e.key.lo;
        for t in Tier::ALL {
            let e = &self.entries[slot as usize];
            let has = committed && e.replicas.iter().any(|r| self.tier_of(*r) == Some(t));
            let tracked = e.has(IN_POLICY[t.index()]);
            if has && !tracked {
                self.policies[t.index()].insert(slot, key);
                self.entries[slot as usize].flags |= IN_POLICY[t.index()];
            } else if !has && tracked {
                self.policies[t.index()].remove(slot);
                self.entries[slot as usize].flags &= !IN_POLICY[t.index()];
            }
        }
        self.publish_tiers(slot);
    }

    pub(super) fn committed_slot(&self, key: &ObjectKey) -> Result<u32, MasterError> {
        let slot = self
            .find(key)
            .ok_or_else(|| MasterError::UnknownKey(key.to_hex()))?;
        if self.entries[slot as usize].has(PENDING) {
            return Err(MasterError::UnknownKey(key.to_hex()));
        }
        Ok(slot)
    }

    fn is_committed(&self, k: &ObjectKey) -> bool {
        self.find(k)
            .is_some_and(|s| !self.entries[s as usize].has(PENDING))
    }

    /// Whether each key is committed.
    pub fn exists(&self, keys: &[ObjectKey]) -> Vec<bool> {
        keys.iter().map(|k| self.is_committed(k)).collect()
    }

    /// Number of leading keys that are committed (the cached prefix of a block chain).
    pub fn longest_prefix(&self, keys: &[ObjectKey]) -> usize {
        keys.iter().take_while(|k| self.is_committed(k)).count()
    }

    /// Replica count and tiers of a committed object (for status and tests).
    pub fn replica_tiers(&self, key: &ObjectKey) -> Option<Vec<Tier>> {
        let slot = self.find(key)?;
        let e = &self.entries[slot as usize];
        Some(e.replicas.iter().filter_map(|r| self.tier_of(*r)).collect())
    }

    pub(super) fn replica_info(&self, r: Rep, size: u64) -> Option<ReplicaInfo> {
        let seg = self.segments.get(&r.seg)?;
        Some(ReplicaInfo {
            node: self.nodes.get(seg.node as usize)?.name.clone(),
            segment_id: r.seg,
            segment: seg.spec.name.clone(),
            tier: seg.spec.tier,
            numa_node: seg.spec.numa_node,
            endpoints: seg.spec.endpoints.clone(),
            offset: u64::from(r.page) * PAGE_BYTES,
            length: size,
        })
    }
}
