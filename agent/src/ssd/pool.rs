//! Durable index of the pool-mode SSD segment (`pool-ssd.dat`, mounted as `ssd0`): which master
//! object (128-bit key digest) lives at which offset, with its length and a crc32c of its
//! bytes. Demotions and repairs into the segment append a record after the data is flushed;
//! the log is fsynced in batches (every heartbeat and on shutdown) and compacted into a
//! snapshot at start-up. On restart every indexed block is checked against the data file:
//! truncated, out-of-bounds or corrupt blocks are dropped and counted, the rest are announced to
//! the master for adoption. While running, the master's segment-event feed keeps the index in
//! step with the master ([`PoolSsdIndex::apply`]: commits of replicas written by others are
//! checksummed from the file and recorded, frees become tombstones), and every read of an
//! indexed block is verified against its checksum ([`BlockChecker`]). A record is also
//! superseded when a newer one overlaps its bytes. I/O boundary: the files `pool-ssd.idx` and
//! `pool-ssd.dat` under the tier's directory; [`replay`] is pure.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kvpool_core::master::ObjectKey;
use kvpool_core::master::state::{SegmentEvent, SegmentEventKind};

/// Index file of the pool-mode SSD segment, next to its data file.
pub const POOL_INDEX_FILE: &str = "pool-ssd.idx";
const POOL_INDEX_TMP: &str = "pool-ssd.idx.tmp";
const MAGIC: &[u8; 8] = b"KVPPOOLX";
/// Version of the index format this build writes; newer ones are refused.
pub const POOL_INDEX_VERSION: u32 = 1;
const HEADER_LEN: usize = 16;
const REC_PUT: u8 = 1;
const REC_DROP: u8 = 2;
const PUT_LEN: usize = 1 + 16 + 8 + 8 + 4;
const DROP_LEN: usize = 1 + 16 + 8;
/// Bytes read at once while checking a block.
const CHECK_CHUNK: usize = 1 << 20;

/// Errors of the pool SSD index.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum PoolIndexError {
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("index {path} is not a kvpool pool SSD index (bad magic)")]
    BadMagic { path: PathBuf },
    #[error("index {path} has format version {found}; this agent reads up to {POOL_INDEX_VERSION}")]
    UnsupportedVersion { path: PathBuf, found: u32 },
    #[error("reading {path} failed")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing index {path} failed")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("flushing {path} to stable storage failed")]
    Sync {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl PoolIndexError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// One block of the segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolBlock {
    pub key: ObjectKey,
    pub offset: u64,
    pub length: u64,
    pub crc: u32,
}

/// Why a block was dropped at start-up or afterwards (the `reason` metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// The block ends past the segment's capacity.
    OutOfBounds,
    /// The data file is shorter than the block's end.
    Truncated,
    /// The bytes do not match the recorded checksum.
    Corrupt,
    /// The master refused to adopt it (overlap, size mismatch...).
    Refused,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::OutOfBounds => "out_of_bounds",
            DropReason::Truncated => "truncated",
            DropReason::Corrupt => "corrupt",
            DropReason::Refused => "refused",
        }
    }
}

/// What [`PoolSsdIndex::open`] found.
#[derive(Debug, Default)]
pub struct PoolRecovery {
    /// Blocks that passed their checks (to announce to the master), by offset.
    pub blocks: Vec<PoolBlock>,
    /// Blocks dropped, with the reason.
    pub dropped: Vec<(PoolBlock, DropReason)>,
    /// Problems with the index itself (a damaged tail is ignored).
    pub warnings: Vec<String>,
}

/// A replayed index: live blocks by offset, and whether the log ended cleanly.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    pub blocks: BTreeMap<u64, PoolBlock>,
    /// Byte position where a damaged tail starts, if any.
    pub damaged_at: Option<usize>,
}

