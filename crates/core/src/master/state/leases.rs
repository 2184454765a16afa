//! Reads and what holds objects in place: read leases (granted by `get`, released or
//! expired), hard and soft pins, and removal, refused while readers hold leases. Pure; time
//! comes from the injected clock.

use super::{HARD_PIN, LIVE, LeaseRec, MasterError, MasterState, PENDING, SOFT_PIN};
use crate::master::types::{GetResult, Lease, ObjectKey, Tier};

impl MasterState {
    /// Replica locations of a committed object, with a read lease. Counts a hit on the node
    /// and tier of the replica a reader away from every replica reads: the first DRAM one,
    /// else the first (see [`MasterState::node_reports`]).
    pub fn get(&mut self, key: ObjectKey) -> Result<GetResult, MasterError> {
        let slot = self.committed_slot(&key)?;
        let now = self.clock.now_ms();
        let e = &mut self.entries[slot as usize];
        if e.leases == u16::MAX {
            return Err(MasterError::LeaseLimit(key.to_hex()));
        }
        e.leases += 1;
        let (generation, size) = (e.generation, e.size);
        let reps = e.replicas.clone();
        let id = self.next_lease;
        self.next_lease += 1;
        let expires_ms = now + self.config.lease_ttl_ms;
        self.leases.insert(
            id,
            LeaseRec {
                slot,
                generation,
                granted_ms: now,
                expires_ms,
            },
        );
        self.lease_expiry.insert((expires_ms, id));
        for t in Tier::ALL {
            self.policies[t.index()].touch(slot);
        }
        // The hit counts on the node and tier of the replica a reader on none of the replicas'
        // nodes reads (the client's `pick_nearest`): the first DRAM one, else the first.
        let mut served: Option<(u32, usize)> = None;
        for r in reps.iter().filter(|_| self.config.node_get_hits) {
            if let Some(s) = self.segments.get(&r.seg) {
                let t = s.spec.tier.index();
                if served.is_none() || t == Tier::Dram.index() {
                    served = Some((s.node, t));
                }
                if t == Tier::Dram.index() {
                    break;
                }
            }
        }
        if let Some((node, t)) = served
            && let Some(ns) = self.nodes.get_mut(node as usize)
        {
            ns.get_hits[t] += 1;
        }
        let replicas = reps
            .into_iter()
            .filter_map(|r| self.replica_info(r, size))
            .collect();
        Ok(GetResult {
            size,
            replicas,
            lease: Lease { id, expires_ms },
        })
    }

    /// End a read lease early (the reader finished). Returns how long the lease held its
    /// object in place, in ms: the wait a remove or an eviction of that object faced.
    pub fn release_lease(&mut self, id: u64) -> Result<u64, MasterError> {
        let rec = self.leases.remove(&id).ok_or(MasterError::StaleLease(id))?;
        let held_ms = self.clock.now_ms().saturating_sub(rec.granted_ms);
        self.lease_expiry.remove(&(rec.expires_ms, id));
        if let Some(e) = self.entries.get_mut(rec.slot as usize)
            && e.has(LIVE)
            && e.generation == rec.generation
        {
            e.leases = e.leases.saturating_sub(1);
        }
        Ok(held_ms)
    }

    /// Remove a committed object. Refused while readers hold leases on it.
    pub fn remove(&mut self, key: ObjectKey) -> Result<(), MasterError> {
        let slot = self
            .find(&key)
            .ok_or_else(|| MasterError::UnknownKey(key.to_hex()))?;
        let e = &self.entries[slot as usize];
        if e.has(PENDING) {
            return Err(MasterError::PutInProgress(key.to_hex()));
        }
        // Right after a failover the readers' leases on restored objects are unknown here:
        // until they have expired, a remove could free memory under one of them.
        let restored_grace =
            slot < self.restored_slots && self.clock.now_ms() < self.evict_not_before_ms;
        if e.leases > 0 || restored_grace {
            return Err(MasterError::Leased {
                key: key.to_hex(),
                leases: e.leases,
            });
        }
        self.drop_object(slot);
        Ok(())
    }

    /// Remove every committed object no reader holds a lease on (Mooncake's `remove_all`);
    /// puts in progress and leased objects stay. Returns how many were removed.
    pub fn remove_all(&mut self) -> u64 {
        let in_grace = self.clock.now_ms() < self.evict_not_before_ms;
        let doomed: Vec<u32> = (0..)
            .zip(&self.entries)
            .filter(|(slot, e)| {
                e.has(LIVE)
                    && !e.has(PENDING)
                    && e.leases == 0
                    && !(in_grace && *slot < self.restored_slots)
            })
            .map(|(slot, _)| slot)
            .collect();
        for slot in &doomed {
            self.drop_object(*slot);
        }
        doomed.len() as u64
    }

    /// Pin an object: hard pins are never evicted; soft pins (`ttl_ms`) are evicted last.
    pub fn pin(&mut self, key: ObjectKey, hard: bool, ttl_ms: u64) -> Result<(), MasterError> {
        let slot = self.committed_slot(&key)?;
        if hard {
            self.entries[slot as usize].flags |= HARD_PIN;
            self.log_object(slot);
        } else {
            if ttl_ms == 0 {
                return Err(MasterError::InvalidArgument(
                    "a soft pin needs a TTL > 0".into(),
                ));
            }
            self.entries[slot as usize].flags |= SOFT_PIN;
            let until = self.clock.now_ms() + ttl_ms;
            self.soft_pins.insert(slot, until);
        }
        Ok(())
    }

    /// Drop both kinds of pin.
    pub fn unpin(&mut self, key: ObjectKey) -> Result<(), MasterError> {
        let slot = self.committed_slot(&key)?;
        let was_hard = self.entries[slot as usize].has(HARD_PIN);
        self.entries[slot as usize].flags &= !(HARD_PIN | SOFT_PIN);
        self.soft_pins.remove(&slot);
        if was_hard {
            self.log_object(slot);
        }
        Ok(())
    }
}
