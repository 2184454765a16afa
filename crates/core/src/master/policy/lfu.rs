//! LFU with aging: least frequently used first, where frequencies are 4-bit counters halved
//! every `AGING_WINDOW` references per tracked slot, so an object that was hot long ago loses
//! its protection after a few windows. Pure, no I/O.
//!
//! Layout: one LRU list per counter value (0..=15), threaded through two `u32` arrays like
//! [`super::Lru`]; per slot a counter and the aging epoch it was last brought up to date in
//! (10 bytes per slot in all). Aging is O(1): the lists of counters `2c` and `2c + 1` are
//! spliced into the list of `c` (the lower-count list on the eviction side) and the global
//! epoch moves on; a slot's stored counter is shifted right by the epochs it missed when it is
//! next read. Unlinking never needs the slot's counter (a list end is found among the
//! 16 heads and tails), so a stale counter can only misplace a slot's priority, never break a
//! list.

use super::lists::{Lists, NIL};
use super::{Policy, PolicyKind};

/// Largest counter value (4 bits, as TinyLFU's counters).
pub const MAX_COUNT: u8 = 15;
const LISTS: usize = MAX_COUNT as usize + 1;
/// Counters are halved after this many references (inserts and touches) per tracked slot.
pub const AGING_WINDOW: u64 = 10;
/// Smallest number of references between two halvings (tiny caches).
const MIN_WINDOW: u64 = 160;

/// LFU with aging (see the module documentation).
#[derive(Debug)]
pub struct Lfu {
    /// List `c` holds the slots whose counter is `c`.
    lists: Lists<LISTS>,
    count: Vec<u8>,
    epoch: Vec<u8>,
    /// Aging epoch (wraps; see [`Lfu::current_count`]).
    now: u8,
    /// References since the last halving.
    references: u64,
}

impl Default for Lfu {
    fn default() -> Self {
        Self::new()
    }
}

impl Lfu {
    pub fn new() -> Self {
        Self {
            lists: Lists::new(),
            count: Vec::new(),
            epoch: Vec::new(),
            now: 0,
            references: 0,
        }
    }

    fn ensure(&mut self, slot: u32) {
        if self.lists.ensure(slot) {
            let need = slot as usize + 1;
            self.count.resize(need, 0);
            self.epoch.resize(need, 0);
        }
    }

    /// The slot's counter after the halvings it missed (`None`: not tracked). The epoch is a
    /// byte: a slot untouched for 256 halvings or more reads as if it had missed that number
    /// modulo 256, so its counter may be overstated; that only misplaces its priority (it is
    /// in the list of counter 0 by then), never a list.
    pub fn current_count(&self, slot: u32) -> Option<u8> {
        if !self.lists.contains(slot) {
            return None;
        }
        let i = slot as usize;
        let missed = self.now.wrapping_sub(self.epoch[i]);
        Some(if missed >= 8 {
            0
        } else {
            self.count[i] >> missed
        })
    }

    fn push_front(&mut self, slot: u32, count: u8) {
        let i = slot as usize;
        self.count[i] = count;
        self.epoch[i] = self.now;
        self.lists.push_front(usize::from(count), slot);
    }

    /// Count one reference; halve every counter when the window is full.
    fn reference(&mut self) {
        self.references += 1;
        let window = (self.lists.len() as u64 * AGING_WINDOW).max(MIN_WINDOW);
        if self.references >= window {
            self.references = 0;
            self.age();
        }
    }

