//! Segments a same-node process can map: memfd-backed memory ([`Segment::memfd`]), a peer's
//! memfd mapped here ([`Segment::map_fd`], whose page tables [`super::prefault`] fills), and
//! memory owned elsewhere given the file it maps ([`Segment::with_shared_fd`]). I/O boundary:
//! `memfd_create`, `ftruncate`, `fstat` and `mmap` of the shared file.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use nix::libc;

use super::{Backing, HostOptions, MAX_SEGMENT_SIZE, MemoryError, Segment, check_size, prefault};

impl Segment {
    /// Host memory backed by an anonymous memory file (memfd), so that a process on the same
    /// node can map the very same pages (the shared-memory transport passes the fd).
    pub fn memfd(name: &str, size: usize, options: HostOptions) -> Result<Self, MemoryError> {
        check_size(size)?;
        let memfd_err = |source: io::Error| MemoryError::Memfd {
            name: name.to_owned(),
            size,
            source,
        };
        let fd = nix::sys::memfd::memfd_create(
            name.replace('\0', "_").as_str(),
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .map_err(|e| memfd_err(e.into()))?;
        let off = libc::off_t::try_from(size).map_err(|_| MemoryError::InvalidSize {
            size,
            max: MAX_SEGMENT_SIZE,
        })?;
        nix::unistd::ftruncate(&fd, off).map_err(|e| memfd_err(e.into()))?;
        let mut seg = Self::map_fd(fd, size)?;
        if options.lock {
            seg.lock()?;
        }
        Ok(seg)
    }

    /// Map a memfd received from a peer on the same node. The fd's size is checked first: a
    /// peer announcing more bytes than the file holds would otherwise make accesses fault.
    pub fn map_fd(fd: OwnedFd, size: usize) -> Result<Self, MemoryError> {
        check_size(size)?;
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|source| MemoryError::Map { size, source })?
            .len();
        if actual < size as u64 {
            return Err(MemoryError::ShortFd {
                expected: size,
                actual,
            });
        }
        // SAFETY: the file is a memfd (or shm file) whose size we just checked covers `size`;
        // the mapping is MAP_SHARED on purpose and is only accessed through raw copies, so
        // concurrent modification by the other process cannot invalidate Rust references.
        let mut map = unsafe { memmap2::MmapOptions::new().len(size).map_mut(&file) }
            .map_err(|source| MemoryError::Map { size, source })?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or(MemoryError::Allocate { size })?;
        Ok(Segment {
            ptr,
            len: size,
            locked: false,
            numa_node: None,
            gpu_device: None,
            backing: Backing::Mmap {
                _map: map,
                fd: Some(OwnedFd::from(file)),
            },
            prefault: Some(prefault::Prefault::new(size)),
        })
    }

    /// The file behind this segment, if it has one (a memfd, or the file given to
    /// [`Self::with_shared_fd`]): shareable with a same-node process.
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Mmap { fd: Some(fd), .. } | Backing::Foreign { fd: Some(fd), .. } => {
                Some(fd.as_fd())
            }
            _ => None,
        }
    }

    /// Let same-node peers map this memory through `fd` (the shared-memory transport passes
    /// it): the file whose mapping from offset 0 this segment is, at least as long. Only for
    /// memory owned elsewhere ([`Self::from_raw_parts`]); other segments keep what they have.
    /// A shorter file is refused, since a peer's accesses past its end would fault.
    pub fn with_shared_fd(mut self, fd: OwnedFd) -> Result<Self, MemoryError> {
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|source| MemoryError::Map {
                size: self.len,
                source,
            })?
            .len();
        if actual < self.len as u64 {
            return Err(MemoryError::ShortFd {
                expected: self.len,
                actual,
            });
        }
        if let Backing::Foreign { fd: slot, .. } = &mut self.backing {
            *slot = Some(OwnedFd::from(file));
        }
        Ok(self)
    }

    /// Fill the page-table entries of `offset..offset+len` ahead of a copy, where this is a
    /// memfd mapped from a peer (see `prefault`); a range outside the segment is left alone
    /// (the copy's own bounds check refuses it).
    pub(crate) fn prefault(&self, offset: u64, len: usize) {
        if let Some(p) = &self.prefault
            && self.check_range(offset, len as u64).is_ok()
        {
            // SAFETY: a live shared mapping of a file at least `self.len` long (map_fd checked
            // the file's size), and the range lies inside it (checked above).
            unsafe { p.fill(self.ptr.as_ptr(), self.len, offset as usize, len) }
        }
    }
}
