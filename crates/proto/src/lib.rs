//! kvpool's wire protocols and their conversions to the core's types. I/O boundary: none; the
//! servers and clients own the sockets.
//!
//! - `master`: the master's gRPC API (`proto/master/master.proto`) and conversions to
//!   `kvpool_core::master` types, with the limits both ends enforce.
//! - `engine_api`: the node agent's engine API (`proto/agent/v1/engine.proto`), spoken over the
//!   agent's Unix socket.
//! - `auth`: the HMAC request signatures of the master's API.
//! - `fast`: the master's fast lane, the same calls framed plainly on the gRPC port for
//!   callers with one call in flight.
//! - `kv_events`: KV cache events in vLLM's wire format (msgpack batches behind a sequence
//!   number), which engines publish and the conductor consumes.
//! - `openai`: the OpenAI-compatible HTTP requests and responses that the conductor and the
//!   engines exchange, with kvpool's headers; `openai_bodies` the response bodies and ids;
//!   `prefetch` kvpool's own prefetch endpoint between them; `stream_tokens` the generated
//!   tokens counted in an engine's response (SSE events or a JSON body's usage).
//!
//! gRPC server stubs are compiled only with the `server` feature, so clients link no server code.

pub mod auth;
pub mod engine_api;
pub mod fast;
pub mod issuer;
pub mod kv_events;
pub mod master;
pub mod openai;
pub mod openai_bodies;
pub mod prefetch;
pub mod stream_tokens;
