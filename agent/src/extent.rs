//! First-fit extent allocator over a byte range, with coalescing on free and reservation of a
//! given extent (used to rebuild the SSD tier's free space from its index after a restart).
//! Pure: no I/O.

use std::collections::BTreeMap;

/// Free space of a range `[0, capacity)` as disjoint extents.
#[derive(Clone, Debug)]
pub struct ExtentAllocator {
    capacity: u64,
    /// start -> length, never adjacent (always merged).
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

impl ExtentAllocator {
    pub fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self {
            capacity,
            free,
            free_bytes: capacity,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    pub fn largest_free(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// First extent of `len` bytes whose end is at most `limit`; returns its start.
    pub fn allocate(&mut self, len: u64, limit: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let (&start, &flen) = self
            .free
            .iter()
            .find(|&(&s, &l)| l >= len && s + len <= limit)?;
        self.free.remove(&start);
        if flen > len {
            self.free.insert(start + len, flen - len);
        }
        self.free_bytes -= len;
        Some(start)
    }

    /// Mark `[start, start+len)` as used; false when any part of it is not free.
    pub fn reserve(&mut self, start: u64, len: u64) -> bool {
        let Some(end) = start
            .checked_add(len)
            .filter(|&end| len > 0 && end <= self.capacity)
        else {
            return false;
        };
        // The free extent at or before `start` must reach `end`.
        let Some((&fs, &fl)) = self
            .free
            .range(..=start)
            .next_back()
            .filter(|&(&fs, &fl)| fs + fl >= end)
        else {
            return false;
        };
        self.free.remove(&fs);
        if start > fs {
            self.free.insert(fs, start - fs);
        }
        if fs + fl > end {
            self.free.insert(end, fs + fl - end);
        }
        self.free_bytes -= len;
        true
    }

    /// Return `[start, start+len)`, merging with neighbours.
    pub fn free(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut new_start = start;
        let mut new_len = len;
        if let Some((&ps, &pl)) = self.free.range(..start).next_back()
            && ps + pl == start
        {
            self.free.remove(&ps);
            new_start = ps;
            new_len += pl;
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            new_len += nl;
        }
        self.free.insert(new_start, new_len);
        self.free_bytes += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocate_free_merge() {
        let mut a = ExtentAllocator::new(100);
        assert_eq!(a.allocate(30, 100), Some(0));
        assert_eq!(a.allocate(30, 100), Some(30));
        assert_eq!(a.allocate(50, 100), None);
        assert_eq!(a.allocate(40, 60), None, "limit respected");
        a.free(0, 30);
        a.free(30, 30);
        assert_eq!(a.largest_free(), 100);
        assert_eq!(a.free_bytes(), 100);
    }

    #[test]
    fn reserve_splits_and_rejects_overlap() {
        let mut a = ExtentAllocator::new(100);
        assert!(a.reserve(40, 10));
        assert!(!a.reserve(45, 10));
        assert!(!a.reserve(95, 10));
        assert_eq!(a.free_bytes(), 90);
        assert_eq!(a.allocate(45, 100), Some(50));
        assert_eq!(a.allocate(40, 100), Some(0));
    }

    proptest! {
        #[test]
        fn free_space_is_conserved(ops in proptest::collection::vec((1u64..50, any::<bool>()), 1..200)) {
            let mut a = ExtentAllocator::new(1000);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (len, alloc) in ops {
                if alloc || live.is_empty() {
                    if let Some(s) = a.allocate(len, 1000) {
                        for &(ls, ll) in &live {
                            prop_assert!(s + len <= ls || ls + ll <= s, "overlap");
                        }
                        live.push((s, len));
                    }
                } else {
                    let (s, l) = live.swap_remove(0);
                    a.free(s, l);
                }
                let used: u64 = live.iter().map(|x| x.1).sum();
                prop_assert_eq!(a.free_bytes() + used, 1000);
            }
            for (s, l) in live.drain(..) {
                a.free(s, l);
            }
            prop_assert_eq!(a.largest_free(), 1000);
        }
    }
}
