//! The SSD tier's index, `index.log`: magic `KVPSSDIX`, then one framed record per put (key,
//! offset, length, crc32c of the block) or removal (key), appended as the tier changes and
//! replaced by a snapshot of the live blocks at shutdown, after a damaged or older-format log,
//! and when the log holds far more records than blocks. Header, framing, replay and the atomic
//! snapshot are the shared [`crate::ssd::log`]; this module owns the payloads. I/O boundary:
//! `index.log` and its temporary snapshot file.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{Entry, Recovery, SsdError, SsdTier};
use crate::ssd::log::{self, Header, SnapshotError};

pub(super) const INDEX_FILE: &str = "index.log";
const INDEX_TMP: &str = "index.log.tmp";
pub(super) const MAGIC: &[u8; 8] = b"KVPSSDIX";
/// Version of the index format this build writes. Older versions are read and upgraded on the
/// next snapshot; newer ones are refused.
pub const INDEX_VERSION: u32 = 1;
const REC_PUT: u8 = 1;
const REC_REMOVE: u8 = 2;
/// Compact the log when it holds this many more records than live blocks.
const COMPACT_SLACK: u64 = 65_536;

/// The payload of a put record.
pub(super) fn encode_put(key: &[u8], e: &Entry) -> Vec<u8> {
    let mut p = Vec::with_capacity(key.len() + 23);
    p.push(REC_PUT);
    p.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
    p.extend_from_slice(key);
    p.extend_from_slice(&e.offset.to_le_bytes());
    p.extend_from_slice(&e.len.to_le_bytes());
    p.extend_from_slice(&e.crc.to_le_bytes());
    p
}

/// The payload of a removal record.
pub(super) fn encode_remove(key: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(key.len() + 3);
    p.push(REC_REMOVE);
    p.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
    p.extend_from_slice(key);
    p
}

enum Record {
    Put(Vec<u8>, Entry),
    Remove(Vec<u8>),
}

fn decode(p: &[u8]) -> Option<Record> {
    let (&kind, rest) = p.split_first()?;
    let klen = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    let key = rest.get(2..2 + klen)?.to_vec();
    let rest = rest.get(2 + klen..)?;
    match kind {
        REC_PUT if rest.len() == 20 => Some(Record::Put(
            key,
            Entry {
                offset: u64::from_le_bytes(rest.get(..8)?.try_into().ok()?),
                len: u64::from_le_bytes(rest.get(8..16)?.try_into().ok()?),
                crc: u32::from_le_bytes(rest.get(16..20)?.try_into().ok()?),
            },
        )),
        REC_REMOVE if rest.is_empty() => Some(Record::Remove(key)),
        _ => None,
    }
}

/// The index as replayed from disk.
#[derive(Debug, Default)]
pub(super) struct Replayed {
    /// The last word on every key.
    pub entries: HashMap<Vec<u8>, Entry>,
    /// Records read.
    pub records: u64,
    /// Format version found (0: no index yet).
    pub version: u32,
    /// Length of the valid log when the whole file was valid; `None` when a damaged tail was
    /// cut.
    pub valid_len: Option<u64>,
}

/// Replay the index of the tier in `dir`, noting a damaged tail in `recovery`.
pub(super) fn read(dir: &Path, recovery: &mut Recovery) -> Result<Replayed, SsdError> {
    let path = dir.join(INDEX_FILE);
    let read_err = |source| SsdError::ReadIndex {
        path: path.clone(),
        source,
    };
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => return Err(read_err(source)),
    };
    parse(&path, &bytes, recovery)
}

/// Replay the bytes of the index file at `path` (named in errors and warnings), noting a
/// damaged tail in `recovery`. Pure.
pub(super) fn parse(
    path: &Path,
    bytes: &[u8],
    recovery: &mut Recovery,
) -> Result<Replayed, SsdError> {
    let path = path.to_owned();
    if bytes.is_empty() {
        return Ok(Replayed {
            valid_len: Some(0),
            ..Replayed::default()
        });
    }
    let version = match log::read_header(bytes, MAGIC) {
        Header::Version(v) if v != 0 && v <= INDEX_VERSION => v,
        Header::Version(found) => return Err(SsdError::UnsupportedVersion { path, found }),
        Header::Foreign | Header::Short => return Err(SsdError::BadMagic { path }),
    };
    let mut entries = HashMap::new();
    let replay = log::replay(
        bytes.get(log::HEADER_LEN..).unwrap_or_default(),
        |payload| match decode(payload) {
            Some(Record::Put(k, e)) => {
                entries.insert(k, e);
                true
            }
            Some(Record::Remove(k)) => {
                entries.remove(&k);
                true
            }
            None => false,
        },
    );
    let pos = log::HEADER_LEN + replay.end;
    if replay.damaged {
        recovery.warnings.push(format!(
            "index {} is damaged after byte {pos} of {}; the tail is ignored",
            path.display(),
            bytes.len()
        ));
    }
    Ok(Replayed {
        entries,
        records: replay.records,
        version,
        valid_len: (!replay.damaged).then_some(pos as u64),
    })
}

/// Open (or create) the index log of the tier in `dir` for appending.
pub(super) fn open_log(dir: &Path) -> Result<File, SsdError> {
    let path = dir.join(INDEX_FILE);
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|source| SsdError::Open { path, source })
}

impl SsdTier {
    pub(super) fn write_index_err(&self, source: std::io::Error) -> SsdError {
        SsdError::WriteIndex {
            path: self.dir.join(INDEX_FILE),
            source,
        }
    }

    /// Append one record (compacting the log into a snapshot when it grew too long).
    pub(super) fn append(&mut self, payload: &[u8]) -> Result<(), SsdError> {
        let rec = log::record(payload);
        let end = self
            .index
            .metadata()
            .map_err(|source| self.write_index_err(source))?
            .len();
        self.index
            .write_all_at(&rec, end)
            .map_err(|source| self.write_index_err(source))?;
        self.index_records += 1;
        self.dirty = true;
        if self.index_records > self.entries.len() as u64 * 2 + COMPACT_SLACK {
            self.snapshot()?;
        }
        Ok(())
    }

    /// Rewrite the index as a snapshot of the live blocks (atomically: temp file, fsync, rename,
    /// fsync of the directory). Called on shutdown and when the log grows.
    pub fn snapshot(&mut self) -> Result<(), SsdError> {
        self.data.sync_data().map_err(SsdError::Sync)?;
        let tmp = self.dir.join(INDEX_TMP);
        let final_path = self.dir.join(INDEX_FILE);
        let mut out = Vec::with_capacity(64 + self.entries.len() * 64);
        out.extend_from_slice(&log::header(MAGIC, INDEX_VERSION));
        let mut keys: Vec<&Vec<u8>> = self.entries.keys().collect();
        keys.sort();
        for key in keys {
            if let Some(e) = self.entries.get(key) {
                log::push_record(&mut out, &encode_put(key, e));
            }
        }
        log::write_atomically(&self.dir, &tmp, &final_path, &out).map_err(|e| match e {
            SnapshotError::Write(source) => SsdError::WriteIndex { path: tmp, source },
            SnapshotError::SyncDir(source) => SsdError::Sync(source),
        })?;
        self.index = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&final_path)
            .map_err(|source| SsdError::Open {
                path: final_path.clone(),
                source,
            })?;
        self.index_records = self.entries.len() as u64;
        self.dirty = false;
        Ok(())
    }
}
