//! Where the local-only agent announces what it holds: [`SegmentRegistrar`] and its in-process
//! [`LocalRegistrar`] record the DRAM tier's segments and the recovered SSD blocks. Pool mode
//! does not use it: there `crate::pool::PoolRegistrar` hands the tier's memory itself to the
//! transfer engine and the master. The error type is shared by both. I/O boundary: none in
//! this module.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::dram::SegmentInfo;

/// Errors of registration.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RegistrarError {
    #[error("segment {0} is already registered")]
    Duplicate(String),
    #[error("segment {0} is not registered")]
    Unknown(String),
    #[error("registering segment {name} with the transfer engine")]
    Transfer {
        name: String,
        #[source]
        source: kvpool_transfer::TransferError,
    },
}

kvpool_runtime::error_category!(RegistrarError);

/// Tier a block is announced from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnnouncedTier {
    Dram,
    Ssd,
}

/// What the agent needs from the transfer engine and the master.
pub trait SegmentRegistrar: Send + Sync {
    /// Make a DRAM segment reachable by the transfer engine.
    fn register(&self, segment: &SegmentInfo) -> Result<(), RegistrarError>;
    /// Withdraw a segment (on shutdown).
    fn deregister(&self, index: u32) -> Result<(), RegistrarError>;
    /// Tell the pool which blocks this node holds (after a restart: the recovered SSD tier).
    fn announce(&self, keys: &[Vec<u8>], tier: AnnouncedTier) -> Result<(), RegistrarError>;
}

/// Local-only mode: remembers registrations in memory.
#[derive(Debug, Default)]
pub struct LocalRegistrar {
    segments: Mutex<BTreeMap<u32, SegmentInfo>>,
    announced: AtomicU64,
}

impl LocalRegistrar {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registered segments.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.segments.lock().values().cloned().collect()
    }

    /// Blocks announced so far.
    pub fn announced(&self) -> u64 {
        self.announced.load(Ordering::Relaxed)
    }
}

impl SegmentRegistrar for LocalRegistrar {
    fn register(&self, segment: &SegmentInfo) -> Result<(), RegistrarError> {
        let mut map = self.segments.lock();
        if map.contains_key(&segment.index) {
            return Err(RegistrarError::Duplicate(segment.index.to_string()));
        }
        map.insert(segment.index, segment.clone());
        Ok(())
    }

    fn deregister(&self, index: u32) -> Result<(), RegistrarError> {
        self.segments
            .lock()
            .remove(&index)
            .map(|_| ())
            .ok_or_else(|| RegistrarError::Unknown(index.to_string()))
    }

    fn announce(&self, keys: &[Vec<u8>], _tier: AnnouncedTier) -> Result<(), RegistrarError> {
        self.announced
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_deregister_round_trip() {
        let r = LocalRegistrar::new();
        let seg = SegmentInfo {
            index: 3,
            numa_node: Some(0),
            addr: 4096,
            bytes: 8192,
            hugepage_size: None,
            numa_bound: true,
            locked: false,
        };
        r.register(&seg).expect("register");
        assert_eq!(r.register(&seg).expect_err("dup").category(), "duplicate");
        assert_eq!(r.segments(), vec![seg]);
        r.announce(&[b"k".to_vec(), b"l".to_vec()], AnnouncedTier::Ssd)
            .expect("announce");
        assert_eq!(r.announced(), 2);
        r.deregister(3).expect("deregister");
        assert_eq!(r.deregister(3).expect_err("gone").category(), "unknown");
    }
}
