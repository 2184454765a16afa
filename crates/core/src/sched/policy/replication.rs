//! Hot-block replication: counting hits on the blocks of accepted requests and planning copies
//! of a hot prefix into the local caches of the least loaded instances that lack it. Pure; the
//! caller (simulator or front door) performs the copies.

use crate::sched::blocks::BlockKey;
use crate::sched::index::PrefixIndex;

use super::Scheduler;
use super::decision::Placement;
use super::load::PrefillLoad;

/// Instances to copy a hot prefix to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replication {
    /// Leading blocks of the request to copy.
    pub blocks: usize,
    /// Prefill instances that receive them.
    pub targets: Vec<usize>,
}

impl Scheduler {
    /// Records a hit on every matched block of an accepted request and, when a block's hit
    /// count reaches a multiple of the hot threshold, plans copying the prefix up to the deepest
    /// such block to the least loaded instances that lack it (never the chosen one, which will
    /// hold the whole prompt anyway).
    pub fn record_hits(
        &self,
        index: &mut PrefixIndex,
        keys: &[BlockKey],
        placement: &Placement,
        prefill: &[PrefillLoad],
        now_s: f64,
    ) -> Option<Replication> {
        let matched = (placement.prefix.matched_blocks as usize).min(keys.len());
        let threshold = self.config.hot.threshold;
        let mut deepest = None;
        for (j, &key) in keys.iter().enumerate().take(matched) {
            let hits = index.record_hit(key);
            if threshold > 0 && hits > 0 && hits.is_multiple_of(threshold) {
                deepest = Some(j);
            }
        }
        let j = deepest?;
        let holders = index.holders(keys[j]);
        let n = prefill.len().min(index.instances());
        let mut candidates: Vec<usize> = (0..n)
            .filter(|&i| i != placement.prefill && !holders.contains(i))
            .filter(|&i| self.eligible.prefill(i))
            .collect();
        candidates.sort_by(|&a, &b| {
            let qa = (prefill[a].free_at_s - now_s).max(0.0);
            let qb = (prefill[b].free_at_s - now_s).max(0.0);
            qa.total_cmp(&qb).then(a.cmp(&b))
        });
        candidates.truncate(self.config.hot.fanout);
        if candidates.is_empty() {
            return None;
        }
        Some(Replication {
            blocks: j + 1,
            targets: candidates,
        })
    }
}
