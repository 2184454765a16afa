//! Caller memory on a GPU: with feature `cuda`, a registered address that is a GPU's own
//! memory (a torch CUDA tensor's `data_ptr()`) becomes a device segment of the transfer
//! engine, reached only through the device's copies into pinned staging buffers; the host
//! never dereferences it. Without the feature, or without a driver, every address is host
//! memory. I/O boundary: the CUDA driver's pointer queries (feature `cuda`).

use std::sync::Arc;

use kvpool_transfer::Segment;

use crate::errors::Failure;

/// Whether `register_buffer` accepts a GPU's own memory (a CUDA tensor's `data_ptr()`) and
/// moves it through pinned staging with no host copy of the caller's: true in a build with
/// feature `cuda` on a host whose CUDA driver reports a GPU.
#[pyo3::pyfunction]
pub fn device_memory_supported() -> bool {
    supported()
}

/// Whether this build can register GPU memory and a driver with a GPU is present.
pub fn supported() -> bool {
    #[cfg(feature = "cuda")]
    {
        kvpool_transfer::cuda::cuda_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The device segment over `ptr..ptr+len` when that is a GPU's own memory; None for host
/// memory (pageable, pinned or managed). An address on a GPU that does not hold the whole
/// range in one allocation is refused.
pub fn segment(ptr: usize, len: usize) -> Result<Option<Arc<Segment>>, Failure> {
    #[cfg(feature = "cuda")]
    {
        use kvpool_transfer::cuda;
        if cuda::device_ordinal(ptr as u64).is_none() {
            return Ok(None);
        }
        cuda::device_segment(ptr as u64, len, std::path::Path::new("/sys"))
            .map(|s| Some(Arc::new(s)))
            .map_err(|e| Failure::invalid(format!("GPU buffer {ptr:#x}+{len}: {e}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ptr, len);
        Ok(None)
    }
}
