//! Unit tests of the metadata core, driven by a fake clock.

use std::sync::Arc;

use super::*;
use crate::master::clock::FakeClock;
use crate::master::types::{
    AdoptItem, Lease, PutOptions, PutStarted, ReplicaInfo, Spread, Task, Tier,
};

const MIB: u64 = 1 << 20;

fn key(i: u64) -> ObjectKey {
    ObjectKey::from_bytes(&i.to_le_bytes())
}

pub(super) fn spec(node: &str, name: &str, tier: Tier, capacity: u64) -> SegmentSpec {
    SegmentSpec::new(node, name, tier, capacity, format!("tcp://{node}:1"))
}

/// Mounts the segment `spec(node, name, tier, capacity)`; returns its id.
fn mount(m: &mut MasterState, node: &str, name: &str, tier: Tier, capacity: u64) -> u32 {
    m.mount(spec(node, name, tier, capacity)).expect("mount")
}

pub(super) fn master(config: MasterConfig) -> (MasterState, FakeClock) {
    let clock = FakeClock::new(1_000);
    (MasterState::new(config, Arc::new(clock.clone())), clock)
}

fn opts(replicas: u8) -> PutOptions {
    PutOptions {
        replicas,
        ..PutOptions::default()
    }
}

pub(super) fn put(
    m: &mut MasterState,
    k: ObjectKey,
    size: u64,
    o: &PutOptions,
) -> Vec<ReplicaInfo> {
    match m.put_start(k, size, o).expect("put_start") {
        PutStarted::Allocated { put_id, replicas } => {
            m.put_end(k, put_id).expect("put_end");
            replicas
        }
        PutStarted::AlreadyCommitted { .. } => panic!("unexpected duplicate"),
    }
}

/// One replica, written from `node`.
fn written_by(node: &str) -> PutOptions {
    PutOptions {
        writer_node: Some(node.into()),
        ..opts(1)
    }
}

fn start(m: &mut MasterState, k: ObjectKey, size: u64, o: &PutOptions) -> (u64, Vec<ReplicaInfo>) {
    match m.put_start(k, size, o).expect("put_start") {
        PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        PutStarted::AlreadyCommitted { .. } => panic!("unexpected duplicate"),
    }
}

#[test]
fn entry_stays_compact() {
    assert!(
        std::mem::size_of::<Entry>() <= 56,
        "{}",
        std::mem::size_of::<Entry>()
    );
}

#[test]
fn put_get_exists_prefix_roundtrip() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "dram0", Tier::Dram, 64 * MIB);
    let k: Vec<ObjectKey> = (0..4).map(key).collect();
    let (id, reps) = start(&mut m, k[0], 5000, &opts(1));
    assert_eq!(reps.len(), 1);
    assert_eq!(reps[0].length, 5000);
    assert_eq!(reps[0].offset % PAGE_BYTES, 0);
    // Pending objects are invisible to readers.
    assert_eq!(m.exists(&k[..1]), vec![false]);
    assert!(matches!(m.get(k[0]), Err(MasterError::UnknownKey(_))));
    m.put_end(k[0], id).expect("end");
    m.put_end(k[0], id).expect("ending twice is idempotent");
    put(&mut m, k[1], 100, &opts(1));
    put(&mut m, k[3], 100, &opts(1));
    assert_eq!(m.exists(&k), vec![true, true, false, true]);
    assert_eq!(m.longest_prefix(&k), 2);
    let got = m.get(k[0]).expect("get");
    assert_eq!(got.size, 5000);
    assert_eq!(got.replicas, reps);
    assert_eq!(m.stats().objects, 3);
    assert_eq!(
        m.stats().used_bytes[0],
        4 * PAGE_BYTES,
        "5000 B takes 2 pages, 100 B one"
    );
}

#[test]
fn placement_prefers_writer_then_numa_then_free_space_on_distinct_nodes() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s0", Tier::Dram, 64 * MIB);
    let mut numa1 = spec("a", "s1", Tier::Dram, 32 * MIB);
    numa1.numa_node = 1;
    m.mount(numa1).expect("mount");
    mount(&mut m, "b", "s0", Tier::Dram, 128 * MIB);
    mount(&mut m, "c", "s0", Tier::Dram, 16 * MIB);
    let o = PutOptions {
        replicas: 2,
        writer_node: Some("a".into()),
        numa_hint: Some(1),
        ..PutOptions::default()
    };
    let reps = put(&mut m, key(1), MIB, &o);
    assert_eq!(reps.len(), 2);
    assert_eq!(
        (reps[0].node.as_str(), reps[0].segment.as_str()),
        ("a", "s1")
    );
    assert_eq!(
        reps[1].node, "b",
        "second replica: most free space elsewhere"
    );
    // No writer: the emptiest segment first.
    let reps = put(&mut m, key(2), MIB, &opts(3));
    let nodes: Vec<&str> = reps.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(nodes, vec!["b", "a", "c"]);
    // More replicas than nodes: as many as possible, then repaired later.
    let reps = put(&mut m, key(3), MIB, &opts(4));
    assert_eq!(reps.len(), 3);
    assert_eq!(m.stats().under_replicated, 1);
}

#[test]
fn failure_domain_spread_uses_distinct_domains() {
    let (mut m, _clock) = master(MasterConfig::default());
    for (node, zone) in [("a", "z1"), ("b", "z1"), ("c", "z2")] {
        let mut s = spec(node, "s", Tier::Dram, 64 * MIB);
        s.failure_domain = zone.into();
        m.mount(s).expect("mount");
    }
    let o = PutOptions {
        replicas: 2,
        writer_node: Some("a".into()),
        spread: Spread::FailureDomain,
        ..PutOptions::default()
    };
    let reps = put(&mut m, key(1), MIB, &o);
    let nodes: Vec<&str> = reps.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(nodes, vec!["a", "c"]);
    // Repairs keep to the spread: with c gone, b (same zone as a) is not a valid target; a
    // new zone is.
    let c = m
        .segment_records()
        .into_iter()
        .find(|(_, s)| s.node == "c")
        .map(|(id, _)| id);
    m.unmount("c", c.expect("c mounted")).expect("unmount");
    m.tick();
    assert!(
        m.heartbeat("b").expect("hb").is_empty(),
        "no repair into the same zone"
    );
    let mut d = spec("d", "s", Tier::Dram, 64 * MIB);
    d.failure_domain = "z3".into();
    m.mount(d).expect("mount");
    m.tick();
    let tasks = m.heartbeat("d").expect("hb");
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].target.node, "d");
}

/// A pool spread over failure domains (`MasterConfig::spread`) places every put that way,
/// including those that ask only for distinct nodes; nodes that announce no domain only need
/// to be distinct nodes.
#[test]
fn pool_wide_failure_domain_spread_applies_to_every_put() {
    let config = MasterConfig {
        spread: Spread::FailureDomain,
        ..MasterConfig::default()
    };
    let (mut m, _clock) = master(config);
    for (node, zone) in [("a", "z1"), ("b", "z1"), ("c", "z2"), ("d", "z2")] {
        let mut s = spec(node, "s", Tier::Dram, 64 * MIB);
        s.failure_domain = zone.into();
        m.mount(s).expect("mount");
    }
    let zone = |n: &str| if n < "c" { "z1" } else { "z2" };
    for i in 0..20 {
        let o = PutOptions {
            replicas: 2,
            writer_node: Some(["a", "b", "c", "d"][i % 4].into()),
            ..PutOptions::default()
        };
        let reps = put(&mut m, key(i as u64), MIB, &o);
        assert_eq!(reps.len(), 2);
        assert_ne!(zone(&reps[0].node), zone(&reps[1].node), "{reps:?}");
    }
    // Three replicas over two domains: only two can be placed.
    assert_eq!(put(&mut m, key(100), MIB, &opts(3)).len(), 2);
    // A node without a domain counts only as a distinct node.
    mount(&mut m, "e", "s", Tier::Dram, 64 * MIB);
    assert_eq!(put(&mut m, key(101), MIB, &opts(3)).len(), 3);
}

