//! kvpool node agent library: topology discovery, NUMA-aware DRAM tier, persistent SSD tier,
//! the engine API over a Unix socket, and the runtime that wires them with the admin server.
//! The engine API serves from one `api::BlockStore`: the local tiered store (`store`, over
//! `dram` and `ssd`) in local-only mode, or the pool (`pool`), where the DRAM tier's memory
//! belongs to the pool: the master allocates in it and the agent executes the master's copy
//! tasks. `runtime` sequences either mode the same way. Dependencies point one way:
//! `runtime` -> {`store`, `pool`} -> `api` (the trait) -> `metrics`.
//! Each module names its own I/O boundary in its header; `unsafe` lives only in `memory`
//! (mmap/mbind/mlock, hand-over to the transfer engine, the SSD segment's file mapping),
//! `ssd::aligned` (aligned buffers), `numa_verify` (read-only page-placement queries) and
//! `kvpool_client::engine_api::shm` (shared staging copies).

pub mod api;
pub mod bench;
pub mod bench_restart;
pub mod cli;
pub mod config;
pub mod discovery;
pub mod dram;
pub mod extent;
#[cfg(feature = "cuda")]
pub mod gpu_cuda;
pub mod issuer;
pub mod locality;
pub mod memory;
pub mod metrics;
pub mod node;
pub mod numa_verify;
pub mod placement;
pub mod pool;
pub mod registrar;
pub mod runtime;
pub mod ssd;
pub mod store;
pub mod topology;

/// The pool-mode modules under the paths they had before `pool` became a folder.
pub use pool::{api as pool_api, feed as pool_feed, tasks};

/// Engine API types generated from the library's `proto/agent/v1/engine.proto`.
pub use kvpool_proto::engine_api as proto;
