//! The engine API: tonic gRPC over a Unix socket (server and Rust client), with block bytes in
//! shared-memory staging areas. I/O boundary: the Unix socket and the staging files.

pub mod client;
pub mod server;
pub mod shm;

/// Socket file name inside the configured socket directory.
pub const SOCKET_NAME: &str = "agent.sock";
