//! The pool's own block events, for consumers of vLLM KV events (llm-d, Dynamo) that index
//! the pool as one more cache tier: per object and tier, `Stored` when the object's first
//! readable replica appears in the tier and `Removed` when its last one there goes (removal,
//! eviction, expiry, agent death, corruption). The events wait in a bounded outbox that the
//! master's publisher drains; when it overflows, or when publishing starts (a process start, a
//! new leader), the next drain is a snapshot instead: `Cleared`, then `Stored` for every
//! published object in each tier. Objects are named by their key (see [`EventName::of_key`]);
//! the name is learnt from puts and persisted with the object. Pure; no sockets.

use std::collections::HashMap;

use super::{LIVE, MasterState, PENDING};
use crate::master::types::{EventName, ObjectKey, Tier};

/// Outbox entries kept by default before the outbox is dropped for a snapshot.
pub const POOL_EVENTS_CAP: usize = 1 << 16;

/// One change of what the pool holds, per object and tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolEvent {
    Stored {
        tier: Tier,
        name: EventName,
    },
    Removed {
        tier: Tier,
        name: EventName,
    },
    /// Forget everything published before (the start of a snapshot).
    Cleared,
}

/// What a drain of the outbox hands the publisher.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolEventsDrain {
    pub events: Vec<PoolEvent>,
    /// The events are a snapshot (`Cleared` first) because publishing started or the outbox
    /// overflowed.
    pub resync: bool,
    /// The snapshot replaces an outbox that overflowed.
    pub overflowed: bool,
}

/// The outbox and what it needs to know about objects.
#[derive(Debug)]
pub(super) struct PoolEvents {
    cap: usize,
    queue: Vec<PoolEvent>,
    /// The next drain is a snapshot; changes until then are not queued.
    resync: bool,
    overflowed: bool,
    /// Per slot: the object's name and the tiers (bit `1 << tier index`) it was last
    /// published as stored in. Objects without a name (their key was never seen by this
    /// master) are not published.
    names: HashMap<u32, (EventName, u8)>,
}

impl PoolEvents {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            queue: Vec::new(),
            resync: true,
            overflowed: false,
            names: HashMap::new(),
        }
    }

    /// An empty outbox with the same bound (a new leader's state).
    pub(super) fn fresh(&self) -> Self {
        Self::new(self.cap)
    }

    fn push(&mut self, e: PoolEvent) {
        if self.resync {
            return;
        }
        if self.queue.len() >= self.cap {
            self.queue.clear();
            self.resync = true;
            self.overflowed = true;
            return;
        }
        self.queue.push(e);
    }
}

fn bit(t: Tier) -> u8 {
    1 << t.index()
}

impl MasterState {
    /// Collect pool events from now on, keeping at most `cap` in the outbox; the first drain
    /// is a snapshot.
    pub fn enable_pool_events(&mut self, cap: usize) {
        if self.pool_events.is_none() {
            self.pool_events = Some(PoolEvents::new(cap));
        }
    }

    pub fn pool_events_enabled(&self) -> bool {
        self.pool_events.is_some()
    }

    /// Ask for a snapshot on the next drain (a publisher starting over).
    pub fn resync_pool_events(&mut self) {
        if let Some(p) = self.pool_events.as_mut() {
            p.queue.clear();
            p.resync = true;
        }
    }

    /// Learn the key `raw` of `key` (a put saw it). An object committed without a known name
    /// (restored from records without one, or adopted from an agent) is published from now.
    pub fn name_object(&mut self, key: ObjectKey, raw: &[u8]) {
        if self.pool_events.is_none() {
            return;
        }
        let Some(slot) = self.find(&key) else {
            return;
        };
        if let Some(p) = self.pool_events.as_mut() {
            p.names
                .entry(slot)
                .or_insert_with(|| (EventName::of_key(raw), 0));
        }
        self.publish_tiers(slot);
    }

