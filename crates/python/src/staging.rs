//! Space in the agent session's staging area: a first-fit allocator over the offsets of the
//! mapping, shared by every call of one store (each takes the ranges its bytes pass through,
//! and gives them back when it ends) and by `alloc_buffer` (ranges handed to the caller until
//! `free_buffer`). A call that finds no room waits for another to give some back, up to its
//! deadline. Pure bookkeeping: no I/O.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::errors::{Failure, Kind};

/// Every range starts on a multiple of this (a cache line; numpy's default alignment).
pub const ALIGN: u64 = 64;

/// The free ranges of a staging area of `size` bytes.
#[derive(Debug)]
pub struct Arena {
    size: u64,
    /// Free ranges: offset -> length, never adjacent (they are merged when given back).
    free: Mutex<BTreeMap<u64, u64>>,
    freed: Notify,
}

/// A range taken from an [`Arena`]; given back when dropped.
#[derive(Debug)]
pub struct Range {
    arena: Arc<Arena>,
    pub offset: u64,
    /// The bytes taken (the request rounded up to [`ALIGN`]).
    pub len: u64,
}

impl Drop for Range {
    fn drop(&mut self) {
        self.arena.give(self.offset, self.len);
    }
}

fn rounded(n: u64) -> Option<u64> {
    n.max(1).checked_next_multiple_of(ALIGN)
}

impl Arena {
    /// The whole area free (its size rounded down to [`ALIGN`]).
    pub fn new(size: u64) -> Arc<Self> {
        let size = size - size % ALIGN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Arc::new(Self {
            size,
            free: Mutex::new(free),
            freed: Notify::new(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes free now (possibly in several pieces).
    pub fn free_bytes(&self) -> u64 {
        self.free.lock().values().sum()
    }

    /// `n` bytes now, or None when no free range is that long.
    pub fn try_take(self: &Arc<Self>, n: u64) -> Option<Range> {
        let len = rounded(n)?;
        let mut free = self.free.lock();
        let (&offset, &have) = free.iter().find(|(_, have)| **have >= len)?;
        free.remove(&offset);
        if have > len {
            free.insert(offset + len, have - len);
        }
        Some(Range {
            arena: Arc::clone(self),
            offset,
            len,
        })
    }

    /// `n` bytes, waiting up to `wait` for other calls to give back room. Fails with
    /// `NoSpace` when `n` exceeds the whole area or the wait runs out.
    pub async fn take(self: &Arc<Self>, n: u64, wait: Duration) -> Result<Range, Failure> {
        if rounded(n).is_none_or(|len| len > self.size) {
            return Err(Failure::new(
                Kind::NoSpace,
                format!(
                    "{n} bytes do not fit the agent session's {}-byte staging area (open the \
                     store with a larger staging_bytes / local_buffer_size)",
                    self.size
                ),
            ));
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            // Registered before looking, so a range given back in between still wakes us.
            notified.as_mut().enable();
            if let Some(r) = self.try_take(n) {
                return Ok(r);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Failure::new(
                    Kind::NoSpace,
                    format!(
                        "the agent session's staging area ({} bytes, {} free) had no room for \
                         {n} bytes within {} ms: other calls or alloc_buffer hold it",
                        self.size,
                        self.free_bytes(),
                        wait.as_millis()
                    ),
                ));
            }
        }
    }

    fn give(&self, offset: u64, len: u64) {
        {
            let mut free = self.free.lock();
            let (mut start, mut end) = (offset, offset + len);
            if let Some((&p, &plen)) = free.range(..offset).next_back()
                && p + plen == start
            {
                free.remove(&p);
                start = p;
            }
            if let Some(nlen) = free.remove(&end) {
                end += nlen;
            }
            free.insert(start, end - start);
        }
        self.freed.notify_waiters();
    }
}
