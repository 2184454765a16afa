//! HTTP server of the synthetic engine (axum): `/v1/completions`, `/v1/chat/completions`
//! (JSON or server-sent events), `/v1/models` and the prefetch endpoint. I/O boundary: the TCP
//! listener, the timers that stand in for GPU work, and (through `agent`) the node agent that
//! holds the KV blocks.
//!
//! The map: `endpoints` (router, the completion endpoints) and `error_bodies` (the
//! errors it answers); `generate` runs one request: its `prefill` half (KV in through
//! `pool_io`, the queued compute, KV out) and its `decode` steps; `sglang` is SGLang's
//! bootstrap (roles, the KV hand-off through the pool); `report` the KV load headers the
//! conductor learns from; `prefetch` the prefetch endpoint; `info` SGLang's `/health`,
//! `/server_info` and `/model_info` (what SGLang's router asks a worker); `kv_events` the KV
//! event publisher (vLLM's `--kv-events-config`, ZMQ PUB and replay); `shared` and
//! `metrics` what the handlers share.

mod decode;
mod endpoints;
mod error_bodies;
mod generate;
mod info;
mod kv_events;
mod metrics;
mod pool_io;
mod prefetch;
mod prefill;
mod report;
mod sglang;
mod shared;

pub use endpoints::{ServerError, router, router_with_agent};
pub use kv_events::{KvEventsConfig, router_publishing};
/// Serves a router on a listener until the token is cancelled (the runtime's serve loop; a
/// failure there is [`ServerError::Serve`] to the CLI).
pub use kvpool_runtime::http::{serve, serve_with};
pub use sglang::HandoffError;
