//! Page tables of a shared-memory mapping filled ahead of the copies: a segment mapped from a
//! memfd starts with no page-table entries in this process, so each first touch of a 4 KiB page
//! is a page fault, and on a virtual machine one fault costs microseconds (measured here: a
//! 16 MiB copy into a fresh mapping of pages the owner had already allocated took 17 ms, 3.6 ms
//! once mapped). Before a copy touches a 2 MiB chunk for the first time, one
//! `madvise(MADV_POPULATE_WRITE)` fills the chunk's entries in a single call (about a fifth of
//! the faults' cost); a bit per chunk remembers it, so a chunk is filled once per mapping.
//! Best effort: where the kernel refuses (before 5.14), the pages fault in as they are touched.
//! I/O boundary: `madvise`.

use std::sync::atomic::{AtomicU64, Ordering};

use nix::libc;

/// Bytes filled at a time.
pub(super) const CHUNK: usize = 2 << 20;

const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Which chunks of a mapping have their page-table entries.
#[derive(Debug)]
pub(super) struct Prefault {
    chunks: Box<[AtomicU64]>,
}

impl Prefault {
    /// For a mapping of `len` bytes.
    pub(super) fn new(len: usize) -> Self {
        let words = len.div_ceil(CHUNK).div_ceil(64);
        Self {
            chunks: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Fill the entries of every chunk of `offset..offset+len` not filled yet, in the mapping
    /// of `map_len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base+map_len` is a live shared mapping of a file at least that long, and
    /// `offset..offset+len` lies inside it (population writes nothing, but faults in pages
    /// as a write would: past the end of the file that would be SIGBUS).
    pub(super) unsafe fn fill(&self, base: *mut u8, map_len: usize, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        for chunk in offset / CHUNK..=(offset + len - 1) / CHUNK {
            let (word, bit) = (chunk / 64, 1u64 << (chunk % 64));
            let Some(w) = self.chunks.get(word) else {
                return;
            };
            if w.load(Ordering::Relaxed) & bit != 0 {
                continue;
            }
            let start = chunk * CHUNK;
            let end = (start + CHUNK).min(map_len);
            // SAFETY: start..end lies inside the live mapping (the caller's contract; `end` is
            // clamped to its length); the advice changes no contents. Errors are ignored on
            // purpose: the pages then fault in one by one, as without it.
            unsafe {
                libc::madvise(base.add(start).cast(), end - start, MADV_POPULATE_WRITE);
            }
            // Two threads may fill the same chunk at once: harmless, and rare.
            w.fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// Whether the chunk holding `offset` was filled (tests).
    #[cfg(test)]
    pub(super) fn is_filled(&self, offset: usize) -> bool {
        let chunk = offset / CHUNK;
        self.chunks
            .get(chunk / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1u64 << (chunk % 64)) != 0)
    }
}
