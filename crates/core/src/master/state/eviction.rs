//! Eviction at the watermarks: choosing victims through the tier's policy (never leased,
//! pinned, pending or busy objects), dropping their replicas, or demoting a DRAM replica to an
//! SSD segment of the same node. Pure.

use super::{BUSY, HARD_PIN, IN_POLICY, LIVE, MasterState, PENDING, Rep, SOFT_PIN};
use crate::master::types::{TaskKind, Tier};

impl MasterState {
    fn tier_over(&self, tier: Tier, fraction: f64) -> bool {
        let t = tier.index();
        let cap = self.capacity_pages[t];
        let used = self.used_pages[t].saturating_sub(self.releasing_pages[t]);
        cap > 0 && used as f64 > fraction * cap as f64
    }

    pub(super) fn evict_to_watermark(&mut self, tier: Tier) -> u64 {
        let wm = self.config.watermarks[tier.index()];
        if !self.tier_over(tier, wm.high) {
            return 0;
        }
        let mut n = 0;
        while self.tier_over(tier, wm.low) && self.evict_one(tier) {
            n += 1;
        }
        n
    }

    /// Evict one object's replicas from `tier`: never leased, hard-pinned, pending or busy
    /// objects; soft-pinned ones only when nothing else can go. Returns false when nothing
    /// could be evicted.
    pub(super) fn evict_one(&mut self, tier: Tier) -> bool {
        if self.clock.now_ms() < self.evict_not_before_ms {
            return false;
        }
        let t = tier.index();
        let entries = &self.entries;
        let mut victim = None;
        for allow_soft in [false, true] {
            let blocked = HARD_PIN | PENDING | BUSY | if allow_soft { 0 } else { SOFT_PIN };
            victim = self.policies[t].evict(&mut |s| {
                entries
                    .get(s as usize)
                    .is_some_and(|e| e.has(LIVE) && e.leases == 0 && e.flags & blocked == 0)
            });
            if victim.is_some() {
                break;
            }
        }
        let Some(slot) = victim else {
            return false;
        };
        self.entries[slot as usize].flags &= !IN_POLICY[t];
        let e = &self.entries[slot as usize];
        let pages = e.pages();
        let in_tier: Vec<Rep> = e
            .replicas
            .iter()
            .copied()
            .filter(|r| self.tier_of(*r) == Some(tier))
            .collect();
        let mut demoting = false;
        for r in in_tier {
            if tier == Tier::Dram && !demoting && self.start_demotion(slot, r, pages) {
                demoting = true;
                continue;
            }
            self.entries[slot as usize].replicas.retain(|x| *x != r);
            let key = self.entries[slot as usize].key;
            self.feed_free(r, key);
            self.free_rep(r, pages);
            self.counters.evicted_dropped[t] += 1;
        }
        self.settle(slot);
        true
    }

    /// Demote `source` (a DRAM replica) to an SSD segment of the same node, if there is room.
    fn start_demotion(&mut self, slot: u32, source: Rep, pages: u32) -> bool {
        let Some(node) = self.segments.get(&source.seg).map(|s| s.node) else {
            return false;
        };
        let target = self
            .nodes
            .get(node as usize)
            .map(|n| n.segments.clone())
            .unwrap_or_default()
            .into_iter()
            .find_map(|sid| {
                let seg = self.segments.get_mut(&sid)?;
                if seg.spec.tier != Tier::Ssd || seg.sealed {
                    return None;
                }
                seg.alloc.allocate(pages).map(|page| Rep { seg: sid, page })
            });
        let Some(target) = target else { return false };
        self.log_reserve(target, pages);
        self.used_pages[Tier::Ssd.index()] += u64::from(pages);
        self.releasing_pages[Tier::Dram.index()] += u64::from(pages);
        self.start_task(TaskKind::Demote, slot, source, target, node, pages);
        true
    }
}
