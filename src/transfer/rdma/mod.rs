//! RDMA transport: device discovery and GID choice from sysfs, NIC ranking by topology, slice
//! striping across NICs and the retry/fallback state machine (pure, tested with fixture trees),
//! the queue-pair handshake encoding, the data path over a narrow verbs interface (with an
//! in-process fake fabric for tests), and the libibverbs binding behind cargo feature `rdma`.
//! I/O boundary: reading sysfs under a configurable root; libibverbs calls in `verbs`; the
//! control connection of the handshake in `datapath`.

pub mod datapath;
pub mod fake;
pub mod handshake;
pub mod plan;
#[cfg(feature = "rdma")]
pub mod provider;
pub mod topology;
#[cfg(feature = "rdma")]
pub mod verbs;

use std::sync::Arc;

pub use datapath::{RdmaError, RdmaProvider};

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

/// The host's RDMA devices (from `/sys` and libibverbs), or why there are none. Without the
/// `rdma` feature this is always `NoDevice`.
pub fn default_provider() -> Result<Arc<dyn RdmaProvider>, RdmaError> {
    #[cfg(feature = "rdma")]
    {
        let p = provider::VerbsProvider::discover(std::path::Path::new("/sys"), None, &[], None)?;
        Ok(Arc::new(p))
    }
    #[cfg(not(feature = "rdma"))]
    {
        Err(RdmaError::NoDevice)
    }
}
