//! `kvpool bench sched --events-per-decision N`: the engines' KV events streaming into the
//! conductor's index between decisions. Batches of vLLM-format events (stored and removed runs
//! of an indexed chain, for every prefill instance in turn) are encoded up front; before each
//! timed decision the next ones are decoded (`kvpool_proto::kv_events`), applied to that
//! instance's holdings (`kvpool_conductor::kv_events`) and their index changes to the prefix
//! index, the work the conductor's subscriber does per batch. Reports the ingestion rate (block
//! events per second of that work) beside the decision latency. I/O boundary: the clock.

use std::time::{Duration, Instant};

use kvpool_conductor::kv_events::{Delta, Holdings};
use kvpool_core::sched::PrefixIndex;
use kvpool_proto::kv_events::{
    Encoding, EventBatch, KvEvent, WireHash, decode_batch, encode_batch,
};

/// Block events per batch: a stored run and a removed run of this many blocks each.
pub const RUN_BLOCKS: usize = 16;

/// Encoded batches cycled through (enough that the index sees fresh keys for a long run).
const BATCHES: usize = 4096;

/// The stream's state over the benchmark.
pub struct EventStream {
    batches: Vec<(usize, Vec<u8>)>,
    holdings: Vec<Holdings>,
    next: usize,
    per_decision: usize,
    deltas: Vec<Delta>,
    pub block_events: u64,
    pub busy: Duration,
}

impl EventStream {
    /// Batches over `keys` (chains of `chain_blocks`) for `instances` prefill instances, enough
    /// per decision for `events_per_decision` block events.
    pub fn new(
        keys: &[u64],
        chain_blocks: usize,
        instances: usize,
        events_per_decision: usize,
    ) -> Self {
        let chains = (keys.len() / chain_blocks.max(1)).max(1);
        let run = RUN_BLOCKS.min(chain_blocks.max(1));
        let batches = (0..BATCHES)
            .map(|i| {
                let c = (i * 7919) % chains;
                let chain =
                    &keys[c * chain_blocks..(c * chain_blocks + chain_blocks).min(keys.len())];
                let hashes = |r: &[u64]| r.iter().map(|&k| WireHash::Int(k)).collect::<Vec<_>>();
                let stored = &chain[..run.min(chain.len())];
                // Remove what an earlier batch stored for another chain's tail, so the index
                // both grows and shrinks.
                let old = &keys[((c + 1) % chains) * chain_blocks..];
                let removed = &old[..run.min(old.len())];
                let events = vec![
                    KvEvent::BlockStored {
                        block_hashes: hashes(stored),
                        parent: None,
                        token_ids: Vec::new(),
                        block_size: 16,
                        lora_id: None,
                        lora_name: None,
                        medium: Some("GPU".into()),
                        group_idx: None,
                    },
                    KvEvent::BlockRemoved {
                        block_hashes: hashes(removed),
                        medium: Some("GPU".into()),
                        group_idx: None,
                    },
                ];
                let batch = EventBatch {
                    ts: 0.0,
                    events,
                    data_parallel_rank: None,
                };
                (i % instances.max(1), encode_batch(&batch, Encoding::Array))
            })
            .collect();
        EventStream {
            batches,
            holdings: (0..instances).map(|_| Holdings::default()).collect(),
            next: 0,
            per_decision: events_per_decision.div_ceil(2 * run).max(1),
            deltas: Vec::new(),
            block_events: 0,
            busy: Duration::ZERO,
        }
    }

    /// Decodes and applies the next batches (called between decisions).
    pub fn apply(&mut self, index: &mut PrefixIndex) {
        let start = Instant::now();
        for _ in 0..self.per_decision {
            let (inst, bytes) = &self.batches[self.next % self.batches.len()];
            self.next += 1;
            let Ok(batch) = decode_batch(bytes) else {
                continue;
            };
            self.deltas.clear();
            let Some(h) = self.holdings.get_mut(*inst) else {
                continue;
            };
            let applied = h.apply(&batch, &mut self.deltas);
            self.block_events += applied.stored + applied.removed;
            for d in &self.deltas {
                match *d {
                    Delta::Added(k) => index.add_local(k, *inst),
                    Delta::Removed(k) => index.remove_local(k, *inst),
                }
            }
        }
        self.busy += start.elapsed();
    }

    /// Block events applied per second of decode-and-apply work.
    pub fn events_per_second(&self) -> f64 {
        self.block_events as f64 / self.busy.as_secs_f64().max(1e-9)
    }
}
