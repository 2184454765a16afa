//! Unit tests of the per-node segment-event feed (issue 4): commits and frees of SSD replicas
//! reach the owning agent in order, survive a lost reply until acknowledged, resynchronise with
//! a snapshot after a failover or an overflow, and corrupt-block reports drop the replica.

use super::*;

fn ssd_opts(replicas: u8) -> PutOptions {
    PutOptions {
        replicas,
        tier: Some(Tier::Ssd),
        ..PutOptions::default()
    }
}

/// (kind, key, offset, length) of each event.
fn view(events: &[SegmentEvent]) -> Vec<(SegmentEventKind, ObjectKey, u64, u64)> {
    events
        .iter()
        .map(|e| (e.kind, e.key, e.offset, e.length))
        .collect()
}

#[test]
fn commits_and_frees_of_ssd_replicas_reach_their_agent_until_acknowledged() {
    let (mut m, _clock) = master(MasterConfig::default());
    mount(&mut m, "a", "dram0", Tier::Dram, 8 * MIB);
    let ssd = mount(&mut m, "a", "ssd0", Tier::Ssd, 8 * MIB);
    // A DRAM put produces no event; an SSD put produces a commit only once it ends.
    put(&mut m, key(1), 5000, &PutOptions::default());
    let (put_id, reps) = match m.put_start(key(2), 6000, &ssd_opts(1)).expect("start") {
        PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        PutStarted::AlreadyCommitted { .. } => panic!("new key"),
    };
    let r = m.heartbeat_feed("a", 0, 0, &[]).expect("hb");
    assert!(r.events.is_empty(), "a pending put is not announced");
    assert_ne!(r.feed_epoch, 0);
    m.put_end(key(2), put_id).expect("end");
    let off = reps[0].offset;
    m.remove(key(2)).expect("remove");
    let epoch = r.feed_epoch;
    let r = m.heartbeat_feed("a", epoch, 0, &[]).expect("hb");
    assert_eq!(
        view(&r.events),
        vec![
            (SegmentEventKind::Commit, key(2), off, 6000),
            (SegmentEventKind::Free, key(2), off, 0),
        ]
    );
    assert!(r.events.iter().all(|e| e.segment_id == ssd));
    assert!(r.events[0].seq < r.events[1].seq);
    // The reply was lost: the same events come again.
    let again = m.heartbeat_feed("a", epoch, 0, &[]).expect("hb");
    assert_eq!(again.events, r.events);
    // Acknowledging the first leaves the second; acknowledging both empties the feed.
    let first = r.events[0].seq;
    let r = m.heartbeat_feed("a", epoch, first, &[]).expect("hb");
    assert_eq!(r.events.len(), 1);
    let r = m
        .heartbeat_feed("a", epoch, r.events[0].seq, &[])
        .expect("hb");
    assert!(r.events.is_empty());
}

#[test]
fn evictions_failed_tasks_and_demotions_are_fed_with_the_right_keys() {
    let mut m = full_dram_over_ssd();
    let r = m.heartbeat_feed("a", 0, 0, &[]).expect("hb");
    assert_eq!(r.tasks.len(), 5, "demotions");
    assert!(r.events.is_empty(), "a task target is not a replica yet");
    // Two succeed (commits), one fails (a free of its own key).
    m.complete_task("a", r.tasks[0].id, true).expect("ok");
    m.complete_task("a", r.tasks[1].id, false).expect("failed");
    let r2 = m.heartbeat_feed("a", r.feed_epoch, 0, &[]).expect("hb");
    assert_eq!(
        view(&r2.events),
        vec![
            (
                SegmentEventKind::Commit,
                r.tasks[0].key,
                r.tasks[0].target.offset,
                MIB
            ),
            (
                SegmentEventKind::Free,
                r.tasks[1].key,
                r.tasks[1].target.offset,
                0
            ),
        ]
    );
    // Evicting the SSD replica frees it under its key.
    m.remove(r.tasks[0].key).expect("remove");
    let r3 = m
        .heartbeat_feed("a", r.feed_epoch, r2.events[1].seq, &[])
        .expect("hb");
    assert_eq!(
        view(&r3.events),
        vec![(
            SegmentEventKind::Free,
            r.tasks[0].key,
            r.tasks[0].target.offset,
            0
        )]
    );
}

#[test]
fn a_stale_epoch_or_an_overflow_is_answered_with_a_snapshot() {
    let (mut m, _clock) = master(MasterConfig::default());
    let ssd = mount(&mut m, "a", "ssd0", Tier::Ssd, 64 * MIB);
    let a = put(&mut m, key(1), 4096, &ssd_opts(1));
    let b = put(&mut m, key(2), 9000, &ssd_opts(1));
    let epoch = m.feed_epoch();
    // An agent that applied events of another master instance (before a failover).
    let r = m.heartbeat_feed("a", epoch ^ 2, 7, &[]).expect("hb");
    let none = ObjectKey { hi: 0, lo: 0 };
    let mut got = view(&r.events);
    assert_eq!(got.first(), Some(&(SegmentEventKind::Reset, none, 0, 0)));
    assert_eq!(got.last(), Some(&(SegmentEventKind::ResetDone, none, 0, 0)));
    got.sort_by_key(|e| e.2);
    assert!(got.contains(&(SegmentEventKind::Commit, key(1), a[0].offset, 4096)));
    assert!(got.contains(&(SegmentEventKind::Commit, key(2), b[0].offset, 9000)));
    assert_eq!(r.events.len(), 4);
    assert!(r.events.iter().all(|e| e.segment_id == ssd));
    // Acknowledged under the new epoch, the snapshot is gone.
    let last = r.events[3].seq;
    assert!(
        m.heartbeat_feed("a", epoch, last, &[])
            .expect("hb")
            .events
            .is_empty()
    );
    // An agent that never acknowledges: the feed stops growing at its cap and resynchronises.
    for i in 0..(FEED_CAP as u64 / 2 + 1) {
        put(&mut m, key(100 + i), 1, &ssd_opts(1));
        m.remove(key(100 + i)).expect("remove");
    }
    let r = m.heartbeat_feed("a", epoch, last, &[]).expect("hb");
    assert_eq!(r.events[0].kind, SegmentEventKind::Reset);
    assert_eq!(r.events.len(), 4, "the snapshot holds the two live objects");
}

