//! Settings of the transfer engine ([`EngineConfig`]): lanes, slicing, pipelining, timeouts and
//! transport preferences, with the documented defaults and their validation. Pure, except that
//! the default node name is read from the environment (`KVPOOL_NODE_NAME`, then `HOSTNAME`), and
//! so are the SR-IOV VFs the device plugin gave to the pod (`PCIDEVICE_*`).

use std::path::PathBuf;
use std::time::Duration;

use super::error::TransferError;
use super::frame;
use super::rdma::select::{self, NicPolicy};

/// Engine settings. `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Name of this node; segments whose descriptor names the same node are reached through
    /// shared memory when possible.
    pub node: String,
    /// TCP connections (lanes) per peer.
    pub lanes: usize,
    /// Requests larger than this are cut into slices spread over the lanes.
    pub slice_size: u64,
    /// Largest data frame accepted from a peer (target side); at least `slice_size`.
    pub max_slice: u64,
    /// Slices in flight per lane (pipelining depth).
    pub window: usize,
    /// A blocking [`transfer`](crate::TransferEngine::transfer) over TCP of at most this many
    /// bytes, all to one peer, is run by the calling thread on a connection of its own
    /// instead of through the lanes' threads: less latency for small values (0: never).
    pub inline_max_bytes: u64,
    /// An inline transfer polls for its reply this long before it sleeps on the socket
    /// (see [`crate::wire::spin_until_readable`]): less latency for a caller that waits
    /// anyway, at the price of that much CPU per call. Zero: no polling.
    pub spin_wait: Duration,
    /// Small requests of a batch to the same TCP segment travel together in vectored frames
    /// (READV / WRITEV, up to `slice_size` bytes each), when the target announces them; as a
    /// target, announce and serve them. Off: one frame per request, as before they existed.
    pub vectored: bool,
    /// Per-frame integrity of the TCP data path (see docs/transfer.md "Per-frame integrity"):
    /// `require` seals every frame of this engine's lanes and, as a target, refuses
    /// initiators that do not; `allow` (the default) seals only for initiators that ask; `off`
    /// refuses them. Inline transfers are not used under `require` (they go through the lanes).
    pub integrity: crate::Integrity,
    /// TLS on the TCP connections (see docs/transfer.md "TLS"): `require` dials targets over
    /// TLS 1.3 only (verified against `tls.ca_file`) and, as a target, refuses plaintext
    /// initiators; `allow` serves TLS and plaintext initiators alike; `off` (the default) has
    /// no TLS. Inside TLS the per-frame integrity option is not used (TLS protects every byte)
    /// and inline transfers go through the lanes.
    pub tls: crate::TransferTls,
    /// Every wait on a peer (reply, payload, handshake) gives up after this long.
    pub timeout: Duration,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Reach same-node segments through shared memory.
    pub prefer_shm: bool,
    /// Want RDMA: when no RDMA path works the engine falls back to TCP, loudly.
    pub want_rdma: bool,
    /// Which RDMA NICs to open (allow-list, the pod's VFs, GID index, NUMA node of the engine's
    /// memory); see [`crate::rdma::select`].
    pub rdma_nics: NicPolicy,
    /// Root of the sysfs tree the RDMA devices are discovered under (`/sys`).
    pub sysfs_root: PathBuf,
    /// Notifications kept until read.
    pub notification_capacity: usize,
    /// Target side: connections served at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// Target side: connections served at once from one source address (more are accepted
    /// and closed at once), so that one host cannot take every slot.
    pub max_connections_per_source: usize,
    /// Target side: accepted connections still in the handshake at once. At the cap the
    /// oldest of them is closed to make room for the newcomer: unauthenticated connections
    /// never take the room of authenticated ones, nor keep a real peer out.
    pub max_handshakes: usize,
    /// Target side: an accepted connection must finish the whole handshake within this, however
    /// slowly its bytes trickle in; then it is closed.
    pub handshake_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            node: std::env::var("KVPOOL_NODE_NAME")
                .or_else(|_| std::env::var("HOSTNAME"))
                .unwrap_or_else(|_| "localhost".into()),
            lanes: 4,
            slice_size: 4 * 1024 * 1024,
            max_slice: frame::DEFAULT_MAX_SLICE,
            window: 8,
            inline_max_bytes: 4 * 1024 * 1024,
            spin_wait: Duration::ZERO,
            vectored: true,
            integrity: crate::Integrity::Allow,
            tls: crate::TransferTls::default(),
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            prefer_shm: true,
            want_rdma: false,
            rdma_nics: NicPolicy {
                pod_vfs: pod_vfs_from_process_env(),
                ..NicPolicy::default()
            },
            sysfs_root: PathBuf::from("/sys"),
            notification_capacity: 4096,
            max_connections: 1024,
            max_connections_per_source: 256,
            max_handshakes: 128,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// The VFs the SR-IOV device plugin gave to this process's pod (`PCIDEVICE_*`); entries that
/// are not PCI addresses are logged and skipped.
fn pod_vfs_from_process_env() -> Vec<String> {
    let (vfs, notes) = select::pod_vfs_from_env(std::env::vars());
    for n in notes {
        tracing::warn!("SR-IOV device plugin variable: {n}");
    }
    vfs
}

impl EngineConfig {
    pub(crate) fn validate(&self) -> Result<(), TransferError> {
        let bad = |m: &str| Err(TransferError::Config(m.to_owned()));
        if self.lanes == 0 || self.lanes > 64 {
            return bad("lanes must be between 1 and 64");
        }
        if self.slice_size == 0 || self.slice_size > self.max_slice {
            return bad("slice_size must be > 0 and <= max_slice");
        }
        if self.max_slice > (1 << 30) {
            return bad("max_slice must be <= 1 GiB");
        }
        if self.window == 0 || self.window > 1024 {
            return bad("window must be between 1 and 1024");
        }
        if self.max_connections == 0
            || self.max_connections_per_source == 0
            || self.max_handshakes == 0
        {
            return bad(
                "max_connections, max_connections_per_source and max_handshakes must be > 0",
            );
        }
        if self.max_handshakes > self.max_connections {
            return bad("max_handshakes must be <= max_connections");
        }
        if self.timeout.is_zero()
            || self.connect_timeout.is_zero()
            || self.handshake_timeout.is_zero()
        {
            return bad("timeouts must be > 0");
        }
        if self.tls.mode == crate::TlsMode::Require && self.want_rdma {
            return bad(
                "tls require covers the TCP transport only: it cannot be combined with RDMA \
                 (want_rdma)",
            );
        }
        if self.rdma_nics.allow.iter().any(|d| d.trim().is_empty()) {
            return bad("rdma_nics.allow must not contain empty device names");
        }
        if self.rdma_nics.gid_index.is_some_and(|g| g > MAX_GID_INDEX) {
            return bad("rdma_nics.gid_index must be <= 255");
        }
        Ok(())
    }
}

/// Largest GID table index a port has (tables hold at most 256 entries).
pub const MAX_GID_INDEX: u32 = 255;
