//! Unit tests of the pool SSD index: replay of puts, drops and overlaps, a damaged tail, the
//! start-up checks against the data file, and refused index files.

use std::os::unix::fs::FileExt;

use super::records::{MAGIC, REC_DROP, REC_PUT, encode};
use super::*;

fn key(i: u64) -> ObjectKey {
    ObjectKey::from_bytes(&i.to_le_bytes())
}

fn block(i: u64, offset: u64, data: &[u8]) -> PoolBlock {
    PoolBlock {
        key: key(i),
        offset,
        length: data.len() as u64,
        crc: crc32c::crc32c(data),
    }
}

fn records(blocks: &[(u8, PoolBlock)]) -> Vec<u8> {
    blocks.iter().flat_map(|(k, b)| encode(*k, b)).collect()
}

#[test]
fn replay_applies_puts_drops_and_overlaps_in_order() {
    let a = block(1, 0, &[1; 8192]);
    let b = block(2, 8192, &[2; 100]);
    // Overlaps the tail of `a` only: `a` is gone, `b` stays.
    let c = block(3, 4096, &[3; 4096]);
    let log = records(&[(REC_PUT, a), (REC_PUT, b), (REC_PUT, c)]);
    let r = replay(&log);
    assert_eq!(r.damaged_at, None);
    assert_eq!(r.blocks.values().copied().collect::<Vec<_>>(), vec![c, b]);
    // A drop names key and offset; a drop for another key at that offset is ignored.
    let log = records(&[(REC_PUT, a), (REC_DROP, b), (REC_DROP, block(9, 0, &[]))]);
    assert_eq!(replay(&log).blocks.len(), 1);
    let log = records(&[(REC_PUT, a), (REC_DROP, a)]);
    assert!(replay(&log).blocks.is_empty());
}

#[test]
fn replay_stops_at_a_damaged_tail() {
    let a = block(1, 0, &[1; 10]);
    let b = block(2, 4096, &[2; 10]);
    let mut log = records(&[(REC_PUT, a), (REC_PUT, b)]);
    let whole = log.len();
    log.truncate(whole - 3);
    let r = replay(&log);
    assert_eq!(r.blocks.len(), 1);
    assert_eq!(r.damaged_at, Some(whole / 2));
    let mut log = records(&[(REC_PUT, a), (REC_PUT, b)]);
    let last = log.len() - 1;
    log[last] ^= 0xff;
    assert_eq!(replay(&log).damaged_at, Some(whole / 2));
}

#[test]
fn open_checks_blocks_against_the_data_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data_path = dir.path().join("pool-ssd.dat");
    let capacity = 64 * 1024;
    {
        let (mut idx, rec) =
            PoolSsdIndex::open(dir.path(), &data_path, capacity).expect("open empty");
        assert!(rec.blocks.is_empty() && rec.dropped.is_empty());
        let f = OpenOptions::new()
            .write(true)
            .open(&data_path)
            .expect("data");
        f.set_len(capacity).expect("size");
        for (i, fill) in [(0u64, 1u8), (1, 2), (2, 3)] {
            let data = vec![fill; 5000];
            f.write_all_at(&data, i * 8192).expect("write");
            idx.record(key(i), i * 8192, 5000, crc32c::crc32c(&data))
                .expect("record");
        }
        // Past the capacity of the next start.
        let far = vec![9u8; 100];
        f.write_all_at(&far, capacity - 4096).expect("write");
        idx.record(key(7), capacity - 4096, 100, crc32c::crc32c(&far))
            .expect("record");
        assert_eq!(idx.len(), 4);
        idx.sync().expect("sync");
        // Corrupt block 1 while "down".
        f.write_all_at(&[0xee], 8192 + 10).expect("corrupt");
    }
    let (idx, rec) = PoolSsdIndex::open(dir.path(), &data_path, capacity - 8192).expect("reopen");
    let kept: Vec<ObjectKey> = rec.blocks.iter().map(|b| b.key).collect();
    assert_eq!(kept, vec![key(0), key(2)]);
    let mut dropped: Vec<(ObjectKey, DropReason)> =
        rec.dropped.iter().map(|(b, r)| (b.key, *r)).collect();
    dropped.sort_by_key(|d| d.1);
    assert_eq!(
        dropped,
        vec![
            (key(7), DropReason::OutOfBounds),
            (key(1), DropReason::Corrupt)
        ]
    );
    assert_eq!(idx.len(), 2);
    drop(idx);
    // Truncated data file: the block past its end is dropped as truncated.
    let f = OpenOptions::new()
        .write(true)
        .open(&data_path)
        .expect("data");
    f.set_len(16384).expect("truncate");
    let (mut idx, rec) = PoolSsdIndex::open(dir.path(), &data_path, capacity).expect("again");
    assert_eq!(rec.blocks.len(), 1);
    assert_eq!(rec.dropped[0].1, DropReason::Truncated);
    assert!(idx.forget(key(0), 0).expect("forget"));
    assert!(!idx.forget(key(0), 0).expect("already gone"));
    idx.sync().expect("sync");
    drop(idx);
    let (_, rec) = PoolSsdIndex::open(dir.path(), &data_path, capacity).expect("last");
    assert!(rec.blocks.is_empty());
}

