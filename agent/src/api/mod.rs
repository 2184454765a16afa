//! The engine API: tonic gRPC over a Unix socket, with block bytes in shared-memory staging
//! areas. The server lives here, with the [`block_store::BlockStore`] it serves from; the
//! protocol, the Rust client and the staging files are in the shared library
//! (`kvpool_client::engine_api`) so that engines written in Rust (the synthetic engine,
//! `kvpool up`) use them without depending on the agent. I/O boundary: the Unix socket and the
//! staging files.

pub mod block_store;
pub mod server;

pub use block_store::{BatchError, BlockStore};
pub use kvpool_client::engine_api::{SOCKET_NAME, client, shm};
