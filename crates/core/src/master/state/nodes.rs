//! Node liveness: heartbeats (which hand each agent its queued tasks), agent death, and the
//! transport state each node reports with its heartbeat. Pure: time comes from the injected
//! clock, the service calls these on each heartbeat RPC.

use super::{MasterError, MasterState};
use crate::master::types::{Task, TransportState};

impl MasterState {
    /// Record a heartbeat and hand the node its queued tasks.
    pub fn heartbeat(&mut self, node: &str) -> Result<Vec<Task>, MasterError> {
        let now = self.clock.now_ms();
        let n = *self
            .node_ids
            .get(node)
            .filter(|n| self.nodes[**n as usize].alive)
            .ok_or_else(|| MasterError::UnknownNode(node.to_owned()))?;
        let ns = &mut self.nodes[n as usize];
        ns.last_heartbeat_ms = now;
        // Heard from after a writer found it unreachable: placements resume.
        if ns.suspect_since_ms.is_some_and(|t| now > t) {
            ns.suspect_since_ms = None;
        }
        let ids: Vec<u64> = ns.outbox.drain(..).collect();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.task_view(id))
            .collect())
    }

    /// A writer could not reach the nodes named in `names`: place nothing there until each
    /// is heard from again (see [`PutOptions::avoid_nodes`]).
    ///
    /// [`PutOptions::avoid_nodes`]: crate::master::types::PutOptions::avoid_nodes
    pub(super) fn suspect_nodes(&mut self, names: &[String]) {
        let now = self.clock.now_ms();
        for name in names {
            if let Some(&n) = self.node_ids.get(name) {
                let ns = &mut self.nodes[n as usize];
                if ns.alive && ns.suspect_since_ms.is_none() {
                    ns.suspect_since_ms = Some(now);
                    self.counters.nodes_suspected += 1;
                }
            }
        }
    }

    pub(super) fn kill_node(&mut self, n: u32) {
        let segs = std::mem::take(&mut self.nodes[n as usize].segments);
        for s in segs {
            self.remove_segment(s);
        }
        let ns = &mut self.nodes[n as usize];
        ns.alive = false;
        ns.outbox.clear();
        ns.feed.clear();
        ns.feed_reset = false;
        self.counters.nodes_died += 1;
    }

    /// Keep the transport state `node` reported with its heartbeat (replacing the previous one).
    /// Unknown or dead nodes are refused as a heartbeat would be.
    pub fn record_transport(
        &mut self,
        node: &str,
        state: TransportState,
    ) -> Result<(), MasterError> {
        let known = self
            .node_ids
            .get(node)
            .is_some_and(|n| self.nodes.get(*n as usize).is_some_and(|ns| ns.alive));
        if !known {
            return Err(MasterError::UnknownNode(node.to_owned()));
        }
        self.transport.insert(node.to_owned(), state);
        Ok(())
    }

    /// The transport state of every live node that reported one, sorted by node name.
    pub fn transports(&self) -> Vec<(String, TransportState)> {
        let mut out: Vec<(String, TransportState)> = self
            .transport
            .iter()
            .filter(|(name, _)| {
                self.node_ids
                    .get(*name)
                    .and_then(|n| self.nodes.get(*n as usize))
                    .is_some_and(|ns| ns.alive)
            })
            .map(|(name, t)| (name.clone(), t.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}
