//! GPU memory for the transfer engine (cargo feature `cuda`), through cudarc with the CUDA
//! driver loaded at run time. Device buffers are staged through registered host segments:
//! TCP and shared memory can only move host bytes (GPUDirect RDMA registration is future work,
//! see docs/transfer.md). I/O boundary: CUDA driver calls.

use std::sync::Arc;

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
        Ok(GpuBuffer { stream, buf })
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
    }
}
