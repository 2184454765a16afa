//! `N` doubly linked lists of slots threaded through two shared arrays, the order LRU/FIFO
//! ([`super::Lru`], one list) and LFU ([`super::Lfu`], one list per counter value) keep.
//! A slot is in at most one list. Pure, no I/O.

/// End of a list (no previous or next slot).
pub(super) const NIL: u32 = u32::MAX;
/// In the arrays of a slot that is in no list.
const ABSENT: u32 = u32::MAX - 1;

/// `N` lists over the same slots: heads are the most recent end, tails the eviction end.
#[derive(Debug)]
pub(super) struct Lists<const N: usize> {
    pub(super) prev: Vec<u32>,
    pub(super) next: Vec<u32>,
    pub(super) head: [u32; N],
    pub(super) tail: [u32; N],
    len: usize,
}

impl<const N: usize> Lists<N> {
    pub(super) fn new() -> Self {
        Self {
            prev: Vec::new(),
            next: Vec::new(),
            head: [NIL; N],
            tail: [NIL; N],
            len: 0,
        }
    }

    /// Make room for `slot` in the arrays; whether they grew (the caller grows its own).
    pub(super) fn ensure(&mut self, slot: u32) -> bool {
        let need = slot as usize + 1;
        if self.prev.len() >= need {
            return false;
        }
        self.prev.resize(need, ABSENT);
        self.next.resize(need, ABSENT);
        true
    }

    pub(super) fn contains(&self, slot: u32) -> bool {
        self.prev.get(slot as usize).is_some_and(|p| *p != ABSENT)
    }

    /// Slots in all lists together.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Put `slot` (in no list, within the arrays) at the head of list `list`.
    pub(super) fn push_front(&mut self, list: usize, slot: u32) {
        let i = slot as usize;
        self.prev[i] = NIL;
        self.next[i] = self.head[list];
        if self.head[list] != NIL {
            self.prev[self.head[list] as usize] = slot;
        } else {
            self.tail[list] = slot;
        }
        self.head[list] = slot;
        self.len += 1;
    }

    /// Take `slot` (in a list) out of its list. The list need not be known: a slot at a list's
    /// end is found among the `N` heads and tails.
    pub(super) fn unlink(&mut self, slot: u32) {
        let i = slot as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else if let Some(l) = self.head.iter().position(|h| *h == slot) {
            self.head[l] = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else if let Some(l) = self.tail.iter().position(|t| *t == slot) {
            self.tail[l] = p;
        }
        self.prev[i] = ABSENT;
        self.next[i] = ABSENT;
        self.len -= 1;
    }

    /// Take `slot` out of its list if it is in one.
    pub(super) fn remove(&mut self, slot: u32) {
        if self.contains(slot) {
            self.unlink(slot);
        }
    }

    /// The first slot of list `list`, from its tail, that `may_evict` accepts, taken out.
    pub(super) fn evict_from(
        &mut self,
        list: usize,
        may_evict: &mut dyn FnMut(u32) -> bool,
    ) -> Option<u32> {
        let mut cur = self.tail[list];
        while cur != NIL {
            if may_evict(cur) {
                self.unlink(cur);
                return Some(cur);
            }
            cur = self.prev[cur as usize];
        }
        None
    }
}
