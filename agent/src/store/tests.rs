//! Unit tests of the tiered store: LRU eviction in DRAM only, demotion and promotion.

use super::*;
use crate::placement::SegmentPlan;
use crate::ssd::{DirectIo, SsdConfig};

fn store(dram_bytes: u64, ssd_dir: Option<&std::path::Path>, ssd_cap: u64) -> TieredStore {
    let plans = [SegmentPlan {
        numa_node: Some(0),
        bytes: dram_bytes,
        hugepage_size: None,
    }];
    let (dram, _) = DramTier::new(&plans, false).expect("dram");
    let ssd = ssd_dir.map(|dir| {
        SsdTier::open(&SsdConfig {
            dir: dir.to_owned(),
            capacity: ssd_cap,
            direct_io: DirectIo::Auto,
        })
        .expect("ssd")
        .0
    });
    let metrics = AgentMetrics::new(&prometheus::Registry::new()).expect("metrics");
    TieredStore::new(dram, ssd, Arc::new(metrics))
}

fn get(s: &TieredStore, key: &[u8]) -> Option<(Vec<u8>, Served)> {
    s.get_with(key, <[u8]>::to_vec).expect("get")
}

#[test]
fn dram_only_evicts_lru_and_counts_drops() {
    let s = store(3 * 4096, None, 0);
    s.put(b"a", &[1; 4096], None).expect("a");
    s.put(b"b", &[2; 4096], None).expect("b");
    s.put(b"c", &[3; 4096], None).expect("c");
    assert!(get(&s, b"a").is_some(), "touch a: b is now oldest");
    s.put(b"d", &[4; 4096], None).expect("d");
    assert!(!s.exists(b"b"));
    assert!(s.exists(b"a") && s.exists(b"c") && s.exists(b"d"));
    assert_eq!(s.metrics().dropped.with_label_values(&["no_ssd"]).get(), 1);
    assert_eq!(
        s.put(b"big", &[0; 5 * 4096], None)
            .expect_err("too large")
            .category(),
        "too_large"
    );
    assert_eq!(
        s.put(b"", &[0; 1], None).expect_err("empty").category(),
        "bad_key"
    );
}

#[test]
fn demotes_to_ssd_and_promotes_on_hit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = store(2 * 4096, Some(dir.path()), 1 << 20);
    s.put(b"a", &[1; 3000], None).expect("a");
    s.put(b"b", &[2; 4096], None).expect("b");
    s.put(b"c", &[3; 10], None).expect("c");
    assert_eq!(s.metrics().demotions.get(), 1);
    let (bytes, served) = get(&s, b"a").expect("a present");
    assert_eq!(served, Served::Ssd);
    assert_eq!(bytes, vec![1; 3000]);
    assert_eq!(s.metrics().promotions.get(), 1);
    let (_, served) = get(&s, b"a").expect("a present");
    assert_eq!(served, Served::Dram);
    assert!(s.remove(b"a").expect("remove"));
    assert!(!s.exists(b"a"));
    assert!(get(&s, b"a").is_none());
    assert_eq!(s.metrics().misses.get(), 1);
}
