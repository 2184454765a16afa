//! The periodic tick: expiry of read leases, soft pins, pending puts, tasks and restored
//! reservations; agents silent past the timeout declared dead; repairs scheduled; tiers evicted
//! down to their watermarks. Pure: the service calls it on a timer, time comes from the clock.

use std::collections::HashMap;

use super::{MasterState, Rep, SOFT_PIN, TickReport};
use crate::master::types::Tier;

impl MasterState {
    /// Expire leases, soft pins, pending puts and tasks; declare silent agents dead; schedule
    /// repairs; evict tiers above their high watermark. Call periodically.
    pub fn tick(&mut self) -> TickReport {
        let now = self.clock.now_ms();
        let mut report = TickReport::default();
        while let Some(&(exp, id)) = self.lease_expiry.first() {
            if exp > now {
                break;
            }
            if let Ok(held_ms) = self.release_lease(id) {
                self.counters.leases_expired += 1;
                report.expired_lease_holds_ms.push(held_ms);
            }
        }
        for s in expired(&self.soft_pins, now) {
            self.soft_pins.remove(&s);
            self.entries[s as usize].flags &= !SOFT_PIN;
        }
        for s in expired(&self.pending, now) {
            self.drop_object(s);
            self.counters.puts_expired += 1;
        }
        let expired_tasks: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.deadline_ms <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired_tasks {
            self.finish_task(id, false);
        }
        let released: Vec<(u32, u32, u32, u64)> = self
            .quarantine
            .iter()
            .copied()
            .filter(|q| q.3 <= now)
            .collect();
        self.quarantine.retain(|q| q.3 > now);
        for (seg, page, pages, _) in released {
            self.free_rep(Rep { seg, page }, pages);
            self.log_unreserve(Rep { seg, page });
        }
        let lost_before = self.counters.objects_lost;
        for n in 0..self.nodes.len() as u32 {
            let ns = &self.nodes[n as usize];
            if ns.alive && ns.last_heartbeat_ms + self.config.heartbeat_timeout_ms < now {
                report.dead_nodes.push(ns.name.clone());
                self.kill_node(n);
            }
        }
        report.objects_lost = self.counters.objects_lost - lost_before;
        self.expire_hot(now);
        report.repairs_scheduled = self.schedule_repairs();
        for t in Tier::ALL {
            report.evicted += self.evict_to_watermark(t);
        }
        report
    }
}

/// Slots whose deadline (soft pin or pending put) is `now` or earlier.
fn expired(deadlines: &HashMap<u32, u64>, now: u64) -> Vec<u32> {
    deadlines
        .iter()
        .filter(|(_, until)| **until <= now)
        .map(|(s, _)| *s)
        .collect()
}
