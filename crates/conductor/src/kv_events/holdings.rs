//! What one prefill engine holds according to its KV events ([`Holdings`]), and how a batch's
//! sequence number relates to the last one seen ([`step`]). A block counts as held while any
//! of the engine's data-parallel ranks holds it on any medium (device, CPU offload, disk), so
//! a removal from one rank or medium leaves the others' copies in the index. Pure.
//! Sequence numbers: see [`step`].

use std::collections::HashMap;

use kvpool_core::sched::BlockKey;
use kvpool_proto::kv_events::{EventBatch, KvEvent};

/// Ranks told apart per engine; higher ranks share bits (modulo), which can only keep a block
/// in the index longer than the engine holds it, never drop one it holds.
const RANKS: u32 = 16;

/// A change of the prefix index for this engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delta {
    /// The engine holds the block now (it did not before).
    Added(BlockKey),
    /// The engine holds the block no more.
    Removed(BlockKey),
}

/// Counts of one applied batch, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
}

/// The blocks one engine holds, each with the (rank, medium) copies it has.
#[derive(Debug, Default)]
pub struct Holdings {
    blocks: HashMap<BlockKey, u64>,
}

fn medium_code(medium: Option<&str>) -> u32 {
    match medium.map(str::to_ascii_uppercase).as_deref() {
        None | Some("GPU") => 0,
        Some("CPU") | Some("CPU_PINNED") => 1,
        Some("DISK") => 2,
        Some(_) => 3,
    }
}

fn bit(rank: Option<u32>, medium: Option<&str>) -> u64 {
    1u64 << ((rank.unwrap_or(0) % RANKS) * 4 + medium_code(medium))
}

fn rank_mask(rank: Option<u32>) -> u64 {
    0xf << ((rank.unwrap_or(0) % RANKS) * 4)
}

impl Holdings {
    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether the engine holds `key` (on any rank or medium).
    pub fn holds(&self, key: BlockKey) -> bool {
        self.blocks.contains_key(&key)
    }

    /// Every block held (for re-entering them in a fresh index).
    pub fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.blocks.keys().copied()
    }

    /// Applies `batch`, appending the index changes to `out`.
    pub fn apply(&mut self, batch: &EventBatch, out: &mut Vec<Delta>) -> Applied {
        let rank = batch.data_parallel_rank;
        let mut counts = Applied::default();
        for event in &batch.events {
            let (block_hashes, medium, stored) = match event {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => (block_hashes, medium, true),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => (block_hashes, medium, false),
                KvEvent::AllBlocksCleared => {
                    self.drop_bits(rank_mask(rank), out);
                    counts.cleared += 1;
                    continue;
                }
            };
            let b = bit(rank, medium.as_deref());
            for h in block_hashes {
                if stored {
                    self.add_bit(h.key(), b, out);
                    counts.stored += 1;
                } else {
                    self.remove_bit(h.key(), b, out);
                    counts.removed += 1;
                }
            }
        }
        counts
    }

    /// Sets `bit` of `key`, reporting the block as added when it was held nowhere before.
    fn add_bit(&mut self, key: BlockKey, bit: u64, out: &mut Vec<Delta>) {
        let mask = self.blocks.entry(key).or_insert(0);
        if *mask == 0 {
            out.push(Delta::Added(key));
        }
        *mask |= bit;
    }

    /// Clears `bit` of `key`, forgetting the block (and reporting it removed) when no bit is
    /// left.
    fn remove_bit(&mut self, key: BlockKey, bit: u64, out: &mut Vec<Delta>) {
        if let Some(mask) = self.blocks.get_mut(&key) {
            *mask &= !bit;
            if *mask == 0 {
                self.blocks.remove(&key);
                out.push(Delta::Removed(key));
            }
        }
    }

    /// Forgets everything (the engine restarted, or events were lost beyond repair).
    pub fn clear(&mut self, out: &mut Vec<Delta>) {
        self.drop_bits(u64::MAX, out);
    }

    fn drop_bits(&mut self, bits: u64, out: &mut Vec<Delta>) {
        self.blocks.retain(|&key, mask| {
            *mask &= !bits;
            if *mask == 0 {
                out.push(Delta::Removed(key));
                false
            } else {
                true
            }
        });
    }
}

