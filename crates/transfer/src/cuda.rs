//! GPU memory for the transfer engine (cargo feature `cuda`), through cudarc with the CUDA
//! driver loaded at run time (a build with the feature runs on hosts without a driver: every
//! entry point checks [`cuda_available`] first).
//!
//! A GPU's own memory becomes a device segment ([`CudaMemory`], a
//! [`DeviceMemory`](crate::memory::device::DeviceMemory)): the engine never dereferences its
//! address on the host; payloads move between the device and pinned host staging buffers with
//! asynchronous copies on per-buffer CUDA streams, overlapped with the socket (see
//! `memory::device`). Memory comes from a caller (an engine's KV cache tensors, registered by
//! address through [`device_segment`]) or from [`GpuBuffer::alloc`]. A buffer can also become a
//! segment in CUDA managed memory ([`GpuBuffer::into_segment`]), reachable by host and GPU at
//! one address. GPUDirect RDMA of device memory is not implemented (docs/transfer.md).
//! I/O boundary: CUDA driver calls, and the GPU's sysfs `numa_node` file.

use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute, CUpointer_attribute};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError, result};
use parking_lot::Mutex;

use super::memory::device::{DeviceError, DeviceMemory, Staging};
use super::memory::{MemoryError, Segment};

/// Errors of GPU memory handling.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) or no GPU on this host")]
    Unavailable,
    #[error("CUDA driver call failed: {0:?}")]
    Driver(DriverError),
    #[error("making the segment failed")]
    Host(#[source] MemoryError),
    #[error(
        "GPU {0} cannot share managed memory with the host while it runs (no concurrent managed access)"
    )]
    NoConcurrentAccess(usize),
    #[error("address {ptr:#x} is not device memory of a GPU (host, managed or unknown memory)")]
    NotDeviceMemory { ptr: u64 },
    #[error(
        "device range {ptr:#x}+{len} runs past its allocation ({start:#x}+{size}); register \
         one allocation at a time"
    )]
    BeyondAllocation {
        ptr: u64,
        len: usize,
        start: u64,
        size: usize,
    },
}

