//! Registered memory: the RAII owner of a byte region that the transfer engine shares with remote
//! peers, and the raw copy/socket primitives that move bytes in and out of it.
//! I/O boundary: `mmap`/`mlock`/`memfd_create`, `recv`/`send` on borrowed socket fds, and
//! adopting descriptors received with SCM_RIGHTS. Apart from the FFI modules (`rdma::verbs`,
//! `cuda`), this is the only module of the transfer engine that contains `unsafe`.
//!
//! # Memory model
//! A [`Segment`] is memory shared with other parties: remote peers write into it and read from it
//! at any time while it is registered, exactly like a `MAP_SHARED` mapping shared with another
//! process. The engine therefore never hands out Rust references (`&[u8]` / `&mut [u8]`) to
//! segment bytes: every access is a bounds-checked raw copy (`ptr::copy`, `recv` into a raw
//! pointer, `send` from a raw pointer). Overlapping concurrent transfers on the same range give
//! unspecified *bytes* (the last writer wins per byte), never memory unsafety on the Rust side;
//! callers that need a consistent view coordinate at a higher level (the master's leases).
//! The memory itself stays valid while anyone holds the `Arc<Segment>`: in-flight transfers hold
//! a clone, so unregistering or dropping the owner's handle mid-transfer cannot free it.

use std::alloc::Layout;
use std::io;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use nix::libc;

mod between;
mod checked;
pub mod device;
mod numa;
mod prefault;
mod shared;
mod socket;

pub(crate) use between::adopt_received_fds;
pub use between::{BatchCopy, copy_between, copy_between_in, vouch_copies};
pub use checked::{Check as CallerMemory, copy as checked_copy};
pub use numa::{NumaNodeError, numa_node_file, parse_numa_node, pci_numa_node};
pub(crate) use socket::{Span, recv_spans, send_spans};

/// Alignment of engine-allocated buffers: a page, which also suits O_DIRECT and RDMA.
pub const SEGMENT_ALIGN: usize = 4096;

/// Errors of segment allocation and access.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum MemoryError {
    #[error("segment size must be > 0 and at most {max} bytes, got {size}")]
    InvalidSize { size: usize, max: usize },
    #[error("allocating {size} bytes of aligned memory failed")]
    Allocate { size: usize },
    #[error("mlock of {size} bytes failed (check RLIMIT_MEMLOCK / CAP_IPC_LOCK)")]
    #[strum(serialize = "mlock")]
    Lock {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("creating memfd segment {name:?} of {size} bytes failed")]
    Memfd {
        name: String,
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("mapping {size} bytes failed")]
    #[strum(serialize = "mmap")]
    Map {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("shared file descriptor holds {actual} bytes, fewer than the {expected} announced")]
    ShortFd { expected: usize, actual: u64 },
    #[error("range offset {offset} + length {len} is outside the segment of {size} bytes")]
    OutOfBounds { offset: u64, len: u64, size: usize },
    #[error("segment memory is on device {ordinal}: the host reaches it only through staging")]
    OnDevice { ordinal: u32 },
    #[error("device memory: {0}")]
    Device(#[from] device::DeviceError),
    #[error("staged copy of device memory failed: {0}")]
    Staged(#[source] io::Error),
    #[error("caller memory is not mapped for this copy (unmapped since it was registered?): {0}")]
    Fault(#[source] io::Error),
}

impl MemoryError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Largest single segment: 1 TiB, far above any node's DRAM tier, small enough that
/// `offset + len` arithmetic on `u64` can never overflow after validation.
pub const MAX_SEGMENT_SIZE: usize = 1 << 40;

/// Options for engine-allocated host memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOptions {
    /// Pin the pages in RAM (`mlock`) so they are never swapped out under a transfer.
    pub lock: bool,
}

enum Backing {
    /// `std::alloc` allocation with this layout, freed on drop.
    Heap(Layout),
    /// A memory mapping (anonymous, caller-provided, or a memfd), unmapped on drop.
    Mmap {
        _map: memmap2::MmapMut,
        /// The memfd behind the mapping, when there is one: it can be shared with a process on
        /// the same node.
        fd: Option<OwnedFd>,
    },
    /// Memory owned elsewhere; `release` runs on drop.
    Foreign {
        release: Option<Box<dyn FnOnce() + Send + Sync>>,
        /// The shareable file behind the memory (a memfd, a tmpfs or hugetlbfs file mapped
        /// from offset 0), when its owner gave one ([`Segment::with_shared_fd`]).
        fd: Option<OwnedFd>,
    },
    /// Memory on a device, reached only through its staging copies (`ptr` is the device
    /// address, never dereferenced).
    Device(std::sync::Arc<dyn device::DeviceMemory>),
}

/// A contiguous byte region that can be registered with the transfer engine.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    locked: bool,
    /// NUMA node the pages are known to be on (set by the owner, see [`Segment::on_numa_node`]).
    numa_node: Option<u32>,
    /// The GPU (CUDA ordinal) the memory belongs to, see [`Segment::on_gpu`].
    gpu_device: Option<u32>,
    backing: Backing,
    /// A peer's memfd mapped here ([`Segment::map_fd`]): page-table entries filled a chunk at a
    /// time ahead of the copies.
    prefault: Option<prefault::Prefault>,
}

