//! Aligned direct I/O for the SSD tier's data file: [`AlignedBuf`] (a zeroed heap buffer
//! aligned and padded to [`ALIGN`], this module's only `unsafe`), the padding rule of every
//! block, opening the file with or without `O_DIRECT`, and a read that fills a buffer until
//! the file ends. I/O boundary: [`open_data`] and [`read_fully`].

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

/// Alignment and size granularity of direct I/O.
pub const ALIGN: u64 = 4096;

/// Bytes a block of `len` bytes takes on disk: rounded up to [`ALIGN`], at least one unit.
pub fn padded(len: u64) -> u64 {
    // Saturating: a length from a damaged index near u64::MAX must not overflow (the caller's
    // bounds check then refuses it).
    len.max(1).div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// A heap buffer aligned for direct I/O, length a multiple of [`ALIGN`], zero-filled.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to [`ALIGN`]).
    pub fn new(len: usize) -> Self {
        let align = ALIGN as usize;
        let len = len.max(1).div_ceil(align) * align;
        let layout = match Layout::from_size_align(len, align) {
            Ok(l) => l,
            Err(_) => std::alloc::handle_alloc_error(Layout::new::<u8>()),
        };
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    fn layout(&self) -> Option<Layout> {
        Layout::from_size_align(self.len, ALIGN as usize).ok()
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(layout) = self.layout() {
            // SAFETY: allocated in `new` with this same layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Whether `buf` starts at an [`ALIGN`]-aligned address (direct I/O needs it).
pub fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as u64).is_multiple_of(ALIGN)
}

/// Open (creating it when missing) the data file at `path`, with `O_DIRECT` when `direct`.
pub fn open_data(path: &Path, direct: bool) -> std::io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(true).truncate(false);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path)
}

/// Read into `dst` at `offset` until it is full or the file ends; returns the bytes read.
pub fn read_fully(f: &File, dst: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut read = 0usize;
    while read < dst.len() {
        let Some(rest) = dst.get_mut(read..) else {
            break;
        };
        match f.read_at(rest, offset + read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_padded() {
        let b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert!(is_aligned(&b));
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!((padded(0), padded(4096), padded(4097)), (4096, 4096, 8192));
    }
}
