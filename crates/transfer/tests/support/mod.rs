//! What the transfer engine's loopback tests share (integrity, tls): the test key, an engine on
//! a shared directory, a host segment registered under a name, and a target served on a
//! loopback port. Failures panic. I/O boundary: loopback sockets, host memory.

#![allow(clippy::unwrap_used, dead_code)] // test support: unwrap is the failure report

use std::sync::Arc;

use kvpool_transfer::*;

pub const MIB: usize = 1024 * 1024;

/// The key every engine of these tests shares.
pub fn key() -> AuthKey {
    AuthKey::new(*b"test-key-0123456789abcdef").unwrap()
}

/// An engine with `config`, keyed with [`key`], that finds segments in `dir`.
pub fn engine(config: EngineConfig, dir: &Arc<StaticDirectory>) -> TransferEngine {
    TransferEngine::new(
        config,
        key(),
        dir.clone(),
        TransferMetrics::unregistered().unwrap(),
    )
    .unwrap()
}

/// A host segment of `size` bytes registered with `engine` as `name`.
pub fn host_segment(engine: &TransferEngine, name: &str, size: usize) -> LocalSegment {
    engine
        .register(
            name,
            Arc::new(Segment::host(size, HostOptions::default()).unwrap()),
        )
        .unwrap()
}

/// A target engine with `config` holding a 4 MiB segment `t/dram0`, listening on a loopback
/// port: the engine, its server and the segment. The segment is not yet in any directory.
pub fn listening_target(
    config: EngineConfig,
    dir: &Arc<StaticDirectory>,
) -> (TransferEngine, TcpServer, LocalSegment) {
    let engine = engine(config, dir);
    let mem = host_segment(&engine, "t/dram0", 4 * MIB);
    let server = engine.listen_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
    (engine, server, mem)
}

/// An initiator engine with `config` and a 4 MiB buffer `i/buf`, reaching segments through
/// `dir`.
pub fn initiator(
    config: EngineConfig,
    dir: &Arc<StaticDirectory>,
) -> (TransferEngine, LocalSegment) {
    let engine = engine(config, dir);
    let mem = host_segment(&engine, "i/buf", 4 * MIB);
    (engine, mem)
}
