//! Hot objects: more replicas for a while. A caller that sees an object read often (the
//! conductor, for the blocks of a hot prompt prefix) asks for `replicas` copies for `ttl_ms`;
//! the object's desired replica count rises (never above the live nodes), the repair loop
//! copies it to other nodes as it copies under-replicated objects, and readers take the
//! nearest copy. When the time runs out the desired count falls back and the copies beyond it
//! are freed (those nobody is reading; the others at a later tick). Asking again extends the
//! time. Pure; no I/O.

use super::{BUSY, LIVE, MasterError, MasterState, PENDING};
use crate::master::types::ObjectKey;

/// How soon a trim that found the object read (or being copied) is tried again.
const TRIM_RETRY_MS: u64 = 1_000;

impl MasterState {
    /// Ask for `replicas` copies of the committed object `key` for `ttl_ms`: its desired
    /// replica count becomes at least that many (at most one per live node, and at most
    /// `max_replicas`) until then; a hot object asked again keeps its higher count and the
    /// later end. Answers the desired count now.
    pub fn replicate_hot(
        &mut self,
        key: ObjectKey,
        replicas: u8,
        ttl_ms: u64,
    ) -> Result<u8, MasterError> {
        if replicas == 0 || replicas > self.config.max_replicas {
            return Err(MasterError::InvalidArgument(format!(
                "replicas must be from 1 to {}, not {replicas}",
                self.config.max_replicas
            )));
        }
        if ttl_ms == 0 {
            return Err(MasterError::InvalidArgument(
                "hot replicas need a TTL > 0".into(),
            ));
        }
        let slot = self.committed_slot(&key)?;
        let alive = self.nodes.iter().filter(|n| n.alive).count();
        let target = replicas.min(u8::try_from(alive).unwrap_or(u8::MAX));
        let until = self.clock.now_ms().saturating_add(ttl_ms);
        let e = &mut self.entries[slot as usize];
        // A hot object keeps its own count and the later end; its raised count never falls
        // while it is hot.
        let (base, until) = match self.hot.get(&slot) {
            Some(&(base, was_until)) => (base, until.max(was_until)),
            None => (e.desired, until),
        };
        let desired = e.desired.max(target);
        if desired == base {
            return Ok(desired);
        }
        self.hot.insert(slot, (base, until));
        if e.desired != desired {
            e.desired = desired;
            if e.replicas.len() < usize::from(desired) {
                self.under.insert(slot);
            }
            self.log_object(slot);
        }
        self.counters.hot_requests += 1;
        Ok(desired)
    }