// SAFETY: a Segment is a pointer to memory it owns (or that its creator promised stays valid
// until `release`); no thread-affine state is involved. All byte access goes through raw copies
// (see the module's memory model), so sharing `&Segment` across threads creates no Rust
// references that could alias mutably.
unsafe impl Send for Segment {}
// SAFETY: see `Send` above; `&Segment` only permits bounds-checked raw copies.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.backing {
            Backing::Heap(_) => "heap",
            Backing::Mmap { fd: Some(_), .. } => "memfd",
            Backing::Mmap { fd: None, .. } => "mmap",
            Backing::Foreign { fd: Some(_), .. } => "foreign-shared",
            Backing::Foreign { fd: None, .. } => "foreign",
            Backing::Device(_) => "device",
        };
        f.debug_struct("Segment")
            .field("len", &self.len)
            .field("kind", &kind)
            .field("locked", &self.locked)
            .field("numa_node", &self.numa_node)
            .field("gpu_device", &self.gpu_device)
            .finish()
    }
}

fn check_size(size: usize) -> Result<(), MemoryError> {
    if size == 0 || size > MAX_SEGMENT_SIZE {
        return Err(MemoryError::InvalidSize {
            size,
            max: MAX_SEGMENT_SIZE,
        });
    }
    Ok(())
}

