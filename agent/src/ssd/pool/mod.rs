//! Durable index of a persistent pool-mode segment — the SSD segment (`pool-ssd.dat`, mounted
//! as `ssd0`) and, with `dram.persistence`, each DRAM segment kept in a tmpfs or hugetlbfs file
//! (`dram<i>.dat`, index `dram<i>.idx`): which master object (128-bit key digest) lives at
//! which offset, with its length and a crc32c of its bytes. Demotions and repairs into the segment append a record after the data is flushed;
//! the log is fsynced in batches (every heartbeat and on shutdown) and compacted into a
//! snapshot at start-up. On restart every indexed block is checked against the data file:
//! truncated, out-of-bounds or corrupt blocks are dropped and counted, the rest are announced to
//! the master for adoption. While running, the master's segment-event feed keeps the index in
//! step with the master ([`PoolSsdIndex::apply`]: commits of replicas written by others are
//! checksummed from the file, frees become tombstones), and every read of an indexed block is
//! verified against its checksum ([`BlockChecker`]). A commit checksummed from the file is
//! *unconfirmed* until a later, complete answer of the feed shows the replica was not freed
//! meanwhile ([`PoolSsdIndex::confirm`]); only then is it written to the log, so a crash can
//! never bring back a key with the checksum of bytes another writer put there after the key
//! was freed (docs/agent.md, *SSD persistence*). A record is also
//! superseded when a newer one overlaps its bytes. The record format is in [`records`], the
//! checks of blocks against the data file in [`check`]. I/O boundary: the files
//! `pool-ssd.idx` and `pool-ssd.dat` under the tier's directory; [`replay`] is pure.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvpool_core::master::ObjectKey;
use kvpool_core::master::state::{SegmentEvent, SegmentEventKind};
use parking_lot::Mutex;

use crate::ssd::log::{self, Header, SnapshotError};

mod append;
mod check;
mod records;
#[cfg(test)]
mod tests;

pub use check::BlockChecker;
use check::check_block;
use records::{MAGIC, REC_DROP, REC_PUT, encode, insert};
pub use records::{Replayed, replay};

/// Index file of the pool-mode SSD segment, next to its data file.
pub const POOL_INDEX_FILE: &str = "pool-ssd.idx";
/// Version of the index format this build writes; newer ones are refused.
pub const POOL_INDEX_VERSION: u32 = 1;

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
    #[error("index {path} is not a kvpool segment index (bad magic)")]
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

kvpool_runtime::error_category!(PoolIndexError);

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

/// Flush the data of `file` (at `path`) to stable storage.
fn flush(file: &File, path: &Path) -> Result<(), PoolIndexError> {
    file.sync_data().map_err(|source| PoolIndexError::Sync {
        path: path.to_owned(),
        source,
    })
}

