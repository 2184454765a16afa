//! Synthetic inference engine: serves the OpenAI-compatible HTTP API with timing taken from the
//! scheduling cost model, so that the conductor, `kvpool up` and tests run without GPUs.
//! I/O boundary: `server` (HTTP listener, sleeps) and `cli` (flags, runtime, admin server);
//! `api` and `EngineCore` here are pure.
//!
//! Prompts are turned into stand-in token ids (`sched::text_tokens`) and chained block keys;
//! a local LRU prefix cache of blocks decides how many prompt tokens need prefill. Prefills run
//! one at a time in arrival order; decoding requests share steps whose duration follows the
//! decode cost model for the current batch. Not yet done: reading and writing real KV blocks
//! through the node agent.

pub mod api;
pub mod cli;
pub mod server;

use std::num::NonZeroU32;

use crate::sched::{DecodeCost, Inserted, LruSet, PrefillCost, block_keys};

/// Settings of a synthetic engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Model name served (requests for another model get 404).
    pub model: String,
    pub prefill_cost: PrefillCost,
    pub decode_cost: DecodeCost,
    pub block_size: NonZeroU32,
    /// Prefix cache capacity in blocks.
    pub cache_blocks: usize,
    /// Bytes of prompt text per stand-in token.
    pub chunk_bytes: usize,
    /// Every modelled duration is multiplied by this (0.001 makes tests fast).
    pub time_scale: f64,
}

/// What prefilling one prompt costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPlan {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Modelled seconds (before `time_scale`).
    pub seconds: f64,
}

/// The engine's pure state: its prefix cache.
#[derive(Debug)]
pub struct EngineCore {
    config: EngineConfig,
    cache: LruSet,
}

impl EngineCore {
    pub fn new(config: EngineConfig) -> Self {
        let cache = LruSet::new(config.cache_blocks);
        Self { config, cache }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Looks up the longest cached prefix of `tokens`, caches all of its blocks, and returns
    /// the prefill cost of the rest.
    pub fn prefill(&mut self, tokens: &[u32]) -> PrefillPlan {
        let keys = block_keys(tokens, self.config.block_size);
        let hit = keys.iter().take_while(|&&k| self.cache.contains(k)).count();
        for &k in keys.iter().rev() {
            if let Inserted::NoCapacity = self.cache.insert(k) {
                break;
            }
        }
        let n = tokens.len() as u64;
        let cached = (hit as u64 * u64::from(self.config.block_size.get())).min(n);
        PrefillPlan {
            prompt_tokens: n,
            cached_tokens: cached,
            seconds: self.config.prefill_cost.seconds(cached, n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_prefix_is_cached() {
        let mut core = EngineCore::new(EngineConfig {
            model: "m".into(),
            prefill_cost: PrefillCost {
                fixed_s: 0.0,
                linear_s: 0.001,
                quadratic_s: 0.0,
            },
            decode_cost: DecodeCost::default(),
            block_size: NonZeroU32::new(4).unwrap(),
            cache_blocks: 100,
            chunk_bytes: 4,
            time_scale: 1.0,
        });
        let a: Vec<u32> = (0..10).collect();
        let p = core.prefill(&a);
        assert_eq!((p.prompt_tokens, p.cached_tokens), (10, 0));
        assert!((p.seconds - 0.010).abs() < 1e-12);
        // Same first 8 tokens (2 full blocks), different tail.
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([77, 78, 79, 80]);
        let p = core.prefill(&b);
        assert_eq!(p.cached_tokens, 8);
        assert!((p.seconds - 0.004).abs() < 1e-12);
        // The whole of `a` again: everything cached, including its partial last block.
        assert_eq!(core.prefill(&a).cached_tokens, 10);
    }
}