#[test]
fn bad_puts_get_clear_errors_and_change_nothing() {
    let (mut m, _clock) = master(MasterConfig::default());
    assert_eq!(
        m.put_start(key(1), 10, &opts(1)),
        Err(MasterError::NoSegments)
    );
    mount(&mut m, "a", "s", Tier::Dram, 4 * MIB);
    let before = m.stats();
    assert!(matches!(
        m.put_start(key(1), 5 * MIB, &opts(1)),
        Err(MasterError::TooLarge { size, largest }) if size == 5 * MIB && largest == 4 * MIB
    ));
    assert!(matches!(
        m.put_start(key(1), 0, &opts(1)),
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.put_start(key(1), 1, &opts(0)),
        Err(MasterError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.put_start(key(1), 1, &opts(200)),
        Err(MasterError::InvalidArgument(_))
    ));
    assert_eq!(m.stats(), before);

    let (id, _) = start(&mut m, key(1), 100, &opts(1));
    let mid = m.stats();
    assert!(matches!(
        m.put_start(key(1), 100, &opts(1)),
        Err(MasterError::PutInProgress(_))
    ));
    assert!(matches!(
        m.put_end(key(2), id),
        Err(MasterError::StalePut { .. })
    ));
    assert!(matches!(
        m.put_end(key(1), id ^ (1 << 40)),
        Err(MasterError::StalePut { .. })
    ));
    assert!(matches!(
        m.put_end(key(1), u64::MAX),
        Err(MasterError::StalePut { .. })
    ));
    assert!(matches!(
        m.remove(key(1)),
        Err(MasterError::PutInProgress(_))
    ));
    assert_eq!(m.stats(), mid);
    m.put_end(key(1), id).expect("end");
    // Duplicate put of the same size: idempotent, nothing allocated.
    let done = m.stats();
    assert_eq!(
        m.put_start(key(1), 100, &opts(1)),
        Ok(PutStarted::AlreadyCommitted { size: 100 })
    );
    assert!(matches!(
        m.put_start(key(1), 200, &opts(1)),
        Err(MasterError::SizeConflict {
            existing: 100,
            requested: 200,
            ..
        })
    ));
    assert!(matches!(
        m.put_revoke(key(1), id),
        Err(MasterError::StalePut { .. })
    ));
    assert!(matches!(m.remove(key(9)), Err(MasterError::UnknownKey(_))));
    assert!(matches!(m.get(key(9)), Err(MasterError::UnknownKey(_))));
    assert!(matches!(
        m.pin(key(9), true, 0),
        Err(MasterError::UnknownKey(_))
    ));
    assert!(matches!(
        m.release_lease(77),
        Err(MasterError::StaleLease(77))
    ));
    assert_eq!(m.stats(), done);
}

/// A master with the default configuration and `capacity` of DRAM on node a; returns its clock
/// and its reuse delay too.
fn dram_on_a(capacity: u64) -> (MasterState, FakeClock, u64) {
    let (mut m, clock) = master(MasterConfig::default());
    let delay = m.config().reuse_delay_ms;
    mount(&mut m, "a", "s", Tier::Dram, capacity);
    (m, clock, delay)
}

#[test]
fn revoke_and_put_timeout_free_space() {
    let (mut m, clock, delay) = dram_on_a(4 * MIB);
    let (id, _) = start(&mut m, key(1), MIB, &opts(1));
    assert_eq!(m.stats().used_bytes[0], MIB);
    m.put_revoke(key(1), id).expect("revoke");
    assert!(matches!(
        m.put_end(key(1), id),
        Err(MasterError::StalePut { .. })
    ));
    // Held back for the reuse delay, then free.
    assert_eq!(m.stats().used_bytes[0], MIB);
    clock.advance_ms(delay);
    m.tick();
    assert_eq!(m.stats().used_bytes[0], 0);
    let (id, _) = start(&mut m, key(1), MIB, &opts(1));
    clock.advance_ms(m.config().put_timeout_ms + 1);
    m.tick();
    assert_eq!(m.stats().pending_puts, 0);
    assert!(matches!(
        m.put_end(key(1), id),
        Err(MasterError::StalePut { .. })
    ));
    assert_eq!(m.counters().puts_expired, 1);
    // (The agent died meanwhile, silent past its heartbeat timeout: its space went with it.)
    assert_eq!(m.counters().reuse_deferred, 2);
}

#[test]
fn an_abandoned_write_keeps_its_space_from_the_next_object_until_the_reuse_delay() {
    let (mut m, clock, delay) = dram_on_a(2 * MIB);
    let (id, first) = start(&mut m, key(1), MIB, &opts(1));
    m.put_revoke(key(1), id).expect("revoke");
    clock.advance_ms(1_000);
    // The next object goes elsewhere: a late write of the revoked put cannot reach it.
    let second = put(&mut m, key(2), MIB, &opts(1));
    assert_ne!(second[0].offset, first[0].offset);
    // While the revoked range is held back, room is made elsewhere (key 2 is evicted).
    let (id3, third) = start(&mut m, key(3), MIB, &opts(1));
    assert_ne!(
        third[0].offset, first[0].offset,
        "the held-back range was given out"
    );
    m.put_revoke(key(3), id3).expect("revoke");
    // The journal still holds the reservation (a new leader keeps it too) until released.
    let journal = m.take_journal();
    assert!(
        !journal.iter().any(
            |op| matches!(op, JournalOp::Unreserve { offset, .. } if *offset == first[0].offset)
        ),
        "unreserved before the delay: {journal:?}"
    );
    clock.advance_ms(delay - 1_001);
    m.tick();
    assert_eq!(
        m.stats().used_bytes[0],
        2 * MIB,
        "both revoked ranges held back"
    );
    clock.advance_ms(1);
    m.tick();
    assert_eq!(
        m.stats().used_bytes[0],
        MIB,
        "the first released, the second not yet"
    );
    let fourth = put(&mut m, key(4), MIB, &opts(1));
    assert_eq!(fourth[0].offset, first[0].offset);
    // A put of which nothing was sent is given back at once.
    let (id5, fifth) = start(&mut m, key(5), MIB, &opts(1));
    m.put_revoke_unsent(key(5), id5).expect("revoke unsent");
    let sixth = put(&mut m, key(6), MIB, &opts(1));
    assert_eq!(sixth[0].offset, fifth[0].offset);
    // Without a delay the range is given out at once.
    let (mut m, _clock) = master(MasterConfig {
        reuse_delay_ms: 0,
        ..MasterConfig::default()
    });
    mount(&mut m, "a", "s", Tier::Dram, MIB);
    let (id, _) = start(&mut m, key(1), MIB, &opts(1));
    m.put_revoke(key(1), id).expect("revoke");
    put(&mut m, key(2), MIB, &opts(1));
    assert_eq!(m.counters().reuse_deferred, 0);
}

#[test]
fn lease_hold_times_are_reported_on_release_and_on_expiry() {
    let (mut m, clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s", Tier::Dram, 4 * MIB);
    put(&mut m, key(1), MIB, &opts(1));
    let first = m.get(key(1)).expect("get").lease;
    let second = m.get(key(1)).expect("get").lease;
    clock.advance_ms(40);
    assert_eq!(m.release_lease(first.id).expect("release"), 40);
    assert!(m.tick().expired_lease_holds_ms.is_empty());
    let ttl = m.config().lease_ttl_ms;
    clock.advance_ms(ttl);
    let report = m.tick();
    assert_eq!(report.expired_lease_holds_ms, vec![ttl + 40]);
    assert_eq!(m.counters().leases_expired, 1);
    assert!(matches!(
        m.release_lease(second.id),
        Err(MasterError::StaleLease(_))
    ));
    m.remove(key(1)).expect("no lease left");
}

/// The default configuration with the watermarks `high` and `low` on both tiers.
fn watermarked(high: f64, low: f64) -> MasterConfig {
    MasterConfig {
        watermarks: [Watermarks { high, low }; 2],
        ..MasterConfig::default()
    }
}

fn small_pool(policy: PolicyKind) -> (MasterState, FakeClock) {
    let config = MasterConfig {
        policy,
        ..watermarked(0.9, 0.7)
    };
    let (mut m, clock) = master(config);
    // 10 objects of 1 MiB fill it.
    mount(&mut m, "a", "s", Tier::Dram, 10 * MIB);
    (m, clock)
}

#[test]
fn eviction_at_high_watermark_follows_lru_and_respects_leases_and_pins() {
    let (mut m, _clock) = small_pool(PolicyKind::Lru);
    for i in 0..9 {
        put(&mut m, key(i), MIB, &opts(1));
    }
    assert_eq!(m.stats().objects, 9, "90% is not above the high watermark");
    // Object 0: leased. 1: hard pinned. 2: soft pinned. 3: touched recently.
    let lease = m.get(key(0)).expect("get").lease;
    m.pin(key(1), true, 0).expect("hard pin");
    m.pin(key(2), false, 60_000).expect("soft pin");
    m.get(key(3)).expect("touch");
    // Crossing 90% evicts down to 70%: 10 -> 7 objects, oldest unprotected first: 4, 5, 6.
    put(&mut m, key(9), MIB, &opts(1));
    assert_eq!(m.stats().objects, 7);
    let alive = m.exists(&(0..10).map(key).collect::<Vec<_>>());
    assert_eq!(
        alive,
        vec![
            true, true, true, true, false, false, false, true, true, true
        ]
    );
    assert_eq!(m.counters().evicted_dropped[0], 3);
    assert!(matches!(
        m.remove(key(0)),
        Err(MasterError::Leased { leases: 1, .. })
    ));
    m.release_lease(lease.id).expect("release");
    assert!(matches!(
        m.release_lease(lease.id),
        Err(MasterError::StaleLease(_))
    ));
}

#[test]
fn soft_pins_go_last_and_hard_pins_never() {
    let (mut m, clock) = small_pool(PolicyKind::Lru);
    for i in 0..9 {
        put(&mut m, key(i), MIB, &opts(1));
        m.pin(key(i), i < 4, 60_000).expect("pin");
    }
    // 0..4 hard, 4..9 soft, the newcomer is still pending while eviction runs: eviction has
    // to take soft-pinned objects, oldest first, and never a hard-pinned one.
    put(&mut m, key(9), MIB, &opts(1));
    let all: Vec<ObjectKey> = (0..10).map(key).collect();
    assert_eq!(
        m.exists(&all),
        vec![
            true, true, true, true, false, false, false, true, true, true
        ]
    );
    // Once soft pins expire, an unpinned object is no longer protected and the old soft-pinned
    // ones (now plain) go in LRU order: 10 -> 7 MiB takes 7, 8 and 9 before the newer puts.
    clock.advance_ms(60_001);
    m.heartbeat("a").expect("hb");
    m.tick();
    assert_eq!(m.stats().soft_pins, 0);
    for i in 10..13 {
        put(&mut m, key(i), MIB, &opts(1));
    }
    let all: Vec<ObjectKey> = (0..13).map(key).collect();
    let alive = m.exists(&all);
    assert!(alive[..4].iter().all(|a| *a), "hard pins stay: {alive:?}");
    assert_eq!(
        &alive[7..],
        &[false, false, false, true, true, true],
        "{alive:?}"
    );
}

/// A pin given with the put holds from the commit on: filling the pool with such objects
/// evicts none of them (a pin sent after the put could find its object evicted already), a
/// soft pin is counted, and a put of a committed key pins it.
#[test]
fn pins_given_with_the_put_hold_from_the_commit() {
    let (mut m, _clock) = small_pool(PolicyKind::Lru);
    let hard = PutOptions {
        hard_pin: true,
        ..opts(1)
    };
    for i in 0..10 {
        put(&mut m, key(i), MIB, &hard);
    }
    let all: Vec<ObjectKey> = (0..10).map(key).collect();
    assert_eq!(m.exists(&all), vec![true; 10], "none evicted at 100%");
    assert!(matches!(
        m.put_start(key(10), MIB, &opts(1)),
        Err(MasterError::NoSpace { .. })
    ));
    m.remove(key(9)).expect("remove");
    let soft = PutOptions {
        soft_pin_ttl_ms: 60_000,
        ..opts(1)
    };
    put(&mut m, key(9), MIB, &soft);
    assert_eq!(m.stats().soft_pins, 1);
    // A put of the committed key with a hard pin pins it (and moves no byte).
    assert!(matches!(
        m.put_start(key(9), MIB, &hard),
        Ok(PutStarted::AlreadyCommitted { .. })
    ));
    m.unpin(key(0)).expect("unpin");
    // Only object 0 is unpinned now: the next put evicts it and nothing else.
    m.remove(key(1)).expect("remove");
    put(&mut m, key(1), MIB, &opts(1));
    put(&mut m, key(11), MIB, &opts(1));
    let alive = m.exists(&[key(0), key(9), key(11)]);
    assert_eq!(alive, vec![false, true, true], "{alive:?}");
}

#[test]
fn leased_objects_survive_space_pressure() {
    for policy in PolicyKind::ALL {
        leased_objects_survive_space_pressure_under(policy);
    }
}

/// Hard pins and leases hold under every policy; soft pins go only when nothing else can.
#[test]
fn every_policy_spares_leased_and_pinned_objects() {
    for policy in PolicyKind::ALL {
        let (mut m, _clock) = small_pool(policy);
        for i in 0..9 {
            put(&mut m, key(i), MIB, &opts(1));
        }
        // Make 0..3 the most frequently and recently used, then protect them.
        for _ in 0..3 {
            for i in 0..3 {
                m.get(key(i)).expect("get");
            }
        }
        let lease = m.get(key(3)).expect("get").lease;
        m.pin(key(4), true, 0).expect("hard pin");
        m.pin(key(5), false, 60_000).expect("soft pin");
        // Each new put crosses the high watermark again; 20 of them churn the pool.
        for i in 100..120 {
            put(&mut m, key(i), MIB, &opts(1));
        }
        let alive = m.exists(&[key(3), key(4), key(5)]);
        assert_eq!(
            alive,
            vec![true, true, true],
            "{policy:?}: leased, hard-pinned and (with other victims left) soft-pinned stay"
        );
        assert!(m.counters().evicted_dropped[0] >= 18, "{policy:?} evicted");
        m.release_lease(lease.id).expect("release");
    }
}

fn leased_objects_survive_space_pressure_under(policy: PolicyKind) {
    let (mut m, clock) = small_pool(policy);
    for i in 0..10 {
        put(&mut m, key(i), MIB, &opts(1));
    }
    let leases: Vec<Lease> = m
        .exists(&(0..10).map(key).collect::<Vec<_>>())
        .iter()
        .enumerate()
        .filter(|(_, alive)| **alive)
        .map(|(i, _)| m.get(key(i as u64)).expect("get").lease)
        .collect();
    let leased_count = leases.len();
    // Every resident object is leased: a new put finds no space and nothing changes.
    let before = m.stats();
    if before.used_bytes[0] + MIB > before.capacity_bytes[0] {
        assert_eq!(
            m.put_start(key(100), MIB, &opts(1)),
            Err(MasterError::NoSpace { size: MIB })
        );
        assert_eq!(m.stats(), before);
    }
    // Leases expire; then space can be reclaimed.
    clock.advance_ms(m.config().lease_ttl_ms + 1);
    m.tick();
    assert_eq!(m.stats().leases, 0);
    assert_eq!(m.counters().leases_expired, leased_count as u64);
    put(&mut m, key(100), MIB, &opts(1));
}

#[test]
fn agent_death_drops_its_replicas_and_schedules_repair() {
    let (mut m, clock) = master(MasterConfig::default());
    for n in ["a", "b", "c"] {
        mount(&mut m, n, "s", Tier::Dram, 64 * MIB);
    }
    let o = PutOptions {
        replicas: 2,
        writer_node: Some("a".into()),
        ..PutOptions::default()
    };
    let mut keys = Vec::new();
    for i in 0..20 {
        put(&mut m, key(i), MIB, &o);
        keys.push(key(i));
    }
    let one = PutOptions {
        replicas: 1,
        writer_node: Some("a".into()),
        ..PutOptions::default()
    };
    put(&mut m, key(100), MIB, &one);
    // b and c keep heartbeating, a goes silent.
    let timeout = m.config().heartbeat_timeout_ms;
    clock.advance_ms(timeout / 2);
    m.heartbeat("b").expect("hb");
    m.heartbeat("c").expect("hb");
    clock.advance_ms(timeout / 2 + 1);
    m.heartbeat("b").expect("hb");
    m.heartbeat("c").expect("hb");
    let report = m.tick();
    assert_eq!(report.dead_nodes, vec!["a".to_string()]);
    assert_eq!(
        report.objects_lost, 1,
        "only the single-replica object is lost"
    );
    assert!(matches!(m.heartbeat("a"), Err(MasterError::UnknownNode(_))));
    assert_eq!(m.exists(&keys), vec![true; 20]);
    for k in &keys {
        let got = m.get(*k).expect("readable");
        assert_eq!(got.replicas.len(), 1);
        assert_ne!(got.replicas[0].node, "a");
    }
    assert_eq!(report.repairs_scheduled, 20);
    assert_eq!(m.stats().under_replicated, 20);
    // Tasks go to the target node with the heartbeat; target differs from the source node.
    let mut tasks = m.heartbeat("b").expect("hb");
    tasks.extend(m.heartbeat("c").expect("hb"));
    assert_eq!(tasks.len(), 20);
    for t in &tasks {
        assert_eq!(t.kind, TaskKind::Repair);
        assert_ne!(t.source.node, t.target.node);
        m.complete_task(&t.target.node, t.id, true)
            .expect("complete");
    }
    assert!(matches!(
        m.complete_task("b", tasks[0].id, true),
        Err(MasterError::UnknownTask(_))
    ));
    assert_eq!(m.stats().under_replicated, 0);
    for k in &keys {
        assert_eq!(m.get(*k).expect("get").replicas.len(), 2);
    }
    assert_eq!(m.counters().repairs_done, 20);
}

/// Nodes a, b and c with `capacity` of DRAM each (and `reuse_delay_ms`); key 1 (1 MiB) stored
/// on a and b before c came, then b unmounted: after a tick, the one repair task (to c) that
/// c's heartbeat hands out. Returns b's segment id and that task.
fn repairing_to_c(reuse_delay_ms: u64, capacity: u64) -> (MasterState, FakeClock, u32, Vec<Task>) {
    let (mut m, clock) = master(MasterConfig {
        reuse_delay_ms,
        ..MasterConfig::default()
    });
    mount(&mut m, "a", "s", Tier::Dram, capacity);
    let b = mount(&mut m, "b", "s", Tier::Dram, capacity);
    put(&mut m, key(1), MIB, &opts(2));
    mount(&mut m, "c", "s", Tier::Dram, capacity);
    m.unmount("b", b).expect("unmount");
    m.tick();
    let tasks = m.heartbeat("c").expect("hb");
    assert_eq!(tasks.len(), 1);
    (m, clock, b, tasks)
}

#[test]
fn failed_or_expired_repairs_free_their_target_and_retry() {
    let (mut m, clock, b, tasks) = repairing_to_c(1_000, 64 * MIB);
    assert!(matches!(
        m.unmount("b", b),
        Err(MasterError::UnknownSegment { .. })
    ));
    assert_eq!(m.stats().used_bytes[0], 2 * MIB, "source + reserved target");
    m.complete_task("c", tasks[0].id, false).expect("fail");
    // The failed copy's target is held back for the reuse delay, then freed; the repair is
    // scheduled again in the same tick (source + new target).
    assert_eq!(m.stats().used_bytes[0], 2 * MIB);
    clock.advance_ms(1_000);
    m.tick();
    assert_eq!(m.stats().used_bytes[0], 2 * MIB);
    let tasks = m.heartbeat("c").expect("hb");
    assert_eq!(tasks.len(), 1, "rescheduled");
    clock.advance_ms(m.config().task_timeout_ms + 1);
    m.heartbeat("a").expect("hb");
    m.heartbeat("c").expect("hb");
    m.tick();
    assert_eq!(m.counters().repairs_failed, 2);
}

#[test]
fn put_racing_agent_death_never_commits_dead_memory() {
    let (mut m, clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "b", "s", Tier::Dram, 64 * MIB);
    let (id1, reps) = start(&mut m, key(1), MIB, &opts(2));
    assert_eq!(reps.len(), 2);
    let (id2, _) = start(&mut m, key(2), MIB, &opts(1));
    clock.advance_ms(m.config().heartbeat_timeout_ms / 2);
    m.heartbeat("b").expect("hb");
    clock.advance_ms(m.config().heartbeat_timeout_ms / 2 + 1);
    m.heartbeat("b").expect("hb");
    m.tick();
    // key 1 commits on b only, and is queued for repair.
    m.put_end(key(1), id1).expect("commit on survivor");
    let got = m.get(key(1)).expect("get");
    assert_eq!(got.replicas.len(), 1);
    assert_eq!(got.replicas[0].node, "b");
    assert_eq!(m.stats().under_replicated, 1);
    // key 2 lived on the emptier node; if that was a, the put fails cleanly.
    match m.put_end(key(2), id2) {
        Ok(()) => assert_eq!(m.get(key(2)).expect("get").replicas[0].node, "b"),
        Err(e) => {
            assert!(matches!(e, MasterError::ReplicasLost(_)));
            assert_eq!(m.exists(&[key(2)]), vec![false]);
        }
    }
    // Now b dies too, while a put is pending there.
    let (id4, _) = start(&mut m, key(4), MIB, &opts(1));
    clock.advance_ms(m.config().heartbeat_timeout_ms + 1);
    m.tick();
    assert_eq!(
        m.put_end(key(4), id4),
        Err(MasterError::ReplicasLost(key(4).to_hex()))
    );
    assert_eq!(m.exists(&[key(1), key(4)]), vec![false, false]);
    assert_eq!(m.stats().objects, 0);
}

/// Node "a" with 10 MiB of DRAM (watermarks 90% / 50%) over 100 MiB of SSD, and ten 1 MiB
/// objects put on it, keys 0 to 9 oldest first: DRAM has just crossed its high watermark.
fn full_dram_over_ssd() -> MasterState {
    let config = watermarked(0.9, 0.5);
    let (mut m, _clock) = master(config);
    mount(&mut m, "a", "dram", Tier::Dram, 10 * MIB);
    mount(&mut m, "a", "ssd", Tier::Ssd, 100 * MIB);
    for i in 0..10 {
        put(&mut m, key(i), MIB, &opts(1));
    }
    m
}

#[test]
fn dram_eviction_demotes_to_ssd_on_the_same_node() {
    let mut m = full_dram_over_ssd();
    // Crossing 90% of DRAM: 10 -> 5 MiB by demoting the 5 oldest objects.
    let tasks = m.heartbeat("a").expect("hb");
    assert_eq!(tasks.len(), 5);
    assert!(tasks.iter().all(|t| t.kind == TaskKind::Demote
        && t.source.tier == Tier::Dram
        && t.target.tier == Tier::Ssd));
    // While demotions run, the objects stay readable from DRAM.
    let leased = m.get(tasks[0].key).expect("get");
    assert_eq!(leased.replicas.len(), 1);
    assert_eq!(leased.replicas[0].tier, Tier::Dram);
    for t in &tasks {
        m.complete_task("a", t.id, true).expect("done");
    }
    // Leased object keeps its DRAM copy as well; others moved.
    assert_eq!(
        m.replica_tiers(&tasks[0].key).expect("tiers"),
        vec![Tier::Dram, Tier::Ssd]
    );
    for t in &tasks[1..] {
        assert_eq!(m.replica_tiers(&t.key).expect("tiers"), vec![Tier::Ssd]);
    }
    assert_eq!(m.stats().objects, 10, "nothing dropped");
    assert_eq!(m.counters().demoted, 5);
    assert_eq!(m.stats().used_bytes[1], 5 * MIB);
    m.release_lease(leased.lease.id).expect("release");
}

#[test]
fn snapshot_restore_roundtrip() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "b", "s", Tier::Ssd, 64 * MIB);
    for i in 0..10 {
        put(&mut m, key(i), 3 * PAGE_BYTES + i, &opts(2));
    }
    m.pin(key(3), true, 0).expect("pin");
    let segs = m.segment_records();
    let objs = m.object_records();
    let (mut n, _c) = master(MasterConfig::default());
    assert_eq!(n.restore(segs.clone(), objs.clone(), Vec::new()), 0);
    assert_eq!(n.stats().objects, 10);
    assert_eq!(n.stats().used_bytes, m.stats().used_bytes);
    assert_eq!(n.segment_records(), segs);
    let mut a = n.object_records();
    let mut b = objs;
    a.sort_by_key(|r| r.key);
    b.sort_by_key(|r| r.key);
    assert_eq!(a, b);
    // New allocations never overlap restored ones.
    let (_, reps) = start(&mut n, key(99), MIB, &opts(1));
    for r in n.object_records().iter().flat_map(|o| o.replicas.clone()) {
        let seg_same = r.0 == reps[0].segment_id;
        assert!(!seg_same || r.1 + 4 * PAGE_BYTES <= reps[0].offset || reps[0].offset + MIB <= r.1);
    }
}

