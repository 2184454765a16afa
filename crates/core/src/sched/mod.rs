//! KVCache-centric scheduling policy core (Mooncake's conductor): block keys, the global prefix
//! index, cost models and their online fit, prefill/decode choice, early rejection with and without prediction,
//! hot-block replication and the baseline policies. Pure code: no I/O and no clock reads; time
//! is passed in by the caller (the trace simulator or the front door).

pub mod blocks;
pub mod cost;
pub mod cost_fit;
pub mod engine_hash;
pub mod index;
mod key_table;
pub mod lru;
pub mod policy;
pub mod pool_keys;
pub(crate) mod rng;

pub use blocks::{BlockKey, block_count, block_keys, pool_key, text_tokens};
#[cfg(feature = "clap")]
pub use cost::CostFlags;
pub use cost::{DecodeCost, FitError, HandoffCost, PrefillCost};
pub use cost_fit::{CostFitter, FitConfig, Observed};
pub use engine_hash::{
    BlockHashKind, BlockHashing, EngineHash, ExtraKeys, VllmHasher, u64_of_hash_bytes,
};
pub use index::{IndexError, InstanceMask, PrefixIndex, PrefixMatch};
pub use lru::{Inserted, LruSet};
pub use policy::{
    ConfigError, Decision, DecodeLoad, DecodeMember, DecodeView, Eligible, HotConfig, Placement,
    Policy, PrefillLoad, RejectReason, Rejection, Replication, Request, Scheduler, SchedulerConfig,
    Slo, TtftEstimate,
};
pub use pool_keys::{KeyContractError, PoolKeys, VllmKeys, VllmName, parse_vllm_name};
