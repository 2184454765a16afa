//! Eviction policies over dense object slots: LRU (default), FIFO (baseline), S3-FIFO
//! (scan resistant: one-hit wonders leave through a small probationary queue) and LFU with
//! aging ([`lfu`]: frequent objects stay, until their counters decay). Pure, no I/O.
//!
//! The master keeps one policy instance per tier; the trace simulator drives the same code.
//! A policy only orders slots: the caller's `may_evict` predicate decides whether a candidate
//! can go now (leases, pins and in-flight tasks are the caller's business).

use std::collections::{HashMap, VecDeque};

mod lfu;
mod lists;

pub use lfu::Lfu;
use lists::Lists;

/// Which eviction policy to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Least recently used first.
    #[default]
    Lru,
    /// Oldest insertion first (baseline).
    Fifo,
    /// S3-FIFO: a probationary queue filters objects seen once.
    S3fifo,
    /// Least frequently used first; counters halve with age.
    Lfu,
}

impl PolicyKind {
    /// Every policy, in the order tables list them.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Lru,
        PolicyKind::Fifo,
        PolicyKind::S3fifo,
        PolicyKind::Lfu,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Fifo => "fifo",
            PolicyKind::S3fifo => "s3fifo",
            PolicyKind::Lfu => "lfu",
        }
    }

    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(true)),
            PolicyKind::Fifo => Box::new(Lru::new(false)),
            PolicyKind::S3fifo => Box::new(S3Fifo::new()),
            PolicyKind::Lfu => Box::new(Lfu::new()),
        }
    }
}

/// An eviction order over slots `0..u32::MAX - 1`.
pub trait Policy: Send + std::fmt::Debug {
    fn kind(&self) -> PolicyKind;
    /// Start tracking `slot`; `key` identifies the object across slot reuse (ghost history).
    fn insert(&mut self, slot: u32, key: u64);
    /// Record an access.
    fn touch(&mut self, slot: u32);
    /// Stop tracking `slot` (removed by the caller, not evicted).
    fn remove(&mut self, slot: u32);
    /// Number of tracked slots.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Pick a victim that `may_evict` accepts and stop tracking it. `None` when no tracked
    /// slot is acceptable.
    fn evict(&mut self, may_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
}

/// A doubly linked list of slots; `touch` moves to the head when `recency` is set (LRU),
/// otherwise order is insertion only (FIFO).
#[derive(Debug)]
pub struct Lru {
    recency: bool,
    list: Lists<1>,
}

impl Lru {
    pub fn new(recency: bool) -> Self {
        Self {
            recency,
            list: Lists::new(),
        }
    }
}

impl Policy for Lru {
    fn kind(&self) -> PolicyKind {
        if self.recency {
            PolicyKind::Lru
        } else {
            PolicyKind::Fifo
        }
    }

    fn insert(&mut self, slot: u32, _key: u64) {
        self.list.ensure(slot);
        self.list.remove(slot);
        self.list.push_front(0, slot);
    }

    fn touch(&mut self, slot: u32) {
        if self.recency && self.list.contains(slot) && self.list.head[0] != slot {
            self.list.unlink(slot);
            self.list.push_front(0, slot);
        }
    }

    fn remove(&mut self, slot: u32) {
        self.list.remove(slot);
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn evict(&mut self, may_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        self.list.evict_from(0, may_evict)
    }
}

const NOT_QUEUED: u8 = 0;
const IN_SMALL: u8 = 1;
const IN_MAIN: u8 = 2;
const MAX_FREQ: u8 = 3;

/// S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of entries) filters objects seen once; an
/// object re-accessed while in it moves to the main FIFO, which reinserts objects with a
/// non-zero access counter (decrementing it). A bounded ghost FIFO of recently evicted keys
/// sends returning objects straight to main.
#[derive(Debug)]
pub struct S3Fifo {
    small: VecDeque<(u32, u32)>,
    main: VecDeque<(u32, u32)>,
    /// per slot: queue, access counter, incarnation (detects stale queue entries)
    queue: Vec<u8>,
    freq: Vec<u8>,
    seq: Vec<u32>,
    keys: Vec<u64>,
    small_len: usize,
    main_len: usize,
    ghost: VecDeque<u64>,
    ghost_set: HashMap<u64, u32>,
}

impl S3Fifo {
    pub fn new() -> Self {
        Self {
            small: VecDeque::new(),
            main: VecDeque::new(),
            queue: Vec::new(),
            freq: Vec::new(),
            seq: Vec::new(),
            keys: Vec::new(),
            small_len: 0,
            main_len: 0,
            ghost: VecDeque::new(),
            ghost_set: HashMap::new(),
        }
    }

