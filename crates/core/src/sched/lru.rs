//! LRU set of block keys with a capacity in blocks: the eviction order of a prefill instance's
//! local cache and of the global pool. Pure; no I/O.
//!
//! Nodes live in one vector linked by indices (no per-entry allocation); a key map finds them.

use super::blocks::BlockKey;
use super::index::KeyMap;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: BlockKey,
    prev: u32,
    next: u32,
}

/// What `LruSet::insert` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// The key was already present; it is now the most recently used.
    Present,
    /// The key was added; `evicted` is the least recently used key that made room, if any.
    Added { evicted: Option<BlockKey> },
    /// The capacity is zero: nothing is kept.
    NoCapacity,
}

/// A set of keys evicted in least-recently-used order once it holds `capacity` keys.
#[derive(Debug)]
pub struct LruSet {
    map: KeyMap<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32, // most recently used
    tail: u32, // least recently used
    capacity: usize,
}

impl LruSet {
    /// An empty set holding at most `capacity` keys (`usize::MAX`: unlimited). At most
    /// `u32::MAX - 1` keys are ever held.
    pub fn new(capacity: usize) -> Self {
        Self {
            map: KeyMap::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity: capacity.min(NIL as usize - 1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, key: BlockKey) -> bool {
        self.map.contains_key(&key)
    }

    /// Marks `key` most recently used; false when absent.
    pub fn touch(&mut self, key: BlockKey) -> bool {
        match self.map.get(&key) {
            Some(&slot) => {
                self.unlink(slot);
                self.push_front(slot);
                true
            }
            None => false,
        }
    }

    /// Adds `key` as most recently used, evicting the least recently used key when full.
    pub fn insert(&mut self, key: BlockKey) -> Inserted {
        if self.touch(key) {
            return Inserted::Present;
        }
        if self.capacity == 0 {
            return Inserted::NoCapacity;
        }
        let evicted = if self.map.len() >= self.capacity {
            self.pop_back()
        } else {
            None
        };
        let node = Node {
            key,
            prev: NIL,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.nodes[slot as usize] = node;
                slot
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(key, slot);
        self.push_front(slot);
        Inserted::Added { evicted }
    }

    /// Removes `key`; false when absent.
    pub fn remove(&mut self, key: BlockKey) -> bool {
        match self.map.remove(&key) {
            Some(slot) => {
                self.unlink(slot);
                self.free.push(slot);
                true
            }
            None => false,
        }
    }

    /// Keys from most to least recently used.
    pub fn iter(&self) -> impl Iterator<Item = BlockKey> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let n = self.nodes[cur as usize];
            cur = n.next;
            Some(n.key)
        })
    }

    fn pop_back(&mut self) -> Option<BlockKey> {
        if self.tail == NIL {
            return None;
        }
        let slot = self.tail;
        let key = self.nodes[slot as usize].key;
        self.unlink(slot);
        self.map.remove(&key);
        self.free.push(slot);
        Some(key)
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old = self.head;
        {
            let n = &mut self.nodes[slot as usize];
            n.prev = NIL;
            n.next = old;
        }
        if old == NIL {
            self.tail = slot;
        } else {
            self.nodes[old as usize].prev = slot;
        }
        self.head = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used() {
        let mut l = LruSet::new(3);
        assert_eq!(l.insert(1), Inserted::Added { evicted: None });
        assert_eq!(l.insert(2), Inserted::Added { evicted: None });
        assert_eq!(l.insert(3), Inserted::Added { evicted: None });
        assert!(l.touch(1)); // order now 1, 3, 2
        assert_eq!(l.insert(4), Inserted::Added { evicted: Some(2) });
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![4, 1, 3]);
        assert_eq!(l.insert(1), Inserted::Present);
        assert_eq!(l.insert(5), Inserted::Added { evicted: Some(3) });
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![5, 1]);
        assert_eq!(l.insert(6), Inserted::Added { evicted: None });
        assert_eq!(l.len(), 3);
        assert!(!l.touch(42));
    }

    #[test]
    fn zero_capacity_keeps_nothing() {
        let mut l = LruSet::new(0);
        assert_eq!(l.insert(1), Inserted::NoCapacity);
        assert!(l.is_empty());
        assert!(!l.contains(1));
    }

    #[test]
    fn matches_a_naive_model() {
        // Deterministic pseudo-random operations against a Vec-based reference.
        let mut l = LruSet::new(5);
        let mut model: Vec<u64> = Vec::new(); // front = most recent
        let mut x = 12345u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = (x >> 33) % 12;
            if (x >> 20).is_multiple_of(5) {
                let was = model.iter().position(|&k| k == key);
                assert_eq!(l.remove(key), was.is_some());
                if let Some(p) = was {
                    model.remove(p);
                }
            } else {
                let got = l.insert(key);
                if let Some(p) = model.iter().position(|&k| k == key) {
                    model.remove(p);
                    model.insert(0, key);
                    assert_eq!(got, Inserted::Present);
                } else {
                    let evicted = if model.len() == 5 { model.pop() } else { None };
                    model.insert(0, key);
                    assert_eq!(got, Inserted::Added { evicted });
                }
            }
            assert_eq!(l.iter().collect::<Vec<_>>(), model);
        }
    }
}