#[test]
fn a_new_leader_honours_unknown_leases_for_one_lease_ttl() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    put(&mut m, key(1), MIB, &opts(1));
    let (mut n, clock) = master(MasterConfig::default());
    assert_eq!(
        n.restore(m.segment_records(), m.object_records(), Vec::new()),
        0
    );
    // A reader may still hold a lease granted by the old leader: remove is refused as leased
    // (retryable) and changes nothing ...
    let before = n.stats();
    assert!(matches!(n.remove(key(1)), Err(MasterError::Leased { .. })));
    assert_eq!(n.stats(), before);
    // Objects committed on the new leader are not affected: all their leases are known.
    put(&mut n, key(2), MIB, &opts(1));
    n.remove(key(2))
        .expect("remove of an object committed after the takeover");
    // ... until every such lease has expired.
    clock.advance_ms(MasterConfig::default().lease_ttl_ms);
    n.remove(key(1)).expect("remove after one lease TTL");
    assert_eq!(n.stats().objects, 0);
}

#[test]
fn journal_replays_into_an_equal_state() {
    let (mut m, clock) = master(MasterConfig::default());
    m.enable_journal();
    mount(&mut m, "a", "s", Tier::Dram, 16 * MIB);
    let b = mount(&mut m, "b", "s", Tier::Dram, 16 * MIB);
    mount(&mut m, "c", "s", Tier::Dram, 16 * MIB);
    for i in 0..30 {
        put(&mut m, key(i), MIB / 2, &opts(2));
    }
    m.pin(key(1), true, 0).expect("pin");
    m.remove(key(2)).expect("remove");
    let (pending_id, _) = start(&mut m, key(100), MIB, &opts(1));
    m.unmount("b", b).expect("unmount");
    m.tick();
    // Replay the journal into key-value maps, as etcd would hold them.
    let (segs, objs, reserved, ids_used) = replay(m.take_journal());
    assert!(ids_used > 1);
    assert!(m.take_journal().is_empty());
    let mut want = m.object_records();
    want.sort_by_key(|r| r.key);
    assert_eq!(objs, want);
    assert_eq!(segs, m.segment_records());
    // The pending put and the repair targets are reserved.
    assert!(!reserved.is_empty());
    let reserved_bytes: u64 = reserved.iter().map(|(_, _, l)| l).sum();
    let (mut n, nclock) = master(MasterConfig::default());
    assert_eq!(n.restore(m.segment_records(), want, reserved), 0);
    assert_eq!(n.stats().used_bytes, m.stats().used_bytes);
    // The old put id means nothing to the new leader; the key can be put again at once.
    assert!(matches!(
        n.put_end(key(100), pending_id),
        Err(MasterError::StalePut { .. })
    ));
    put(&mut n, key(100), MIB, &opts(1));
    // Quarantined space comes back after the put timeout.
    let used = n.stats().used_bytes[0];
    nclock.advance_ms(n.config().task_timeout_ms + 1);
    for node in ["a", "c"] {
        n.heartbeat(node).expect("hb");
    }
    let tasks_before = n.stats().tasks;
    n.tick();
    let new_repairs = n.stats().tasks - tasks_before;
    assert_eq!(
        n.stats().used_bytes[0],
        used - reserved_bytes + new_repairs * (MIB / 2),
        "reservations released, new repair targets allocated"
    );
    let _ = clock;
}

