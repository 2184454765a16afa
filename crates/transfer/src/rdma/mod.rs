//! RDMA transport: device discovery and GID choice from sysfs, NIC ranking by topology, slice
//! striping across NICs and the retry/fallback state machine (pure, tested with fixture trees),
//! the queue-pair handshake encoding, the data path over a narrow verbs interface (with an
//! in-process fake fabric for tests), and the libibverbs binding behind cargo feature `rdma`.
//! I/O boundary: reading sysfs under a configurable root; libibverbs calls in `verbs`; the
//! control connection of the handshake in `datapath`.

pub mod address;
pub mod datapath;
pub mod fake;
pub mod handshake;
pub mod plan;
#[cfg(feature = "rdma")]
pub mod provider;
pub mod select;
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

/// The host's RDMA devices (from `sysfs_root` and libibverbs) chosen by `policy` (see
/// [`select`]), or why there are none. Without the `rdma` feature this is always `NoDevice`.
pub fn default_provider(
    sysfs_root: &std::path::Path,
    policy: &select::NicPolicy,
) -> Result<Arc<dyn RdmaProvider>, RdmaError> {
    #[cfg(feature = "rdma")]
    {
        let p = provider::VerbsProvider::discover(sysfs_root, policy)?;
        Ok(Arc::new(p))
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (sysfs_root, policy);
        Err(RdmaError::NoDevice)
    }
}

/// An engine's transport as the agent reports it to the master (and the operator turns into the
/// `TransportDegraded` condition). Pure.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransportStatus {
    /// RDMA was wanted (`want_rdma`).
    pub rdma_requested: bool,
    /// RDMA was wanted but transfers use TCP: no device, or a fallback event happened.
    pub fallback: bool,
    /// Why (the last fallback's reason); `None` without a fallback.
    pub reason: Option<String>,
    /// RDMA devices the engine opened.
    pub devices: Vec<String>,
}

impl TransportStatus {
    /// From the engine's parts: `available` says a provider with devices exists, `fell_back`
    /// that a fallback event happened, `reason` the last one's (or the provider's) error.
    pub fn new(
        requested: bool,
        available: bool,
        fell_back: bool,
        reason: Option<String>,
        devices: Vec<String>,
    ) -> Self {
        let fallback = requested && (fell_back || !available);
        let reason = match (fallback, reason) {
            (false, _) => None,
            (true, Some(r)) => Some(r),
            (true, None) => Some(RdmaError::NoDevice.to_string()),
        };
        TransportStatus {
            rdma_requested: requested,
            fallback,
            reason,
            devices,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_status_says_fallback_only_when_rdma_was_wanted() {
        let off = TransportStatus::new(false, false, false, Some("x".into()), vec![]);
        assert!(!off.fallback && off.reason.is_none());
        let no_device = TransportStatus::new(true, false, false, None, vec![]);
        assert!(no_device.fallback);
        assert_eq!(
            no_device.reason.as_deref(),
            Some("no usable RDMA device on this host")
        );
        let fine = TransportStatus::new(true, true, false, None, vec!["mlx5_0".into()]);
        assert!(!fine.fallback && fine.reason.is_none());
        assert_eq!(fine.devices, ["mlx5_0"]);
        let event = TransportStatus::new(true, true, true, Some("s: peer".into()), vec![]);
        assert!(event.fallback);
        assert_eq!(event.reason.as_deref(), Some("s: peer"));
    }
}
