//! The SSD tier with real files in temp directories: restart recovery, upgrade of the index,
//! injected corruption and truncation, a damaged index tail, and a full disk (a small tmpfs
//! when running as root, a capacity limit always).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use kvpool_agent::dram::DramTier;
use kvpool_agent::metrics::AgentMetrics;
use kvpool_agent::placement::SegmentPlan;
use kvpool_agent::ssd::{ALIGN, AlignedBuf, DirectIo, SsdConfig, SsdError, SsdTier};
use kvpool_agent::store::{Served, TieredStore};

fn cfg(dir: &Path, capacity: u64) -> SsdConfig {
    SsdConfig {
        dir: dir.to_owned(),
        capacity,
        direct_io: DirectIo::Auto,
    }
}

fn block(seed: u8, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b[..len].iter_mut().enumerate() {
        *x = seed.wrapping_add((i % 241) as u8);
    }
    b
}

/// Open the tier in `dir` with 1 MiB of capacity.
fn open_tier(dir: &Path) -> (SsdTier, kvpool_agent::ssd::Recovery) {
    SsdTier::open(&cfg(dir, 1 << 20)).expect("open")
}

/// The tier in `dir` (see [`open_tier`]) with `blocks` put into it in order: (key, seed of
/// [`block`], length).
fn tier_with(dir: &Path, blocks: &[(&[u8], u8, usize)]) -> SsdTier {
    let (mut t, _) = open_tier(dir);
    for &(key, seed, len) in blocks {
        t.put(key, &block(seed, len), len as u64).expect("put");
    }
    t
}

/// The tier's data file in `dir`, open for reading and writing (to damage it).
fn data_file(dir: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("blocks.dat"))
        .expect("open data")
}

/// Cut the tier's data file in `dir` to `len` bytes.
fn truncate_data(dir: &Path, len: u64) {
    data_file(dir).set_len(len).expect("truncate");
}

/// Recovery left a warning that mentions `what`.
#[track_caller]
fn assert_warned(rec: &kvpool_agent::ssd::Recovery, what: &str) {
    assert!(
        rec.warnings.iter().any(|w| w.contains(what)),
        "{:?}",
        rec.warnings
    );
}

fn assert_corrupt(err: &SsdError, why: &str) {
    assert!(
        matches!(err, SsdError::Corrupt { reason } if *reason == why),
        "{err}"
    );
}

fn expect_block(tier: &mut SsdTier, key: &[u8], seed: u8, len: usize) {
    let (buf, got_len) = tier.get(key).expect("get").expect("present");
    assert_eq!(got_len, len as u64);
    assert_eq!(&buf[..len], &block(seed, len)[..len], "bytes of {key:?}");
}

#[test]
fn restart_recovers_blocks_from_the_log_and_from_a_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (mut t, _) = open_tier(dir.path());
        t.put(b"one", &block(1, 5000), 5000).expect("put");
        t.put(b"two", &block(2, 100), 100).expect("put");
        t.put(b"three", &block(3, 9000), 9000).expect("put");
        t.put(b"two", &block(4, 200), 200).expect("overwrite");
        assert!(t.remove(b"three").expect("remove"));
        t.sync().expect("sync");
        // Dropped without a snapshot, as after a crash: the log alone must do.
    }
    {
        let (mut t, rec) = open_tier(dir.path());
        assert_eq!(rec.blocks, 2);
        assert_eq!(rec.bytes, 5200);
        assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
        expect_block(&mut t, b"one", 1, 5000);
        expect_block(&mut t, b"two", 4, 200);
        assert!(!t.contains(b"three"));
        // Recovered space accounting: two blocks of 2 and 1 units.
        assert_eq!(t.usage().used, 3 * ALIGN);
        t.put(b"four", &block(5, 4096), 4096)
            .expect("put after restart");
        t.snapshot().expect("snapshot");
    }
    let (mut t, rec) = open_tier(dir.path());
    assert_eq!(rec.blocks, 3);
    assert_eq!(rec.version_found, kvpool_agent::ssd::INDEX_VERSION);
    expect_block(&mut t, b"four", 5, 4096);
    let mut keys = t.keys();
    keys.sort();
    assert_eq!(
        keys,
        vec![b"four".to_vec(), b"one".to_vec(), b"two".to_vec()]
    );
}

