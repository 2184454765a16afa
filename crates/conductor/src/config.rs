//! The conductor's settings ([`ConductorConfig`]), validated from the flags by `cli`, and the
//! master connection it asks for pooled prefixes ([`PoolLookup`]). Pure data; the I/O is the
//! caller's (the master client connects lazily).

use kvpool_core::sched::SchedulerConfig;

use crate::engines::{Engines, RoutingProtocol};
use crate::tokenize;

/// Settings of the conductor.
#[derive(Clone, Debug)]
pub struct ConductorConfig {
    /// Model name served.
    pub model: String,
    /// Base URLs (`http://host:port`) of the prefill engines.
    pub prefill: Vec<String>,
    /// Base URLs of the decode engines.
    pub decode: Vec<String>,
    /// Policy, SLOs and cost models (one prefill cost per prefill URL).
    pub scheduler: SchedulerConfig,
    /// Prefix cache capacity of each prefill engine, in blocks (mirrored here).
    pub engine_cache_blocks: usize,
    /// How prompts become token ids: a Hugging Face tokenizer, or stand-in text chunks (whose
    /// size must match the engines').
    pub tokenizer: tokenize::PromptTokenizer,
    /// The pool's master, asked per request which prefix blocks the pool holds; `None`: the
    /// policy knows only the engines' local caches.
    pub pool: Option<PoolLookup>,
    /// How requests are handed to the prefill and decode engines.
    pub protocol: RoutingProtocol,
    /// Wall seconds per cost-model second of the engines (their `--time-scale`): the
    /// conductor's clock and the engines' measured KV fetch times are divided by it, so that
    /// queues, fetches and SLOs are all in the cost model's seconds.
    pub time_scale: f64,
}

/// How the conductor asks the pool's master for a request's cached prefix.
#[derive(Clone, Debug)]
pub struct PoolLookup {
    pub client: kvpool_client::master::MasterClient,
    /// Longest wait for one lookup; past it the request is placed on local knowledge only.
    pub timeout: std::time::Duration,
}

impl ConductorConfig {
    /// Whether at least one prefill and one decode engine are configured; without them the
    /// conductor serves 503s and is not ready.
    pub fn has_engines(&self) -> bool {
        !self.prefill.is_empty() && !self.decode.is_empty()
    }

    /// Bytes of one KV block as the scheduler counts them.
    pub fn block_bytes(&self) -> u64 {
        let s = &self.scheduler;
        s.bytes_per_token
            .saturating_mul(u64::from(s.block_size.get()))
    }

    /// The engines configured at start.
    pub fn engines(&self) -> Engines {
        Engines {
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            protocols: Default::default(),
        }
    }

    /// This configuration serving `engines` instead: one prefill cost per prefill engine (the
    /// first configured cost, or the default when none was configured).
    pub fn with_engines(&self, engines: &Engines) -> Self {
        let cost = self
            .scheduler
            .prefill_costs
            .first()
            .copied()
            .unwrap_or_default();
        let mut c = self.clone();
        c.prefill = engines.prefill.clone();
        c.decode = engines.decode.clone();
        c.scheduler.prefill_costs = vec![cost; engines.prefill.len()];
        c
    }
}
