//! Process plumbing shared by every long-running kvpool server: the admin HTTP server
//! (`/livez`, `/readyz`, `/metrics`), SIGTERM/SIGINT to a cancellation token, log set-up, and
//! the wiring of an HTTP service with its admin server. I/O boundary: sockets and signals;
//! what is served is the caller's.

pub mod admin;
pub mod shutdown;
pub mod telemetry;
pub mod wiring;