    fn ensure(&mut self, slot: u32) {
        let need = slot as usize + 1;
        if self.queue.len() < need {
            self.queue.resize(need, NOT_QUEUED);
            self.freq.resize(need, 0);
            self.seq.resize(need, 0);
            self.keys.resize(need, 0);
        }
    }

    fn queued(&self, slot: u32) -> u8 {
        self.queue.get(slot as usize).copied().unwrap_or(NOT_QUEUED)
    }

    fn live(&self, (slot, seq): (u32, u32)) -> bool {
        self.queued(slot) != NOT_QUEUED && self.seq[slot as usize] == seq
    }

    fn promote(&mut self, slot: u32) {
        let i = slot as usize;
        if self.queue[i] == IN_SMALL {
            self.small_len -= 1;
            self.main_len += 1;
        }
        self.queue[i] = IN_MAIN;
        self.seq[i] = self.seq[i].wrapping_add(1);
        self.main.push_back((slot, self.seq[i]));
    }

    fn drop_slot(&mut self, slot: u32) {
        let i = slot as usize;
        match self.queue[i] {
            IN_SMALL => self.small_len -= 1,
            IN_MAIN => self.main_len -= 1,
            _ => {}
        }
        self.queue[i] = NOT_QUEUED;
        self.seq[i] = self.seq[i].wrapping_add(1);
    }

    fn remember(&mut self, key: u64) {
        self.ghost.push_back(key);
        *self.ghost_set.entry(key).or_insert(0) += 1;
        let cap = self.main_len.max(self.small_len).max(16);
        while self.ghost.len() > cap {
            if let Some(old) = self.ghost.pop_front()
                && let Some(n) = self.ghost_set.get_mut(&old)
            {
                *n -= 1;
                if *n == 0 {
                    self.ghost_set.remove(&old);
                }
            }
        }
    }

    /// Drop stale entries at queue heads and compact queues that are mostly stale, so memory
    /// stays proportional to live entries.
    fn compact(&mut self) {
        if self.small.len() > 2 * self.small_len + 64 {
            let mut q = std::mem::take(&mut self.small);
            q.retain(|e| self.live(*e));
            self.small = q;
        }
        if self.main.len() > 2 * self.main_len + 64 {
            let mut q = std::mem::take(&mut self.main);
            q.retain(|e| self.live(*e));
            self.main = q;
        }
    }
}

impl Default for S3Fifo {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for S3Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::S3fifo
    }

    fn insert(&mut self, slot: u32, key: u64) {
        self.ensure(slot);
        if self.queued(slot) != NOT_QUEUED {
            self.drop_slot(slot);
        }
        let i = slot as usize;
        self.freq[i] = 0;
        self.keys[i] = key;
        self.seq[i] = self.seq[i].wrapping_add(1);
        if self.ghost_set.contains_key(&key) {
            self.queue[i] = IN_MAIN;
            self.main_len += 1;
            self.main.push_back((slot, self.seq[i]));
        } else {
            self.queue[i] = IN_SMALL;
            self.small_len += 1;
            self.small.push_back((slot, self.seq[i]));
        }
        self.compact();
    }

    fn touch(&mut self, slot: u32) {
        if self.queued(slot) != NOT_QUEUED {
            let f = &mut self.freq[slot as usize];
            *f = (*f + 1).min(MAX_FREQ);
        }
    }

    fn remove(&mut self, slot: u32) {
        if self.queued(slot) != NOT_QUEUED {
            self.drop_slot(slot);
            self.compact();
        }
    }

    fn len(&self) -> usize {
        self.small_len + self.main_len
    }