/// Structural invariants of the core, checked after every operation of the property test.
fn check_invariants(m: &MasterState) {
    use std::collections::HashMap as Map;
    // Every extent in use, per segment: replicas, task targets, quarantine.
    let mut extents: Map<u32, Vec<(u32, u32)>> = Map::new();
    let mut live = 0u64;
    let mut tracked = [0usize; 2];
    for (slot, e) in m.entries.iter().enumerate() {
        if !e.has(LIVE) {
            continue;
        }
        live += 1;
        assert_eq!(m.find(&e.key), Some(slot as u32), "indexed");
        for r in &e.replicas {
            assert!(
                m.segments.contains_key(&r.seg),
                "replica on a removed segment"
            );
            extents.entry(r.seg).or_default().push((r.page, e.pages()));
        }
        if !e.has(PENDING) {
            assert!(!e.replicas.is_empty(), "committed object without replicas");
        }
        for t in Tier::ALL {
            let has = !e.has(PENDING) && e.replicas.iter().any(|r| m.tier_of(*r) == Some(t));
            assert_eq!(
                e.has(IN_POLICY[t.index()]),
                has,
                "policy membership of slot {slot}"
            );
            tracked[t.index()] += usize::from(has);
        }
        let leases = m
            .leases
            .values()
            .filter(|l| l.slot == slot as u32 && l.generation == e.generation)
            .count();
        assert_eq!(usize::from(e.leases), leases, "lease count of slot {slot}");
    }
    assert_eq!(live, m.live_objects);
    assert_eq!(m.index.len() as u64, live);
    for t in Tier::ALL {
        assert_eq!(
            m.policies[t.index()].len(),
            tracked[t.index()],
            "policy size"
        );
    }
    for t in m.tasks.values() {
        if m.segments.contains_key(&t.target.seg) {
            let pages = t.pages;
            extents
                .entry(t.target.seg)
                .or_default()
                .push((t.target.page, pages));
        }
    }
    for (seg, page, pages, _) in &m.quarantine {
        extents.entry(*seg).or_default().push((*page, *pages));
    }
    let mut used = [0u64; 2];
    for (id, seg) in &m.segments {
        let mut v = extents.remove(id).unwrap_or_default();
        v.sort_unstable();
        for w in v.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "overlapping extents on segment {id}: {w:?}"
            );
        }
        let pages: u64 = v.iter().map(|(_, n)| u64::from(*n)).sum();
        assert_eq!(
            seg.alloc.used_bytes(),
            pages * PAGE_BYTES,
            "segment {id} accounting"
        );
        used[seg.spec.tier.index()] += pages;
    }
    assert_eq!(used, m.used_pages, "tier accounting");
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8, u8, u8),
    Start(u8, u8),
    End(u8),
    Revoke(u8),
    Get(u8),
    Release(u8),
    Remove(u8),
    Pin(u8, bool),
    Beat(u8),
    Advance(u16),
    Complete(u8, bool),
    Remount(u8),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u8..40, 1u8..4, 1u8..3).prop_map(|(k, s, r)| Op::Put(k, s, r)),
        2 => (0u8..40, 1u8..4).prop_map(|(k, s)| Op::Start(k, s)),
        2 => any::<u8>().prop_map(Op::End),
        1 => any::<u8>().prop_map(Op::Revoke),
        3 => (0u8..40).prop_map(Op::Get),
        2 => any::<u8>().prop_map(Op::Release),
        1 => (0u8..40).prop_map(Op::Remove),
        1 => (0u8..40, any::<bool>()).prop_map(|(k, h)| Op::Pin(k, h)),
        3 => (0u8..3).prop_map(Op::Beat),
        2 => (0u16..4000).prop_map(Op::Advance),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(t, ok)| Op::Complete(t, ok)),
        1 => (0u8..3).prop_map(Op::Remount),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    #[test]
    fn random_operations_keep_the_core_consistent(
        ops in proptest::collection::vec(op(), 1..120),
        policy in proptest::sample::select(PolicyKind::ALL.to_vec()),
    ) {
        let config = MasterConfig {
            policy,
            heartbeat_timeout_ms: 5_000,
            lease_ttl_ms: 3_000,
            put_timeout_ms: 6_000,
            task_timeout_ms: 4_000,
            watermarks: [Watermarks { high: 0.8, low: 0.6 }; 2],
            ..MasterConfig::default()
        };
        let (mut m, clock) = master(config);
        m.enable_journal();
        let nodes = ["a", "b", "c"];
        for n in nodes {
            mount(&mut m, n, "dram", Tier::Dram, 8 * MIB);
        }
        mount(&mut m, "a", "ssd", Tier::Ssd, 16 * MIB);
        let mut puts: Vec<(ObjectKey, u64)> = Vec::new();
        let mut leases: Vec<(u64, ObjectKey, Vec<ReplicaInfo>)> = Vec::new();
        let mut tasks: Vec<(String, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Put(k, s, r) => {
                    let size = u64::from(s) * MIB - 100;
                    if let Ok(PutStarted::Allocated { put_id, .. }) =
                        m.put_start(key(u64::from(k)), size, &opts(r))
                    {
                        let _ = m.put_end(key(u64::from(k)), put_id);
                    }
                }
                Op::Start(k, s) => {
                    let size = u64::from(s) * MIB - 100;
                    if let Ok(PutStarted::Allocated { put_id, .. }) =
                        m.put_start(key(u64::from(k)), size, &opts(1))
                    {
                        puts.push((key(u64::from(k)), put_id));
                    }
                }
                Op::End(i) if !puts.is_empty() => {
                    let (k, id) = puts.swap_remove(usize::from(i) % puts.len());
                    let _ = m.put_end(k, id);
                }
                Op::Revoke(i) if !puts.is_empty() => {
                    let (k, id) = puts.swap_remove(usize::from(i) % puts.len());
                    let _ = m.put_revoke(k, id);
                }
                Op::Get(k) => {
                    if let Ok(g) = m.get(key(u64::from(k))) {
                        leases.push((g.lease.id, key(u64::from(k)), g.replicas));
                    }
                }
                Op::Release(i) if !leases.is_empty() => {
                    let (id, _, _) = leases.swap_remove(usize::from(i) % leases.len());
                    let _ = m.release_lease(id);
                }
                Op::Remove(k) => {
                    let _ = m.remove(key(u64::from(k)));
                }
                Op::Pin(k, hard) => {
                    let _ = m.pin(key(u64::from(k)), hard, 2_000);
                }
                Op::Beat(n) => {
                    if let Ok(t) = m.heartbeat(nodes[usize::from(n)]) {
                        tasks.extend(t.into_iter().map(|t| (t.target.node.clone(), t.id)));
                    }
                }
                Op::Advance(ms) => {
                    clock.advance_ms(u64::from(ms));
                    m.tick();
                }
                Op::Complete(i, ok) if !tasks.is_empty() => {
                    let (node, id) = tasks.swap_remove(usize::from(i) % tasks.len());
                    let _ = m.complete_task(&node, id, ok);
                }
                Op::Remount(n) => {
                    let _ = m.mount(spec(nodes[usize::from(n)], "dram", Tier::Dram, 8 * MIB));
                }
                _ => {}
            }
            check_invariants(&m);
            // A replica handed out under a lease stays allocated to that object while the
            // lease is active (unless its agent died or was remounted: that memory is gone).
            let now = m.now_ms();
            for (id, k, reps) in &leases {
                let Some(rec) = m.leases.get(id) else { continue };
                if rec.expires_ms <= now {
                    continue;
                }
                let current = m.object_record(k).map(|r| r.replicas).unwrap_or_default();
                for r in reps {
                    if m.segments.contains_key(&r.segment_id) {
                        proptest::prop_assert!(
                            current.contains(&(r.segment_id, r.offset)),
                            "leased replica {r:?} of {k:?} was freed"
                        );
                    }
                }
            }
        }
        // What the journal persisted rebuilds the same objects and allocation (HA takeover).
        let (segs, objs, rsv, ids_used) = replay(m.take_journal());
        let (mut n, _c) = master(m.config().clone());
        n.reserve_segment_ids(ids_used);
        proptest::prop_assert_eq!(n.restore(segs, objs, rsv), 0);
        proptest::prop_assert_eq!(n.next_segment_id(), m.next_segment_id(), "segment ids never reused");
        check_invariants(&n);
        let mut a = n.object_records();
        let mut b = m.object_records();
        a.sort_by_key(|r| r.key);
        b.sort_by_key(|r| r.key);
        proptest::prop_assert_eq!(a, b);
        // Pending puts are not carried over; everything else is.
        let pending_pages: u64 = m
            .pending
            .keys()
            .map(|s| u64::from(m.entries[*s as usize].pages()) * m.entries[*s as usize].replicas.len() as u64)
            .sum();
        let task_pages: u64 = m.tasks.values().filter(|t| m.segments.contains_key(&t.target.seg)).map(|t| u64::from(t.pages)).sum();
        let total = |st: &MasterState| st.used_pages.iter().sum::<u64>();
        proptest::prop_assert_eq!(total(&n), total(&m), "reservations cover pending puts ({}) and tasks ({})", pending_pages, task_pages);
    }
}

