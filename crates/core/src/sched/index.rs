//! Global prefix index: block key -> the prefill instances that hold the block in their local
//! cache, the number of pool replicas that hold it, and how often it was hit. Pure; no I/O (the
//! master's and engines' events are applied through its methods by whoever receives them).
//!
//! An entry is 32 bytes (key, a 128-bit instance mask, hit count, replica count) in an open
//! addressing table (`key_table`); see `memory_bytes`. Prefix matching walks the request's keys
//! once, prefetching the slots of the keys ahead, and finds, for every prefill instance at the
//! same time, how far the prefix reaches using its local cache plus the pool.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::blocks::BlockKey;
use super::key_table::{KeyTable, Vacancy};

/// Largest number of prefill instances one index tracks (bits in `InstanceMask`).
pub const MAX_PREFILL_INSTANCES: usize = 128;

/// Errors of the prefix index.
#[derive(Debug, thiserror::Error, PartialEq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum IndexError {
    #[error(
        "the prefix index tracks at most {MAX_PREFILL_INSTANCES} prefill instances, {requested} requested"
    )]
    TooManyInstances { requested: usize },
}

impl IndexError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A set of prefill instance numbers below `MAX_PREFILL_INSTANCES`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InstanceMask([u64; 2]);

impl InstanceMask {
    /// The set `{0, .., n - 1}` (`n` is clamped to the maximum).
    pub fn first(n: usize) -> Self {
        let n = n.min(MAX_PREFILL_INSTANCES);
        let word = |w: usize| -> u64 {
            let bits = n.saturating_sub(w * 64).min(64);
            if bits == 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            }
        };
        Self([word(0), word(1)])
    }
    pub fn contains(&self, i: usize) -> bool {
        i < MAX_PREFILL_INSTANCES && self.0[i / 64] & (1 << (i % 64)) != 0
    }
    /// Adds `i`; ignored when `i` is out of range (the index checks ranges up front).
    pub fn insert(&mut self, i: usize) {
        if i < MAX_PREFILL_INSTANCES {
            self.0[i / 64] |= 1 << (i % 64);
        }
    }
    pub fn remove(&mut self, i: usize) {
        if i < MAX_PREFILL_INSTANCES {
            self.0[i / 64] &= !(1 << (i % 64));
        }
    }
    pub fn is_empty(&self) -> bool {
        self.0 == [0, 0]
    }
    pub fn len(&self) -> usize {
        (self.0[0].count_ones() + self.0[1].count_ones()) as usize
    }
    pub fn and(self, other: Self) -> Self {
        Self([self.0[0] & other.0[0], self.0[1] & other.0[1]])
    }
    pub fn and_not(self, other: Self) -> Self {
        Self([self.0[0] & !other.0[0], self.0[1] & !other.0[1]])
    }
    /// Members in increasing order.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        (0..2).flat_map(move |w| {
            let mut bits = self.0[w];
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                Some(w * 64 + b)
            })
        })
    }
}

/// Hasher for block keys: one multiply and a shift. Chained xxh3 keys are already uniform; the
/// traces' dense ids need the multiply so that neighbouring ids spread over the table.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write_u64(&mut self, x: u64) {
        let h = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
}

/// `HashMap` keyed by block keys with `KeyHasher`.
pub type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<KeyHasher>>;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    local: InstanceMask,
    hits: u32,
    pool_replicas: u16,
}

impl Vacancy for Entry {
    /// The index keeps no entry that no instance and no pool replica holds.
    fn is_vacant(&self) -> bool {
        self.local.is_empty() && self.pool_replicas == 0
    }
}

/// Keys ahead of the current one whose slots the prefix walk prefetches.
const PREFETCH_AHEAD: usize = 8;

/// How far one prefill instance can serve a request's prefix from cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks available locally or in the pool.
    pub matched_blocks: u32,
    /// Of those, the blocks in the instance's local cache (the rest come from the pool).
    pub local_blocks: u32,
}

impl PrefixMatch {
    /// Blocks the instance must fetch from the pool.
    pub fn pool_blocks(&self) -> u32 {
        self.matched_blocks - self.local_blocks
    }
}