/// Insert `b`, dropping every block whose bytes overlap it (the master reused those bytes, so
/// the older object there is gone).
fn insert(blocks: &mut BTreeMap<u64, PoolBlock>, b: PoolBlock) {
    let end = b.offset.saturating_add(b.length.max(1));
    // Indexed blocks never overlap each other, so the ones `b` overlaps are the last ones
    // starting before its end.
    let doomed: Vec<u64> = blocks
        .range(..end)
        .rev()
        .take_while(|(_, o)| o.offset.saturating_add(o.length.max(1)) > b.offset)
        .map(|(k, _)| *k)
        .collect();
    for k in doomed {
        blocks.remove(&k);
    }
    blocks.insert(b.offset, b);
}

fn encode(kind: u8, b: &PoolBlock) -> Vec<u8> {
    let mut p = Vec::with_capacity(PUT_LEN + 8);
    let plen: u32 = if kind == REC_PUT {
        PUT_LEN as u32
    } else {
        DROP_LEN as u32
    };
    p.extend_from_slice(&plen.to_le_bytes());
    let start = p.len() + 4;
    p.extend_from_slice(&[0; 4]);
    p.push(kind);
    p.extend_from_slice(&b.key.hi.to_le_bytes());
    p.extend_from_slice(&b.key.lo.to_le_bytes());
    p.extend_from_slice(&b.offset.to_le_bytes());
    if kind == REC_PUT {
        p.extend_from_slice(&b.length.to_le_bytes());
        p.extend_from_slice(&b.crc.to_le_bytes());
    }
    let crc = crc32c::crc32c(p.get(start..).unwrap_or_default());
    if let Some(slot) = p.get_mut(4..8) {
        slot.copy_from_slice(&crc.to_le_bytes());
    }
    p
}

fn u64_at(p: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(p.get(at..at + 8)?.try_into().ok()?))
}

fn header() -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&POOL_INDEX_VERSION.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// Replay the records after the header. Pure. A record that is cut short, fails its checksum
/// or does not decode ends the replay there (a crash while appending).
pub fn replay(records: &[u8]) -> Replayed {
    let mut out = Replayed::default();
    let mut pos = 0;
    while pos < records.len() {
        let parsed = (|| {
            let plen = u32::from_le_bytes(records.get(pos..pos + 4)?.try_into().ok()?) as usize;
            let crc = u32::from_le_bytes(records.get(pos + 4..pos + 8)?.try_into().ok()?);
            let p = records.get(pos + 8..pos + 8 + plen)?;
            if crc32c::crc32c(p) != crc {
                return None;
            }
            let key = ObjectKey {
                hi: u64_at(p, 1)?,
                lo: u64_at(p, 9)?,
            };
            let offset = u64_at(p, 17)?;
            let rec = match (p.first()?, plen) {
                (&REC_PUT, PUT_LEN) => (
                    true,
                    PoolBlock {
                        key,
                        offset,
                        length: u64_at(p, 25)?,
                        crc: u32::from_le_bytes(p.get(33..37)?.try_into().ok()?),
                    },
                ),
                (&REC_DROP, DROP_LEN) => (
                    false,
                    PoolBlock {
                        key,
                        offset,
                        length: 0,
                        crc: 0,
                    },
                ),
                _ => return None,
            };
            Some((rec, 8 + plen))
        })();
        let Some(((put, block), used)) = parsed else {
            out.damaged_at = Some(pos);
            break;
        };
        if put {
            insert(&mut out.blocks, block);
        } else if out
            .blocks
            .get(&block.offset)
            .is_some_and(|b| b.key == block.key)
        {
            out.blocks.remove(&block.offset);
        }
        pos += used;
    }
    out
}

