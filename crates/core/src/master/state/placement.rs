//! Replica placement: choosing segments for new replicas (distinct nodes or failure domains,
//! the writer's node and NUMA node first, then free space) and allocating their extents.
//! Pure; used by puts and repairs.

use smallvec::SmallVec;

use super::{MasterState, Rep};
use crate::master::types::{PutOptions, Spread, Tier};

/// Placement preference, compared lexicographically: on the writer's node, on its NUMA node,
/// free bytes, then the lower segment id (determinism).
type PlacementScore = (bool, bool, u64, std::cmp::Reverse<u32>);

impl MasterState {
    /// Choose up to `count` segments of `tier` on distinct nodes (or failure domains) that can
    /// hold `pages`, preferring the writer's node, then its NUMA node, then free space.
    pub(super) fn place(
        &mut self,
        pages: u32,
        count: u8,
        tier: Tier,
        opts: &PutOptions,
        existing: &[Rep],
    ) -> SmallVec<[Rep; 2]> {
        let writer = opts
            .writer_node
            .as_ref()
            .and_then(|n| self.node_ids.get(n))
            .copied();
        let mut used_nodes: Vec<u32> = opts
            .avoid_nodes
            .iter()
            .filter_map(|n| self.node_ids.get(n).copied())
            .collect();
        let mut used_domains: Vec<String> = Vec::new();
        for r in existing {
            if let Some(s) = self.segments.get(&r.seg) {
                used_nodes.push(s.node);
                used_domains.push(self.nodes[s.node as usize].failure_domain.clone());
            }
        }
        let mut out: SmallVec<[Rep; 2]> = SmallVec::new();
        for _ in 0..count {
            let mut best: Option<(PlacementScore, u32)> = None;
            for (id, seg) in &self.segments {
                let ns = &self.nodes[seg.node as usize];
                if seg.spec.tier != tier
                    || !ns.alive
                    || ns.suspect_since_ms.is_some()
                    || seg.sealed
                    || seg.alloc.largest_free_pages() < pages
                    || used_nodes.contains(&seg.node)
                {
                    continue;
                }
                if opts.spread == Spread::FailureDomain
                    && !ns.failure_domain.is_empty()
                    && used_domains.contains(&ns.failure_domain)
                {
                    continue;
                }
                let on_writer = writer == Some(seg.node);
                let numa = on_writer && opts.numa_hint == Some(seg.spec.numa_node);
                let score = (
                    on_writer,
                    numa,
                    seg.alloc.free_bytes(),
                    std::cmp::Reverse(*id),
                );
                if best.as_ref().is_none_or(|(b, _)| score > *b) {
                    best = Some((score, *id));
                }
            }
            let Some((_, id)) = best else { break };
            let Some(seg) = self.segments.get_mut(&id) else {
                break;
            };
            let Some(page) = seg.alloc.allocate(pages) else {
                break;
            };
            self.used_pages[tier.index()] += u64::from(pages);
            used_nodes.push(seg.node);
            used_domains.push(self.nodes[seg.node as usize].failure_domain.clone());
            out.push(Rep { seg: id, page });
        }
        out
    }

    pub(super) fn largest_segment(&self, tiers: &[Tier]) -> u64 {
        self.segments
            .values()
            .filter(|s| tiers.contains(&s.spec.tier) && self.nodes[s.node as usize].alive)
            .map(|s| s.alloc.capacity_bytes())
            .max()
            .unwrap_or(0)
    }
}
