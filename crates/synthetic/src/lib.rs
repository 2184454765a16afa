//! Synthetic inference engine: serves the OpenAI-compatible HTTP API with timing taken from the
//! scheduling cost model, so that the conductor, `kvpool up` and tests run without GPUs.
//! I/O boundary: `server` (HTTP listener, sleeps), `agent` (the node agent's socket) and `cli`
//! (flags, config file, runtime, admin server); `kv` and `EngineCore` here are pure; the HTTP contract it serves is `kvpool_proto::openai`.
//!
//! Prompts are turned into stand-in token ids (`sched::text_tokens`) and chained block keys;
//! a local LRU prefix cache of blocks (the GPU's cache) decides how many prompt tokens need
//! prefill. With a node agent (`--agent-socket`) the engine also keeps real KV blocks in the
//! pool: it reads the cached prefix beyond its local cache through the agent, checks every byte,
//! prefills the rest and writes the new blocks back; a decode instance reads the request's blocks
//! before decoding. Prefills run one at a time in arrival order; decoding requests share steps
//! whose duration follows the decode cost model for the current batch.

pub mod agent;

pub mod cli;
pub mod kv;
pub mod server;

use std::num::NonZeroU32;

use kvpool_core::sched::{BlockHashing, BlockKey, DecodeCost, Inserted, LruSet, PrefillCost};
use kvpool_proto::kv_events::{KvEvent, WireHash};

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
    /// `Some`: serve SGLang's disaggregation protocol in this role (requests carry a
    /// `bootstrap_room`); `None`: vLLM's (`kv_transfer_params` says the role per request).
    pub sglang: Option<SglangMode>,
    /// How prompt blocks are keyed (vLLM's block hashes by default, as the engines it stands
    /// in for; the conductor must use the same).
    pub hashing: BlockHashing,
}

/// This engine's half of SGLang prefill/decode disaggregation (SGLang's
/// `--disaggregation-mode`), with the KV hand-off going through the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SglangMode {
    pub role: SglangRole,
    /// How long a decode engine waits for its room's KV to arrive before failing the request.
    pub bootstrap_timeout: std::time::Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SglangRole {
    /// Prefill only: compute the prompt's KV, put it in the pool, mark the room done.
    Prefill,
    /// Decode only: wait for the room's KV in the pool, read it, generate.
    Decode,
}

/// What prefilling one prompt costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPlan {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Modelled seconds (before `time_scale`).
    pub seconds: f64,
}

/// The engine's pure state: its prefix cache, and the KV events its changes make (taken by
/// the publisher, when there is one).
#[derive(Debug)]
pub struct EngineCore {
    config: EngineConfig,
    cache: LruSet,
    events: Vec<KvEvent>,
    /// Whether events are collected (an engine without a publisher keeps none).
    publish: bool,
}

impl EngineCore {
    pub fn new(config: EngineConfig) -> Self {
        let cache = LruSet::new(config.cache_blocks);
        Self {
            config,
            cache,
            events: Vec::new(),
            publish: false,
        }
    }

    /// Collect KV events from now on (for [`EngineCore::take_events`]).
    pub fn publish_events(&mut self) {
        self.publish = true;
    }