/// The global prefix index.
#[derive(Debug)]
pub struct PrefixIndex {
    map: KeyTable<Entry>,
    instances: usize,
}

impl PrefixIndex {
    /// An empty index over `instances` prefill instances.
    pub fn new(instances: usize) -> Result<Self, IndexError> {
        Self::with_capacity(instances, 0)
    }

    /// An empty index with room for `blocks` entries before it grows.
    pub fn with_capacity(instances: usize, blocks: usize) -> Result<Self, IndexError> {
        if instances > MAX_PREFILL_INSTANCES {
            return Err(IndexError::TooManyInstances {
                requested: instances,
            });
        }
        Ok(Self {
            map: KeyTable::with_capacity(blocks),
            instances,
        })
    }

    pub fn instances(&self) -> usize {
        self.instances
    }

    /// Number of indexed blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Bytes the table holds: every slot (key and entry, 32 bytes), used or not. The table
    /// keeps between 3/8 and 3/4 of its power-of-two slots full.
    pub fn memory_bytes(&self) -> usize {
        self.map.memory_bytes()
    }

    /// Instance `instance` now holds `key` locally. Out-of-range instances are ignored.
    pub fn add_local(&mut self, key: BlockKey, instance: usize) {
        if instance < self.instances {
            self.map.upsert(key, |e| e.local.insert(instance));
        }
    }

    /// Instance `instance` evicted `key` (the entry goes when nobody holds the block).
    pub fn remove_local(&mut self, key: BlockKey, instance: usize) {
        self.map.update(key, |e| e.local.remove(instance));
    }

    /// One more pool replica of `key`.
    pub fn add_pool_replica(&mut self, key: BlockKey) {
        self.map
            .upsert(key, |e| e.pool_replicas = e.pool_replicas.saturating_add(1));
    }

    /// One pool replica of `key` fewer (the entry goes when nobody holds the block).
    pub fn remove_pool_replica(&mut self, key: BlockKey) {
        self.map
            .update(key, |e| e.pool_replicas = e.pool_replicas.saturating_sub(1));
    }

    /// Instances holding `key` locally.
    pub fn holders(&self, key: BlockKey) -> InstanceMask {
        self.map.get(key).map(|e| e.local).unwrap_or_default()
    }

    /// Pool replicas of `key`.
    pub fn pool_replicas(&self, key: BlockKey) -> u16 {
        self.map.get(key).map_or(0, |e| e.pool_replicas)
    }

    /// Counts one hit on `key` and returns the new count (0 when the key is not indexed).
    pub fn record_hit(&mut self, key: BlockKey) -> u32 {
        self.map
            .update(key, |e| {
                e.hits = e.hits.saturating_add(1);
                e.hits
            })
            .unwrap_or(0)
    }

    /// Hits recorded on `key`.
    pub fn hits(&self, key: BlockKey) -> u32 {
        self.map.get(key).map_or(0, |e| e.hits)
    }

    /// For every instance, how many leading blocks of `keys` it can serve from its local cache
    /// plus (when `use_pool`) the pool, and how many of those are local. `out` is overwritten
    /// with one entry per instance.
    pub fn match_prefix(&self, keys: &[BlockKey], use_pool: bool, out: &mut Vec<PrefixMatch>) {
        out.clear();
        out.resize(self.instances, PrefixMatch::default());
        let mut alive = InstanceMask::first(self.instances);
        let mut walked = 0u32;
        // The walk is bound by memory latency in a large table: start the misses of the keys
        // ahead so that they overlap with the work on this one.
        for key in keys.iter().take(PREFETCH_AHEAD) {
            self.map.prefetch(*key);
        }
        for (n, key) in keys.iter().enumerate() {
            if let Some(ahead) = keys.get(n + PREFETCH_AHEAD) {
                self.map.prefetch(*ahead);
            }
            let Some(e) = self.map.get(*key) else { break };
            if !(use_pool && e.pool_replicas > 0) {
                for i in alive.and_not(e.local).iter() {
                    out[i].matched_blocks = walked;
                }
                alive = alive.and(e.local);
                if alive.is_empty() {
                    return;
                }
            }
            for i in alive.and(e.local).iter() {
                out[i].local_blocks += 1;
            }
            walked += 1;
        }
        for i in alive.iter() {
            out[i].matched_blocks = walked;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_basics() {
        let m = InstanceMask::first(70);
        assert_eq!(m.len(), 70);
        assert!(m.contains(0) && m.contains(69) && !m.contains(70));
        assert_eq!(InstanceMask::first(128).len(), 128);
        assert_eq!(InstanceMask::first(0).len(), 0);
        let mut a = InstanceMask::default();
        a.insert(3);
        a.insert(100);
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![3, 100]);
        a.remove(3);
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![100]);
        assert!(InstanceMask::default().is_empty());
    }

