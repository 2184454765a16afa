//! libibverbs binding (cargo feature `rdma`). I/O boundary: verbs calls.

/// Number of RDMA devices visible to this process (0 when the kernel has no RDMA support).
pub fn device_count() -> usize {
    0
}
