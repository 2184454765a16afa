//! Memory regions of the agent: the DRAM tier's anonymous mappings (huge pages when asked,
//! mbind to a NUMA node, mlock) or shared mappings of tmpfs/hugetlbfs files when the tier
//! persists across restarts, and, in pool mode, their hand-over to the transfer engine plus
//! the file mapping that backs the pool-mode SSD segment. I/O boundary: the
//! mmap/mbind/mlock/munmap/fallocate system calls. This is one of the few modules of the agent
//! with `unsafe` (the others are `ssd::AlignedBuf` and `api::shm`); failures to get huge pages,
//! a NUMA binding or a lock degrade to warnings, only a failed plain mmap is an error.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// Errors of region mapping.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum MemoryError {
    #[error("mmap of {bytes} bytes failed")]
    #[strum(serialize = "mmap")]
    Map {
        bytes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("region size must be non-zero")]
    Empty,
    #[error("cannot prepare {len} bytes in {path}")]
    File {
        path: PathBuf,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("handing {len} bytes to the transfer engine")]
    Transfer {
        len: usize,
        #[source]
        source: kvpool_transfer::MemoryError,
    },
}

kvpool_runtime::error_category!(MemoryError);

/// What to map.
#[derive(Clone, Debug)]
pub struct RegionRequest {
    pub bytes: usize,
    pub numa_node: Option<u32>,
    pub hugepage_size: Option<u64>,
    pub lock: bool,
    /// Back the region with a memfd instead of private anonymous memory, so that engines on
    /// this node can map the same pages (pool mode's same-node shared memory).
    pub shareable: bool,
}

/// How the mapping actually came out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionOutcome {
    pub hugepage_size: Option<u64>,
    pub numa_bound: bool,
    pub locked: bool,
    pub warnings: Vec<String>,
}

/// An owned mapping, unmapped on drop: private anonymous memory, a memfd, or a file.
#[derive(Debug)]
pub struct MappedRegion {
    ptr: NonNull<u8>,
    len: usize,
    /// The memfd or file behind a shared mapping (a same-node process can map it too).
    fd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the region is plain memory owned by this value; access to its bytes is synchronised
// by the owner (the DRAM tier holds it behind a lock).
unsafe impl Send for MappedRegion {}
// SAFETY: as above; shared references only expose the address and length.
unsafe impl Sync for MappedRegion {}

const MPOL_BIND: libc::c_long = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;
const MPOL_MF_MOVE: libc::c_ulong = 2;
const MAP_HUGE_SHIFT: u32 = 26;
const MADV_POPULATE_WRITE: libc::c_int = 23;

fn mmap_anon(len: usize, extra_flags: libc::c_int) -> std::io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping at a kernel-chosen address touches no existing
    // memory; the result is checked against MAP_FAILED before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap returned null"))
}