/// How a live batch's sequence number follows the last one applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The next one (or the first seen).
    Next,
    /// Batches `from..to` were missed: replay them, or clear the engine's entries.
    Gap { from: u64, to: u64 },
    /// Not above the last one: a PUB socket never repeats, so the publisher started counting
    /// again (an engine restart; vLLM counts from 0). Its old entries are stale.
    Restart,
}

/// Classifies the live stream's `seq` after `last` (the last applied sequence, if any).
pub fn step(last: Option<u64>, seq: u64) -> Step {
    match last {
        None => Step::Next,
        Some(l) if seq == l.wrapping_add(1) => Step::Next,
        Some(l) if seq > l => Step::Gap {
            from: l + 1,
            to: seq,
        },
        Some(_) => Step::Restart,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_proto::kv_events::WireHash;

    fn stored(hashes: &[u64], medium: Option<&str>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| WireHash::Int(h)).collect(),
            parent: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            lora_name: None,
            medium: medium.map(str::to_owned),
            group_idx: None,
        }
    }

    fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|&h| WireHash::Int(h)).collect(),
            medium: medium.map(str::to_owned),
            group_idx: None,
        }
    }

    fn batch(rank: Option<u32>, events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: rank,
        }
    }

    #[test]
    fn stores_and_removals_move_the_index_once_per_block() {
        let mut h = Holdings::default();
        let mut out = Vec::new();
        let c = h.apply(
            &batch(None, vec![stored(&[1, 2], None), stored(&[2], None)]),
            &mut out,
        );
        assert_eq!(out, vec![Delta::Added(1), Delta::Added(2)]);
        assert_eq!(c.stored, 3);
        out.clear();
        h.apply(&batch(None, vec![removed(&[1, 9], None)]), &mut out);
        assert_eq!(out, vec![Delta::Removed(1)], "unknown 9 changes nothing");
        assert!(h.holds(2) && !h.holds(1));
    }

    #[test]
    fn a_block_stays_while_another_rank_or_medium_holds_it() {
        let mut h = Holdings::default();
        let mut out = Vec::new();
        h.apply(&batch(Some(0), vec![stored(&[5], Some("GPU"))]), &mut out);
        h.apply(&batch(Some(1), vec![stored(&[5], Some("GPU"))]), &mut out);
        h.apply(&batch(Some(0), vec![stored(&[5], Some("CPU"))]), &mut out);
        assert_eq!(out, vec![Delta::Added(5)]);
        out.clear();
        h.apply(&batch(Some(0), vec![removed(&[5], Some("GPU"))]), &mut out);
        h.apply(&batch(Some(1), vec![KvEvent::AllBlocksCleared]), &mut out);
        assert!(out.is_empty(), "rank 0's CPU copy remains");
        h.apply(&batch(Some(0), vec![removed(&[5], Some("cpu"))]), &mut out);
        assert_eq!(out, vec![Delta::Removed(5)]);
        assert!(h.is_empty());
    }

    #[test]
    fn clear_removes_everything_and_reports_it() {
        let mut h = Holdings::default();
        let mut out = Vec::new();
        h.apply(&batch(None, vec![stored(&[1, 2, 3], None)]), &mut out);
        out.clear();
        h.clear(&mut out);
        out.sort_by_key(|d| match d {
            Delta::Added(k) | Delta::Removed(k) => *k,
        });
        assert_eq!(
            out,
            vec![Delta::Removed(1), Delta::Removed(2), Delta::Removed(3)]
        );
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn sequence_steps_find_gaps_repeats_and_restarts() {
        assert_eq!(step(None, 7), Step::Next);
        assert_eq!(step(Some(7), 8), Step::Next);
        assert_eq!(step(Some(7), 11), Step::Gap { from: 8, to: 11 });
        assert_eq!(step(Some(7), 5), Step::Restart);
        assert_eq!(step(Some(7), 7), Step::Restart);
        assert_eq!(step(Some(7), 0), Step::Restart);
    }
}