/// The SSD segment's index as pool mode shares it: the task runner and the engine API record
/// writes, the link syncs and announces it, the read guard drops bad blocks from it.
pub type SharedIndex = Arc<Mutex<PoolSsdIndex>>;

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
    /// Blocks of `blocks` indexed from a feed commit whose checksum is not trusted yet (the
    /// range may have been freed and rewritten before it was taken), by offset, with the feed
    /// round that took it. Not in the log; an entry whose block left `blocks` is stale.
    unconfirmed: BTreeMap<u64, (PoolBlock, u64)>,
    /// The feed round commits are applied in now ([`Self::begin_feed_round`]).
    round: u64,
    /// Length of the log file up to its last whole record: a failed append is cut back to it.
    whole_len: u64,
    /// Records that could not be appended (a full filesystem), in order: appended before any
    /// newer record, at the next append or sync that finds room. A record is whole in the log
    /// or absent from it, never torn.
    backlog: Vec<u8>,
    /// `kvpool_agent_ssd_full`: 1 while records wait in the backlog.
    full_gauge: Option<prometheus::IntGauge>,
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
        Self::open_at(&dir.join(POOL_INDEX_FILE), data_path, capacity)
    }

    /// [`Self::open`] with the index at `index_path` (a persistent DRAM segment's index is
    /// `dram<i>.idx`; the snapshot's temporary file is `index_path` + `.tmp`).
    pub fn open_at(
        index_path: &Path,
        data_path: &Path,
        capacity: u64,
    ) -> Result<(Self, PoolRecovery), PoolIndexError> {
        let index_path = index_path.to_owned();
        let dir = index_path
            .parent()
            .map(Path::to_owned)
            .unwrap_or_else(|| PathBuf::from("."));
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
            let version = match log::read_header(&bytes, MAGIC) {
                Header::Foreign => return Err(PoolIndexError::BadMagic { path: index_path }),
                Header::Short => 0,
                Header::Version(v) => v,
            };
            if version == 0 || version > POOL_INDEX_VERSION {
                return Err(PoolIndexError::UnsupportedVersion {
                    path: index_path,
                    found: version,
                });
            }
            replay(bytes.get(log::HEADER_LEN..).unwrap_or_default())
        };
        if let Some(at) = replayed.damaged_at {
            recovery.warnings.push(format!(
                "index {} is damaged after byte {}; the tail is ignored",
                index_path.display(),
                at + log::HEADER_LEN
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
        let replayed_damage = replayed.damaged_at;
        for b in replayed.blocks.into_values() {
            match check_block(&data, data_len, capacity, &b).map_err(read_err)? {
                None => {
                    blocks.insert(b.offset, b);
                    recovery.blocks.push(b);
                }
                Some(reason) => recovery.dropped.push((b, reason)),
            }
        }
        let damaged_at = replayed_damage;
        let index = match Self::write_snapshot(&dir, &index_path, &blocks) {
            Ok(f) => f,
            // No room for a fresh snapshot (a full filesystem): keep the log, cut at its last
            // whole record, rather than not starting.
            Err(e) if !bytes.is_empty() => {
                recovery
                    .warnings
                    .push(format!("{e}; the log is kept as it was"));
                Self::keep_log(&index_path, damaged_at.map(|at| at + log::HEADER_LEN))?
            }
            Err(e) => return Err(e),
        };
        let whole_len = index
            .metadata()
            .map_err(|source| PoolIndexError::Read {
                path: index_path.clone(),
                source,
            })?
            .len();
        Ok((
            Self {
                index_path,
                data_path: data_path.to_owned(),
                index,
                data,
                blocks,
                dirty: false,
                limbo: None,
                unconfirmed: BTreeMap::new(),
                round: 0,
                whole_len,
                backlog: Vec::new(),
                full_gauge: None,
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
        let mut tmp = index_path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut out = log::header(MAGIC, POOL_INDEX_VERSION);
        for b in blocks.values() {
            out.extend_from_slice(&encode(REC_PUT, b));
        }
        log::write_atomically(dir, &tmp, index_path, &out).map_err(|e| match e {
            SnapshotError::Write(source) => PoolIndexError::Write { path: tmp, source },
            SnapshotError::SyncDir(source) => PoolIndexError::Sync {
                path: dir.to_owned(),
                source,
            },
        })?;
        OpenOptions::new()
            .append(true)
            .open(index_path)
            .map_err(|source| PoolIndexError::Open {
                path: index_path.to_owned(),
                source,
            })
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
        flush(&self.data, &self.data_path)?;
        let b = PoolBlock {
            key,
            offset,
            length,
            crc,
        };
        self.append(&encode(REC_PUT, &b))?;
        self.unconfirmed.remove(&offset);
        insert(&mut self.blocks, b);
        Ok(())
    }

    /// Whether `b` is indexed only in memory, waiting for [`Self::confirm`].
    fn is_unconfirmed(&self, b: &PoolBlock) -> bool {
        self.unconfirmed.get(&b.offset).is_some_and(|(u, _)| u == b)
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
        self.unconfirmed.remove(&offset);
        Ok(true)
    }

    /// Append the records waiting for room, if there is room now, and flush appended records
    /// to stable storage (a no-op when nothing changed).
    pub fn sync(&mut self) -> Result<(), PoolIndexError> {
        self.drain();
        if self.dirty {
            flush(&self.index, &self.index_path)?;
            self.dirty = false;
        }
        Ok(())
    }

    /// The durably indexed blocks (recorded or confirmed, not the unconfirmed feed commits),
    /// by offset: what a restart would find and what a mount announces.
    pub fn blocks(&self) -> Vec<PoolBlock> {
        self.blocks
            .values()
            .filter(|b| !self.is_unconfirmed(b))
            .copied()
            .collect()
    }

    /// The number of durably indexed blocks (see [`Self::blocks`]).
    pub fn len(&self) -> usize {
        self.blocks.len() - self.unconfirmed()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of feed commits indexed in memory only, waiting for [`Self::confirm`].
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed
            .values()
            .filter(|(b, _)| self.blocks.get(&b.offset) == Some(b))
            .count()
    }

    /// Start applying one answer of the master's feed: commits applied from now on belong to a
    /// new round. Returns the round before it, the one to pass to [`Self::confirm`] once this
    /// answer has been applied in full.
    pub fn begin_feed_round(&mut self) -> u64 {
        self.round += 1;
        self.round - 1
    }

    /// Make durable (append put records; the data file is flushed first) every unconfirmed
    /// commit of round `through` or earlier that is still indexed. Call only after applying in
    /// full a *complete* answer of the feed (every event the master held when it answered)
    /// to a heartbeat sent after round `through` ended: a replica freed after its checksum
    /// was taken has then been dropped by that answer's FREE (or by its RESET_DONE), so what
    /// is left was still committed after the checksum, i.e. the bytes checksummed were its
    /// own. Returns how many were confirmed.
    pub fn confirm(&mut self, through: u64) -> Result<usize, PoolIndexError> {
        let due: Vec<PoolBlock> = self
            .unconfirmed
            .values()
            .filter(|(b, round)| *round <= through && self.blocks.get(&b.offset) == Some(b))
            .map(|(b, _)| *b)
            .collect();
        if !due.is_empty() {
            flush(&self.data, &self.data_path)?;
        }
        for b in &due {
            self.append(&encode(REC_PUT, b))?;
            self.unconfirmed.remove(&b.offset);
        }
        let blocks = &self.blocks;
        self.unconfirmed
            .retain(|off, (b, round)| *round > through && blocks.get(off) == Some(b));
        Ok(due.len())
    }

    /// Forget every unconfirmed commit (the segment was mounted again under a new id: the
    /// master knows only what the mount announces, [`Self::blocks`]). Returns how many.
    pub fn discard_unconfirmed(&mut self) -> Result<usize, PoolIndexError> {
        let stale: Vec<PoolBlock> = self
            .unconfirmed
            .values()
            .filter(|(b, _)| self.blocks.get(&b.offset) == Some(b))
            .map(|(b, _)| *b)
            .collect();
        self.unconfirmed.clear();
        for b in &stale {
            self.forget(b.key, b.offset)?;
        }
        Ok(stale.len())
    }

    /// The indexed block that holds byte `offset`, if any (unconfirmed ones included: reads of
    /// them are checked too).
    pub fn block_at(&self, offset: u64) -> Option<PoolBlock> {
        self.blocks
            .range(..=offset)
            .next_back()
            .map(|(_, b)| *b)
            .filter(|b| offset < b.offset.saturating_add(b.length))
    }

    /// Index `length` bytes at `offset` as `key`, with the checksum of the bytes the data file
    /// holds there now (a replica another node or client wrote), *unconfirmed*: in memory
    /// only, in the current feed round, until [`Self::confirm`] writes it to the log. A no-op
    /// when exactly that block is durably indexed already; an unconfirmed one is checksummed
    /// again (the feed may have lost a free and a new commit of the key in between). Returns
    /// whether the block was (re)indexed.
    pub fn commit_from_file(
        &mut self,
        key: ObjectKey,
        offset: u64,
        length: u64,
    ) -> Result<bool, PoolIndexError> {
        if let Some(b) = self.blocks.get(&offset)
            && b.key == key
            && b.length == length
            && !self.is_unconfirmed(b)
        {
            return Ok(false);
        }
        let crc = log::crc_of_file(&self.data, offset, length).map_err(|source| {
            PoolIndexError::Read {
                path: self.data_path.clone(),
                source,
            }
        })?;
        let b = PoolBlock {
            key,
            offset,
            length,
            crc,
        };
        insert(&mut self.blocks, b);
        self.unconfirmed.insert(offset, (b, self.round));
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