impl CudaError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Whether the CUDA driver library can be loaded and reports at least one device. Must be
/// checked before any other cudarc call: cudarc panics when the library is missing.
pub fn cuda_available() -> bool {
    // SAFETY: is_culib_present only tries to dlopen the driver library and reports success.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    present && CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// One pointer attribute of `ptr` as a plain value of type `T` (the attribute's C type).
///
/// # Safety
/// `T` must be the C type of `attr` as the driver API documents it.
unsafe fn pointer_attribute<T: Default>(ptr: u64, attr: CUpointer_attribute) -> Option<T> {
    let mut value = T::default();
    // SAFETY: `value` is a live T of the attribute's type (caller's contract); the driver
    // only inspects `ptr`, never dereferences it.
    let rc = unsafe { sys::cuPointerGetAttribute((&raw mut value).cast(), attr, ptr) };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some(value)
}

/// The GPU whose own memory `ptr` points into, or None for host memory (pageable or pinned),
/// managed memory (the host can reach it at that address) and addresses the driver does not
/// know. None as well without a driver.
pub fn device_ordinal(ptr: u64) -> Option<u32> {
    if ptr == 0 || !cuda_available() || result::init().is_err() {
        return None;
    }
    // SAFETY: MEMORY_TYPE is an unsigned int (CUmemorytype), IS_MANAGED a bool-valued
    // unsigned int, DEVICE_ORDINAL an int.
    unsafe {
        let kind: u32 =
            pointer_attribute(ptr, CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return None;
        }
        let managed: u32 =
            pointer_attribute(ptr, CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED)
                .unwrap_or(0);
        if managed != 0 {
            return None;
        }
        let ordinal: i32 = pointer_attribute(
            ptr,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        )?;
        u32::try_from(ordinal).ok()
    }
}

/// The GPU's PCI address as sysfs names it (`0000:18:00.0`), from the driver.
fn pci_bus_id(ctx: &CudaContext) -> Result<String, CudaError> {
    let attr = |a| ctx.attribute(a).map_err(CudaError::Driver);
    let domain = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(format!("{domain:04x}:{bus:02x}:{device:02x}.0"))
}

/// Device memory of one GPU as a segment backing: `len` bytes at device address `base`,
/// borrowed from a caller or owned (a [`GpuBuffer`]'s allocation, freed with the last handle).
pub struct CudaMemory {
    ctx: Arc<CudaContext>,
    base: u64,
    len: usize,
    ordinal: u32,
    bus: Option<String>,
    /// Pinned staging buffers given back after use.
    pool: Mutex<Vec<Box<dyn Staging>>>,
    _owned: Option<CudaSlice<u8>>,
}

impl CudaMemory {
    /// At most this many idle staging buffers are kept per segment.
    const POOL_MAX: usize = 8;
}

impl DeviceMemory for CudaMemory {
    fn device_addr(&self) -> u64 {
        self.base
    }
    fn len(&self) -> usize {
        self.len
    }
    fn ordinal(&self) -> u32 {
        self.ordinal
    }
    fn pci_bus_id(&self) -> Option<String> {
        self.bus.clone()
    }
    fn staging(&self, len: usize) -> Result<Box<dyn Staging>, DeviceError> {
        let want = len.clamp(1, crate::memory::device::STAGING_CHUNK);
        {
            let mut pool = self.pool.lock();
            if let Some(i) = pool.iter().position(|s| s.capacity() >= want) {
                return Ok(pool.swap_remove(i));
            }
        }
        // New buffers are a whole chunk, so that they serve any later request.
        let cap = crate::memory::device::STAGING_CHUNK;
        PinnedStaging::new(&self.ctx, self.base, self.len, cap)
            .map(|s| Box::new(s) as Box<dyn Staging>)
            .map_err(|e| DeviceError::Staging {
                size: cap,
                why: e.to_string(),
            })
    }
    fn recycle(&self, staging: Box<dyn Staging>) {
        let mut pool = self.pool.lock();
        if pool.len() < Self::POOL_MAX {
            pool.push(staging);
        }
    }
}

/// A pinned host buffer with its own CUDA stream, copying to and from one device range.
struct PinnedStaging {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    host: NonNull<u8>,
    cap: usize,
    dev_base: u64,
    dev_len: usize,
}

// SAFETY: the pinned buffer is owned by this value and only touched through `&mut self`; the
// CUDA handles are usable from any thread once the context is bound (done before every call).
unsafe impl Send for PinnedStaging {}

impl PinnedStaging {
    fn new(
        ctx: &Arc<CudaContext>,
        dev_base: u64,
        dev_len: usize,
        cap: usize,
    ) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        // SAFETY: a fresh pinned allocation of `cap` bytes; freed in Drop with free_host.
        let raw = unsafe { result::malloc_host(cap, 0) }?;
        let host = NonNull::new(raw.cast::<u8>())
            .ok_or(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))?;
        Ok(PinnedStaging {
            ctx: ctx.clone(),
            stream,
            host,
            cap,
            dev_base,
            dev_len,
        })
    }

    /// The device address of `offset..offset+len`, checked against the device range and the
    /// buffer's capacity.
    fn device_range(&self, offset: u64, len: usize) -> Result<u64, DeviceError> {
        let inside = offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= self.dev_len as u64);
        if !inside || len > self.cap {
            return Err(DeviceError::Copy(format!(
                "range {offset}+{len} outside the device memory of {} bytes (staging {})",
                self.dev_len, self.cap
            )));
        }
        Ok(self.dev_base + offset)
    }

    fn host_slice(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: `host` is our pinned allocation of `cap >= len` bytes, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.host.as_ptr(), len) }
    }
}

fn copy_error(e: DriverError) -> DeviceError {
    DeviceError::Copy(format!("{e:?}"))
}

