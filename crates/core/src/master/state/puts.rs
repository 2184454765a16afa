//! The put state machine: `put_start` allocates replica locations (evicting for room),
//! `put_end` commits what survived, `put_revoke` abandons. Pure; the client writes the bytes
//! between start and end.

use super::{HARD_PIN, LIVE, MasterError, MasterState, PENDING, SOFT_PIN, SPREAD_DOMAINS};
use crate::master::alloc::{PAGE_BYTES, pages_for};
use crate::master::types::{ObjectKey, PutOptions, PutStarted, Spread, Tier};

/// Victims one put may evict to make room before it gives up with `NO_SPACE`.
const MAX_EVICTIONS_PER_PUT: usize = 4096;

fn put_id(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(slot)
}

impl MasterState {
    /// Allocate replica locations for `key`; the caller writes them, then calls `put_end`.
    pub fn put_start(
        &mut self,
        key: ObjectKey,
        size: u64,
        opts: &PutOptions,
    ) -> Result<PutStarted, MasterError> {
        if size == 0 {
            return Err(MasterError::InvalidArgument(
                "value size must be > 0".into(),
            ));
        }
        if opts.replicas == 0 || opts.replicas > self.config.max_replicas {
            return Err(MasterError::InvalidArgument(format!(
                "replicas must be in 1..={}, got {}",
                self.config.max_replicas, opts.replicas
            )));
        }
        if let Some(slot) = self.find(&key) {
            let e = &self.entries[slot as usize];
            if e.has(PENDING) {
                return Err(MasterError::PutInProgress(key.to_hex()));
            }
            if e.size != size {
                return Err(MasterError::SizeConflict {
                    key: key.to_hex(),
                    existing: e.size,
                    requested: size,
                });
            }
            // A put of a committed key (same size) still pins it as asked.
            if opts.hard_pin || opts.soft_pin_ttl_ms > 0 {
                self.pin(key, opts.hard_pin, opts.soft_pin_ttl_ms)?;
            }
            return Ok(PutStarted::AlreadyCommitted { size });
        }
        // The pool's spread is a floor: a put may ask for failure domains on a node-spread
        // pool, never for less on a domain-spread one.
        let spread_opts;
        let opts = if self.config.spread == Spread::FailureDomain
            && opts.spread != Spread::FailureDomain
        {
            spread_opts = PutOptions {
                spread: Spread::FailureDomain,
                ..opts.clone()
            };
            &spread_opts
        } else {
            opts
        };
        if !opts.avoid_nodes.is_empty() {
            self.suspect_nodes(&opts.avoid_nodes);
        }
        let tiers: &[Tier] = match opts.tier {
            Some(Tier::Dram) => &[Tier::Dram],
            Some(Tier::Ssd) => &[Tier::Ssd],
            None => &Tier::ALL,
        };
        let largest = self.largest_segment(tiers);
        let pages = pages_for(size).filter(|p| u64::from(*p) * PAGE_BYTES <= largest);
        let Some(pages) = pages else {
            return Err(if largest == 0 {
                MasterError::NoSegments
            } else {
                MasterError::TooLarge { size, largest }
            });
        };
        for &tier in tiers {
            // Evict for room, one victim at a time, bounded so that one put on a fragmented
            // tier cannot empty it.
            let mut budget = MAX_EVICTIONS_PER_PUT;
            let reps = loop {
                let reps = self.place(pages, opts.replicas, tier, opts, &[]);
                if !reps.is_empty() || budget == 0 || !self.evict_one(tier) {
                    break reps;
                }
                budget -= 1;
            };
            if reps.is_empty() {
                continue;
            }
            for r in &reps {
                self.log_reserve(*r, pages);
            }
            let slot = self.new_object(key, size, opts.replicas, reps);
            if opts.spread == Spread::FailureDomain {
                self.entries[slot as usize].flags |= SPREAD_DOMAINS;
            }
            self.entries[slot as usize].flags |= PENDING;
            // Pinned from the start: a pending object is never evicted, and at its commit it
            // is pinned already, so no eviction can come between the two.
            if opts.hard_pin {
                self.entries[slot as usize].flags |= HARD_PIN;
            } else if opts.soft_pin_ttl_ms > 0 {
                self.entries[slot as usize].flags |= SOFT_PIN;
                let until = self.clock.now_ms() + opts.soft_pin_ttl_ms;
                self.soft_pins.insert(slot, until);
            }
            let deadline = self.clock.now_ms() + self.config.put_timeout_ms;
            self.pending.insert(slot, deadline);
            let e = &self.entries[slot as usize];
            let (generation, size) = (e.generation, e.size);
            let replicas = e
                .replicas
                .clone()
                .into_iter()
                .filter_map(|r| self.replica_info(r, size))
                .collect();
            self.evict_to_watermark(tier);
            return Ok(PutStarted::Allocated {
                put_id: put_id(slot, generation),
                replicas,
            });
        }
        Err(MasterError::NoSpace { size })
    }

    fn pending_slot(&self, key: &ObjectKey, id: u64) -> Result<u32, MasterError> {
        let stale = || MasterError::StalePut {
            key: key.to_hex(),
            put_id: id,
        };
        let slot = (id & 0xffff_ffff) as u32;
        let generation = (id >> 32) as u32;
        let e = self.entries.get(slot as usize).ok_or_else(stale)?;
        if !e.has(LIVE) || e.generation != generation || e.key != *key {
            return Err(stale());
        }
        Ok(slot)
    }

    /// Commit a put. Replicas lost to a dead agent since `put_start` are left out; if none is
    /// left the put fails with [`MasterError::ReplicasLost`]. Ending an already committed put
    /// again is a no-op success (retries after a lost reply).
    pub fn put_end(&mut self, key: ObjectKey, id: u64) -> Result<(), MasterError> {
        let slot = self.pending_slot(&key, id)?;
        let e = &mut self.entries[slot as usize];
        if !e.has(PENDING) {
            return Ok(());
        }
        if e.replicas.is_empty() {
            self.drop_object(slot);
            return Err(MasterError::ReplicasLost(key.to_hex()));
        }
        e.flags &= !PENDING;
        if e.replicas.len() < usize::from(e.desired) {
            self.under.insert(slot);
        }
        let reps = e.replicas.clone();
        let size = e.size;
        self.pending.remove(&slot);
        self.sync_policy(slot);
        for r in reps {
            self.log_unreserve(r);
            self.feed_commit(r, key, size);
        }
        self.log_object(slot);
        Ok(())
    }

    /// Abandon a pending put whose bytes may have been sent: its space is held back for the
    /// reuse delay (see `abandon`) before it is given out again.
    pub fn put_revoke(&mut self, key: ObjectKey, id: u64) -> Result<(), MasterError> {
        let slot = self.revocable(key, id)?;
        self.drop_object(slot);
        Ok(())
    }

    /// Abandon a pending put of which no byte was sent: its space is free at once.
    pub fn put_revoke_unsent(&mut self, key: ObjectKey, id: u64) -> Result<(), MasterError> {
        let slot = self.revocable(key, id)?;
        self.forget_object(slot, false);
        Ok(())
    }

    fn revocable(&self, key: ObjectKey, id: u64) -> Result<u32, MasterError> {
        let slot = self.pending_slot(&key, id)?;
        if !self.entries[slot as usize].has(PENDING) {
            return Err(MasterError::StalePut {
                key: key.to_hex(),
                put_id: id,
            });
        }
        Ok(slot)
    }
}
