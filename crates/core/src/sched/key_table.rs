//! The prefix index's table: open addressing with linear probing from block keys to small
//! entries, laid out for the prefix walk. Pure; no I/O.
//!
//! A general-purpose hash map puts its control bytes and its entries in two arrays, so a lookup
//! in a table far larger than the caches costs two dependent cache (and TLB) misses, and it
//! offers no way to ask for a key's memory ahead of time. Here a key and its entry share one
//! 32-byte slot (two to a cache line), a lookup touches the key's home slot and usually nothing
//! else, and `prefetch` lets a walk over a request's keys start the misses of the next keys
//! while it works on the current one: the walk's misses overlap instead of queueing.
//!
//! A slot is vacant when its value says so (`Vacancy`): the index keeps no entry that nobody
//! holds, so no separate occupancy flag (and no tombstone: removal shifts the probe run back).

/// Values that can tell an unused slot from a used one: the default value is vacant, and a
/// value that becomes vacant is removed from the table.
pub(super) trait Vacancy: Copy + Default {
    fn is_vacant(&self) -> bool;
}

/// Smallest table: 16 slots.
const MIN_BITS: u32 = 4;

/// Open-addressing table from `u64` keys to `V`, at most three quarters full.
#[derive(Debug, Clone)]
pub(super) struct KeyTable<V> {
    slots: Vec<(u64, V)>,
    len: usize,
    /// `slots.len() == 1 << bits` (no slots at all before the first insert).
    bits: u32,
}

impl<V: Vacancy> KeyTable<V> {
    /// A table that holds `entries` before it grows (no memory for 0).
    pub(super) fn with_capacity(entries: usize) -> Self {
        let mut t = Self {
            slots: Vec::new(),
            len: 0,
            bits: 0,
        };
        if entries > 0 {
            t.resize(Self::bits_for(entries));
        }
        t
    }

    /// Smallest `bits` whose table holds `entries` at most three quarters full.
    fn bits_for(entries: usize) -> u32 {
        let slots = entries.saturating_mul(4).div_ceil(3).max(1 << MIN_BITS);
        slots.next_power_of_two().trailing_zeros()
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated (used or not).
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the slot array.
    pub(super) fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<(u64, V)>()
    }

    /// Home slot of `key`: the top `bits` of a multiplicative hash (dense trace ids spread
    /// over the whole table; chained hashes are uniform already).
    #[inline]
    fn home(&self, key: u64) -> usize {
        let h = (key ^ (key >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> (64 - self.bits)) as usize
    }

    /// Slot holding `key`, or the vacant slot that ends its probe run.
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let (k, v) = &self.slots[i];
            if v.is_vacant() {
                return Err(i);
            }
            if *k == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Asks the CPU to bring `key`'s home slot into the cache; a hint only.
    #[inline]
    pub(super) fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let slot = &self.slots[self.home(key)];
        prefetch_read(slot);
    }

    pub(super) fn get(&self, key: u64) -> Option<&V> {
        if self.slots.is_empty() {
            return None;
        }
        self.find(key).ok().map(|i| &self.slots[i].1)
    }

    /// Applies `f` to `key`'s value (the default when absent) and stores the result; a result
    /// that is vacant removes the key (or inserts nothing).
    pub(super) fn upsert<R>(&mut self, key: u64, f: impl FnOnce(&mut V) -> R) -> R {
        if self.slots.is_empty() || (self.len + 1) * 4 > self.slots.len() * 3 {
            self.resize(Self::bits_for(self.len + 1).max(self.bits + 1));
        }
        match self.find(key) {
            Ok(i) => {
                let r = f(&mut self.slots[i].1);
                if self.slots[i].1.is_vacant() {
                    self.remove_at(i);
                }
                r
            }
            Err(i) => {
                let mut v = V::default();
                let r = f(&mut v);
                if !v.is_vacant() {
                    self.slots[i] = (key, v);
                    self.len += 1;
                }
                r
            }
        }
    }

    /// Applies `f` to `key`'s value when present (removing it when the result is vacant).
    pub(super) fn update<R>(&mut self, key: u64, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        if self.slots.is_empty() {
            return None;
        }
        let i = self.find(key).ok()?;
        let r = f(&mut self.slots[i].1);
        if self.slots[i].1.is_vacant() {
            self.remove_at(i);
        }
        Some(r)
    }