#[test]
fn corrupted_block_is_dropped_reported_and_never_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut t = tier_with(dir.path(), &[(b"good", 1, 3000), (b"bad", 2, 3000)]);
    t.sync().expect("sync");
    // Flip one byte of the second block on disk (blocks are laid out in put order).
    let data = data_file(dir.path());
    let mut byte = [0u8; 1];
    data.read_exact_at(&mut byte, ALIGN + 1234).expect("read");
    byte[0] ^= 0xff;
    data.write_all_at(&byte, ALIGN + 1234).expect("write");
    drop(data);

    let err = t.get(b"bad").expect_err("corrupt");
    assert_corrupt(&err, "checksum mismatch");
    assert!(!t.contains(b"bad"), "dropped from the index");
    assert!(t.get(b"bad").expect("get").is_none());
    expect_block(&mut t, b"good", 1, 3000);
    // The drop is persistent.
    drop(t);
    let (t, rec) = open_tier(dir.path());
    assert_eq!(rec.blocks, 1);
    assert!(!t.contains(b"bad"));
}

#[test]
fn truncated_data_file_is_detected() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let mut t = tier_with(dir.path(), &[(b"a", 1, 4096), (b"b", 2, 8192)]);
        t.snapshot().expect("snapshot");
    }
    truncate_data(dir.path(), 4096 + 100);
    let (mut t, rec) = open_tier(dir.path());
    assert_eq!(rec.blocks, 1);
    assert_warned(&rec, "truncated");
    expect_block(&mut t, b"a", 1, 4096);
    assert!(!t.contains(b"b"));

    // Truncation while running is caught on read.
    t.put(b"c", &block(3, 8192), 8192).expect("put");
    truncate_data(dir.path(), 4096);
    let err = t.get(b"c").expect_err("truncated");
    assert_corrupt(&err, "truncated");
}

#[test]
fn damaged_index_tail_keeps_the_valid_prefix() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let mut t = tier_with(dir.path(), &[(b"a", 1, 100), (b"b", 2, 100)]);
        t.sync().expect("sync");
    }
    // A torn append: half a record of garbage.
    let index = dir.path().join("index.log");
    let mut bytes = std::fs::read(&index).expect("read index");
    bytes.extend_from_slice(&[0x20, 0, 0, 0, 1, 2, 3]);
    std::fs::write(&index, &bytes).expect("write index");
    let (mut t, rec) = open_tier(dir.path());
    assert_eq!(rec.blocks, 2);
    assert_warned(&rec, "damaged");
    expect_block(&mut t, b"b", 2, 100);
    // The rewritten index is clean again.
    drop(t);
    let (_, rec) = open_tier(dir.path());
    assert!(rec.warnings.is_empty(), "{:?}", rec.warnings);
}

fn store_with_ssd(ssd_dir: &Path, ssd_capacity: u64) -> TieredStore {
    let plans = [SegmentPlan {
        numa_node: Some(0),
        bytes: 64 << 10,
        hugepage_size: None,
    }];
    let (dram, _) = DramTier::new(&plans, false).expect("dram");
    let (ssd, _) = SsdTier::open(&cfg(ssd_dir, ssd_capacity)).expect("ssd");
    let metrics = Arc::new(AgentMetrics::new(&prometheus::Registry::new()).expect("metrics"));
    TieredStore::new(dram, Some(ssd), metrics)
}

/// The bytes of `key`, which `store` must hold and serve from `tier`.
#[track_caller]
fn served_from(store: &TieredStore, key: &[u8], tier: Served) -> Vec<u8> {
    let (bytes, served) = store
        .get_with(key, <[u8]>::to_vec)
        .expect("get")
        .unwrap_or_else(|| panic!("{} missing", String::from_utf8_lossy(key)));
    assert_eq!(served, tier, "{}", String::from_utf8_lossy(key));
    bytes
}