/// Check one block against the data file: bounds, length, checksum.
fn check_block(
    data: &File,
    data_len: u64,
    capacity: u64,
    b: &PoolBlock,
) -> std::io::Result<Option<DropReason>> {
    let Some(end) = b.offset.checked_add(b.length) else {
        return Ok(Some(DropReason::OutOfBounds));
    };
    if b.length == 0 || end > capacity {
        return Ok(Some(DropReason::OutOfBounds));
    }
    if end > data_len {
        return Ok(Some(DropReason::Truncated));
    }
    let mut buf = vec![0u8; CHECK_CHUNK.min(usize::try_from(b.length).unwrap_or(CHECK_CHUNK))];
    let mut crc = 0u32;
    let mut pos = b.offset;
    while pos < end {
        let n = usize::try_from(end - pos)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let Some(chunk) = buf.get_mut(..n) else {
            return Ok(Some(DropReason::Corrupt));
        };
        match data.read_exact_at(chunk, pos) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok(Some(DropReason::Truncated));
            }
            Err(e) => return Err(e),
        }
        crc = crc32c::crc32c_append(crc, chunk);
        pos += n as u64;
    }
    Ok((crc != b.crc).then_some(DropReason::Corrupt))
}

/// The durable index of the pool-mode SSD segment. Not thread safe by itself.
#[derive(Debug)]
pub struct PoolSsdIndex {
    index_path: PathBuf,
    data_path: PathBuf,
    index: File,
    /// Kept open to flush the mapped data before a record names it.
    data: File,
    blocks: BTreeMap<u64, PoolBlock>,
    /// Records appended since the last fsync of the index.
    dirty: bool,
    /// During a resynchronisation (between the feed's RESET and RESET_DONE): blocks indexed
    /// before it that the master has not confirmed yet.
    limbo: Option<BTreeMap<u64, PoolBlock>>,
}