    /// Empties slot `i` and shifts the rest of its probe run back so that every key stays
    /// reachable from its home slot (no tombstones).
    fn remove_at(&mut self, i: usize) {
        let mask = self.slots.len() - 1;
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            if self.slots[j].1.is_vacant() {
                break;
            }
            let home = self.home(self.slots[j].0);
            // The entry at j may fill the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = (0, V::default());
        self.len -= 1;
    }

    fn resize(&mut self, bits: u32) {
        let old = std::mem::replace(&mut self.slots, vec![(0, V::default()); 1 << bits]);
        self.bits = bits;
        for (k, v) in old {
            if !v.is_vacant() {
                let Err(i) = self.find(k) else {
                    unreachable!("keys are unique in the old table")
                };
                self.slots[i] = (k, v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_read<T>(p: &T) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: a prefetch is a hint that never faults and does not touch program state; `p`
    // is a valid reference anyway.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(p).cast::<i8>()) }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn prefetch_read<T>(_p: &T) {}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    struct Count(u32);

    impl Vacancy for Count {
        fn is_vacant(&self) -> bool {
            self.0 == 0
        }
    }

    #[test]
    fn insert_get_remove() {
        let mut t = KeyTable::<Count>::with_capacity(0);
        assert_eq!(t.get(7), None);
        assert_eq!(t.update(7, |c| c.0 += 1), None);
        t.upsert(7, |c| c.0 += 2);
        t.upsert(0, |c| c.0 += 1);
        assert_eq!(t.get(7), Some(&Count(2)));
        assert_eq!(t.get(0), Some(&Count(1)));
        assert_eq!(t.len(), 2);
        // A vacant result inserts nothing / removes the key.
        t.upsert(9, |_| ());
        assert_eq!(t.len(), 2);
        assert_eq!(t.update(7, |c| c.0 = 0), Some(()));
        assert_eq!(t.get(7), None);
        assert_eq!(t.len(), 1);
        assert_eq!(t.slots(), 16);
        assert_eq!(t.memory_bytes(), 16 * 16);
    }

    #[test]
    fn capacity_and_growth() {
        let t = KeyTable::<Count>::with_capacity(1_000_000);
        assert_eq!(t.slots(), 1 << 21);
        let mut t = KeyTable::<Count>::with_capacity(12);
        assert_eq!(t.slots(), 16);
        for k in 0..1000u64 {
            t.upsert(k, |c| c.0 = 1);
            assert!(t.len() * 4 <= t.slots() * 3);
        }
        assert_eq!(t.len(), 1000);
        assert!((0..1000).all(|k| t.get(k) == Some(&Count(1))));
    }

    #[test]
    fn removal_keeps_colliding_runs_reachable() {
        // Keys that share a home slot in a 16-slot table, wrapping around its end.
        let t0 = KeyTable::<Count>::with_capacity(1);
        let mut same_home: Vec<u64> = (0..100_000u64).filter(|&k| t0.home(k) == 15).collect();
        same_home.truncate(5);
        let mut t = KeyTable::<Count>::with_capacity(1);
        for (n, &k) in same_home.iter().enumerate() {
            t.upsert(k, |c| c.0 = n as u32 + 1);
        }
        assert_eq!(t.slots(), 16);
        t.update(same_home[1], |c| c.0 = 0);
        for (n, &k) in same_home.iter().enumerate() {
            let want = (n != 1).then_some(Count(n as u32 + 1));
            assert_eq!(t.get(k).copied(), want, "key {k}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]
        /// The table agrees with a `HashMap` model over any sequence of increments and
        /// decrements on a small key space (many collisions, removals and growth).
        #[test]
        fn agrees_with_a_hash_map(ops in proptest::collection::vec((0u64..200, any::<bool>()), 0..2000)) {
            let mut t = KeyTable::<Count>::with_capacity(0);
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (k, inc) in ops {
                let key = k.wrapping_mul(0x1000_0000_0000_0001);
                if inc {
                    t.upsert(key, |c| c.0 += 1);
                    *model.entry(key).or_default() += 1;
                } else {
                    t.update(key, |c| c.0 -= 1);
                    if let Some(v) = model.get_mut(&key) {
                        *v -= 1;
                        if *v == 0 {
                            model.remove(&key);
                        }
                    }
                }
                prop_assert_eq!(t.len(), model.len());
            }
            for k in 0u64..200 {
                let key = k.wrapping_mul(0x1000_0000_0000_0001);
                prop_assert_eq!(t.get(key).map(|c| c.0), model.get(&key).copied());
            }
        }
    }
}