#[test]
fn a_corrupt_block_report_drops_that_replica_only() {
    let (mut m, _clock) = master(MasterConfig::default());
    let s1 = mount(&mut m, "a", "ssd0", Tier::Ssd, 8 * MIB);
    mount(&mut m, "b", "ssd0", Tier::Ssd, 8 * MIB);
    let reps = put(&mut m, key(1), 5000, &ssd_opts(2));
    assert_eq!(reps.len(), 2);
    let mine = reps.iter().find(|r| r.node == "a").expect("on a");
    let epoch = m.feed_epoch();
    let commits = m.heartbeat_feed("a", epoch, 0, &[]).expect("hb").events;
    assert_eq!(commits.len(), 1);
    // Reports that name another key, offset or segment change nothing.
    let bad = [
        CorruptBlock {
            segment_id: s1,
            key: key(9),
            offset: mine.offset,
        },
        CorruptBlock {
            segment_id: s1,
            key: key(1),
            offset: mine.offset + 4096,
        },
        CorruptBlock {
            segment_id: s1 + 1,
            key: key(1),
            offset: mine.offset,
        },
    ];
    m.heartbeat_feed("a", epoch, commits[0].seq, &bad)
        .expect("hb");
    assert_eq!(m.replica_tiers(&key(1)).expect("tiers").len(), 2);
    let report = [CorruptBlock {
        segment_id: s1,
        key: key(1),
        offset: mine.offset,
    }];
    let r = m
        .heartbeat_feed("a", epoch, commits[0].seq, &report)
        .expect("hb");
    assert_eq!(m.replica_tiers(&key(1)).expect("tiers").len(), 1);
    assert_eq!(m.counters().corrupt_dropped, 1);
    assert_eq!(m.stats().under_replicated, 1, "repair is due");
    assert_eq!(
        view(&r.events),
        vec![(SegmentEventKind::Free, key(1), mine.offset, 0)]
    );
    let got = m.get(key(1)).expect("still readable");
    assert!(got.replicas.iter().all(|r| r.node == "b"));
    // The last replica: the object is gone.
    m.release_lease(got.lease.id).expect("release");
    let theirs = got.replicas[0].clone();
    m.heartbeat_feed(
        "b",
        0,
        0,
        &[CorruptBlock {
            segment_id: theirs.segment_id,
            key: key(1),
            offset: theirs.offset,
        }],
    )
    .expect("hb");
    assert_eq!(m.exists(&[key(1)]), vec![false]);
}

#[test]
fn a_persistent_dram_segment_gets_the_feed_and_is_sealed_until_its_adoption_completes() {
    let (mut m, _clock) = master(MasterConfig::default());
    let dram = m
        .mount(SegmentSpec {
            persistent: true,
            ..spec("a", "dram0", Tier::Dram, 8 * MIB)
        })
        .expect("mount");
    assert!(m.sealed(dram));
    // Nothing is placed in it while its agent has not announced what it holds.
    assert!(m.put_start(key(1), 5000, &PutOptions::default()).is_err());
    let r = m
        .adopt("a", dram, &[adopt_item(key(2), 0, 5000)], false)
        .expect("adopt");
    assert_eq!(r, vec![Ok(())]);
    assert!(m.sealed(dram), "more batches may follow");
    m.adopt("a", dram, &[], true).expect("last batch");
    assert!(!m.sealed(dram));
    // Now puts land there, next to the adopted block, and their commits and frees reach the
    // agent's feed like an SSD segment's.
    let reps = put(&mut m, key(1), 5000, &PutOptions::default());
    assert_eq!(reps[0].segment, "dram0");
    assert_ne!(reps[0].offset, 0, "not over the adopted block");
    m.remove(key(2)).expect("remove");
    let r = m.heartbeat_feed("a", 0, 0, &[]).expect("hb");
    assert_eq!(
        view(&r.events),
        vec![
            (SegmentEventKind::Commit, key(1), reps[0].offset, 5000),
            (SegmentEventKind::Free, key(2), 0, 0),
        ]
    );
    assert!(r.events.iter().all(|e| e.segment_id == dram));
    // A DRAM segment mounted without persistence has neither the seal nor the feed.
    let plain = mount(&mut m, "b", "dram0", Tier::Dram, 8 * MIB);
    assert!(!m.sealed(plain));
    put(
        &mut m,
        key(3),
        5000,
        &PutOptions {
            writer_node: Some("b".into()),
            ..PutOptions::default()
        },
    );
    let r = m.heartbeat_feed("b", 0, 0, &[]).expect("hb");
    assert!(r.events.is_empty());
}
