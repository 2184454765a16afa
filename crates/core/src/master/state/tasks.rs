//! Replication and demotion tasks: queuing them for the agent that does the copy, what a
//! completed or failed task changes, and scheduling repairs of under-replicated objects.
//! Pure; the agents copy the bytes and report back.

use smallvec::SmallVec;

use super::{BUSY, LIVE, MasterError, MasterState, PENDING, Rep, SPREAD_DOMAINS, TaskRec};
use crate::master::types::{PutOptions, Spread, Task, TaskKind, Tier};

impl MasterState {
    /// Mark `slot` busy and queue a task for `node`'s agent that copies `source` (`pages` pages
    /// of the object) to `target`. A demotion takes the pages out of the DRAM tier's usage
    /// meanwhile (the caller has counted them in `releasing_pages`).
    pub(super) fn start_task(
        &mut self,
        kind: TaskKind,
        slot: u32,
        source: Rep,
        target: Rep,
        node: u32,
        pages: u32,
    ) {
        let e = &mut self.entries[slot as usize];
        e.flags |= BUSY;
        let rec = TaskRec {
            kind,
            slot,
            generation: e.generation,
            source,
            target,
            node,
            deadline_ms: self.clock.now_ms() + self.config.task_timeout_ms,
            pages,
            releasing_pages: if kind == TaskKind::Demote { pages } else { 0 },
            key: e.key,
        };
        self.add_task(rec);
    }

    fn add_task(&mut self, rec: TaskRec) {
        let id = self.next_task;
        self.next_task += 1;
        if let Some(n) = self.nodes.get_mut(rec.node as usize) {
            n.outbox.push_back(id);
        }
        self.tasks.insert(id, rec);
    }

    pub(super) fn task_view(&self, id: u64) -> Option<Task> {
        let t = self.tasks.get(&id)?;
        let e = self.entries.get(t.slot as usize)?;
        Some(Task {
            id,
            kind: t.kind,
            key: e.key,
            source: self.replica_info(t.source, e.size)?,
            target: self.replica_info(t.target, e.size)?,
        })
    }

    /// An agent reports a task done (`ok`) or failed.
    pub fn complete_task(&mut self, node: &str, id: u64, ok: bool) -> Result<(), MasterError> {
        let n = self.node_ids.get(node).copied();
        if self.tasks.get(&id).map(|t| t.node) != n || n.is_none() {
            return Err(MasterError::UnknownTask(id));
        }
        self.finish_task(id, ok);
        Ok(())
    }

    pub(super) fn finish_task(&mut self, id: u64, ok: bool) {
        let Some(t) = self.tasks.remove(&id) else {
            return;
        };
        let src_tier = self.tier_of(t.source);
        if t.kind == TaskKind::Demote {
            self.releasing_pages[Tier::Dram.index()] -= u64::from(t.releasing_pages);
        }
        let target_alive = self.segments.contains_key(&t.target.seg);
        let object_ok = self
            .entries
            .get(t.slot as usize)
            .is_some_and(|e| e.has(LIVE) && e.generation == t.generation);
        let success = ok && target_alive && object_ok;
        if success {
            // The target becomes a replica (logged with the object below).
            self.log_unreserve(t.target);
        } else {
            if target_alive {
                self.feed_free(t.target, t.key);
            }
            if ok {
                // The copy finished: nothing more can arrive.
                self.log_unreserve(t.target);
                self.free_rep(t.target, t.pages);
            } else {
                // Failed or expired: the copy may still be writing.
                self.abandon(t.target, t.pages);
            }
        }
        if !object_ok {
            return;
        }
        let slot = t.slot;
        let pages = t.pages;
        self.entries[slot as usize].flags &= !BUSY;
        if success {
            let size = self.entries[slot as usize].size;
            self.feed_commit(t.target, t.key, size);
            self.entries[slot as usize].replicas.push(t.target);
        }
        let c = &mut self.counters;
        *match (t.kind, success) {
            (TaskKind::Repair, true) => &mut c.repairs_done,
            (TaskKind::Repair, false) => &mut c.repairs_failed,
            (TaskKind::Demote, true) => &mut c.demoted,
            (TaskKind::Demote, false) => &mut c.demotions_failed,
        } += 1;
        match t.kind {
            TaskKind::Repair => {
                let e = &self.entries[slot as usize];
                if e.replicas.len() < usize::from(e.desired) {
                    self.under.insert(slot);
                } else {
                    self.under.remove(&slot);
                }
            }
            TaskKind::Demote => {
                // The DRAM copy was chosen for eviction; free it unless a reader now holds a
                // lease on the object (then it stays and is evicted again later).
                let e = &self.entries[slot as usize];
                let src_present = e.replicas.contains(&t.source);
                if src_present && e.leases == 0 && src_tier == Some(Tier::Dram) {
                    self.entries[slot as usize]
                        .replicas
                        .retain(|r| *r != t.source);
                    self.free_rep(t.source, pages);
                    if !success {
                        self.counters.evicted_dropped[Tier::Dram.index()] += 1;
                    }
                }
            }
        }
        self.settle(slot);
    }

    pub(super) fn schedule_repairs(&mut self) -> u64 {
        let mut scheduled = 0;
        let candidates: Vec<u32> = self
            .under
            .iter()
            .copied()
            .take(self.config.repairs_per_tick)
            .collect();
        for slot in candidates {
            let e = &self.entries[slot as usize];
            if !e.has(LIVE) || e.has(PENDING) || e.replicas.len() >= usize::from(e.desired) {
                self.under.remove(&slot);
                continue;
            }
            if e.has(BUSY) {
                continue;
            }
            let Some(&source) = e.replicas.first() else {
                continue;
            };
            let existing: SmallVec<[Rep; 2]> = e.replicas.clone();
            let pages = e.pages();
            let Some(tier) = self.tier_of(source) else {
                continue;
            };
            let opts = PutOptions {
                spread: if self.entries[slot as usize].has(SPREAD_DOMAINS) {
                    Spread::FailureDomain
                } else {
                    Spread::Node
                },
                ..PutOptions::default()
            };
            let mut target = self.place(pages, 1, tier, &opts, &existing);
            if target.is_empty() && tier == Tier::Dram {
                target = self.place(pages, 1, Tier::Ssd, &opts, &existing);
            }
            let Some(&target) = target.first() else {
                continue;
            };
            let Some(node) = self.segments.get(&target.seg).map(|s| s.node) else {
                continue;
            };
            self.log_reserve(target, pages);
            self.start_task(TaskKind::Repair, slot, source, target, node, pages);
            scheduled += 1;
        }
        scheduled
    }
}
