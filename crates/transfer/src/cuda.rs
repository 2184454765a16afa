//! GPU memory for the transfer engine (cargo feature `cuda`), through cudarc with the CUDA
//! driver loaded at run time. Device buffers are staged through registered host segments:
//! TCP and shared memory can only move host bytes (GPUDirect RDMA registration is future work,
//! see docs/transfer.md); or a buffer becomes a segment itself in CUDA managed memory
//! ([`GpuBuffer::into_segment`]), tagged with its GPU and the GPU's NUMA node from sysfs.
//! I/O boundary: CUDA driver calls, and the GPU's sysfs `numa_node` file.

use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};

use super::memory::{MemoryError, Segment};

/// Errors of GPU memory handling.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) or no GPU on this host")]
    Unavailable,
    #[error("CUDA driver call failed: {0:?}")]
    Driver(DriverError),
    #[error("staging through the host segment failed")]
    Host(#[source] MemoryError),
    #[error(
        "GPU {0} cannot share managed memory with the host while it runs (no concurrent managed access)"
    )]
    NoConcurrentAccess(usize),
    #[error("device range offset {offset} + length {len} exceeds the buffer of {size} bytes")]
    OutOfBounds {
        offset: usize,
        len: usize,
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
        let ctx = self.stream.context();
        let attr = |a| ctx.attribute(a).map_err(CudaError::Driver);
        let domain = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
        let bus = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
        let device = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
        Ok(format!("{domain:04x}:{bus:02x}:{device:02x}.0"))
    }

    /// Turn the buffer into a segment the transfer engine can register and serve: its bytes
    /// move into CUDA managed memory of the same size (reachable from the host and from the
    /// GPU at one address) and the device allocation is freed. The segment is tagged with the
    /// GPU's ordinal and the GPU's NUMA node from `<sysfs_root>/bus/pci/devices/<bdf>/numa_node`
    /// ([`Segment::device_memory`]), so its descriptor lists the NICs on that node. Needs a GPU
    /// with concurrent managed access (host and GPU touching the memory at once; every data
    /// center GPU on Linux has it).
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

    fn check(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.buf.len() => Ok(()),
            _ => Err(CudaError::OutOfBounds {
                offset,
                len,
                size: self.buf.len(),
            }),
        }
    }

    /// Copy `len` bytes from `seg[seg_offset..]` to the device at `dev_offset`.
    pub fn upload(
        &mut self,
        seg: &Segment,
        seg_offset: u64,
        dev_offset: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check(dev_offset, len)?;
        let mut staging = vec![0u8; len];
        seg.read_at(seg_offset, &mut staging)
            .map_err(CudaError::Host)?;
        let mut view = self.buf.slice_mut(dev_offset..dev_offset + len);
        self.stream
            .memcpy_htod(&staging, &mut view)
            .map_err(CudaError::Driver)?;
        self.stream.synchronize().map_err(CudaError::Driver)
    }

    /// Copy `len` device bytes at `dev_offset` into `seg[seg_offset..]`.
    pub fn download(
        &self,
        dev_offset: usize,
        seg: &Segment,
        seg_offset: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        self.check(dev_offset, len)?;
        seg.check_range(seg_offset, len as u64)
            .map_err(CudaError::Host)?;
        let mut staging = vec![0u8; len];
        let view = self.buf.slice(dev_offset..dev_offset + len);
        self.stream
            .memcpy_dtoh(&view, &mut staging)
            .map_err(CudaError::Driver)?;
        self.stream.synchronize().map_err(CudaError::Driver)?;
        seg.write_at(seg_offset, &staging).map_err(CudaError::Host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostOptions;

    #[test]
    fn gpu_round_trip_or_skip() {
        if !cuda_available() {
            eprintln!(
                "SKIP: no CUDA device (no libcuda driver library, or no GPU visible to this process)"
            );
            return;
        }
        let seg = Segment::host(8192, HostOptions::default()).unwrap();
        seg.write_at(100, b"to the gpu and back").unwrap();
        let mut gpu = GpuBuffer::alloc(0, 4096).unwrap();
        gpu.upload(&seg, 100, 1000, 19).unwrap();
        gpu.download(1000, &seg, 5000, 19).unwrap();
        let mut out = [0u8; 19];
        seg.read_at(5000, &mut out).unwrap();
        assert_eq!(&out, b"to the gpu and back");
        assert!(gpu.upload(&seg, 0, 4090, 10).is_err());
        // The buffer as a segment: the same bytes, readable from the host, tagged with the
        // GPU and its NUMA node as sysfs says.
        let bdf = gpu.pci_bus_id().unwrap();
        let want_numa = crate::memory::pci_numa_node(Path::new("/sys"), &bdf)
            .ok()
            .flatten();
        let managed = match gpu.into_segment(Path::new("/sys")) {
            Ok(s) => s,
            Err(CudaError::NoConcurrentAccess(_)) => {
                eprintln!("SKIP into_segment: no concurrent managed access on GPU 0");
                return;
            }
            Err(e) => panic!("into_segment: {e}"),
        };
        assert_eq!(
            (managed.gpu_device(), managed.numa_node()),
            (Some(0), want_numa)
        );
        managed.read_at(1000, &mut out).unwrap();
        assert_eq!(&out, b"to the gpu and back");
        eprintln!("GPU 0 at {bdf} on NUMA node {want_numa:?}");
    }
}
