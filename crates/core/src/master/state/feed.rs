//! The segment-event feed (issue 4): each node's agent learns, in order, which replicas were
//! committed to and freed from its SSD segments and persistent DRAM segments ([`fed`]), acknowledges them on its next heartbeat, and
//! gets a full snapshot after a failover or an overflow; its corrupt-block reports drop
//! replicas. Pure; the heartbeat RPC carries the events.

use super::{LIVE, MasterError, MasterState, PENDING, Rep};
use crate::master::alloc::PAGE_BYTES;
use crate::master::types::{
    CorruptBlock, HeartbeatReply, ObjectKey, SegmentEvent, SegmentEventKind, SegmentSpec, Tier,
};

/// Events kept per node before the feed gives up and resynchronises with a snapshot.
pub const FEED_CAP: usize = 1 << 16;
/// Events sent per heartbeat answer at most.
pub const FEED_BATCH: usize = 4096;

/// Whether a segment gets the feed: its agent keeps a durable index of what it holds (every SSD
/// segment, and a DRAM segment whose memory outlives the agent). Pure.
pub fn fed(spec: &SegmentSpec) -> bool {
    spec.tier == Tier::Ssd || spec.persistent
}

impl MasterState {
    /// This instance's feed epoch (never 0).
    pub fn feed_epoch(&self) -> u64 {
        self.feed_epoch
    }

    /// Queue `kind` for the agent of the segment `r` lives in, when that segment has a feed
    /// ([`fed`]: SSD and persistent DRAM segments).
    fn feed_push(&mut self, r: Rep, kind: SegmentEventKind, key: ObjectKey, length: u64) {
        let Some(seg) = self.segments.get(&r.seg) else {
            return;
        };
        if !fed(&seg.spec) {
            return;
        }
        let Some(ns) = self.nodes.get_mut(seg.node as usize) else {
            return;
        };
        if ns.feed_reset {
            // The coming snapshot covers this change.
            return;
        }
        if ns.feed.len() >= FEED_CAP {
            ns.feed.clear();
            ns.feed_reset = true;
            return;
        }
        let seq = ns.feed_next_seq;
        ns.feed_next_seq += 1;
        ns.feed.push_back(SegmentEvent {
            seq,
            kind,
            segment_id: r.seg,
            key,
            offset: u64::from(r.page) * PAGE_BYTES,
            length,
        });
    }

    pub(super) fn feed_commit(&mut self, r: Rep, key: ObjectKey, size: u64) {
        self.feed_push(r, SegmentEventKind::Commit, key, size);
    }

    pub(super) fn feed_free(&mut self, r: Rep, key: ObjectKey) {
        self.feed_push(r, SegmentEventKind::Free, key, 0);
    }

    /// Replace node `n`'s feed by a snapshot of its fed segments: RESET, one COMMIT per
    /// committed replica, RESET_DONE, per segment.
    fn feed_snapshot(&mut self, n: u32) {
        let Some(ns) = self.nodes.get_mut(n as usize) else {
            return;
        };
        ns.feed.clear();
        ns.feed_reset = false;
        let ssd: Vec<u32> = ns
            .segments
            .iter()
            .copied()
            .filter(|s| self.segments.get(s).is_some_and(|g| fed(&g.spec)))
            .collect();
        let none = ObjectKey { hi: 0, lo: 0 };
        for seg in ssd {
            self.feed_push(Rep { seg, page: 0 }, SegmentEventKind::Reset, none, 0);
            let held: Vec<(Rep, ObjectKey, u64)> = self
                .entries
                .iter()
                .filter(|e| e.has(LIVE) && !e.has(PENDING))
                .flat_map(|e| {
                    e.replicas
                        .iter()
                        .filter(|r| r.seg == seg)
                        .map(|r| (*r, e.key, e.size))
                })
                .collect();
            for (r, key, size) in held {
                self.feed_commit(r, key, size);
            }
            self.feed_push(Rep { seg, page: 0 }, SegmentEventKind::ResetDone, none, 0);
        }
    }

    /// A heartbeat with the segment-event feed: record it, apply the agent's corrupt-block
    /// reports, drop the events it acknowledged (`acked` under `epoch`; epoch 0 means it just
    /// mounted and announced its index), and answer its queued tasks and up to [`FEED_BATCH`]
    /// pending events. An epoch from another master instance (a failover) or an overflowed
    /// feed is answered with a snapshot.
    pub fn heartbeat_feed(
        &mut self,
        node: &str,
        epoch: u64,
        acked: u64,
        corrupt: &[CorruptBlock],
    ) -> Result<HeartbeatReply, MasterError> {
        let tasks = self.heartbeat(node)?;
        let n = *self
            .node_ids
            .get(node)
            .ok_or_else(|| MasterError::UnknownNode(node.to_owned()))?;
        for c in corrupt {
            self.drop_corrupt(n, c);
        }
        let stale = epoch != 0 && epoch != self.feed_epoch;
        let ns = &mut self.nodes[n as usize];
        if stale {
            ns.feed_reset = true;
        } else {
            while ns.feed.front().is_some_and(|e| e.seq <= acked) {
                ns.feed.pop_front();
            }
        }
        if ns.feed_reset {
            self.feed_snapshot(n);
        }
        let events = self.nodes[n as usize]
            .feed
            .iter()
            .take(FEED_BATCH)
            .copied()
            .collect();
        Ok(HeartbeatReply {
            tasks,
            feed_epoch: self.feed_epoch,
            events,
        })
    }

    /// Drop the replica of `c.key` at `c.offset` in node `n`'s segment `c.segment_id` (its
    /// agent found it corrupt); the object is repaired from another replica, or forgotten when
    /// this was its last one.
    fn drop_corrupt(&mut self, n: u32, c: &CorruptBlock) {
        let owned = self
            .segments
            .get(&c.segment_id)
            .is_some_and(|s| s.node == n);
        let Some(slot) = self.find(&c.key).filter(|_| owned) else {
            return;
        };
        let Ok(page) = u32::try_from(c.offset / PAGE_BYTES) else {
            return;
        };
        let r = Rep {
            seg: c.segment_id,
            page,
        };
        let e = &self.entries[slot as usize];
        if e.has(PENDING) || !e.replicas.contains(&r) || !c.offset.is_multiple_of(PAGE_BYTES) {
            return;
        }
        let pages = e.pages();
        self.entries[slot as usize].replicas.retain(|x| *x != r);
        self.feed_free(r, c.key);
        self.free_rep(r, pages);
        self.counters.corrupt_dropped += 1;
        let e = &self.entries[slot as usize];
        if e.replicas.is_empty() {
            self.counters.objects_lost += 1;
            self.drop_object(slot);
            return;
        }
        if e.replicas.len() < usize::from(e.desired) {
            self.under.insert(slot);
        }
        self.sync_policy(slot);
        self.log_object(slot);
    }
}