    /// Halve every counter: list `c` becomes list `2c + 1` followed by list `2c` (which is
    /// nearer the eviction end), for every `c`.
    fn age(&mut self) {
        let lists = &mut self.lists;
        let (old_head, old_tail) = (lists.head, lists.tail);
        lists.head = [NIL; LISTS];
        lists.tail = [NIL; LISTS];
        for c in 0..LISTS / 2 {
            let (hi, lo) = (2 * c + 1, 2 * c);
            let (h, t) = match (old_head[hi], old_head[lo]) {
                (NIL, NIL) => (NIL, NIL),
                (NIL, _) => (old_head[lo], old_tail[lo]),
                (_, NIL) => (old_head[hi], old_tail[hi]),
                (_, lo_head) => {
                    let hi_tail = old_tail[hi];
                    lists.next[hi_tail as usize] = lo_head;
                    lists.prev[lo_head as usize] = hi_tail;
                    (old_head[hi], old_tail[lo])
                }
            };
            lists.head[c] = h;
            lists.tail[c] = t;
        }
        self.now = self.now.wrapping_add(1);
    }
}

impl Policy for Lfu {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lfu
    }

    fn insert(&mut self, slot: u32, _key: u64) {
        self.ensure(slot);
        self.lists.remove(slot);
        self.push_front(slot, 0);
        self.reference();
    }

    fn touch(&mut self, slot: u32) {
        let Some(count) = self.current_count(slot) else {
            return;
        };
        self.lists.unlink(slot);
        self.push_front(slot, (count + 1).min(MAX_COUNT));
        self.reference();
    }

    fn remove(&mut self, slot: u32) {
        self.lists.remove(slot);
    }

    fn len(&self) -> usize {
        self.lists.len()
    }

    fn evict(&mut self, may_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        (0..LISTS).find_map(|l| self.lists.evict_from(l, may_evict))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(p: &mut Lfu) -> Vec<u32> {
        std::iter::from_fn(|| p.evict(&mut |_| true)).collect()
    }

    #[test]
    fn fewer_references_go_first_and_ties_go_least_recent_first() {
        let mut p = Lfu::new();
        for s in 0..5 {
            p.insert(s, u64::from(s));
        }
        // 4: three touches, 1: two, 3: one, 0 and 2: none (0 older).
        for s in [4, 1, 4, 3, 1, 4] {
            p.touch(s);
        }
        assert_eq!(p.current_count(4), Some(3));
        assert_eq!(drain(&mut p), vec![0, 2, 3, 1, 4]);
        assert_eq!(p.current_count(4), None);
    }

    #[test]
    fn frequent_objects_survive_a_scan_of_one_hit_wonders() {
        let mut p = Lfu::new();
        for s in 0..5 {
            p.insert(s, u64::from(s));
            p.touch(s);
        }
        for s in 5..100 {
            p.insert(s, u64::from(s));
        }
        let first: Vec<u32> = (0..95).filter_map(|_| p.evict(&mut |_| true)).collect();
        assert_eq!(first.len(), 95);
        assert!(
            first.iter().all(|s| *s >= 5),
            "hot objects survive: {first:?}"
        );
    }

    #[test]
    fn old_hot_objects_lose_their_protection_as_counters_age() {
        let mut p = Lfu::new();
        // Slot 0 was very hot once.
        p.insert(0, 0);
        for _ in 0..100 {
            p.touch(0);
        }
        assert_eq!(p.current_count(0), Some(MAX_COUNT));
        // Then a working set of 20 objects is referenced three times each, for long enough
        // that several aging windows pass; slot 0 is never referenced again.
        for s in 1..=20 {
            p.insert(s, u64::from(s));
        }
        let before = p.now;
        for _ in 0..200 {
            for s in 1..=20 {
                p.touch(s);
            }
        }
        assert!(p.now.wrapping_sub(before) >= 4, "at least four halvings");
        assert_eq!(p.current_count(0), Some(0));
        // The old hot object is now the first victim: every current object has a count.
        assert_eq!(p.evict(&mut |_| true), Some(0));
        assert!((1..=20).all(|s| p.current_count(s).is_some_and(|c| c > 0)));
    }

    #[test]
    fn aging_halves_counters_and_keeps_the_lower_half_nearer_eviction() {
        let mut p = Lfu::new();
        for s in 0..4 {
            p.insert(s, u64::from(s));
        }
        // Counters: 0 -> 0, 1 -> 1, 2 -> 2, 3 -> 3.
        for (s, n) in [(1, 1), (2, 2), (3, 3)] {
            for _ in 0..n {
                p.touch(s);
            }
        }
        p.age();
        let counts: Vec<_> = (0..4).map(|s| p.current_count(s)).collect();
        assert_eq!(counts, vec![Some(0), Some(0), Some(1), Some(1)]);
        // Within one list, the slots that had the lower counter are evicted first.
        assert_eq!(drain(&mut p), vec![0, 1, 2, 3]);
        // Removing from the middle, the head and the tail of lists keeps them intact.
        for s in 0..6 {
            p.insert(s, 0);
        }
        p.remove(5);
        p.remove(0);
        p.remove(3);
        assert_eq!(p.len(), 3);
        assert_eq!(drain(&mut p), vec![1, 2, 4]);
    }

    /// A plain model of the same policy: the lists as vectors (front = most recent).
    #[derive(Default)]
    struct Model {
        lists: Vec<Vec<u32>>,
        count: std::collections::HashMap<u32, u8>,
        references: u64,
    }

    impl Model {
        fn new() -> Self {
            Self {
                lists: vec![Vec::new(); LISTS],
                ..Self::default()
            }
        }
        fn len(&self) -> usize {
            self.count.len()
        }
        fn take(&mut self, slot: u32) -> Option<u8> {
            let c = self.count.remove(&slot)?;
            for l in &mut self.lists {
                l.retain(|s| *s != slot);
            }
            Some(c)
        }
        fn put(&mut self, slot: u32, c: u8) {
            self.lists[usize::from(c)].insert(0, slot);
            self.count.insert(slot, c);
        }
        fn reference(&mut self) {
            self.references += 1;
            if self.references >= (self.len() as u64 * AGING_WINDOW).max(MIN_WINDOW) {
                self.references = 0;
                let old = std::mem::replace(&mut self.lists, vec![Vec::new(); LISTS]);
                for c in 0..LISTS / 2 {
                    let mut list = old[2 * c + 1].clone();
                    list.extend(&old[2 * c]);
                    for s in &list {
                        self.count.insert(*s, c as u8);
                    }
                    self.lists[c] = list;
                }
            }
        }
        fn insert(&mut self, slot: u32) {
            self.take(slot);
            self.put(slot, 0);
            self.reference();
        }
        fn touch(&mut self, slot: u32) {
            if let Some(c) = self.take(slot) {
                self.put(slot, (c + 1).min(MAX_COUNT));
                self.reference();
            }
        }
        fn evict(&mut self, ok: impl Fn(u32) -> bool) -> Option<u32> {
            let victim = self
                .lists
                .iter()
                .flat_map(|l| l.iter().rev())
                .copied()
                .find(|s| ok(*s))?;
            self.take(victim);
            Some(victim)
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        #[test]
        fn matches_a_plain_model(
            ops in proptest::collection::vec((0u8..4, 0u32..24, proptest::prelude::any::<u32>()), 1..1500),
        ) {
            let mut p = Lfu::new();
            let mut m = Model::new();
            for (op, slot, mask) in ops {
                match op {
                    0 => {
                        p.insert(slot, 0);
                        m.insert(slot);
                    }
                    1 => {
                        p.touch(slot);
                        m.touch(slot);
                    }
                    2 => {
                        p.remove(slot);
                        m.take(slot);
                    }
                    _ => {
                        let ok = |s: u32| mask & (1 << s) != 0;
                        proptest::prop_assert_eq!(p.evict(&mut |s| ok(s)), m.evict(ok));
                    }
                }
                proptest::prop_assert_eq!(p.len(), m.len());
                for (s, c) in &m.count {
                    proptest::prop_assert_eq!(p.current_count(*s), Some(*c), "count of {}", s);
                }
            }
        }
    }
}
