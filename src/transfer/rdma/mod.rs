//! RDMA transport: device discovery and GID choice from sysfs, NIC ranking by topology, slice
//! striping across NICs and the retry/fallback state machine (pure, tested with fixture trees),
//! plus the verbs binding behind cargo feature `rdma`.
//! I/O boundary: reading sysfs under a configurable root; libibverbs calls in `verbs`.

pub mod plan;
pub mod topology;
#[cfg(feature = "rdma")]
pub mod verbs;

/// Whether an RDMA data path can be used by this process: the feature is compiled in and a
/// device is present.
pub fn transport_available() -> bool {
    #[cfg(feature = "rdma")]
    {
        verbs::device_count() > 0
    }
    #[cfg(not(feature = "rdma"))]
    {
        false
    }
}
