//! kvpool shared library: the types, protocols and policy code that the `kvpool` CLI, the
//! operator (`kvpool-operator`) and the node agent (`kvpool-agent`) all use.
//!
//! Each module names its own I/O boundary in its header. Pure modules (resource types, policy,
//! simulation) do no I/O at all; runtime modules (admin server, shutdown) own sockets and signals.

pub mod admin;
pub mod agent_api;
pub mod bench;
pub mod cli;
pub mod conductor;
pub mod crd;
pub mod master;
pub mod sched;
pub mod shutdown;
pub mod sim;
pub mod synthetic;
pub mod telemetry;
pub mod transfer;
pub mod up;