type Replayed = (
    Vec<(u32, SegmentSpec)>,
    Vec<ObjectRecord>,
    Vec<(u32, u64, u64)>,
    u32,
);

/// Apply journal entries to key-value maps, as etcd would hold them.
fn replay(ops: Vec<JournalOp>) -> Replayed {
    use std::collections::BTreeMap;
    let mut segs: BTreeMap<u32, SegmentSpec> = BTreeMap::new();
    let mut objs: BTreeMap<ObjectKey, ObjectRecord> = BTreeMap::new();
    let mut rsv: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let mut ids_used = 0;
    for op in ops {
        match op {
            JournalOp::PutSegment(id, s) => {
                segs.insert(id, s);
            }
            JournalOp::DelSegment(id) => {
                segs.remove(&id);
            }
            JournalOp::PutObject(r) => {
                objs.insert(r.key, r);
            }
            JournalOp::DelObject(k) => {
                objs.remove(&k);
            }
            JournalOp::Reserve {
                seg,
                offset,
                length,
            } => {
                rsv.insert((seg, offset), length);
            }
            JournalOp::Unreserve { seg, offset } => {
                rsv.remove(&(seg, offset));
            }
            JournalOp::SegmentIdsUsed(n) => ids_used = ids_used.max(n),
        }
    }
    (
        segs.into_iter().collect(),
        objs.into_values().collect(),
        rsv.into_iter().map(|((s, o), l)| (s, o, l)).collect(),
        ids_used,
    )
}