impl Staging for PinnedStaging {
    fn capacity(&self) -> usize {
        self.cap
    }
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        let len = len.min(self.cap);
        self.host_slice(len)
    }
    fn start_download(&mut self, offset: u64, len: usize) -> Result<(), DeviceError> {
        let src = self.device_range(offset, len)?;
        self.ctx.bind_to_thread().map_err(copy_error)?;
        let stream = self.stream.cu_stream();
        let dst = self.host_slice(len);
        // SAFETY: `src..src+len` lies in the registered device range (checked above; the
        // owner keeps it allocated while the segment lives); `dst` is pinned memory of this
        // buffer, not touched until `finish` (the `Staging` contract).
        unsafe { result::memcpy_dtoh_async(dst, src, stream) }.map_err(copy_error)
    }
    fn start_upload(&mut self, offset: u64, len: usize) -> Result<(), DeviceError> {
        let dst = self.device_range(offset, len)?;
        self.ctx.bind_to_thread().map_err(copy_error)?;
        let stream = self.stream.cu_stream();
        let src = self.host_slice(len);
        // SAFETY: as in `start_download`, the other way round.
        unsafe { result::memcpy_htod_async(dst, src, stream) }.map_err(copy_error)
    }
    fn finish(&mut self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(copy_error)
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // No copy may still read or write the buffer when it is freed.
        let _ = self.stream.synchronize();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` came from malloc_host and is freed once, after the stream drained.
        let _ = unsafe { result::free_host(self.host.as_ptr().cast()) };
    }
}

/// A device segment over `len` bytes of GPU memory at `ptr`, which a caller allocated (a
/// torch CUDA tensor's `data_ptr()`, for example). The caller keeps the memory allocated
/// until the segment is unregistered and dropped. Refused unless `ptr` is the device memory of
/// a GPU and `ptr..ptr+len` lies inside one allocation.
pub fn device_segment(ptr: u64, len: usize, sysfs_root: &Path) -> Result<Segment, CudaError> {
    let ordinal = device_ordinal(ptr).ok_or(CudaError::NotDeviceMemory { ptr })?;
    // SAFETY: RANGE_START_ADDR is a CUdeviceptr (u64), RANGE_SIZE a size_t.
    let (start, size) = unsafe {
        (
            pointer_attribute::<u64>(
                ptr,
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ),
            pointer_attribute::<usize>(ptr, CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE),
        )
    };
    let (start, size) = start.zip(size).ok_or(CudaError::NotDeviceMemory { ptr })?;
    let fits = (ptr - start)
        .checked_add(len as u64)
        .is_some_and(|end| end <= size as u64);
    if !fits {
        return Err(CudaError::BeyondAllocation {
            ptr,
            len,
            start,
            size,
        });
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(CudaError::Driver)?;
    memory_segment(ctx, ptr, len, ordinal, None, sysfs_root)
}

fn memory_segment(
    ctx: Arc<CudaContext>,
    base: u64,
    len: usize,
    ordinal: u32,
    owned: Option<CudaSlice<u8>>,
    sysfs_root: &Path,
) -> Result<Segment, CudaError> {
    let bus = pci_bus_id(&ctx).ok();
    let mem = CudaMemory {
        ctx,
        base,
        len,
        ordinal,
        bus,
        pool: Mutex::new(Vec::new()),
        _owned: owned,
    };
    Segment::device(Arc::new(mem), sysfs_root).map_err(CudaError::Host)
}

/// A device allocation on one GPU.
pub struct GpuBuffer {
    stream: Arc<CudaStream>,
    buf: CudaSlice<u8>,
    ordinal: usize,
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBuffer")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl GpuBuffer {
    /// Allocate `len` zeroed bytes on GPU `ordinal`.
    pub fn alloc(ordinal: usize, len: usize) -> Result<Self, CudaError> {
        if !cuda_available() {
            return Err(CudaError::Unavailable);
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::Driver)?;
        let stream = ctx.default_stream();
        let buf = stream.alloc_zeros::<u8>(len).map_err(CudaError::Driver)?;
        Ok(GpuBuffer {
            stream,
            buf,
            ordinal,
        })
    }

    /// The GPU's CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's PCI address as sysfs names it (`0000:18:00.0`), from the driver.
    pub fn pci_bus_id(&self) -> Result<String, CudaError> {
        pci_bus_id(self.stream.context())
    }

    /// The buffer as a device segment: its memory stays on the GPU and is reached through
    /// pinned staging (see [`CudaMemory`]); freed when the segment's last handle drops.
    pub fn into_device_segment(self, sysfs_root: &Path) -> Result<Segment, CudaError> {
        let ctx = self.stream.context().clone();
        let (base, sync) = self.buf.device_ptr(&self.stream);
        drop(sync);
        let len = self.buf.len();
        let ordinal = u32::try_from(self.ordinal).unwrap_or(u32::MAX);
        memory_segment(ctx, base, len, ordinal, Some(self.buf), sysfs_root)
    }

    /// Turn the buffer into a segment in CUDA managed memory of the same size (reachable from
    /// the host and from the GPU at one address); the device allocation is freed. The segment
    /// is tagged with the GPU's ordinal and NUMA node ([`Segment::device_memory`]). Needs a
    /// GPU with concurrent managed access (every data center GPU on Linux has it).
    pub fn into_segment(self, sysfs_root: &Path) -> Result<Segment, CudaError> {
        let ctx = self.stream.context().clone();
        let concurrent = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)
            .map_err(CudaError::Driver)?;
        if concurrent == 0 {
            return Err(CudaError::NoConcurrentAccess(self.ordinal));
        }
        let bdf = self.pci_bus_id()?;
        let len = self.buf.len();
        // SAFETY: u8 is valid for any bit pattern; the memory is filled by the copy below.
        let mut managed =
            unsafe { ctx.alloc_unified::<u8>(len, true) }.map_err(CudaError::Driver)?;
        self.stream
            .memcpy_dtod(&self.buf, &mut managed)
            .map_err(CudaError::Driver)?;
        self.stream.synchronize().map_err(CudaError::Driver)?;
        let ptr = managed
            .as_mut_slice()
            .map_err(CudaError::Driver)?
            .as_mut_ptr();
        let ptr = NonNull::new(ptr).ok_or(CudaError::Host(MemoryError::Allocate { size: len }))?;
        let gpu = u32::try_from(self.ordinal).unwrap_or(u32::MAX);
        // The managed allocation is freed when the segment's last reference drops.
        let release: Box<dyn FnOnce() + Send + Sync> = Box::new(move || drop(managed));
        // SAFETY: `ptr..ptr+len` is the managed allocation, valid for host reads and writes
        // (concurrent managed access checked above) until `release` drops it; the engine
        // touches it only through raw copies.
        unsafe { Segment::device_memory(ptr, len, gpu, &bdf, sysfs_root, Some(release)) }
            .map_err(CudaError::Host)
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{HostOptions, copy_between};

    #[test]
    fn no_driver_means_no_device_memory_and_clear_errors() {
        if cuda_available() {
            return; // The GPU test below covers a host with a driver.
        }
        let host = [0u8; 16];
        assert_eq!(device_ordinal(host.as_ptr() as u64), None);
        assert!(matches!(
            device_segment(host.as_ptr() as u64, 16, Path::new("/sys")),
            Err(CudaError::NotDeviceMemory { .. })
        ));
        assert!(matches!(
            GpuBuffer::alloc(0, 4096),
            Err(CudaError::Unavailable)
        ));
    }

    #[test]
    fn gpu_round_trip_or_skip() {
        if !cuda_available() {
            eprintln!(
                "SKIP: no CUDA device (no libcuda driver library, or no GPU visible to this process)"
            );
            return;
        }
        let seg = Segment::host(8 << 20, HostOptions::default()).unwrap();
        let data: Vec<u8> = (0..(6 << 20)).map(|i| (i % 251) as u8).collect();
        seg.write_at(0, &data).unwrap();
        let gpu = GpuBuffer::alloc(0, 8 << 20).unwrap();
        let bdf = gpu.pci_bus_id().unwrap();
        let dev = gpu.into_device_segment(Path::new("/sys")).unwrap();
        assert_eq!(dev.gpu_device(), Some(0));
        assert_eq!(device_ordinal(dev.addr() as u64), Some(0));
        // Host -> device -> host through pinned staging, more than one chunk.
        copy_between(&seg, 0, &dev, 1000, data.len()).unwrap();
        copy_between(&dev, 1000, &seg, 1 << 20, data.len()).unwrap();
        let mut out = vec![0u8; data.len()];
        seg.read_at(1 << 20, &mut out).unwrap();
        assert!(out == data);
        assert!(copy_between(&seg, 0, &dev, (8 << 20) - 10, 11).is_err());
        eprintln!("GPU 0 at {bdf}");
    }
}
