//! Process plumbing shared by every long-running kvpool server: the admin HTTP server
//! (`/livez`, `/readyz`, `/metrics`, with the build and process metrics every process exports), SIGTERM/SIGINT to a cancellation token, log set-up, the
//! serve-until-shutdown loop of an HTTP router, the listen flags of the HTTP services, and the
//! wiring of an HTTP service with its admin server, and the KV event publisher (vLLM's ZMQ
//! PUB and replay sockets), and the `category()` label of error enums ([`error_category!`]).
//! I/O boundary: sockets and signals;
//! what is served is the caller's.

pub mod admin;
mod category;
pub mod http;
pub mod kv_events;
pub mod listen;
pub mod metrics;
pub mod process_metrics;
pub mod shutdown;
pub mod telemetry;
pub mod wiring;