#[test]
fn a_task_outliving_its_object_frees_exactly_its_own_extent() {
    // Found by the property test: the slot of a removed object is reused by an object of
    // another size before the old object's repair task ends. (No reuse delay: the freeing
    // itself is checked here.)
    let (mut m, _clock, _, tasks) = repairing_to_c(0, 16 * MIB);
    // Something right after the repair target on c, so an over-free would hit it.
    let neighbour = put(&mut m, key(2), MIB, &written_by("c"));
    assert_eq!(neighbour[0].node, "c");
    m.remove(key(1)).expect("remove while repairing");
    // The freed slot now holds a bigger object.
    put(&mut m, key(3), 2 * MIB, &written_by("a"));
    m.complete_task("c", tasks[0].id, false)
        .expect("fail the task");
    // c holds exactly the neighbour again, and its space is still allocated to it.
    assert_eq!(m.stats().used_bytes[0], 3 * MIB);
    let fresh = put(&mut m, key(4), MIB, &written_by("c"));
    assert!(
        fresh[0].node != "c"
            || fresh[0].offset + MIB <= neighbour[0].offset
            || neighbour[0].offset + MIB <= fresh[0].offset,
        "no overlap with the neighbour"
    );
}

fn adopt_item(k: ObjectKey, offset: u64, length: u64) -> AdoptItem {
    AdoptItem {
        key: k,
        offset,
        length,
    }
}

#[test]
fn adopting_into_an_empty_master_creates_committed_ssd_objects() {
    let (mut m, _clock) = master(MasterConfig::default());
    let ssd = mount(&mut m, "a", "ssd0", Tier::Ssd, 16 * MIB);
    let results = m
        .adopt(
            "a",
            ssd,
            &[
                adopt_item(key(1), 0, 5000),
                adopt_item(key(2), 2 * PAGE_BYTES, MIB),
            ],
            true,
        )
        .expect("adopt");
    assert_eq!(results, vec![Ok(()), Ok(())]);
    assert_eq!(m.stats().objects, 2);
    assert_eq!(m.stats().used_bytes[1], 2 * PAGE_BYTES + MIB);
    let got = m.get(key(2)).expect("get");
    assert_eq!(got.size, MIB);
    assert_eq!(got.replicas.len(), 1);
    assert_eq!(got.replicas[0].tier, Tier::Ssd);
    assert_eq!(got.replicas[0].offset, 2 * PAGE_BYTES);
    assert_eq!(got.replicas[0].segment, "ssd0");
    // New allocations never land on adopted bytes.
    let reps = put(&mut m, key(3), MIB, &opts(1));
    let o = reps[0].offset;
    assert!(
        o >= 2 * PAGE_BYTES + MIB,
        "offset {o} overlaps the adopted bytes 0..{}",
        2 * PAGE_BYTES + MIB
    );
    check_invariants(&m);
}

/// Key 1 (1 MiB) in 16 MiB of DRAM on node a, and an empty SSD segment `ssd0` of `ssd_bytes` on
/// `ssd_node`; returns the master and the SSD segment's id.
fn key_1_in_dram_beside_ssd(ssd_node: &str, ssd_bytes: u64) -> (MasterState, u32) {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "dram0", Tier::Dram, 16 * MIB);
    let ssd = mount(&mut m, ssd_node, "ssd0", Tier::Ssd, ssd_bytes);
    put(&mut m, key(1), MIB, &opts(1));
    (m, ssd)
}

