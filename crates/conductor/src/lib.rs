//! The conductor's front door: an OpenAI-compatible HTTP server that places every request with
//! the scheduling policy core (`kvpool_core::sched`) and routes it to the chosen prefill instance and
//! then to the chosen decode instance, following vLLM's disaggregated-serving proxy convention
//! or SGLang's router's.
//! The engine set is fixed by flags or, in Kubernetes, followed at run time by `discovery`;
//! [`State::regrouped`] carries the bookkeeping of the engines that stay over a change.
//! I/O boundary: `server` (listener, HTTP client to the engines, the clock), `discovery` (the
//! Kubernetes API) and `cli`; `config` (settings), `engines` (the engine set and its routing
//! conventions), `fetch_estimate` (the learnt pool bandwidth), `prefill_costs` (the prefill cost models, fitted
//! from measured prefills), `request` (the OpenAI request layer: a body parsed once, forwarded as it came), `stream_tokens` (tokens counted in the decode responses, from `kvpool_proto`) and `state` (the bookkeeping
//! between the policy and the engines) are pure, and so are `tokenize` and `chat` once their files are read.

pub mod blocks;
pub mod chat;
pub mod cli;
mod config;
mod decode_cost;
pub mod discovery;
mod engines;
mod fetch_estimate;
mod handoff_fit;
pub mod kv_events;
pub mod master_flags;
pub mod model_config;
pub mod model_flags;
mod moving_error;
mod peer_load;
pub mod pool_flags;
mod prefill_costs;
pub mod request;
pub mod server;
mod state;
pub use kvpool_proto::stream_tokens;
pub mod tokenize;

pub use config::{
    ConductorConfig, DEFAULT_MAX_PROMPTS, HotPool, KvEventSource, PoolLookup, ShareLoad,
    UpstreamPool,
};
pub use engines::{ConductorProtocol, Engines, RoutingProtocol};
pub use fetch_estimate::FetchEstimate;
pub use prefill_costs::{CostStatus, PrefillCosts};
pub use state::{Refusal, ReplicationTask, State, StateError, Ticket};