    /// The KV events since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The keys of a prompt's blocks as this engine keys them.
    pub fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.config.hashing.keys(tokens, self.config.block_size)
    }

    /// Caches `keys` (a prompt's leading blocks, first first; `tokens` the prompt, when known),
    /// the first most recently used, and records what entered and left as KV events.
    fn cache_prefix(&mut self, keys: &[BlockKey], tokens: Option<&[u32]>) {
        let mut added = vec![false; keys.len()];
        let mut evicted = Vec::new();
        for (i, &k) in keys.iter().enumerate().rev() {
            match self.cache.insert(k) {
                Inserted::NoCapacity => break,
                Inserted::Present => {}
                Inserted::Added { evicted: e } => {
                    added[i] = true;
                    evicted.extend(e);
                }
            }
        }
        if !self.publish {
            return;
        }
        if !evicted.is_empty() {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: evicted.into_iter().map(WireHash::Int).collect(),
                medium: Some("GPU".into()),
                group_idx: None,
            });
        }
        let size = self.config.block_size.get() as usize;
        // One BlockStored per run of consecutive new blocks, as vLLM publishes them.
        let mut i = 0;
        while i < keys.len() {
            if !added[i] {
                i += 1;
                continue;
            }
            let start = i;
            while i < keys.len() && added[i] {
                i += 1;
            }
            let token_ids = tokens
                .and_then(|t| t.get(start * size..(i * size).min(t.len())))
                .map(<[u32]>::to_vec)
                .unwrap_or_default();
            self.events.push(KvEvent::BlockStored {
                block_hashes: keys[start..i].iter().map(|&k| WireHash::Int(k)).collect(),
                parent: start.checked_sub(1).map(|p| WireHash::Int(keys[p])),
                token_ids,
                block_size: self.config.block_size.get(),
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                group_idx: None,
            });
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Looks up the longest cached prefix of `tokens`, caches all of its blocks, and returns
    /// the prefill cost of the rest.
    pub fn prefill(&mut self, tokens: &[u32]) -> PrefillPlan {
        self.prefill_with(tokens, 0)
    }

    /// How many leading blocks of `keys` the local prefix cache holds.
    pub fn local_prefix(&self, keys: &[BlockKey]) -> usize {
        keys.iter().take_while(|&&k| self.cache.contains(k)).count()
    }

    /// Puts `keys` (a prompt's leading blocks, first first, loaded from the pool by a prefetch)
    /// in the prefix cache, the first most recently used; stops when the cache is full.
    pub fn adopt(&mut self, keys: &[BlockKey]) {
        self.cache_prefix(keys, None);
    }

    /// As `prefill`, when the first `external_blocks` blocks of the prompt were also loaded from
    /// outside (the pool): the cached prefix is the longer of the two.
    pub fn prefill_with(&mut self, tokens: &[u32], external_blocks: usize) -> PrefillPlan {
        let keys = self.keys(tokens);
        let hit = self
            .local_prefix(&keys)
            .max(external_blocks.min(keys.len()));
        self.cache_prefix(&keys, Some(tokens));
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
    use kvpool_core::sched::block_keys;

    fn config(hashing: BlockHashing) -> EngineConfig {
        EngineConfig {
            model: "m".into(),
            prefill_cost: PrefillCost::default(),
            decode_cost: DecodeCost::default(),
            block_size: NonZeroU32::new(4).unwrap(),
            cache_blocks: 3,
            chunk_bytes: 4,
            time_scale: 1.0,
            sglang: None,
            hashing,
        }
    }

    #[test]
    fn cache_changes_are_published_as_vllm_events_with_vllm_hashes() {
        let mut core = EngineCore::new(config(BlockHashing::vllm("0")));
        core.publish_events();
        let a: Vec<u32> = (0..10).collect();
        let keys = core.keys(&a);
        assert_eq!(keys.len(), 2, "vLLM hashes full blocks only");
        core.prefill(&a);
        let events = core.take_events();
        assert_eq!(events.len(), 1);
        let KvEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            ..
        } = &events[0]
        else {
            panic!("{events:?}");
        };
        assert_eq!(
            block_hashes,
            &keys.iter().map(|&k| WireHash::Int(k)).collect::<Vec<_>>()
        );
        assert_eq!((parent, token_ids.len(), *block_size), (&None, 8, 4));
        // The same prompt again stores nothing new.
        core.prefill(&a);
        assert!(core.take_events().is_empty());
        // Two more blocks overflow the 3-block cache: one eviction, one stored run.
        let b: Vec<u32> = (100..108).collect();
        core.prefill(&b);
        let events = core.take_events();
        assert!(
            matches!(&events[0], KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1),
            "{events:?}"
        );
        assert!(
            matches!(&events[1], KvEvent::BlockStored { block_hashes, .. } if block_hashes.len() == 2)
        );
        // Without a publisher nothing is collected.
        let mut quiet = EngineCore::new(config(BlockHashing::vllm("0")));
        quiet.prefill(&a);
        assert!(quiet.take_events().is_empty());
    }

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
            sglang: None,
            hashing: BlockHashing::Kvpool,
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
        // Blocks loaded from the pool count as cached beyond the local cache.
        let c: Vec<u32> = (100..112).collect();
        let keys = block_keys(&c, NonZeroU32::new(4).unwrap());
        assert_eq!(core.local_prefix(&keys), 0);
        let p = core.prefill_with(&c, 2);
        assert_eq!(p.cached_tokens, 8);
        assert_eq!(core.local_prefix(&keys), 3);
        // Prefetched blocks are cached before any prompt asks for them.
        let d: Vec<u32> = (200..212).collect();
        let keys = block_keys(&d, NonZeroU32::new(4).unwrap());
        core.adopt(&keys[..2]);
        assert_eq!(core.local_prefix(&keys), 2);
        assert_eq!(core.prefill(&d).cached_tokens, 8);
    }
}