#[test]
fn adopting_a_known_key_adds_a_replica_next_to_its_dram_copy() {
    let (mut m, ssd) = key_1_in_dram_beside_ssd("b", 16 * MIB);
    let r = m
        .adopt("b", ssd, &[adopt_item(key(1), 0, MIB)], true)
        .expect("adopt");
    assert_eq!(r, vec![Ok(())]);
    let mut tiers = m.replica_tiers(&key(1)).expect("tiers");
    tiers.sort_by_key(|t| t.index());
    assert_eq!(tiers, vec![Tier::Dram, Tier::Ssd]);
    assert_eq!(m.stats().objects, 1);
    // The same replica announced twice is refused and changes nothing.
    let again = m
        .adopt("b", ssd, &[adopt_item(key(1), 4 * MIB, MIB)], true)
        .expect("adopt");
    assert!(matches!(again[0], Err(MasterError::InvalidArgument(_))));
    assert_eq!(m.stats().used_bytes[1], MIB);
    check_invariants(&m);
}

#[test]
fn bad_adoptions_are_refused_one_by_one_and_change_nothing() {
    let (mut m, ssd) = key_1_in_dram_beside_ssd("a", 4 * MIB);
    let r = m
        .adopt(
            "a",
            ssd,
            &[
                adopt_item(key(10), 0, 2 * PAGE_BYTES),
                // Overlaps the item just adopted.
                adopt_item(key(11), PAGE_BYTES, PAGE_BYTES),
                // Past the end of the 4 MiB segment.
                adopt_item(key(12), 4 * MIB - PAGE_BYTES, 2 * PAGE_BYTES),
                // Not page aligned.
                adopt_item(key(13), MIB + 1, 10),
                // Empty.
                adopt_item(key(14), MIB, 0),
                // Known key, other size.
                adopt_item(key(1), 2 * MIB, 100),
                // Offset overflow.
                adopt_item(key(15), u64::MAX - PAGE_BYTES + 1, PAGE_BYTES),
            ],
            true,
        )
        .expect("adopt");
    assert_eq!(r[0], Ok(()));
    for (i, e) in r.iter().enumerate().skip(1) {
        let e = e.as_ref().expect_err("refused");
        let expected = if i == 5 {
            "size_conflict"
        } else {
            "invalid_argument"
        };
        assert_eq!(e.category(), expected, "item {i}: {e}");
    }
    assert!(
        r[1].as_ref()
            .expect_err("overlap")
            .to_string()
            .contains("overlap")
    );
    assert!(
        r[2].as_ref()
            .expect_err("bounds")
            .to_string()
            .contains("outside")
    );
    assert_eq!(m.stats().objects, 2);
    assert_eq!(m.stats().used_bytes[1], 2 * PAGE_BYTES);
    assert_eq!(m.get(key(1)).expect("get").size, MIB);
    assert_eq!(m.exists(&[key(11), key(12), key(13)]), vec![false; 3]);
    // Another node's segment, or an unknown one, fails the whole call.
    mount(&mut m, "b", "ssd0", Tier::Ssd, 4 * MIB);
    assert!(matches!(
        m.adopt("b", ssd, &[adopt_item(key(20), 2 * MIB, 10)], true),
        Err(MasterError::UnknownSegment { .. })
    ));
    assert!(matches!(
        m.adopt("a", 999, &[], true),
        Err(MasterError::UnknownSegment { .. })
    ));
    check_invariants(&m);
}

#[test]
fn adopted_replicas_are_freed_by_remove_and_eviction() {
    let config = watermarked(0.9, 0.5);
    let (mut m, _clock) = master(config);
    let ssd = mount(&mut m, "a", "ssd0", Tier::Ssd, 10 * MIB);
    let items: Vec<AdoptItem> = (0..9).map(|i| adopt_item(key(i), i * MIB, MIB)).collect();
    let r = m.adopt("a", ssd, &items, true).expect("adopt");
    assert!(r.iter().all(Result::is_ok));
    assert_eq!(m.stats().used_bytes[1], 9 * MIB);
    m.remove(key(0)).expect("remove");
    assert_eq!(m.stats().used_bytes[1], 8 * MIB);
    // The freed bytes can be adopted (or allocated) again.
    let r = m
        .adopt("a", ssd, &[adopt_item(key(100), 0, MIB)], true)
        .expect("adopt");
    assert_eq!(r, vec![Ok(())]);
    // Going over the high watermark evicts adopted objects like any other.
    put(
        &mut m,
        key(200),
        MIB,
        &PutOptions {
            tier: Some(Tier::Ssd),
            ..opts(1)
        },
    );
    assert!(m.stats().used_bytes[1] <= 5 * MIB, "{:?}", m.stats());
    assert!(m.counters().evicted_dropped[1] >= 5);
    check_invariants(&m);
}

#[test]
fn adopted_objects_reach_the_journal() {
    let (mut m, _clock) = master(MasterConfig::default());
    m.enable_journal();
    let ssd = mount(&mut m, "a", "ssd0", Tier::Ssd, 4 * MIB);
    m.take_journal();
    m.adopt("a", ssd, &[adopt_item(key(1), PAGE_BYTES, 10)], true)
        .expect("adopt");
    let ops = m.take_journal();
    assert_eq!(
        ops,
        vec![JournalOp::PutObject(ObjectRecord {
            key: key(1),
            size: 10,
            desired: 1,
            hard_pinned: false,
            spread_failure_domain: false,
            replicas: vec![(ssd, PAGE_BYTES)],
            event_name: None,
        })]
    );
}

/// Transfer engine: the transport state a heartbeat carries is kept per live node, replaced by
/// the next report, refused for unknown nodes and no longer listed once the node died.
#[test]
fn transport_state_is_kept_per_live_node() {
    use super::TransportState;
    let (mut m, clock) = master(MasterConfig::default());
    mount(&mut m, "b", "dram0", Tier::Dram, 4 * MIB);
    mount(&mut m, "a", "dram0", Tier::Dram, 4 * MIB);
    let fell_back = TransportState {
        rdma_requested: true,
        fallback: true,
        fallback_reason: "no usable RDMA device on this host".into(),
        rdma_devices: Vec::new(),
    };
    let on_rdma = TransportState {
        rdma_requested: true,
        rdma_devices: vec!["mlx5_0".into()],
        ..TransportState::default()
    };
    m.record_transport("b", fell_back.clone()).expect("b");
    m.record_transport("a", fell_back).expect("a");
    m.record_transport("a", on_rdma.clone()).expect("a again");
    let t = m.transports();
    assert_eq!(
        t.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(t[0].1, on_rdma, "the newer report replaces the older");
    assert!(t[1].1.fallback);
    assert!(matches!(
        m.record_transport("zz", TransportState::default()),
        Err(MasterError::UnknownNode(_))
    ));
    // b goes silent and is declared dead: it leaves the list.
    let timeout = m.config().heartbeat_timeout_ms;
    clock.advance_ms(timeout + 1);
    m.heartbeat("a").expect("hb");
    assert_eq!(m.tick().dead_nodes, vec!["b".to_string()]);
    let t = m.transports();
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].0, "a");
}

/// The segment-event feed (agent, issue 4), with the helpers above.
mod feed;

// The pool's block events (`events`).

fn block_key(i: u64) -> Vec<u8> {
    crate::sched::pool_key("m", i)
}

/// A put of the raw key `raw` that names the object as the service does.
fn put_named(m: &mut MasterState, raw: &[u8], size: u64, o: &PutOptions) -> ObjectKey {
    let k = ObjectKey::from_bytes(raw);
    let (id, _) = start(m, k, size, o);
    m.name_object(k, raw);
    m.put_end(k, id).expect("put_end");
    k
}

fn stored(tier: Tier, name: EventName) -> PoolEvent {
    PoolEvent::Stored { tier, name }
}

fn removed(tier: Tier, name: EventName) -> PoolEvent {
    PoolEvent::Removed { tier, name }
}

/// A master publishing pool events whose start-up snapshot was drained.
fn publishing(config: MasterConfig, cap: usize) -> (MasterState, FakeClock) {
    let (mut m, clock) = master(config);
    m.enable_pool_events(cap);
    let first = m.take_pool_events();
    assert!(first.resync && !first.overflowed);
    assert_eq!(first.events, vec![PoolEvent::Cleared]);
    (m, clock)
}

