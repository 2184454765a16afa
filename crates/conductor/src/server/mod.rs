//! HTTP side of the conductor: OpenAI-compatible endpoints, the placement decision, and the
//! two upstream calls. Prefill gets the request with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params: {"do_remote_decode": true}`; decode gets the original request plus the
//! `kv_transfer_params` that prefill returned (vLLM's disaggregated proxy convention), and its
//! response, streamed or not, goes back to the client unchanged. vLLM's `MooncakeConnector`
//! pairs the two calls by a `transfer_id` and the prefill instance's bootstrap server instead;
//! SGLang's convention sends the request to both at once, paired by a bootstrap room. The engine set can change while serving
//! ([`EngineSet`]); without a prefill and a decode engine, completions answer 503.
//! I/O boundary: the listener, the HTTP client, the monotonic clock.
//!
//! The map, from the client inwards:
//! - `front`: the router and its endpoints (the OpenAI-facing layer) and [`conductor`];
//!   `error_bodies`: the OpenAI-style errors the conductor answers itself; `access`: API keys,
//!   and the request id, trace context and key each engine call carries.
//! - `handle`: one request, from its body to its placement and the routing convention.
//! - `vllm`, `vllm_mooncake` and `sglang`: the three conventions; `engine_calls`: the prefill call and the decode
//!   relay both use; `upstream`: the HTTP client to the engines and its errors.
//! - `kv_feed`: the prefill engines' KV event streams (ZMQ SUB, replay on gaps) into the
//!   index.
//! - `pool_lookup`: the master's answer on pooled prefixes; `prefetch` and `hot_pool`: hot-prefix
//!   replication into engines that can prefetch and in the pool itself;
//!   `share_load`: the bookings this replica and the other conductor replicas share through the
//!   master.
//! - `shared`, `members`, `engine_set`, `metrics`: what the handlers share, the engine set's
//!   bookkeeping and its handle, and the conductor's metrics (`latency`: each request's
//!   timing; `engine_load`: the engines' booked load, read at scrape time); `models`: the model
//!   names served (flags, or the engines' own lists); `load`: the per-role load signal the
//!   operator autoscales by (`/v1/kvpool/load`).

mod access;
mod bootstrap;
mod engine_calls;
mod engine_load;
mod engine_set;
pub mod engine_tokenize;
mod error_bodies;
mod front;
mod handle;
mod hot_pool;
mod kv_feed;
mod latency;
mod load;
mod members;
mod metrics;
mod models;
mod pool_lookup;
mod prefetch;
mod sglang;
mod share_load;
mod shared;
mod upstream;
mod usage_fill;
mod vllm;
mod vllm_mooncake;

pub use access::{Access, ApiKeys, KeyFileError, REQUEST_ID_HEADER, read_keys};
pub use engine_calls::{
    DECODE_HEADER, LOCAL_BLOCKS_HEADER, POOL_BLOCKS_HEADER, PREFILL_HEADER, TTFT_HEADER,
};
pub use engine_set::EngineSet;
pub use front::{Conductor, ServerError, conductor, router};
/// Serves a router on a listener until the token is cancelled (the runtime's serve loop; a
/// failure there is [`ServerError::Serve`] to the CLI).
pub use kvpool_runtime::http::{serve, serve_with};
pub use load::LOAD_WINDOW;
pub use pool_lookup::POOL_LOOKUP_BACKOFF;
pub use prefetch::MAX_PREFETCHES_IN_FLIGHT;
pub use upstream::url_host;