    /// Objects whose hot time ran out go back to their own replica count; copies beyond it
    /// that nobody reads or copies are freed, newest first (the hot copies were added last).
    pub(super) fn expire_hot(&mut self, now: u64) {
        let expired: Vec<(u32, u8)> = self
            .hot
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(slot, (base, _))| (*slot, *base))
            .collect();
        for (slot, base) in expired {
            self.hot.remove(&slot);
            let e = &self.entries[slot as usize];
            if !e.has(LIVE) || e.has(PENDING) {
                continue;
            }
            if e.leases > 0 || e.has(BUSY) {
                // Read or being copied now: keep the count up a little longer.
                self.hot.insert(slot, (base, now + TRIM_RETRY_MS));
                continue;
            }
            let key = e.key;
            let pages = e.pages();
            let e = &mut self.entries[slot as usize];
            e.desired = base;
            let extra = e.replicas.len().saturating_sub(usize::from(base));
            let dropped: Vec<_> = (0..extra).filter_map(|_| e.replicas.pop()).collect();
            self.under.remove(&slot);
            for r in dropped {
                self.feed_free(r, key);
                self.free_rep(r, pages);
                self.counters.hot_replicas_trimmed += 1;
            }
            self.settle(slot);
        }
    }

    /// Objects with more replicas asked for than their own count, now.
    pub fn hot_objects(&self) -> usize {
        self.hot.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{master, put, spec};
    use super::*;
    use crate::master::MasterConfig;
    use crate::master::types::{PutOptions, Tier};

    const MIB: u64 = 1 << 20;

    fn key(i: u64) -> ObjectKey {
        ObjectKey::from_bytes(&i.to_le_bytes())
    }

    /// Runs the repair loop to its end (one copy of an object at a time): ticks, and the
    /// tasks each of `nodes` gets with its heartbeat completed.
    fn repair(m: &mut MasterState, nodes: &[&str]) {
        for _ in 0..8 {
            for node in nodes {
                assert!(m.heartbeat(node).expect("hb").is_empty());
            }
            m.tick();
            for node in nodes {
                for t in m.heartbeat(node).expect("hb") {
                    m.complete_task(node, t.id, true).expect("complete");
                }
            }
            if m.stats().under_replicated == 0 {
                return;
            }
        }
        panic!("still under-replicated after 8 rounds");
    }

    #[test]
    fn a_hot_object_gains_copies_on_other_nodes_and_loses_them_when_it_cools() {
        let (mut m, clock) = master(MasterConfig::default());
        for n in ["a", "b", "c"] {
            m.mount(spec(n, "s", Tier::Dram, 64 * MIB)).expect("mount");
        }
        put(&mut m, key(1), MIB, &PutOptions::default());
        assert_eq!(m.get(key(1)).expect("get").replicas.len(), 1);

        // Three copies asked for: the repair loop makes them, one per node.
        assert_eq!(m.replicate_hot(key(1), 3, 10_000), Ok(3));
        repair(&mut m, &["a", "b", "c"]);
        let nodes: std::collections::BTreeSet<String> = m
            .get(key(1))
            .expect("get")
            .replicas
            .into_iter()
            .map(|r| r.node)
            .collect();
        assert_eq!(nodes.len(), 3, "{nodes:?}");
        assert_eq!(m.stats().used_bytes[0], 3 * MIB);
        assert_eq!(m.hot_objects(), 1);

        // Asking for fewer keeps the count; asking again extends the time.
        assert_eq!(m.replicate_hot(key(1), 2, 10_000), Ok(3));
        for _ in 0..3 {
            clock.advance_ms(3_000);
            repair(&mut m, &["a", "b", "c"]);
        }
        assert_eq!(m.replicate_hot(key(1), 3, 10_000), Ok(3));
        clock.advance_ms(2_000);
        repair(&mut m, &["a", "b", "c"]);
        let copies = |m: &MasterState| m.replica_tiers(&key(1)).expect("committed").len();
        assert_eq!(copies(&m), 3, "extended");

        // Cooled down: back to one copy, the space freed, nothing left to repair.
        clock.advance_ms(4_000);
        repair(&mut m, &["a", "b", "c"]);
        clock.advance_ms(4_001);
        repair(&mut m, &["a", "b", "c"]);
        assert_eq!(copies(&m), 1);
        assert_eq!(m.stats().used_bytes[0], MIB);
        assert_eq!(m.stats().under_replicated, 0);
        assert_eq!(m.hot_objects(), 0);
    }

    #[test]
    fn copies_never_exceed_the_live_nodes_and_a_read_copy_waits_for_its_reader() {
        let (mut m, clock) = master(MasterConfig::default());
        for n in ["a", "b"] {
            m.mount(spec(n, "s", Tier::Dram, 64 * MIB)).expect("mount");
        }
        put(&mut m, key(1), MIB, &PutOptions::default());
        // Two nodes: eight asked, two made.
        assert_eq!(m.replicate_hot(key(1), 8, 1_000), Ok(2));
        repair(&mut m, &["a", "b"]);
        assert_eq!(m.stats().under_replicated, 0);
        let got = m.get(key(1)).expect("get (takes a read lease)");
        assert_eq!(got.replicas.len(), 2);
        clock.advance_ms(1_000);
        repair(&mut m, &["a", "b"]);
        // The lease holds the copies a while longer.
        assert_eq!(m.hot_objects(), 1);
        m.release_lease(got.lease.id).expect("release");
        clock.advance_ms(TRIM_RETRY_MS);
        repair(&mut m, &["a", "b"]);
        assert_eq!(m.stats().used_bytes[0], MIB);
        assert_eq!(m.hot_objects(), 0);
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let (mut m, _clock) = master(MasterConfig::default());
        m.mount(spec("a", "s", Tier::Dram, 64 * MIB))
            .expect("mount");
        put(&mut m, key(1), MIB, &PutOptions::default());
        for (replicas, ttl) in [(0, 10), (9, 10), (2, 0)] {
            assert!(matches!(
                m.replicate_hot(key(1), replicas, ttl),
                Err(MasterError::InvalidArgument(_))
            ));
        }
        assert!(matches!(
            m.replicate_hot(key(2), 2, 10),
            Err(MasterError::UnknownKey(_))
        ));
        assert_eq!(m.hot_objects(), 0);
        // One node: nothing to add, nothing to remember.
        assert_eq!(m.replicate_hot(key(1), 2, 10), Ok(1));
        assert_eq!(m.hot_objects(), 0);
    }
}