impl PoolSsdIndex {
    /// Open (or create) the index of data file `data_path` in `dir`, check every indexed block
    /// against the data file (blocks must end within `capacity`), and rewrite the index as a
    /// snapshot of the blocks that passed. Call before the data file is mapped and resized.
    pub fn open(
        dir: &Path,
        data_path: &Path,
        capacity: u64,
    ) -> Result<(Self, PoolRecovery), PoolIndexError> {
        let index_path = dir.join(POOL_INDEX_FILE);
        let mut recovery = PoolRecovery::default();
        let bytes = match std::fs::read(&index_path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(PoolIndexError::Read {
                    path: index_path,
                    source,
                });
            }
        };
        let replayed = if bytes.is_empty() {
            Replayed::default()
        } else {
            if bytes.get(..8) != Some(&MAGIC[..]) {
                return Err(PoolIndexError::BadMagic { path: index_path });
            }
            let version = bytes
                .get(8..12)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .unwrap_or(0);
            if version == 0 || version > POOL_INDEX_VERSION {
                return Err(PoolIndexError::UnsupportedVersion {
                    path: index_path,
                    found: version,
                });
            }
            replay(bytes.get(HEADER_LEN..).unwrap_or_default())
        };
        if let Some(at) = replayed.damaged_at {
            recovery.warnings.push(format!(
                "index {} is damaged after byte {}; the tail is ignored",
                index_path.display(),
                at + HEADER_LEN
            ));
        }
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(data_path)
            .map_err(|source| PoolIndexError::Open {
                path: data_path.to_owned(),
                source,
            })?;
        let read_err = |source| PoolIndexError::Read {
            path: data_path.to_owned(),
            source,
        };
        let data_len = data.metadata().map_err(read_err)?.len();
        let mut blocks = BTreeMap::new();
        for b in replayed.blocks.into_values() {
            match check_block(&data, data_len, capacity, &b).map_err(read_err)? {
                None => {
                    blocks.insert(b.offset, b);
                    recovery.blocks.push(b);
                }
                Some(reason) => recovery.dropped.push((b, reason)),
            }
        }
        let index = Self::write_snapshot(dir, &index_path, &blocks)?;
        Ok((
            Self {
                index_path,
                data_path: data_path.to_owned(),
                index,
                data,
                blocks,
                dirty: false,
                limbo: None,
            },
            recovery,
        ))
    }

    /// Write `blocks` as a fresh index atomically (temp file, fsync, rename, fsync of the dir).
    fn write_snapshot(
        dir: &Path,
        index_path: &Path,
        blocks: &BTreeMap<u64, PoolBlock>,
    ) -> Result<File, PoolIndexError> {
        let tmp = dir.join(POOL_INDEX_TMP);
        let werr = |source| PoolIndexError::Write {
            path: tmp.clone(),
            source,
        };
        let mut out = header();
        for b in blocks.values() {
            out.extend_from_slice(&encode(REC_PUT, b));
        }
        let mut f = File::create(&tmp).map_err(werr)?;
        f.write_all(&out).map_err(werr)?;
        f.sync_all().map_err(werr)?;
        std::fs::rename(&tmp, index_path).map_err(werr)?;
        if let Ok(d) = File::open(dir) {
            d.sync_all().map_err(|source| PoolIndexError::Sync {
                path: dir.to_owned(),
                source,
            })?;
        }
        OpenOptions::new()
            .append(true)
            .open(index_path)
            .map_err(|source| PoolIndexError::Open {
                path: index_path.to_owned(),
                source,
            })
    }

    fn append(&mut self, rec: &[u8]) -> Result<(), PoolIndexError> {
        self.index
            .write_all(rec)
            .map_err(|source| PoolIndexError::Write {
                path: self.index_path.clone(),
                source,
            })?;
        self.dirty = true;
        Ok(())
    }

    /// Record that `key` was written at `offset` (`length` bytes whose checksum is `crc`). The
    /// data file is flushed first, so a record never names bytes that are not on disk; the
    /// record itself reaches the disk at the next [`Self::sync`].
    pub fn record(
        &mut self,
        key: ObjectKey,
        offset: u64,
        length: u64,
        crc: u32,
    ) -> Result<(), PoolIndexError> {
        self.data
            .sync_data()
            .map_err(|source| PoolIndexError::Sync {
                path: self.data_path.clone(),
                source,
            })?;
        let b = PoolBlock {
            key,
            offset,
            length,
            crc,
        };
        self.append(&encode(REC_PUT, &b))?;
        insert(&mut self.blocks, b);
        Ok(())
    }

    /// Forget the block of `key` at `offset` (the master refused it, or it was found bad).
    /// Returns whether it was indexed.
    pub fn forget(&mut self, key: ObjectKey, offset: u64) -> Result<bool, PoolIndexError> {
        if self.blocks.get(&offset).is_none_or(|b| b.key != key) {
            return Ok(false);
        }
        let b = PoolBlock {
            key,
            offset,
            length: 0,
            crc: 0,
        };
        self.append(&encode(REC_DROP, &b))?;
        self.blocks.remove(&offset);
        Ok(true)
    }

    /// Flush appended records to stable storage (a no-op when nothing changed).
    pub fn sync(&mut self) -> Result<(), PoolIndexError> {
        if self.dirty {
            self.index
                .sync_data()
                .map_err(|source| PoolIndexError::Sync {
                    path: self.index_path.clone(),
                    source,
                })?;
            self.dirty = false;
        }
        Ok(())
    }

    /// The indexed blocks, by offset.
    pub fn blocks(&self) -> Vec<PoolBlock> {
        self.blocks.values().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The indexed block that holds byte `offset`, if any.
    pub fn block_at(&self, offset: u64) -> Option<PoolBlock> {
        self.blocks
            .range(..=offset)
            .next_back()
            .map(|(_, b)| *b)
            .filter(|b| offset < b.offset.saturating_add(b.length))
    }

    /// Index `length` bytes at `offset` as `key`, with the checksum of the bytes the data file
    /// holds there now (a replica another node or client wrote). A no-op when exactly that
    /// block is indexed already. Returns whether a record was written.
    pub fn commit_from_file(
        &mut self,
        key: ObjectKey,
        offset: u64,
        length: u64,
    ) -> Result<bool, PoolIndexError> {
        if self
            .blocks
            .get(&offset)
            .is_some_and(|b| b.key == key && b.length == length)
        {
            return Ok(false);
        }
        let crc = crc_of(&self.data, offset, length).map_err(|source| PoolIndexError::Read {
            path: self.data_path.clone(),
            source,
        })?;
        self.record(key, offset, length, crc)?;
        Ok(true)
    }

    /// Apply one event of the master's feed for this segment (see `SegmentEventKind` in
    /// master.proto). Records reach the disk at the next [`Self::sync`]; acknowledge the event
    /// only after that.
    pub fn apply(&mut self, e: &SegmentEvent) -> Result<(), PoolIndexError> {
        match e.kind {
            SegmentEventKind::Commit => {
                if let Some(limbo) = self.limbo.as_mut() {
                    let end = e.offset.saturating_add(e.length.max(1));
                    limbo.retain(|_, b| {
                        b.offset.saturating_add(b.length.max(1)) <= e.offset || b.offset >= end
                    });
                }
                if e.length > 0 {
                    self.commit_from_file(e.key, e.offset, e.length)?;
                }
            }
            SegmentEventKind::Free => {
                if let Some(limbo) = self.limbo.as_mut()
                    && limbo.get(&e.offset).is_some_and(|b| b.key == e.key)
                {
                    limbo.remove(&e.offset);
                }
                self.forget(e.key, e.offset)?;
            }
            SegmentEventKind::Reset => self.limbo = Some(self.blocks.clone()),
            SegmentEventKind::ResetDone => {
                for b in self.limbo.take().unwrap_or_default().into_values() {
                    self.forget(b.key, b.offset)?;
                }
            }
        }
        Ok(())
    }

    /// A reader of the data file for verifying blocks outside the index's lock.
    pub fn checker(&self) -> Result<BlockChecker, PoolIndexError> {
        let data = File::open(&self.data_path).map_err(|source| PoolIndexError::Open {
            path: self.data_path.clone(),
            source,
        })?;
        Ok(BlockChecker {
            data,
            path: self.data_path.clone(),
        })
    }
}

