//! What the pool-mode unit tests share: a transfer engine on no network and host memory to
//! register. I/O boundary: none (a test-only module).

use std::sync::Arc;

use kvpool_transfer::{
    self as transfer, EngineConfig, HostOptions, Segment, StaticDirectory, TransferEngine,
    TransferMetrics,
};

/// The pool key of every test engine (and of the tests' master clients).
pub const KEY: &[u8] = b"tasks-test-key-0123456789abcdef0";

/// A transfer engine of node `node` with one lane and no peers known.
pub fn engine(node: &str) -> TransferEngine {
    TransferEngine::new(
        EngineConfig {
            node: node.into(),
            lanes: 1,
            ..EngineConfig::default()
        },
        transfer::AuthKey::new(KEY.to_vec()).expect("key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

/// `len` bytes of host memory to register as a segment.
pub fn memory(len: usize) -> Segment {
    Segment::host(len, HostOptions::default()).expect("segment")
}
