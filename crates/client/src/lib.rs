//! kvpool's pool client: what engines, the Python package and kvpool's own servers link to use
//! the pool. I/O boundary: gRPC channels to the master (`master`), transfer-engine connections
//! to the agents that hold the bytes (`pool`), and the node agent's Unix socket with its
//! shared-memory staging files (`engine_api`). No servers, no Kubernetes.

pub mod credentials;
pub mod engine_api;
pub mod master;
pub mod pool;
