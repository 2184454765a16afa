//! Unit tests of the SSD tier: batch reads that drop corrupt blocks, capacity, and refused
//! index files (integration tests with restarts are in `agent/tests/ssd_tier.rs`).

use std::path::Path;

use super::index::{INDEX_FILE, MAGIC};
use super::*;
use crate::ssd::log;

/// Open the tier in `dir` with `capacity` bytes and direct I/O where the filesystem allows.
fn open(dir: &Path, capacity: u64) -> Result<(SsdTier, Recovery), SsdError> {
    let direct_io = DirectIo::Auto;
    SsdTier::open(&SsdConfig {
        dir: dir.to_owned(),
        capacity,
        direct_io,
    })
}

/// A padded block of `len` bytes of `fill`.
fn block(fill: u8, len: usize) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    b[..len].fill(fill);
    b
}

#[test]
fn read_each_verifies_every_block_and_drops_corrupt_ones() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut t, _) = open(dir.path(), 64 * ALIGN).expect("open");
    let lens = [5000usize, 100, 3 * ALIGN as usize, 1];
    for (i, len) in lens.iter().enumerate() {
        t.put(
            format!("k{i}").as_bytes(),
            &block(i as u8 + 1, *len),
            *len as u64,
        )
        .expect("put");
    }
    let k1 = t.entries.get(b"k1".as_slice()).copied().expect("k1");
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(DATA_FILE))
        .expect("data")
        .write_all_at(&[0xee], k1.offset + 7)
        .expect("corrupt");
    let keys: Vec<&[u8]> = vec![b"k0", b"k1", b"missing", b"k2", b"k3"];
    type Seen = (usize, Result<Option<Vec<u8>>, &'static str>);
    let mut seen: Vec<Seen> = Vec::new();
    t.read_each(&keys, &mut |i, got| {
        seen.push((
            i,
            got.map(|b| b.map(<[u8]>::to_vec)).map_err(|e| e.category()),
        ));
    })
    .expect("read_each");
    let idx: Vec<usize> = seen.iter().map(|s| s.0).collect();
    assert_eq!(idx, vec![0, 1, 2, 3, 4], "every key once, in order");
    assert_eq!(seen[0].1, Ok(Some(vec![1; 5000])));
    assert_eq!(seen[1].1, Err("corrupt"));
    assert_eq!(seen[2].1, Ok(None));
    assert_eq!(seen[3].1, Ok(Some(vec![3; 3 * ALIGN as usize])));
    assert_eq!(seen[4].1, Ok(Some(vec![4; 1])));
    assert!(
        t.get(b"k1").expect("get").is_none(),
        "the corrupt block is dropped"
    );
}

#[test]
fn put_get_remove_and_capacity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut t, rec) = open(dir.path(), 3 * ALIGN).expect("open");
    assert_eq!(rec.blocks, 0);
    t.put(b"a", &block(1, 5000), 5000).expect("put a");
    let err = t.put(b"b", &block(2, 5000), 5000).expect_err("full");
    assert!(err.is_full(), "{err}");
    t.put(b"c", &block(3, 100), 100).expect("put c");
    let (buf, len) = t.get(b"a").expect("get").expect("present");
    assert_eq!(len, 5000);
    assert!(buf[..5000].iter().all(|&x| x == 1));
    assert!(t.get(b"zz").expect("get").is_none());
    assert!(t.remove(b"a").expect("remove"));
    assert!(!t.remove(b"a").expect("remove again"));
    assert_eq!(t.usage().used, ALIGN);
    assert_eq!(
        t.put(b"", &block(0, 1), 1)
            .expect_err("empty key")
            .category(),
        "bad_key"
    );
}

#[test]
fn unknown_future_version_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let header = log::header(MAGIC, 99);
    std::fs::write(dir.path().join(INDEX_FILE), header).expect("write");
    let err = open(dir.path(), 1 << 20).expect_err("refused");
    assert_eq!(err.category(), "unsupported_version");
    std::fs::write(dir.path().join(INDEX_FILE), b"not an index at all").expect("write");
    let err = open(dir.path(), 1 << 20).expect_err("refused");
    assert_eq!(err.category(), "bad_magic");
}

#[test]
fn recover_index_finds_what_opening_the_tier_finds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut t, _) = open(dir.path(), 64 * ALIGN).expect("open");
    for (i, len) in [100usize, 5000, 1].into_iter().enumerate() {
        t.put(format!("k{i}").as_bytes(), &block(7, len), len as u64)
            .expect("put");
    }
    t.remove(b"k1").expect("remove");
    let bytes = std::fs::read(dir.path().join(INDEX_FILE)).expect("index");
    let data_len = std::fs::metadata(dir.path().join(DATA_FILE))
        .expect("data file")
        .len();
    let usage = t.usage();
    drop(t);
    let (recovered, recovered_usage) =
        SsdTier::recover_index(&bytes, 64 * ALIGN, data_len).expect("recovers");
    let (reopened, opened) = open(dir.path(), 64 * ALIGN).expect("reopen");
    // (Opening may add a warning about O_DIRECT; the index's findings are the same.)
    assert_eq!(
        (recovered.blocks, recovered.bytes, recovered.version_found),
        (opened.blocks, opened.bytes, opened.version_found)
    );
    assert_eq!((recovered.blocks, recovered.bytes), (2, 101));
    assert!(recovered.warnings.is_empty());
    assert_eq!(recovered_usage, usage);
    assert_eq!(reopened.usage(), usage);
    // A short data file drops the blocks past its end, with a warning each.
    let (short, _) = SsdTier::recover_index(&bytes, 64 * ALIGN, 0).expect("recovers");
    assert_eq!((short.blocks, short.warnings.len()), (0, 2));
    assert!(matches!(
        SsdTier::recover_index(b"not an index", 64 * ALIGN, 0),
        Err(SsdError::BadMagic { .. })
    ));
}

#[test]
fn an_index_entry_of_absurd_length_is_dropped_not_a_panic() {
    // Found by the ssd_index fuzz target (fuzz/corpus/ssd_index/regression-len-overflow): an
    // entry whose length rounds up past u64::MAX overflowed the padding arithmetic.
    let input = include_bytes!("../../../../fuzz/corpus/ssd_index/regression-len-overflow");
    let (&which, bytes) = input.split_first().expect("input");
    let data_len = [0, 4096, 1 << 20, 16 << 20, u64::MAX][usize::from(which / 2 % 5)];
    let (recovery, usage) =
        SsdTier::recover_index(bytes, 16 << 20, data_len).expect("the index replays");
    assert!(usage.used <= usage.capacity);
    assert_eq!(recovery.blocks, usage.blocks);
}
