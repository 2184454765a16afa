//! Space allocator of one mounted segment: best-fit over free extents of 4 KiB pages, with
//! coalescing on free. Pure (no I/O): it hands out offsets inside memory that the agent owns.
//!
//! Why not `offset-allocator`: it pre-allocates 32 bytes of node metadata for every allocation
//! it may ever hold and limits sizes to `u32` units; this allocator's memory grows with the
//! number of *free* extents only, which keeps the master under its bytes-per-object budget.
//! Offsets are page aligned, which O_DIRECT on the SSD tier and RDMA registration both want.

use std::collections::{BTreeMap, BTreeSet};

/// Allocation granularity and alignment in bytes.
pub const PAGE_BYTES: u64 = 4096;

/// Number of pages that hold `bytes`, or `None` when it does not fit a `u32` page count.
pub fn pages_for(bytes: u64) -> Option<u32> {
    u32::try_from(bytes.div_ceil(PAGE_BYTES)).ok()
}

/// Free-extent allocator over `[0, pages)`.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    pages: u32,
    free_pages: u64,
    /// start page -> length in pages
    by_start: BTreeMap<u32, u32>,
    /// (length, start), for best fit
    by_len: BTreeSet<(u32, u32)>,
}

impl ExtentAllocator {
    /// Allocator over `capacity_bytes` (rounded down to whole pages, at most `u32::MAX` pages).
    pub fn new(capacity_bytes: u64) -> Self {
        let pages = u32::try_from(capacity_bytes / PAGE_BYTES).unwrap_or(u32::MAX);
        let mut this = Self {
            pages,
            free_pages: 0,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
        };
        if pages > 0 {
            this.insert_free(0, pages);
        }
        this
    }

    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.pages) * PAGE_BYTES
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_pages * PAGE_BYTES
    }

    pub fn used_bytes(&self) -> u64 {
        self.capacity_bytes() - self.free_bytes()
    }

    /// Largest contiguous free run in pages.
    pub fn largest_free_pages(&self) -> u32 {
        self.by_len.last().map_or(0, |(len, _)| *len)
    }

    /// Best fit: the smallest free extent that holds `pages`; returns its start page.
    pub fn allocate(&mut self, pages: u32) -> Option<u32> {
        if pages == 0 {
            return None;
        }
        let (len, start) = *self.by_len.range((pages, 0)..).next()?;
        self.remove_free(start, len);
        if len > pages {
            self.insert_free(start + pages, len - pages);
        }
        Some(start)
    }

    /// Return `[start, start + pages)` to the free set, merging with free neighbours.
    /// Returns false (and changes nothing) if the range is outside the segment or overlaps a
    /// free extent, i.e. a double free.
    pub fn free(&mut self, start: u32, pages: u32) -> bool {
        let Some(end) = start.checked_add(pages) else {
            return false;
        };
        if pages == 0 || end > self.pages {
            return false;
        }
        let prev = self
            .by_start
            .range(..=start)
            .next_back()
            .map(|(s, l)| (*s, *l));
        if let Some((ps, pl)) = prev
            && ps + pl > start
        {
            return false;
        }
        let next = self.by_start.range(start..).next().map(|(s, l)| (*s, *l));
        if let Some((ns, _)) = next
            && ns < end
        {
            return false;
        }
        let mut new_start = start;
        let mut new_len = pages;
        if let Some((ps, pl)) = prev
            && ps + pl == start
        {
            self.remove_free(ps, pl);
            new_start = ps;
            new_len += pl;
        }
        if let Some((ns, nl)) = next
            && ns == end
        {
            self.remove_free(ns, nl);
            new_len += nl;
        }
        self.insert_free(new_start, new_len);
        true
    }

    /// Mark exactly `[start, start + pages)` as used (rebuilding state from a snapshot).
    /// Returns false, changing nothing, unless the whole range is currently free.
    pub fn claim(&mut self, start: u32, pages: u32) -> bool {
        let Some(end) = start.checked_add(pages) else {
            return false;
        };
        if pages == 0 {
            return false;
        }
        let Some((fs, fl)) = self
            .by_start
            .range(..=start)
            .next_back()
            .map(|(s, l)| (*s, *l))
        else {
            return false;
        };
        let fend = fs + fl;
        if fend < end {
            return false;
        }
        self.remove_free(fs, fl);
        if fs < start {
            self.insert_free(fs, start - fs);
        }
        if end < fend {
            self.insert_free(end, fend - end);
        }
        true
    }

    fn insert_free(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_pages += u64::from(len);
    }

    fn remove_free(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_pages -= u64::from(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_coalescing() {
        let mut a = ExtentAllocator::new(10 * PAGE_BYTES);
        let x = a.allocate(3).expect("x");
        let y = a.allocate(3).expect("y");
        let z = a.allocate(4).expect("z");
        assert_eq!((x, y, z), (0, 3, 6));
        assert_eq!(a.allocate(1), None, "full");
        assert!(a.free(x, 3));
        assert!(a.free(z, 4));
        // Best fit picks the 3-page hole for a 2-page request, not the 4-page one.
        assert_eq!(a.allocate(2), Some(0));
        assert!(a.free(0, 2));
        assert!(a.free(y, 3));
        assert_eq!(a.largest_free_pages(), 10, "all merged back");
        assert_eq!(a.free_bytes(), 10 * PAGE_BYTES);
    }

    #[test]
    fn double_free_and_out_of_range_are_refused() {
        let mut a = ExtentAllocator::new(8 * PAGE_BYTES);
        let x = a.allocate(2).expect("x");
        assert!(a.free(x, 2));
        assert!(!a.free(x, 2), "double free");
        assert!(!a.free(7, 2), "past the end");
        assert!(!a.free(u32::MAX, 2), "overflow");
        assert_eq!(a.free_bytes(), 8 * PAGE_BYTES);
    }

    #[test]
    fn claim_takes_exact_ranges_only_when_free() {
        let mut a = ExtentAllocator::new(10 * PAGE_BYTES);
        assert!(a.claim(3, 2));
        assert!(!a.claim(4, 1), "already used");
        assert!(!a.claim(9, 2), "past the end");
        assert_eq!(a.used_bytes(), 2 * PAGE_BYTES);
        assert_eq!(a.allocate(3), Some(0), "hole before the claim");
        assert!(a.free(3, 2));
        assert_eq!(a.largest_free_pages(), 7);
    }

    proptest! {
        #[test]
        fn allocations_never_overlap_and_space_is_conserved(ops in proptest::collection::vec((any::<bool>(), 1u32..6), 1..200)) {
            let mut a = ExtentAllocator::new(64 * PAGE_BYTES);
            let mut live: Vec<(u32, u32)> = Vec::new();
            for (alloc, n) in ops {
                if alloc || live.is_empty() {
                    if let Some(s) = a.allocate(n) {
                        for (ls, ln) in &live {
                            prop_assert!(s + n <= *ls || *ls + *ln <= s, "overlap");
                        }
                        prop_assert!(s + n <= 64);
                        live.push((s, n));
                    }
                } else {
                    let (s, n) = live.swap_remove(n as usize % live.len());
                    prop_assert!(a.free(s, n));
                }
                let used: u64 = live.iter().map(|(_, n)| u64::from(*n)).sum();
                prop_assert_eq!(a.used_bytes(), used * PAGE_BYTES);
            }
        }
    }
}