#[test]
fn keys_name_events_by_their_block_hash_or_their_bytes() {
    assert_eq!(EventName::of_key(&block_key(0xabc)), EventName::Int(0xabc));
    assert_eq!(
        EventName::of_key(b"kvpool/synthetic/m/FFFFFFFFFFFFFFFF"),
        EventName::Int(u64::MAX)
    );
    assert_eq!(EventName::of_key(b"00000000000000ff"), EventName::Int(255));
    for other in [
        &b"kvpool/synthetic/m/0000000000000ff"[..],
        b"kvpool/synthetic/m/00000000000000fg",
        b"a/00000000000000ff/b",
        b"",
    ] {
        assert_eq!(EventName::of_key(other), EventName::Bytes(other.to_vec()));
    }
}

#[test]
fn an_object_is_stored_once_per_tier_and_removed_with_its_last_replica() {
    let (mut m, _clock) = publishing(MasterConfig::default(), POOL_EVENTS_CAP);
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "b", "s", Tier::Dram, 64 * MIB);
    let two = put_named(&mut m, &block_key(7), MIB, &opts(2));
    let plain = put_named(&mut m, b"plain key", MIB, &opts(1));
    let drain = m.take_pool_events();
    assert!(!drain.resync);
    assert_eq!(
        drain.events,
        vec![
            stored(Tier::Dram, EventName::Int(7)),
            stored(Tier::Dram, EventName::Bytes(b"plain key".to_vec())),
        ],
        "two replicas in one tier make one event"
    );
    // A pending put and a revoked one publish nothing.
    let k = ObjectKey::from_bytes(b"revoked");
    let (id, _) = start(&mut m, k, MIB, &opts(1));
    m.name_object(k, b"revoked");
    m.put_revoke(k, id).expect("revoke");
    assert!(m.take_pool_events().events.is_empty());
    m.remove(two).expect("remove");
    m.remove(plain).expect("remove");
    assert_eq!(
        m.take_pool_events().events,
        vec![
            removed(Tier::Dram, EventName::Int(7)),
            removed(Tier::Dram, EventName::Bytes(b"plain key".to_vec())),
        ]
    );
    assert!(m.take_pool_events().events.is_empty(), "drained");
}

#[test]
fn eviction_and_demotion_publish_the_tiers_an_object_leaves_and_enters() {
    let config = watermarked(0.9, 0.5);
    let (mut m, _clock) = publishing(config, POOL_EVENTS_CAP);
    mount(&mut m, "a", "dram", Tier::Dram, 10 * MIB);
    mount(&mut m, "a", "ssd", Tier::Ssd, 100 * MIB);
    for i in 0..10 {
        put_named(&mut m, &block_key(i), MIB, &opts(1));
    }
    assert_eq!(m.take_pool_events().events.len(), 10);
    let tasks = m.heartbeat("a").expect("hb");
    assert_eq!(tasks.len(), 5);
    assert!(
        m.take_pool_events().events.is_empty(),
        "a demotion in flight still reads from DRAM"
    );
    for t in &tasks {
        m.complete_task("a", t.id, true).expect("done");
    }
    let events = m.take_pool_events().events;
    assert_eq!(events.len(), 10, "{events:?}");
    for pair in events.chunks(2) {
        let (
            PoolEvent::Removed {
                tier: from,
                name: a,
            },
            PoolEvent::Stored { tier: to, name: b },
        ) = (&pair[0], &pair[1])
        else {
            panic!("not a move: {pair:?}");
        };
        assert_eq!((*from, *to), (Tier::Dram, Tier::Ssd));
        assert_eq!(a, b);
    }
}

#[test]
fn dropping_replicas_by_eviction_publishes_removals() {
    let (mut m, _clock) = small_pool(PolicyKind::Lru);
    m.enable_pool_events(POOL_EVENTS_CAP);
    m.take_pool_events();
    for i in 0..10 {
        put_named(&mut m, &block_key(i), MIB, &opts(1));
    }
    let events = m.take_pool_events().events;
    let removals: Vec<&PoolEvent> = events
        .iter()
        .filter(|e| matches!(e, PoolEvent::Removed { .. }))
        .collect();
    assert_eq!(
        removals,
        (0..3)
            .map(|i| removed(Tier::Dram, EventName::Int(i)))
            .collect::<Vec<_>>()
            .iter()
            .collect::<Vec<_>>(),
        "the three oldest were evicted"
    );
}

#[test]
fn a_dead_agent_removes_only_the_objects_it_held_last() {
    let (mut m, clock) = publishing(MasterConfig::default(), POOL_EVENTS_CAP);
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "b", "s", Tier::Dram, 64 * MIB);
    let on_a = PutOptions {
        writer_node: Some("a".into()),
        ..opts(1)
    };
    put_named(&mut m, &block_key(1), MIB, &on_a);
    put_named(&mut m, &block_key(2), MIB, &opts(2));
    m.take_pool_events();
    clock.advance_ms(m.config().heartbeat_timeout_ms + 1);
    m.heartbeat("b").expect("hb");
    assert_eq!(m.tick().dead_nodes, vec!["a".to_string()]);
    assert_eq!(
        m.take_pool_events().events,
        vec![removed(Tier::Dram, EventName::Int(1))]
    );
}

#[test]
fn an_overflowing_outbox_is_replaced_by_a_snapshot() {
    let (mut m, _clock) = publishing(MasterConfig::default(), 2);
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "a", "t", Tier::Ssd, 64 * MIB);
    for i in 0..3 {
        put_named(&mut m, &block_key(i), MIB, &opts(1));
    }
    let ssd = PutOptions {
        tier: Some(Tier::Ssd),
        ..opts(1)
    };
    put_named(&mut m, &block_key(9), MIB, &ssd);
    let gone = put_named(&mut m, &block_key(10), MIB, &opts(1));
    m.remove(gone).expect("remove");
    let drain = m.take_pool_events();
    assert!(drain.resync && drain.overflowed);
    assert_eq!(
        drain.events,
        vec![
            PoolEvent::Cleared,
            stored(Tier::Dram, EventName::Int(0)),
            stored(Tier::Dram, EventName::Int(1)),
            stored(Tier::Dram, EventName::Int(2)),
            stored(Tier::Ssd, EventName::Int(9)),
        ]
    );
    // Back to single changes after the snapshot.
    put_named(&mut m, &block_key(11), MIB, &opts(1));
    let next = m.take_pool_events();
    assert!(!next.resync);
    assert_eq!(next.events, vec![stored(Tier::Dram, EventName::Int(11))]);
}

#[test]
fn a_new_leader_snapshots_the_restored_objects_with_their_names() {
    let (mut m, _clock) = publishing(MasterConfig::default(), POOL_EVENTS_CAP);
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    mount(&mut m, "a", "t", Tier::Ssd, 64 * MIB);
    put_named(&mut m, &block_key(5), MIB, &opts(1));
    put_named(&mut m, b"x", MIB, &opts(1));
    // Restored from records without a name (older leaders): not published until named.
    let k = key(77);
    put(&mut m, k, MIB, &opts(1));
    let records = m.object_records();
    assert_eq!(records.iter().filter(|r| r.event_name.is_some()).count(), 2);
    let mut n = m.fresh();
    assert!(n.pool_events_enabled());
    n.restore(m.segment_records(), records, Vec::new());
    let drain = n.take_pool_events();
    assert!(drain.resync && !drain.overflowed);
    assert_eq!(drain.events.len(), 3, "{:?}", drain.events);
    assert_eq!(drain.events[0], PoolEvent::Cleared);
    assert!(
        drain
            .events
            .contains(&stored(Tier::Dram, EventName::Int(5)))
    );
    assert!(
        drain
            .events
            .contains(&stored(Tier::Dram, EventName::Bytes(b"x".to_vec())))
    );
    // A put of the unnamed key names it (the object was committed already).
    n.name_object(k, b"kvpool/synthetic/m/000000000000004d");
    assert_eq!(
        n.take_pool_events().events,
        vec![stored(Tier::Dram, EventName::Int(0x4d))]
    );
    // Asking for a snapshot again lists all three.
    n.resync_pool_events();
    assert_eq!(n.take_pool_events().events.len(), 4);
}

#[test]
fn pool_events_stay_off_unless_enabled() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "s", Tier::Dram, 64 * MIB);
    put_named(&mut m, &block_key(1), MIB, &opts(1));
    assert_eq!(m.take_pool_events(), PoolEventsDrain::default());
    assert!(m.object_records().iter().all(|r| r.event_name.is_none()));
}