#[test]
fn foreign_or_future_index_files_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data_path = dir.path().join("pool-ssd.dat");
    std::fs::write(dir.path().join(POOL_INDEX_FILE), b"not an index at all").expect("w");
    let e = PoolSsdIndex::open(dir.path(), &data_path, 4096).expect_err("magic");
    assert_eq!(e.category(), "bad_magic");
    let mut h = log::header(MAGIC, POOL_INDEX_VERSION);
    h[8] = 99;
    std::fs::write(dir.path().join(POOL_INDEX_FILE), &h).expect("w");
    let e = PoolSsdIndex::open(dir.path(), &data_path, 4096).expect_err("version");
    assert_eq!(e.category(), "unsupported_version");
}

/// A tmpfs of `size` mounted on a fresh directory for the life of the value (root only).
struct SmallFs(tempfile::TempDir);

impl SmallFs {
    /// None where mounting is not possible (not root, or no CAP_SYS_ADMIN); CI runs as root
    /// and must mount (`CI` set: a failure to mount fails the test).
    fn mount(size: &str) -> Option<SmallFs> {
        let dir = tempfile::tempdir().expect("tempdir");
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must be able to mount a tmpfs (root)"
            );
            eprintln!("SKIP: cannot mount a tmpfs here (needs root)");
            return None;
        }
        Some(SmallFs(dir))
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }

    /// Fill what is left with a file; returns its path.
    fn fill(&self) -> std::path::PathBuf {
        let filler = self.path().join("filler");
        let mut f = std::fs::File::create(&filler).expect("filler");
        let chunk = vec![0xeeu8; 4096];
        while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
        filler
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

#[test]
fn a_full_filesystem_tears_no_record_and_loses_no_block() {
    let Some(fs) = SmallFs::mount("2m") else {
        return;
    };
    let dir = fs.path();
    let data_path = dir.join("pool-ssd.dat");
    let values: Vec<Vec<u8>> = (0..300u64).map(|i| vec![(i % 251) as u8; 1000]).collect();
    {
        // The data file holds every block (as a fallocated, mapped segment would).
        let data = std::fs::File::create(&data_path).expect("data");
        for (i, v) in values.iter().enumerate() {
            data.write_all_at(v, i as u64 * 1024).expect("data bytes");
        }
    }
    let gauge = prometheus::IntGauge::new("kvpool_agent_ssd_full", "test").expect("gauge");
    let (mut idx, _) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("open");
    idx.set_full_gauge(gauge.clone());
    for (i, v) in values.iter().enumerate().take(100) {
        idx.record(key(i as u64), i as u64 * 1024, 1000, crc32c::crc32c(v))
            .expect("record");
    }
    idx.sync().expect("sync");
    let filler = fs.fill();
    // No room: 200 more blocks are recorded anyway (waiting), and the log stays whole.
    for (i, v) in values.iter().enumerate().skip(100) {
        idx.record(key(i as u64), i as u64 * 1024, 1000, crc32c::crc32c(v))
            .expect("a full filesystem does not fail a record");
    }
    let _ = idx.sync();
    assert!(idx.is_full());
    assert_eq!(gauge.get(), 1, "kvpool_agent_ssd_full while records wait");
    let log = std::fs::read(dir.join(POOL_INDEX_FILE)).expect("index");
    let replayed = replay(&log[crate::ssd::log::HEADER_LEN..]);
    assert_eq!(replayed.damaged_at, None, "no torn record in the log");
    // The log's last page had room for some; the rest wait.
    let durable = replayed.blocks.len();
    assert!((100..300).contains(&durable), "{durable}");
    // A restart while the filesystem is still full keeps the durable blocks.
    drop(idx);
    let (idx, rec) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("reopen while full");
    assert_eq!(
        (rec.blocks.len(), rec.dropped.len()),
        (durable, 0),
        "{:?}",
        rec.warnings
    );
    drop(idx);
    // Again with the 200 waiting records: room returns, the next sync writes them.
    let (mut idx, _) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("reopen");
    idx.set_full_gauge(gauge.clone());
    for (i, v) in values.iter().enumerate().skip(100) {
        idx.record(key(i as u64), i as u64 * 1024, 1000, crc32c::crc32c(v))
            .expect("record");
    }
    assert!(idx.is_full());
    std::fs::remove_file(&filler).expect("free room");
    idx.sync().expect("sync once there is room");
    assert!(!idx.is_full());
    assert_eq!(gauge.get(), 0, "kvpool_agent_ssd_full clears");
    drop(idx);
    let (_idx, rec) = PoolSsdIndex::open(dir, &data_path, 1 << 20).expect("restart");
    assert_eq!(
        rec.blocks.len(),
        300,
        "every block recorded survives the restart"
    );
    assert!(rec.dropped.is_empty() && rec.warnings.is_empty(), "{rec:?}");
}