    /// The name of the object in `slot`, when known (persisted with the object).
    pub(super) fn event_name(&self, slot: u32) -> Option<EventName> {
        let p = self.pool_events.as_ref()?;
        p.names.get(&slot).map(|(n, _)| n.clone())
    }

    /// Set the name of a restored object.
    pub(super) fn set_event_name(&mut self, slot: u32, name: EventName) {
        if let Some(p) = self.pool_events.as_mut() {
            p.names.insert(slot, (name, 0));
        }
    }

    /// The tiers the object in `slot` is readable from.
    fn readable_tiers(&self, slot: u32) -> u8 {
        let Some(e) = self.entries.get(slot as usize) else {
            return 0;
        };
        if !e.has(LIVE) || e.has(PENDING) {
            return 0;
        }
        e.replicas
            .iter()
            .filter_map(|r| self.tier_of(*r))
            .fold(0, |m, t| m | bit(t))
    }

    /// Queue `Stored` / `Removed` for the tiers the object in `slot` entered or left since it
    /// was last published.
    pub(super) fn publish_tiers(&mut self, slot: u32) {
        if self.pool_events.is_none() {
            return;
        }
        let now = self.readable_tiers(slot);
        self.publish_mask(slot, now);
    }

    /// The object in `slot` is gone: `Removed` for every tier it was published in, and its
    /// name is forgotten.
    pub(super) fn unpublish(&mut self, slot: u32) {
        if self.pool_events.is_none() {
            return;
        }
        self.publish_mask(slot, 0);
        if let Some(p) = self.pool_events.as_mut() {
            p.names.remove(&slot);
        }
    }

    fn publish_mask(&mut self, slot: u32, now: u8) {
        let Some(p) = self.pool_events.as_mut() else {
            return;
        };
        let Some((name, was)) = p.names.get_mut(&slot) else {
            return;
        };
        let before = std::mem::replace(was, now);
        if before == now {
            return;
        }
        let name = name.clone();
        for tier in Tier::ALL {
            let (had, has) = (before & bit(tier) != 0, now & bit(tier) != 0);
            if has && !had {
                p.push(PoolEvent::Stored {
                    tier,
                    name: name.clone(),
                });
            } else if had && !has {
                p.push(PoolEvent::Removed {
                    tier,
                    name: name.clone(),
                });
            }
        }
    }

    /// The queued events, or a snapshot when one is due (`Cleared`, then `Stored` for every
    /// named, readable object, DRAM tier first). Empty when pool events are off.
    pub fn take_pool_events(&mut self) -> PoolEventsDrain {
        let Some(p) = self.pool_events.as_mut() else {
            return PoolEventsDrain::default();
        };
        if !p.resync {
            return PoolEventsDrain {
                events: std::mem::take(&mut p.queue),
                resync: false,
                overflowed: false,
            };
        }
        let overflowed = std::mem::take(&mut p.overflowed);
        let slots: Vec<u32> = p.names.keys().copied().collect();
        let masks: Vec<(u32, u8)> = slots
            .into_iter()
            .map(|s| (s, self.readable_tiers(s)))
            .collect();
        let mut events = vec![PoolEvent::Cleared];
        let Some(p) = self.pool_events.as_mut() else {
            return PoolEventsDrain::default();
        };
        p.queue.clear();
        p.resync = false;
        let mut stored: Vec<(Tier, u32, EventName)> = Vec::new();
        for (slot, mask) in masks {
            if let Some((name, was)) = p.names.get_mut(&slot) {
                *was = mask;
                for tier in Tier::ALL.into_iter().filter(|t| mask & bit(*t) != 0) {
                    stored.push((tier, slot, name.clone()));
                }
            }
        }
        stored.sort_by_key(|(tier, slot, _)| (tier.index(), *slot));
        events.extend(
            stored
                .into_iter()
                .map(|(tier, _, name)| PoolEvent::Stored { tier, name }),
        );
        PoolEventsDrain {
            events,
            resync: true,
            overflowed,
        }
    }
}