    #[test]
    fn rejects_too_many_instances() {
        let err = PrefixIndex::new(129).unwrap_err();
        assert_eq!(err, IndexError::TooManyInstances { requested: 129 });
        assert_eq!(err.category(), "too_many_instances");
    }

    #[test]
    fn match_prefix_hand_computed() {
        // Request blocks 10, 11, 12, 13.
        // instance 0 holds 10, 11 locally; instance 1 holds 10, 12; instance 2 nothing;
        // the pool holds 11 and 12.
        let mut idx = PrefixIndex::new(3).unwrap();
        idx.add_local(10, 0);
        idx.add_local(11, 0);
        idx.add_local(10, 1);
        idx.add_local(12, 1);
        idx.add_pool_replica(11);
        idx.add_pool_replica(12);
        let keys = [10, 11, 12, 13];
        let mut out = Vec::new();
        idx.match_prefix(&keys, true, &mut out);
        // instance 0: 10 local, 11 local, 12 pool, 13 missing -> 3 matched, 2 local
        // instance 1: 10 local, 11 pool, 12 local -> 3 matched, 2 local
        // instance 2: 10 neither local nor pool -> 0
        assert_eq!(
            out,
            vec![
                PrefixMatch {
                    matched_blocks: 3,
                    local_blocks: 2
                },
                PrefixMatch {
                    matched_blocks: 3,
                    local_blocks: 2
                },
                PrefixMatch {
                    matched_blocks: 0,
                    local_blocks: 0
                },
            ]
        );
        assert_eq!(out[0].pool_blocks(), 1);
        // Without the pool: instance 0 stops at 12, instance 1 at 11.
        idx.match_prefix(&keys, false, &mut out);
        assert_eq!(
            out,
            vec![
                PrefixMatch {
                    matched_blocks: 2,
                    local_blocks: 2
                },
                PrefixMatch {
                    matched_blocks: 1,
                    local_blocks: 1
                },
                PrefixMatch {
                    matched_blocks: 0,
                    local_blocks: 0
                },
            ]
        );
    }

    #[test]
    fn whole_prefix_in_pool_matches_everyone() {
        let mut idx = PrefixIndex::new(2).unwrap();
        for k in [1, 2] {
            idx.add_pool_replica(k);
        }
        idx.add_local(1, 1);
        let mut out = Vec::new();
        idx.match_prefix(&[1, 2], true, &mut out);
        assert_eq!(
            out[0],
            PrefixMatch {
                matched_blocks: 2,
                local_blocks: 0
            }
        );
        assert_eq!(
            out[1],
            PrefixMatch {
                matched_blocks: 2,
                local_blocks: 1
            }
        );
    }

    #[test]
    fn entries_disappear_when_nobody_holds_them() {
        let mut idx = PrefixIndex::new(2).unwrap();
        idx.add_local(5, 0);
        idx.add_pool_replica(5);
        assert_eq!(idx.record_hit(5), 1);
        assert_eq!(idx.record_hit(5), 2);
        assert_eq!(idx.record_hit(6), 0);
        idx.remove_local(5, 0);
        assert_eq!(idx.len(), 1);
        assert_eq!(idx.pool_replicas(5), 1);
        idx.remove_pool_replica(5);
        assert!(idx.is_empty());
        assert_eq!(idx.hits(5), 0);
        // Out-of-range instances are ignored rather than corrupting other bits.
        idx.add_local(7, 5);
        assert!(idx.holders(7).is_empty());
        assert_eq!(std::mem::size_of::<(BlockKey, Entry)>(), 32);
        assert_eq!(idx.memory_bytes(), 16 * 32);
    }
}
