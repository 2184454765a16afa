//! Unit tests of the per-node reports ([`MasterState::node_reports`]): bytes per tier and NUMA
//! node, and the `get` hits counted on the node and tier that served them.

use super::tests::{master, put, spec};
use super::*;
use crate::master::types::{AdoptItem, PutOptions};

const MIB: u64 = 1 << 20;

fn on(node: &str, tier: Tier, replicas: u8) -> PutOptions {
    PutOptions {
        replicas,
        writer_node: Some(node.into()),
        tier: Some(tier),
        ..PutOptions::default()
    }
}

/// Node `a`: DRAM on NUMA 1 and 0 and one unbound DRAM segment; node `b`: DRAM on NUMA 0 and
/// an SSD segment.
fn two_nodes() -> (MasterState, crate::master::clock::FakeClock) {
    let (mut m, clock) = master(MasterConfig::default());
    for (node, name, tier, capacity, numa) in [
        ("a", "dram1", Tier::Dram, 64 * MIB, 1),
        ("a", "dram0", Tier::Dram, 32 * MIB, 0),
        ("a", "loose", Tier::Dram, 16 * MIB, UNBOUND_NUMA_NODE),
        ("b", "dram0", Tier::Dram, 32 * MIB, 0),
        ("b", "ssd0", Tier::Ssd, 256 * MIB, 0),
    ] {
        let mut s = spec(node, name, tier, capacity);
        s.numa_node = numa;
        m.mount(s).expect("mount");
    }
    (m, clock)
}

#[test]
fn reports_split_each_nodes_bytes_by_tier_and_numa_node() {
    let (mut m, _) = two_nodes();
    put(
        &mut m,
        ObjectKey::from_bytes(b"x"),
        3 * MIB,
        &on("a", Tier::Dram, 1),
    );
    put(
        &mut m,
        ObjectKey::from_bytes(b"y"),
        MIB,
        &on("b", Tier::Ssd, 1),
    );
    let reports = m.node_reports();
    let names: Vec<&str> = reports.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let (a, b) = (&reports[0], &reports[1]);
    assert_eq!(a.capacity_bytes, [112 * MIB, 0]);
    assert_eq!(b.capacity_bytes, [32 * MIB, 256 * MIB]);
    let numa: Vec<(Option<u32>, Tier, u64)> = a
        .numa
        .iter()
        .map(|n| (n.numa_node, n.tier, n.capacity_bytes))
        .collect();
    assert_eq!(
        numa,
        [
            (Some(0), Tier::Dram, 32 * MIB),
            (Some(1), Tier::Dram, 64 * MIB),
            (None, Tier::Dram, 16 * MIB),
        ]
    );
    // The bytes of `x` are on node a's DRAM, of `y` on node b's SSD; the NUMA rows add up to
    // the node's figures and the nodes' figures to the pool's.
    assert!(a.used_bytes[0] >= 3 * MIB && a.used_bytes[1] == 0, "{a:?}");
    assert!(b.used_bytes[1] >= MIB && b.used_bytes[0] == 0, "{b:?}");
    for r in &reports {
        for t in Tier::ALL {
            let rows = r.numa.iter().filter(|n| n.tier == t);
            let (u, c) = rows.fold((0, 0), |(u, c), n| (u + n.used_bytes, c + n.capacity_bytes));
            assert_eq!(
                (u, c),
                (r.used_bytes[t.index()], r.capacity_bytes[t.index()])
            );
        }
    }
    let stats = m.stats();
    for t in 0..2 {
        let used: u64 = reports.iter().map(|r| r.used_bytes[t]).sum();
        let capacity: u64 = reports.iter().map(|r| r.capacity_bytes[t]).sum();
        assert_eq!(
            (used, capacity),
            (stats.used_bytes[t], stats.capacity_bytes[t])
        );
    }
}

#[test]
fn get_hits_count_on_the_node_and_tier_that_serves_the_reader() {
    let (mut m, _) = two_nodes();
    let (x, y, z) = (
        ObjectKey::from_bytes(b"x"),
        ObjectKey::from_bytes(b"y"),
        ObjectKey::from_bytes(b"z"),
    );
    put(&mut m, x, MIB, &on("a", Tier::Dram, 1));
    put(&mut m, y, MIB, &on("b", Tier::Ssd, 1));
    // Two DRAM replicas, one per node: the hit counts once, on the first one returned.
    put(&mut m, z, MIB, &on("b", Tier::Dram, 2));
    for _ in 0..3 {
        m.get(x).expect("get x");
    }
    m.get(y).expect("get y");
    let first = m.get(z).expect("get z").replicas[0].node.clone();
    assert!(m.get(ObjectKey::from_bytes(b"missing")).is_err());
    let hits: Vec<(String, [u64; 2])> = m
        .node_reports()
        .into_iter()
        .map(|r| (r.node, r.get_hits))
        .collect();
    let z_on_a = u64::from(first == "a");
    assert_eq!(
        hits,
        [
            ("a".to_owned(), [3 + z_on_a, 0]),
            ("b".to_owned(), [1 - z_on_a, 1]),
        ]
    );
}

#[test]
fn an_object_with_dram_and_ssd_replicas_counts_its_hit_on_dram() {
    let (mut m, _) = two_nodes();
    let k = ObjectKey::from_bytes(b"k");
    put(&mut m, k, MIB, &on("b", Tier::Ssd, 1));
    // A second replica in DRAM on node a (a persistent DRAM tier re-adopted after a restart):
    // the SSD replica stays first in the object's list.
    let a_dram = m
        .mount(spec("a", "kept", Tier::Dram, 8 * MIB))
        .expect("mount");
    let item = AdoptItem {
        key: k,
        offset: 0,
        length: MIB,
    };
    let adopted = m.adopt("a", a_dram, &[item], true).expect("adopt");
    assert_eq!(adopted, [Ok(())]);
    let g = m.get(k).expect("get");
    let tiers: Vec<Tier> = g.replicas.iter().map(|r| r.tier).collect();
    assert_eq!(tiers, [Tier::Ssd, Tier::Dram]);
    let hits: Vec<[u64; 2]> = m.node_reports().into_iter().map(|r| r.get_hits).collect();
    assert_eq!(hits, [[1, 0], [0, 0]]);
}

#[test]
fn a_dead_node_leaves_the_reports_and_a_returning_one_keeps_its_counts() {
    let (mut m, clock) = two_nodes();
    let k = ObjectKey::from_bytes(b"k");
    put(&mut m, k, MIB, &on("a", Tier::Dram, 1));
    m.get(k).expect("get");
    clock.advance_ms(m.config().heartbeat_timeout_ms + 1);
    m.heartbeat("b").expect("b is alive");
    let report = m.tick();
    assert_eq!(report.dead_nodes, ["a"]);
    let names: Vec<String> = m.node_reports().into_iter().map(|r| r.node).collect();
    assert_eq!(names, ["b"]);
    m.mount(spec("a", "dram0", Tier::Dram, 32 * MIB))
        .expect("mount again");
    let a = m
        .node_reports()
        .into_iter()
        .find(|r| r.node == "a")
        .expect("a is back");
    assert_eq!((a.get_hits, a.used_bytes), ([1, 0], [0, 0]));
}