impl Segment {
    /// Zeroed, page-aligned host memory from the global allocator.
    pub fn host(size: usize, options: HostOptions) -> Result<Self, MemoryError> {
        check_size(size)?;
        let layout = Layout::from_size_align(size, SEGMENT_ALIGN)
            .map_err(|_| MemoryError::Allocate { size })?;
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemoryError::Allocate { size })?;
        let mut seg = Segment {
            ptr,
            len: size,
            locked: false,
            numa_node: None,
            gpu_device: None,
            backing: Backing::Heap(layout),
            prefault: None,
        };
        if options.lock {
            seg.lock()?;
        }
        Ok(seg)
    }

    /// Wrap a mapping the caller made and placed (for example an anonymous mapping bound to a
    /// NUMA node with `mbind`, or a hugetlbfs file). The mapping is unmapped when the segment
    /// drops.
    pub fn from_mmap(mut map: memmap2::MmapMut, options: HostOptions) -> Result<Self, MemoryError> {
        let len = map.len();
        check_size(len)?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or(MemoryError::Allocate { size: len })?;
        let mut seg = Segment {
            ptr,
            len,
            locked: false,
            numa_node: None,
            gpu_device: None,
            backing: Backing::Mmap {
                _map: map,
                fd: None,
            },
            prefault: None,
        };
        if options.lock {
            seg.lock()?;
        }
        Ok(seg)
    }

    /// Wrap memory owned elsewhere (a GPU-pinned host buffer, a region inside a larger arena).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, not be accessed through Rust
    /// references while the segment exists, and stay valid until `release` runs (called once,
    /// when the last `Arc<Segment>` drops).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        release: Option<Box<dyn FnOnce() + Send + Sync>>,
    ) -> Result<Self, MemoryError> {
        check_size(len)?;
        Ok(Segment {
            ptr,
            len,
            locked: false,
            numa_node: None,
            gpu_device: None,
            backing: Backing::Foreign { release, fd: None },
            prefault: None,
        })
    }

    /// A segment over device memory (a GPU's own memory): every access stages through the
    /// device's copies ([`device::stream_out`], [`device::stream_in`]), none dereferences its
    /// address on the host. Tagged with the device's ordinal, and with the NUMA node of its PCI
    /// address under `sysfs_root` when the device knows its address.
    pub fn device(
        mem: std::sync::Arc<dyn device::DeviceMemory>,
        sysfs_root: &std::path::Path,
    ) -> Result<Self, MemoryError> {
        let len = mem.len();
        check_size(len)?;
        // The address is only announced (descriptors, RDMA registration), never dereferenced:
        // `ptr_at` refuses device segments.
        let ptr = NonNull::new(mem.device_addr() as *mut u8).ok_or(MemoryError::OnDevice {
            ordinal: mem.ordinal(),
        })?;
        let gpu = mem.ordinal();
        let bus = mem.pci_bus_id();
        let seg = Segment {
            ptr,
            len,
            locked: false,
            numa_node: None,
            gpu_device: Some(gpu),
            backing: Backing::Device(mem),
            prefault: None,
        };
        Ok(match bus {
            Some(bdf) => seg.on_gpu(gpu, &bdf, sysfs_root),
            None => seg,
        })
    }

    /// The device memory behind the segment, for a device segment ([`Self::device`]).
    pub fn device_memory_backing(&self) -> Option<&dyn device::DeviceMemory> {
        match &self.backing {
            Backing::Device(mem) => Some(mem.as_ref()),
            _ => None,
        }
    }

    /// Wrap memory that belongs to GPU `gpu` (CUDA ordinal) at PCI address `pci_bus_id`:
    /// memory the GPU computes on that the host can also reach (CUDA managed memory, or a
    /// pinned host buffer mapped for the device). Its NUMA node is the GPU's, read from
    /// `<sysfs_root>/bus/pci/devices/<pci_bus_id>/numa_node` (see [`Self::on_gpu`]).
    ///
    /// # Safety
    /// As [`Self::from_raw_parts`]: `ptr..ptr+len` must be valid for host reads and writes
    /// until `release` runs.
    pub unsafe fn device_memory(
        ptr: NonNull<u8>,
        len: usize,
        gpu: u32,
        pci_bus_id: &str,
        sysfs_root: &std::path::Path,
        release: Option<Box<dyn FnOnce() + Send + Sync>>,
    ) -> Result<Self, MemoryError> {
        // SAFETY: the caller upholds `from_raw_parts`'s contract (same words as ours).
        let seg = unsafe { Self::from_raw_parts(ptr, len, release) }?;
        Ok(seg.on_gpu(gpu, pci_bus_id, sysfs_root))
    }

    /// Say that the memory belongs to GPU `gpu` (CUDA ordinal) at PCI address `pci_bus_id`, and
    /// take the NUMA node from the GPU's sysfs entry under `sysfs_root` (normally `/sys`). When
    /// sysfs has no answer (no such device, a malformed file, `-1`) the segment is announced as
    /// unbound, with a warning. Its descriptor then says `memory: gpu` and `gpu_device`, and
    /// lists the NICs on the GPU's NUMA node.
    pub fn on_gpu(mut self, gpu: u32, pci_bus_id: &str, sysfs_root: &std::path::Path) -> Self {
        self.gpu_device = Some(gpu);
        self.numa_node = match pci_numa_node(sysfs_root, pci_bus_id) {
            Ok(node) => node,
            Err(e) => {
                tracing::warn!(gpu, pci_bus_id, error = %e,
                    "NUMA node of the GPU unknown; its segment is announced as unbound");
                None
            }
        };
        self
    }

    /// The GPU the memory belongs to (CUDA ordinal), if [`Self::on_gpu`] said so.
    pub fn gpu_device(&self) -> Option<u32> {
        self.gpu_device
    }

    fn lock(&mut self) -> Result<(), MemoryError> {
        // SAFETY: ptr..ptr+len is a live allocation owned by self.
        let rc = unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            return Err(MemoryError::Lock {
                size: self.len,
                source: io::Error::last_os_error(),
            });
        }
        self.locked = true;
        Ok(())
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-sized segments are rejected at creation.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the pages are pinned with `mlock`.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Say which NUMA node the pages are on, as the owner verified it (`None`: unknown or
    /// spread). RDMA transfers of this segment go out through NICs on that node when there are
    /// any, and its descriptor announces the node.
    pub fn on_numa_node(mut self, node: Option<u32>) -> Self {
        self.numa_node = node;
        self
    }

    /// The NUMA node given by [`Self::on_numa_node`].
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// Start address, for registering the region with a NIC (RDMA memory registration).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Check that `offset..offset+len` lies inside the segment.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), MemoryError> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(MemoryError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Raw pointer to `offset` after checking `offset..offset+len`; refused for device
    /// memory, which the host must not dereference.
    fn ptr_at(&self, offset: u64, len: usize) -> Result<*mut u8, MemoryError> {
        self.check_range(offset, len as u64)?;
        if let Backing::Device(mem) = &self.backing {
            return Err(MemoryError::OnDevice {
                ordinal: mem.ordinal(),
            });
        }
        // SAFETY: offset + len <= self.len was checked, so the result stays inside (or one past
        // the end of) the allocation; offset fits in usize because it is <= self.len.
        Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
    }

    /// Copy `data` into the segment at `offset` (owner-side access).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemoryError> {
        if let Some(dev) = self.device_memory_backing() {
            self.check_range(offset, data.len() as u64)?;
            let mut at = 0;
            return device::stream_in(dev, offset, data.len(), |buf| {
                buf.copy_from_slice(&data[at..at + buf.len()]);
                at += buf.len();
                Ok(())
            })
            .map_err(MemoryError::Staged);
        }
        let dst = self.ptr_at(offset, data.len())?;
        // SAFETY: dst..dst+len is inside the segment (checked); `data` is a separate Rust
        // slice, so the ranges cannot overlap unless the caller built `data` from segment bytes
        // through unsafe code, which the memory model forbids.
        unsafe { self.copy_raw(dst, data.as_ptr(), data.len(), checked::Check::DST) }
    }

    /// Copy bytes at `offset` out of the segment into `out` (owner-side access).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), MemoryError> {
        if let Some(dev) = self.device_memory_backing() {
            self.check_range(offset, out.len() as u64)?;
            let mut at = 0;
            return device::stream_out(dev, offset, out.len(), |buf| {
                out[at..at + buf.len()].copy_from_slice(buf);
                at += buf.len();
                Ok(())
            })
            .map_err(MemoryError::Staged);
        }
        let src = self.ptr_at(offset, out.len())?;
        // SAFETY: src..src+len is inside the segment (checked); `out` is a distinct Rust slice;
        // caller memory is copied by the kernel, which checks that it is still mapped.
        unsafe { self.copy_raw(out.as_mut_ptr(), src, out.len(), checked::Check::SRC) }
    }

    /// Whether the memory belongs to someone else (a caller's registered buffer), which may
    /// have been unmapped behind the segment's back.
    fn is_foreign(&self) -> bool {
        matches!(self.backing, Backing::Foreign { .. })
    }

    /// Copy `len` bytes from `src` to `dst`, one of which lies in this segment (`side` says
    /// which): through the kernel's checked copy for caller memory (`memory::checked`), a
    /// plain copy otherwise.
    ///
    /// # Safety
    /// Both ranges are valid for the copy, apart from caller memory that may have been
    /// unmapped (which the kernel checks); they overlap only if equal.
    unsafe fn copy_raw(
        &self,
        dst: *mut u8,
        src: *const u8,
        len: usize,
        side: checked::Check,
    ) -> Result<(), MemoryError> {
        if self.is_foreign() {
            // SAFETY: the caller's contract; the kernel checks this segment's side.
            return unsafe { checked::copy(dst, src, len, side) }.map_err(MemoryError::Fault);
        }
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src, dst, len) };
        Ok(())
    }

    /// Fill `offset..offset+len` with `byte`.
    pub fn fill(&self, offset: u64, len: usize, byte: u8) -> Result<(), MemoryError> {
        if let Some(dev) = self.device_memory_backing() {
            self.check_range(offset, len as u64)?;
            return device::stream_in(dev, offset, len, |buf| {
                buf.fill(byte);
                Ok(())
            })
            .map_err(MemoryError::Staged);
        }
        let dst = self.ptr_at(offset, len)?;
        // SAFETY: dst..dst+len is inside the segment (checked).
        unsafe { std::ptr::write_bytes(dst, byte, len) };
        Ok(())
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.locked {
            // SAFETY: the region is still live; unlocking cannot fail in a way we could handle.
            unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.len) };
        }
        match &mut self.backing {
            Backing::Heap(layout) => {
                // SAFETY: ptr was returned by alloc_zeroed with exactly this layout, and no
                // transfer can still use it: transfers hold an Arc<Segment>, and we are in the
                // drop of the last one.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) }
            }
            Backing::Mmap { .. } => {} // MmapMut unmaps itself.
            Backing::Device(_) => {}   // The device memory frees itself with its last handle.
            Backing::Foreign { release, .. } => {
                if let Some(release) = release.take() {
                    release();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_segment_is_aligned_zeroed_and_bounds_checked() {
        let seg = Segment::host(10_000, HostOptions::default()).unwrap();
        assert_eq!(seg.addr() % SEGMENT_ALIGN, 0);
        let mut out = vec![1u8; 100];
        seg.read_at(9_900, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        seg.write_at(5, b"hello").unwrap();
        let mut got = [0u8; 5];
        seg.read_at(5, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert!(matches!(
            seg.write_at(9_999, b"ab"),
            Err(MemoryError::OutOfBounds { .. })
        ));
        assert!(seg.check_range(u64::MAX, 2).is_err());
        assert!(seg.check_range(10_000, 0).is_ok());
        assert!(Segment::host(0, HostOptions::default()).is_err());
    }

    #[test]
    fn memfd_segments_share_pages_through_the_fd() {
        let a = Segment::memfd("t", 8192, HostOptions::default()).unwrap();
        let fd = a.shared_fd().unwrap().try_clone_to_owned().unwrap();
        let b = Segment::map_fd(fd, 8192).unwrap();
        a.write_at(4000, b"shared").unwrap();
        let mut got = [0u8; 6];
        b.read_at(4000, &mut got).unwrap();
        assert_eq!(&got, b"shared");
        copy_between(&b, 4000, &a, 0, 6).unwrap();
        a.read_at(0, &mut got).unwrap();
        assert_eq!(&got, b"shared");
        let fd = a.shared_fd().unwrap().try_clone_to_owned().unwrap();
        assert!(matches!(
            Segment::map_fd(fd, 16384),
            Err(MemoryError::ShortFd { .. })
        ));
    }

    #[test]
    fn a_peer_mapping_fills_each_chunk_once_before_its_first_copy() {
        let len = 2 * prefault::CHUNK + 8192;
        let owner = Segment::memfd("p", len, HostOptions::default()).unwrap();
        let fd = owner.shared_fd().unwrap().try_clone_to_owned().unwrap();
        let peer = Segment::map_fd(fd, len).unwrap();
        let local = Segment::host(8192, HostOptions::default()).unwrap();
        local.write_at(0, b"through the mapping").unwrap();
        let filled = |at: usize| peer.prefault.as_ref().unwrap().is_filled(at);
        assert!(!filled(0) && !filled(prefault::CHUNK));
        // A copy across the boundary of chunks 0 and 1 fills both, and only those.
        let at = prefault::CHUNK as u64 - 5;
        copy_between(&local, 0, &peer, at, 19).unwrap();
        assert!(filled(0) && filled(prefault::CHUNK) && !filled(2 * prefault::CHUNK));
        let mut got = [0u8; 19];
        owner.read_at(at, &mut got).unwrap();
        assert_eq!(&got, b"through the mapping");
        // The last, short chunk too; a range outside the segment is refused, not filled.
        copy_between(&peer, len as u64 - 10, &local, 0, 10).unwrap();
        assert!(filled(len - 1));
        assert!(copy_between(&local, 0, &peer, len as u64, 1).is_err());
        assert!(
            Segment::host(4096, HostOptions::default())
                .unwrap()
                .prefault
                .is_none()
        );
    }

    #[test]
    fn foreign_memory_shares_the_file_it_was_given() {
        let owner = Segment::memfd("f", 8192, HostOptions::default()).unwrap();
        let fd = || owner.shared_fd().unwrap().try_clone_to_owned().unwrap();
        let ptr = NonNull::new(owner.addr() as *mut u8).unwrap();
        // SAFETY: `owner` maps these 8192 bytes and outlives every segment made here.
        let plain = unsafe { Segment::from_raw_parts(ptr, 8192, None) }.unwrap();
        assert!(plain.shared_fd().is_none());
        let shared = plain.with_shared_fd(fd()).unwrap();
        let peer = Segment::map_fd(
            shared.shared_fd().unwrap().try_clone_to_owned().unwrap(),
            8192,
        )
        .unwrap();
        shared.write_at(100, b"same pages").unwrap();
        let mut got = [0u8; 10];
        peer.read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"same pages");
        // A file shorter than the memory would let a peer fault past its end.
        // SAFETY: as above.
        let longer = unsafe { Segment::from_raw_parts(ptr, 8192, None) }.unwrap();
        let short = Segment::memfd("s", 4096, HostOptions::default()).unwrap();
        let e = longer
            .with_shared_fd(short.shared_fd().unwrap().try_clone_to_owned().unwrap())
            .unwrap_err();
        assert!(
            matches!(
                e,
                MemoryError::ShortFd {
                    expected: 8192,
                    actual: 4096
                }
            ),
            "{e}"
        );
        drop(shared);
        drop(owner);
    }

    #[test]
    fn locked_segment_reports_lock_or_a_clear_error() {
        match Segment::host(4096, HostOptions { lock: true }) {
            Ok(seg) => assert!(seg.is_locked()),
            Err(e) => assert_eq!(e.category(), "mlock"),
        }
    }
}