/// A memfd of `len` bytes (of huge pages of `huge` bytes when given) mapped shared.
fn mmap_memfd(
    len: usize,
    huge: Option<u64>,
) -> std::io::Result<(NonNull<u8>, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut flags = libc::MFD_CLOEXEC;
    if let Some(page) = huge {
        flags |= libc::MFD_HUGETLB | (page.trailing_zeros() << MAP_HUGE_SHIFT);
    }
    // SAFETY: the name is a NUL-terminated literal; the result is checked before use.
    let raw = unsafe { libc::memfd_create(c"kvpool-dram".as_ptr(), flags) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    let size = libc::off_t::try_from(len).map_err(std::io::Error::other)?;
    // SAFETY: ftruncate on the descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((mmap_shared(&fd, len)?, fd))
}

/// A read-write shared mapping of the first `len` bytes of `file` (sized to at least that by
/// the caller), at a kernel-chosen address. It stays valid after the descriptor is closed.
fn mmap_shared(file: &impl AsRawFd, len: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: a shared mapping at a kernel-chosen address touches no existing memory; the
    // result is checked against MAP_FAILED before use.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap returned null"))
}

impl MappedRegion {
    /// Map a region as requested, degrading (with warnings) where the system refuses.
    pub fn map(req: &RegionRequest) -> Result<(Self, RegionOutcome), MemoryError> {
        if req.bytes == 0 {
            return Err(MemoryError::Empty);
        }
        let mut outcome = RegionOutcome::default();
        let anon_or_memfd = |len: usize, page: Option<u64>| {
            if req.shareable {
                mmap_memfd(len, page).map(|(ptr, fd)| (ptr, Some(fd)))
            } else {
                let flags = page.map_or(0, |p| {
                    libc::MAP_HUGETLB | ((p.trailing_zeros() as libc::c_int) << MAP_HUGE_SHIFT)
                });
                mmap_anon(len, flags).map(|ptr| (ptr, None))
            }
        };
        let mut mapped = None;
        if let Some(page) = req.hugepage_size {
            let len = round_up(req.bytes, page);
            match anon_or_memfd(len, Some(page)) {
                Ok((ptr, fd)) => {
                    outcome.hugepage_size = Some(page);
                    mapped = Some((ptr, len, fd));
                }
                Err(e) => outcome.warnings.push(format!(
                    "huge pages of {page} bytes unavailable ({e}); using normal pages"
                )),
            }
        }
        let (ptr, len, fd) = match mapped {
            Some(m) => m,
            None => {
                let len = round_up(req.bytes, 4096);
                let (ptr, fd) = anon_or_memfd(len, None)
                    .map_err(|source| MemoryError::Map { bytes: len, source })?;
                (ptr, len, fd)
            }
        };
        Ok(Self { ptr, len, fd }.settle(req, outcome))
    }

    /// Map file `path` shared: created or reopened with its contents kept (a persistent DRAM
    /// tier on tmpfs or hugetlbfs outlives the agent), sized to the request rounded up to
    /// `page` (the filesystem's page: 4 KiB on tmpfs, the huge page size on hugetlbfs) and
    /// reserved with `posix_fallocate` (a fault on a full tmpfs would be SIGBUS), then bound
    /// to the NUMA node, locked and populated as [`Self::map`] does. The file's pages keep the
    /// NUMA placement they got when first touched; `mbind` places the ones touched from now.
    pub fn map_file(
        req: &RegionRequest,
        path: &Path,
        page: u64,
    ) -> Result<(Self, RegionOutcome), MemoryError> {
        if req.bytes == 0 {
            return Err(MemoryError::Empty);
        }
        let len = round_up(req.bytes, page);
        let file_err = |source| MemoryError::File {
            path: path.to_owned(),
            len: len as u64,
            source,
        };
        let file = reserved_file(path, len as u64)?;
        let ptr = mmap_shared(&file, len).map_err(file_err)?;
        let outcome = RegionOutcome {
            hugepage_size: (page > 4096).then_some(page),
            ..RegionOutcome::default()
        };
        let region = Self {
            ptr,
            len,
            fd: Some(file.into()),
        };
        Ok(region.settle(req, outcome))
    }

    /// Bind, lock and populate a fresh mapping as `req` asks, noting what the system refused.
    fn settle(self, req: &RegionRequest, mut outcome: RegionOutcome) -> (Self, RegionOutcome) {
        let region = self;
        if let Some(node) = req.numa_node {
            match region.bind(node) {
                Ok(()) => outcome.numa_bound = true,
                Err(e) => outcome
                    .warnings
                    .push(format!("cannot bind memory to NUMA node {node} ({e})")),
            }
        }
        if req.lock {
            // SAFETY: the range is exactly this live mapping.
            let rc = unsafe { libc::mlock(region.ptr.as_ptr().cast(), region.len) };
            if rc == 0 {
                outcome.locked = true;
            } else {
                let e = std::io::Error::last_os_error();
                outcome.warnings.push(format!(
                    "cannot lock {} bytes ({e}); memory may be swapped",
                    region.len
                ));
            }
        }
        if !outcome.locked {
            // mlock faults the pages in; without it, populate them now (after mbind, so they
            // land on the bound node) instead of on the first put. Best effort: kernels
            // before 5.14 lack MADV_POPULATE_WRITE and the pages then fault lazily.
            // SAFETY: advice on exactly this live mapping; it changes no contents.
            unsafe {
                libc::madvise(region.ptr.as_ptr().cast(), region.len, MADV_POPULATE_WRITE);
            }
        }
        (region, outcome)
    }

    fn bind(&self, node: u32) -> std::io::Result<()> {
        let bits = libc::c_ulong::BITS;
        let words = usize::try_from(node / bits + 1).map_err(std::io::Error::other)?;
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        if let Some(w) = mask.last_mut() {
            *w = 1 << (node % bits);
        }
        let maxnode = libc::c_ulong::try_from(words).map_err(std::io::Error::other)?
            * libc::c_ulong::from(bits)
            + 1;
        // SAFETY: mbind only changes the NUMA policy of this live mapping; the mask buffer holds
        // `words` words, which covers `maxnode - 1` bits.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr(),
                self.len,
                MPOL_BIND,
                mask.as_ptr(),
                maxnode,
                MPOL_MF_STRICT | MPOL_MF_MOVE,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address (for registration with the transfer engine).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// The whole region as bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live, readable, `len` bytes long and initialised (anonymous
        // memory is zero-filled); writes need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole region as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl MappedRegion {
    /// Give the mapping to the transfer engine (pool mode): the returned segment owns it, so
    /// it stays mapped, NUMA-bound and locked until the last user (the registration, or a
    /// transfer still in flight) drops the segment; then it is unmapped.
    /// A shared mapping (memfd or file) gives the segment its file too, for same-node peers.
    pub fn into_transfer_segment(mut self) -> Result<kvpool_transfer::Segment, MemoryError> {
        let (ptr, len, fd) = (self.ptr, self.len, self.fd.take());
        let release: Box<dyn FnOnce() + Send + Sync> = Box::new(move || drop(self));
        // SAFETY: `ptr..ptr+len` is this live read-write mapping; the region moves into
        // `release`, so nothing else can reach it through a Rust reference, and it is unmapped
        // only when `release` runs (or is dropped on error), after the segment's last use.
        let seg = unsafe { kvpool_transfer::Segment::from_raw_parts(ptr, len, Some(release)) }
            .map_err(|source| MemoryError::Transfer { len, source })?;
        match fd {
            // The fd is the file mapped from offset 0 over `len` bytes (both made here).
            Some(fd) => seg
                .with_shared_fd(fd)
                .map_err(|source| MemoryError::Transfer { len, source }),
            None => Ok(seg),
        }
    }

    /// Whether the region is a shared mapping of a file same-node processes can map.
    pub fn is_shareable(&self) -> bool {
        self.fd.is_some()
    }
}

/// Create or reopen `path` (keeping its contents: the pool-mode SSD segment persists across
/// restarts; a longer file is cut to `len`), reserve `len` bytes of disk for it and map it
/// shared, as a transfer-engine segment: the pool-mode SSD segment. The blocks are reserved up front
/// (fallocate) because a write into a hole of a shared file mapping on a full filesystem kills
/// the process with SIGBUS instead of returning ENOSPC.
pub fn map_file_segment(path: &Path, len: u64) -> Result<kvpool_transfer::Segment, MemoryError> {
    let file_err = |source| MemoryError::File {
        path: path.to_owned(),
        len,
        source,
    };
    let file = reserved_file(path, len)?;
    // SAFETY: the file is ours, just sized to `len` bytes with every block allocated; the
    // mapping is only ever accessed through the transfer segment's bounds-checked raw copies.
    let map = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.map_err(file_err)?;
    kvpool_transfer::Segment::from_mmap(map, kvpool_transfer::HostOptions::default()).map_err(
        |source| MemoryError::Transfer {
            len: usize::try_from(len).unwrap_or(usize::MAX),
            source,
        },
    )
}

/// Create or reopen `path` keeping its contents (a persistent segment outlives the agent), cut
/// it to `len` when longer, and reserve `len` bytes for it with `posix_fallocate` (which also
/// extends it): a fault on a hole of a shared mapping of a full filesystem is SIGBUS, not an
/// error.
fn reserved_file(path: &Path, len: u64) -> Result<std::fs::File, MemoryError> {
    let file_err = |source| MemoryError::File {
        path: path.to_owned(),
        len,
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(file_err)?;
    if file.metadata().map_err(file_err)?.len() > len {
        file.set_len(len).map_err(file_err)?;
    }
    let size = libc::off_t::try_from(len)
        .map_err(|_| file_err(std::io::Error::other("length does not fit off_t")))?;
    // SAFETY: fallocate on a file descriptor we own; it only changes the file's allocation.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size) };
    if rc != 0 {
        return Err(file_err(std::io::Error::from_raw_os_error(rc)));
    }
    Ok(file)
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // SAFETY: the region was mapped by `map` with this exact length and is unmapped once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

fn round_up(n: usize, to: u64) -> usize {
    let to = usize::try_from(to).unwrap_or(4096).max(1);
    n.div_ceil(to).saturating_mul(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(bytes: usize, numa_node: Option<u32>, hugepage_size: Option<u64>) -> RegionRequest {
        RegionRequest {
            bytes,
            numa_node,
            hugepage_size,
            lock: false,
            shareable: false,
        }
    }

    #[test]
    fn maps_writes_and_degrades_with_warnings() {
        let req = RegionRequest {
            lock: true,
            ..request(10_000, Some(0), None)
        };
        let (mut region, outcome) = MappedRegion::map(&req).expect("map");
        assert_eq!(region.len(), 12_288);
        region.as_mut_slice()[12_287] = 7;
        assert_eq!(region.as_slice()[12_287], 7);
        // Either the lock worked or there is a warning saying why not.
        assert!(outcome.locked || outcome.warnings.iter().any(|w| w.contains("lock")));
    }

    #[test]
    fn impossible_numa_node_and_hugepages_fall_back() {
        // 16 GiB pages exist on no machine this runs on.
        let req = request(4096, Some(1000), Some(16 << 30));
        let (region, outcome) = MappedRegion::map(&req).expect("map");
        assert_eq!(region.len(), 4096);
        assert_eq!(outcome.hugepage_size, None);
        assert!(!outcome.numa_bound);
        assert_eq!(outcome.warnings.len(), 2, "{:?}", outcome.warnings);
    }

    #[test]
    fn a_region_handed_to_the_transfer_engine_keeps_its_bytes() {
        let req = request(8192, Some(0), None);
        let (mut region, _) = MappedRegion::map(&req).expect("map");
        region.as_mut_slice()[5000] = 42;
        let addr = region.addr();
        let seg = region.into_transfer_segment().expect("segment");
        assert_eq!(
            (seg.addr(), seg.len()),
            (addr, 8192),
            "the very same mapping"
        );
        let mut b = [0u8; 1];
        seg.read_at(5000, &mut b).expect("read");
        assert_eq!(b, [42]);
        seg.write_at(8191, &[9]).expect("write");
        assert!(seg.write_at(8192, &[9]).is_err(), "bounds are checked");
    }

    #[test]
    fn a_shareable_region_hands_its_memfd_to_the_segment() {
        // 16 GiB huge pages exist nowhere: the memfd falls back to normal pages, still shared.
        let req = RegionRequest {
            shareable: true,
            ..request(10_000, None, Some(16 << 30))
        };
        let (mut region, outcome) = MappedRegion::map(&req).expect("map");
        assert!(region.is_shareable());
        assert_eq!((region.len(), outcome.hugepage_size), (12_288, None));
        assert_eq!(outcome.warnings.len(), 1, "{:?}", outcome.warnings);
        region.as_mut_slice()[12_000] = 5;
        let seg = region.into_transfer_segment().expect("segment");
        let fd = seg
            .shared_fd()
            .expect("shared")
            .try_clone_to_owned()
            .expect("dup");
        let peer = kvpool_transfer::Segment::map_fd(fd, 12_288).expect("a peer maps it");
        let mut b = [0u8; 1];
        peer.read_at(12_000, &mut b).expect("read");
        assert_eq!(b, [5], "the peer sees the region's pages");
        seg.write_at(7, &[3]).expect("write");
        peer.read_at(7, &mut b).expect("read");
        assert_eq!(b, [3]);
        // Private anonymous memory has nothing to share.
        let (plain, _) = MappedRegion::map(&request(4096, None, None)).expect("map");
        assert!(!plain.is_shareable());
        assert!(
            plain
                .into_transfer_segment()
                .expect("segment")
                .shared_fd()
                .is_none()
        );
    }

    #[test]
    fn file_segments_are_reserved_mapped_and_shared_with_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pool-ssd.dat");
        std::fs::write(&path, b"bytes from a previous run").expect("old");
        let seg = map_file_segment(&path, 1 << 20).expect("segment");
        assert_eq!(seg.len(), 1 << 20);
        let mut head = [0u8; 5];
        seg.read_at(0, &mut head).expect("read");
        assert_eq!(&head, b"bytes", "old contents are kept");
        let mut tail = [1u8; 5];
        seg.read_at((1 << 20) - 5, &mut tail).expect("read");
        assert_eq!(tail, [0; 5], "the extension reads as zeros");
        seg.write_at(4096, b"demoted").expect("write");
        drop(seg);
        let bytes = std::fs::read(&path).expect("file");
        assert_eq!(bytes.len(), 1 << 20);
        assert_eq!(bytes.get(4096..4103), Some(&b"demoted"[..]));
        // Reopened with a smaller capacity: cut, the kept prefix intact.
        let seg = map_file_segment(&path, 8192).expect("smaller");
        assert_eq!(seg.len(), 8192);
        let mut back = [0u8; 7];
        seg.read_at(4096, &mut back).expect("read");
        assert_eq!(&back, b"demoted");
        drop(seg);
        assert_eq!(std::fs::metadata(&path).expect("meta").len(), 8192);
        let bad = map_file_segment(&dir.path().join("no/such/dir/f"), 4096).expect_err("bad path");
        assert_eq!(bad.category(), "file");
    }

    #[test]
    fn file_regions_keep_their_bytes_across_mappings() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("dram0.dat");
        let req = request(10_000, Some(0), None);
        let (mut region, outcome) = MappedRegion::map_file(&req, &path, 4096).expect("map");
        assert_eq!(region.len(), 12_288);
        assert_eq!(outcome.hugepage_size, None);
        region.as_mut_slice()[9000] = 77;
        drop(region);
        // The bytes are in the file once unmapped, and a new mapping (another process after a
        // restart) sees them.
        assert_eq!(std::fs::read(&path).expect("file")[9000], 77);
        let (region, _) = MappedRegion::map_file(&req, &path, 4096).expect("remap");
        assert_eq!(region.as_slice()[9000], 77);
        let seg = region.into_transfer_segment().expect("segment");
        seg.write_at(100, &[5])
            .expect("write through the engine's view");
        drop(seg);
        assert_eq!(std::fs::read(&path).expect("file")[100], 5);
        let bad = MappedRegion::map_file(&req, &dir.path().join("no/dir/f"), 4096)
            .expect_err("missing directory");
        assert_eq!(bad.category(), "file");
    }

    #[test]
    fn zero_size_is_rejected() {
        let req = request(0, None, None);
        assert_eq!(
            MappedRegion::map(&req).expect_err("empty").category(),
            "empty"
        );
    }
}
