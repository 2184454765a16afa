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
