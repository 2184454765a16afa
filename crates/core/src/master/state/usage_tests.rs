//! Unit tests of the per-node usage the master's metrics export ([`MasterState::node_usage`]).

use std::sync::Arc;

use super::tests::spec;
use super::*;
use crate::master::clock::FakeClock;
use crate::master::types::{PutOptions, PutStarted};

const MIB: u64 = 1 << 20;

#[test]
fn node_usage_sums_each_nodes_segments_per_tier() {
    let mut m = MasterState::new(MasterConfig::default(), Arc::new(FakeClock::new(1_000)));
    for (node, name, tier, capacity) in [
        ("b", "dram0", Tier::Dram, 32 * MIB),
        ("a", "dram0", Tier::Dram, 64 * MIB),
        ("a", "dram1", Tier::Dram, 64 * MIB),
        ("a", "ssd0", Tier::Ssd, 256 * MIB),
    ] {
        m.mount(spec(node, name, tier, capacity)).expect("mount");
    }
    let opts = PutOptions {
        replicas: 1,
        writer_node: Some("b".into()),
        tier: Some(Tier::Dram),
        ..PutOptions::default()
    };
    let key = ObjectKey::from_bytes(b"block");
    match m.put_start(key, MIB, &opts).expect("put_start") {
        PutStarted::Allocated { put_id, .. } => m.put_end(key, put_id).expect("put_end"),
        PutStarted::AlreadyCommitted { .. } => panic!("unexpected duplicate"),
    }
    let usage = m.node_usage();
    let rows: Vec<(&str, Tier, u64)> = usage
        .iter()
        .map(|u| (u.node.as_str(), u.tier, u.capacity_bytes))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("a", Tier::Dram, 128 * MIB),
            ("a", Tier::Ssd, 256 * MIB),
            ("b", Tier::Dram, 32 * MIB),
        ]
    );
    // The block's bytes are counted on the node that holds it, and nowhere else; the total is
    // the tier's used bytes in `stats`.
    let used: u64 = usage.iter().map(|u| u.used_bytes).sum();
    assert_eq!(used, m.stats().used_bytes[0] + m.stats().used_bytes[1]);
    assert!(used >= MIB, "{usage:?}");
    let holder: Vec<&str> = usage
        .iter()
        .filter(|u| u.used_bytes > 0)
        .map(|u| u.node.as_str())
        .collect();
    assert_eq!(holder.len(), 1, "{usage:?}");
}