/// Checksum `length` bytes of `data` at `offset`, reading [`CHECK_CHUNK`] at a time. A file
/// shorter than the range fails with `UnexpectedEof`.
fn crc_of(data: &File, offset: u64, length: u64) -> std::io::Result<u32> {
    let end = offset
        .checked_add(length)
        .ok_or_else(|| std::io::Error::other("block range overflows"))?;
    let mut buf = vec![0u8; CHECK_CHUNK.min(usize::try_from(length).unwrap_or(CHECK_CHUNK))];
    let mut crc = 0u32;
    let mut pos = offset;
    while pos < end {
        let n = usize::try_from(end - pos)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let chunk = buf
            .get_mut(..n)
            .ok_or_else(|| std::io::Error::other("chunk out of range"))?;
        data.read_exact_at(chunk, pos)?;
        crc = crc32c::crc32c_append(crc, chunk);
        pos += n as u64;
    }
    Ok(crc)
}

/// Verifies indexed blocks against the data file (its own file handle, so the check runs
/// without holding the index's lock).
#[derive(Debug)]
pub struct BlockChecker {
    data: File,
    path: PathBuf,
}

impl BlockChecker {
    /// `None` when the bytes of `b` in the data file match its checksum, else why not.
    pub fn verify(&self, b: &PoolBlock) -> Result<Option<DropReason>, PoolIndexError> {
        match crc_of(&self.data, b.offset, b.length) {
            Ok(crc) => Ok((crc != b.crc).then_some(DropReason::Corrupt)),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Ok(Some(DropReason::Truncated))
            }
            Err(source) => Err(PoolIndexError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
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
        let (idx, rec) =
            PoolSsdIndex::open(dir.path(), &data_path, capacity - 8192).expect("reopen");
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
        let mut h = header();
        h[8] = 99;
        std::fs::write(dir.path().join(POOL_INDEX_FILE), &h).expect("w");
        let e = PoolSsdIndex::open(dir.path(), &data_path, 4096).expect_err("version");
        assert_eq!(e.category(), "unsupported_version");
    }
}
