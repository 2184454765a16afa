//! Client side of the node agent's engine API: the protocol (`proto/agent/v1/engine.proto`), a
//! Rust client over the agent's Unix socket, and the shared-memory staging files that carry the
//! block bytes. The agent's server uses the same generated types and staging code. I/O boundary:
//! the Unix socket (`client`) and the mapped staging files (`shm`).

pub mod client;
pub use kvpool_proto::engine_api as proto;
pub mod shm;

/// File name of the agent's socket inside its socket directory.
pub const SOCKET_NAME: &str = "agent.sock";