/// Puts 32 KiB blocks into a 64 KiB DRAM tier until `n` blocks went through.
fn fill(store: &TieredStore, n: u8) {
    for i in 0..n {
        store
            .put(format!("k{i}").as_bytes(), &[i; 32 << 10], None)
            .expect("put");
    }
}

#[test]
fn ssd_capacity_limit_stops_demotion_without_failing_puts() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Room for 3 blocks of 32 KiB on "SSD".
    let store = store_with_ssd(dir.path(), 96 << 10);
    fill(&store, 8);
    let m = store.metrics();
    assert_eq!(m.demotions.get(), 3);
    assert_eq!(m.ssd_full.get(), 1, "condition raised");
    assert_eq!(m.dropped.with_label_values(&["ssd_full"]).get(), 3);
    assert!(store.stats().ssd_full);
    // The newest two are in DRAM, the first three on SSD, the rest dropped.
    for i in [0, 1, 2, 6, 7] {
        assert!(store.exists(format!("k{i}").as_bytes()), "k{i}");
    }
    for i in [3, 4, 5] {
        assert!(!store.exists(format!("k{i}").as_bytes()), "k{i}");
    }
    // Freeing SSD space resumes demotion.
    assert!(store.remove(b"k0").expect("remove"));
    store.put(b"k8", &[8; 32 << 10], None).expect("put");
    assert_eq!(m.demotions.get(), 4);
    assert_eq!(m.ssd_full.get(), 0, "condition cleared");
}

#[test]
fn corrupt_ssd_block_is_a_miss_in_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = store_with_ssd(dir.path(), 1 << 20);
    fill(&store, 3); // k0 demoted to SSD at offset 0
    store.sync().expect("sync");
    let data = data_file(dir.path());
    data.write_all_at(&[0xee; 16], 100).expect("corrupt");
    drop(data);
    let dram_before = store.stats().dram_used;
    assert!(
        store
            .get_with(b"k0", <[u8]>::to_vec)
            .expect("get")
            .is_none()
    );
    assert_eq!(store.metrics().ssd_corrupt.get(), 1);
    // The DRAM block taken for the failed promotion was given back; one block was evicted
    // (demoted) to make room for it.
    assert_eq!(store.stats().dram_used, dram_before - (32 << 10));
    assert!(!store.exists(b"k0"));
    assert_eq!(served_from(&store, b"k2", Served::Dram), vec![2; 32 << 10]);
}

fn mount_tmpfs(dir: &Path, size: &str) -> bool {
    if !nix_is_root() {
        return false;
    }
    Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .is_some_and(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

#[test]
fn full_filesystem_stops_demotion_with_a_condition() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    if !mount_tmpfs(&mnt, "256k") {
        println!(
            "SKIP: mounting a small tmpfs needs root; the capacity-limit test covers the rest"
        );
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _guard = Unmount(&mnt);
    // The tier believes it has 64 MiB; the filesystem has 256 KiB.
    let store = store_with_ssd(&mnt, 64 << 20);
    fill(&store, 16);
    let m = store.metrics();
    assert_eq!(m.ssd_full.get(), 1, "ENOSPC raised the condition");
    let demoted = m.demotions.get();
    assert!((1..14).contains(&demoted), "demoted {demoted}");
    assert!(m.dropped.with_label_values(&["ssd_full"]).get() >= 1);
    // Everything demoted before the disk filled is still readable and intact.
    assert_eq!(served_from(&store, b"k0", Served::Ssd), vec![0; 32 << 10]);
    // The index still persists (it has room: records are small, or it reports an error
    // without crashing).
    let _ = store.persist(false);
}

#[test]
fn ssd_block_larger_than_dram_is_served_without_promotion() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        // Written by an agent that had more DRAM.
        let mut t = tier_with(dir.path(), &[(b"huge", 7, 100_000)]);
        t.snapshot().expect("snapshot");
    }
    let store = store_with_ssd(dir.path(), 1 << 20);
    assert_eq!(
        served_from(&store, b"huge", Served::Ssd),
        block(7, 100_000)[..100_000].to_vec()
    );
    assert_eq!(store.metrics().promotions.get(), 0);
    assert_eq!(store.stats().dram_used, 0);
}