    fn evict(&mut self, may_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        // Every live entry is visited at most a few times (its counter is at most MAX_FREQ),
        // so this bound only trips when nothing is evictable.
        let mut budget = (self.small.len() + self.main.len()) * (usize::from(MAX_FREQ) + 2) + 8;
        while budget > 0 && self.len() > 0 {
            budget -= 1;
            let target_small = self.len().div_ceil(10);
            if self.small_len > 0 && (self.small_len >= target_small || self.main_len == 0) {
                let Some(entry) = self.small.pop_front() else {
                    break;
                };
                if !self.live(entry) {
                    continue;
                }
                let slot = entry.0;
                if self.freq[slot as usize] > 0 || !may_evict(slot) {
                    self.freq[slot as usize] = 0;
                    self.promote(slot);
                    continue;
                }
                let key = self.keys[slot as usize];
                self.drop_slot(slot);
                self.remember(key);
                return Some(slot);
            }
            let Some(entry) = self.main.pop_front() else {
                break;
            };
            if !self.live(entry) {
                continue;
            }
            let slot = entry.0;
            let i = slot as usize;
            if self.freq[i] > 0 {
                self.freq[i] -= 1;
                self.main.push_back(entry);
                continue;
            }
            if !may_evict(slot) {
                self.main.push_back(entry);
                continue;
            }
            self.drop_slot(slot);
            return Some(slot);
        }
        // The budget ran out before the queues' rotation reached an evictable slot (entries
        // re-queued by counters and refusals): one last pass over the live entries in queue
        // order, so that `None` always means that no tracked slot may go.
        let live: Vec<u32> = self
            .small
            .iter()
            .chain(self.main.iter())
            .filter(|e| self.live(**e))
            .map(|e| e.0)
            .collect();
        let slot = live.into_iter().find(|s| may_evict(*s))?;
        if self.queue[slot as usize] == IN_SMALL {
            let key = self.keys[slot as usize];
            self.drop_slot(slot);
            self.remember(key);
        } else {
            self.drop_slot(slot);
        }
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(p: &mut dyn Policy) -> Vec<u32> {
        std::iter::from_fn(|| p.evict(&mut |_| true)).collect()
    }

    /// A policy of `kind` holding slots `0..n` (key = slot), inserted in order.
    fn filled(kind: PolicyKind, n: u32) -> Box<dyn Policy> {
        let mut p = kind.build();
        for s in 0..n {
            p.insert(s, u64::from(s));
        }
        p
    }

    /// A policy of `kind` after 5 hot objects (accessed twice) and a scan of 95 one-hit
    /// wonders.
    fn hot_then_scan(kind: PolicyKind) -> Box<dyn Policy> {
        let mut p = kind.build();
        for s in 0..5 {
            p.insert(s, u64::from(s));
            p.touch(s);
        }
        for s in 5..100 {
            p.insert(s, u64::from(s));
        }
        p
    }

    #[test]
    fn lru_evicts_least_recently_used_first() {
        let mut p = filled(PolicyKind::Lru, 4);
        p.touch(0);
        p.touch(2);
        assert_eq!(drain(p.as_mut()), vec![1, 3, 0, 2]);
        assert!(p.is_empty());
    }

    #[test]
    fn fifo_ignores_accesses() {
        let mut p = filled(PolicyKind::Fifo, 3);
        p.touch(0);
        assert_eq!(drain(p.as_mut()), vec![0, 1, 2]);
    }

    #[test]
    fn lru_skips_what_may_not_be_evicted_and_remove_unlinks() {
        let mut p = filled(PolicyKind::Lru, 4);
        p.remove(1);
        assert_eq!(p.evict(&mut |s| s != 0), Some(2));
        assert_eq!(p.evict(&mut |_| false), None);
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn s3fifo_protects_reaccessed_objects_from_a_scan() {
        let mut p = hot_then_scan(PolicyKind::S3fifo);
        let first: Vec<u32> = (0..90).filter_map(|_| p.evict(&mut |_| true)).collect();
        assert_eq!(first.len(), 90);
        assert!(
            first.iter().all(|s| *s >= 5),
            "hot objects survive: {first:?}"
        );
        // Under LRU the same sequence evicts the hot objects first.
        let mut lru = hot_then_scan(PolicyKind::Lru);
        assert_eq!(lru.evict(&mut |_| true), Some(0));
    }

    #[test]
    fn s3fifo_ghost_hit_goes_to_main_and_blocked_slots_are_kept() {
        let mut p = S3Fifo::new();
        for s in 0..20 {
            p.insert(s, 1000 + u64::from(s));
        }
        let v = p.evict(&mut |_| true).expect("victim");
        assert_eq!(v, 0);
        // Key 1000 returns in a new slot: remembered in the ghost, so it lands in main.
        p.insert(50, 1000);
        assert_eq!(p.queued(50), IN_MAIN);
        // Nothing evictable: returns None without spinning forever, and loses nothing.
        let before = p.len();
        assert_eq!(p.evict(&mut |_| false), None);
        assert_eq!(p.len(), before);
        // Only slot 7 may go.
        assert_eq!(p.evict(&mut |s| s == 7), Some(7));
        p.remove(8);
        assert_eq!(p.len(), before - 2);
        let rest = drain(&mut p);
        assert_eq!(rest.len(), before - 2);
        assert!(!rest.contains(&8) && !rest.contains(&7));
    }

    /// What every policy promises the master (the contract the state machine relies on): it
    /// tracks exactly the inserted and not yet removed or evicted slots, offers `may_evict`
    /// only tracked slots, evicts only slots it accepts, and answers `None` only when it
    /// accepts none of them.
    #[derive(Clone, Debug)]
    enum ContractOp {
        Insert(u8),
        Touch(u8),
        Remove(u8),
        /// Evict with `may_evict` accepting the slots whose bit is set.
        Evict(u32),
    }

    fn contract_op() -> impl proptest::strategy::Strategy<Value = ContractOp> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u8..32).prop_map(ContractOp::Insert),
            4 => (0u8..32).prop_map(ContractOp::Touch),
            1 => (0u8..32).prop_map(ContractOp::Remove),
            3 => any::<u32>().prop_map(ContractOp::Evict),
            1 => Just(ContractOp::Evict(u32::MAX)),
            1 => Just(ContractOp::Evict(0)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        #[test]
        fn every_policy_keeps_the_eviction_contract(
            kind in proptest::sample::select(PolicyKind::ALL.to_vec()),
            ops in proptest::collection::vec(contract_op(), 1..400),
        ) {
            use std::collections::BTreeSet;
            let mut p = kind.build();
            proptest::prop_assert_eq!(p.kind(), kind);
            let mut tracked: BTreeSet<u32> = BTreeSet::new();
            for op in ops {
                match op {
                    ContractOp::Insert(s) => {
                        p.insert(u32::from(s), u64::from(s));
                        tracked.insert(u32::from(s));
                    }
                    ContractOp::Touch(s) => p.touch(u32::from(s)),
                    ContractOp::Remove(s) => {
                        p.remove(u32::from(s));
                        tracked.remove(&u32::from(s));
                    }
                    ContractOp::Evict(mask) => {
                        let mut offered = Vec::new();
                        let victim = p.evict(&mut |s| {
                            offered.push(s);
                            mask & (1 << s) != 0
                        });
                        for s in &offered {
                            proptest::prop_assert!(tracked.contains(s), "{kind:?} offered untracked slot {s}");
                        }
                        match victim {
                            Some(v) => {
                                proptest::prop_assert!(mask & (1 << v) != 0, "{kind:?} evicted blocked slot {v}");
                                proptest::prop_assert!(tracked.remove(&v), "{kind:?} evicted untracked slot {v}");
                            }
                            None => proptest::prop_assert!(
                                tracked.iter().all(|s| mask & (1 << s) == 0),
                                "{kind:?} found no victim among {tracked:?} with mask {mask:#x}"
                            ),
                        }
                    }
                }
                proptest::prop_assert_eq!(p.len(), tracked.len(), "{:?} size", kind);
            }
            // Draining gives back every tracked slot exactly once.
            let mut rest = drain(p.as_mut());
            rest.sort_unstable();
            proptest::prop_assert_eq!(rest, tracked.into_iter().collect::<Vec<_>>());
            proptest::prop_assert!(p.is_empty());
        }
    }

    #[test]
    fn every_policy_has_a_name_and_builds_itself() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.build().kind(), kind);
            assert_eq!(
                serde_json::to_value(kind).expect("serialize"),
                serde_json::Value::from(kind.as_str())
            );
        }
    }
}
