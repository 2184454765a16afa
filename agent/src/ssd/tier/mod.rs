//! SSD tier (local-only mode): blocks demoted from DRAM live in one data file on the configured
//! path, written with aligned direct I/O where the filesystem allows it (buffered I/O with a
//! warning otherwise), each with a crc32c; a versioned append-only index log ([`index`],
//! compacted into a snapshot on shutdown) records where every block is, so a restarted or
//! upgraded agent recovers the tier. A block whose bytes are truncated or do not match their
//! checksum is dropped, reported and never served. This module opens the tier and moves single
//! blocks; [`read_each`] reads batches. I/O boundary: the files `blocks.dat` and `index.log`
//! under the tier's directory.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::extent::ExtentAllocator;
use crate::ssd::aligned::{ALIGN, AlignedBuf, is_aligned, open_data, padded, read_fully};

mod index;
mod read_each;
#[cfg(test)]
mod tests;

pub use index::INDEX_VERSION;

const DATA_FILE: &str = "blocks.dat";
/// Longest key the index stores.
pub const MAX_KEY_LEN: usize = 1024;

/// Errors of the SSD tier.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SsdError {
    #[error("cannot create SSD tier directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("index {path} is not a kvpool SSD index (bad magic)")]
    BadMagic { path: PathBuf },
    #[error("index {path} has format version {found}; this agent reads up to {INDEX_VERSION}")]
    UnsupportedVersion { path: PathBuf, found: u32 },
    #[error("reading index {path} failed")]
    ReadIndex {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing index {path} failed")]
    WriteIndex {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("SSD tier is full ({needed} bytes needed)")]
    Full { needed: u64 },
    #[error("filesystem of the SSD tier is out of space")]
    NoSpace(#[source] std::io::Error),
    #[error("writing block data failed")]
    WriteData(#[source] std::io::Error),
    #[error("reading block data failed")]
    ReadData(#[source] std::io::Error),
    #[error("block is corrupt ({reason}); dropped")]
    Corrupt { reason: &'static str },
    #[error("key of {0} bytes is empty or longer than {MAX_KEY_LEN}")]
    BadKey(usize),
    #[error("syncing SSD tier files failed")]
    Sync(#[source] std::io::Error),
}

kvpool_runtime::error_category!(SsdError);

impl SsdError {
    /// Whether this error means "no room": demotion should stop.
    pub fn is_full(&self) -> bool {
        matches!(self, SsdError::Full { .. } | SsdError::NoSpace(_))
    }
}

/// Direct I/O setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectIo {
    /// Use O_DIRECT when the filesystem accepts it, else buffered I/O with a warning.
    #[default]
    Auto,
    /// Never use O_DIRECT.
    Off,
}

/// Settings of the SSD tier.
#[derive(Clone, Debug)]
pub struct SsdConfig {
    pub dir: PathBuf,
    pub capacity: u64,
    pub direct_io: DirectIo,
}

/// Where a block is in the data file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    offset: u64,
    len: u64,
    crc: u32,
}

/// One block handed out by [`SsdTier::read_each`].
pub type BlockRead<'a> = Result<Option<&'a [u8]>, SsdError>;

/// What opening the tier found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Blocks recovered from the index.
    pub blocks: u64,
    pub bytes: u64,
    /// Index version found on disk (0: new tier).
    pub version_found: u32,
    pub warnings: Vec<String>,
}

/// Space accounting of the tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SsdUsage {
    pub capacity: u64,
    pub used: u64,
    pub free: u64,
    pub blocks: u64,
}

/// The replayed entries that a tier of `capacity` bytes with a data file of `data_len` bytes
/// keeps (aligned, inside the capacity, not overlapping, not past the end of the data file),
/// and the space they hold; each dropped one is a warning in `recovery`. Pure.
fn admit(
    replayed: &mut index::Replayed,
    capacity: u64,
    data_len: u64,
    recovery: &mut Recovery,
) -> (HashMap<Vec<u8>, Entry>, ExtentAllocator) {
    recovery.version_found = replayed.version;
    let mut space = ExtentAllocator::new(capacity / ALIGN * ALIGN);
    let mut live = HashMap::new();
    // Replay order does not matter any more: `entries` holds the last word per key.
    let mut sorted: Vec<(Vec<u8>, Entry)> =
        std::mem::take(&mut replayed.entries).into_iter().collect();
    sorted.sort_by_key(|(_, e)| e.offset);
    for (key, e) in sorted {
        if !e.offset.is_multiple_of(ALIGN)
            || e.len > capacity
            || !space.reserve(e.offset, padded(e.len))
        {
            recovery.warnings.push(format!(
                "index entry at offset {} ({} bytes) lies outside the capacity or overlaps \
                 another; dropped",
                e.offset, e.len
            ));
            continue;
        }
        if e.offset.checked_add(e.len).is_none_or(|end| end > data_len) {
            space.free(e.offset, padded(e.len));
            recovery.warnings.push(format!(
                "block at offset {} is past the end of {DATA_FILE} (truncated); dropped",
                e.offset
            ));
            continue;
        }
        recovery.blocks += 1;
        recovery.bytes += e.len;
        live.insert(key, e);
    }
    (live, space)
}

/// The SSD tier.
#[derive(derive_more::Debug)]
pub struct SsdTier {
    dir: PathBuf,
    data: File,
    direct: bool,
    index: File,
    index_records: u64,
    /// Shown as the number of blocks.
    #[debug("{}", entries.len())]
    entries: HashMap<Vec<u8>, Entry>,
    #[debug(skip)]
    space: ExtentAllocator,
    /// Set after ENOSPC: allocations must stay inside the file as it is.
    fs_full: bool,
    data_len: u64,
    dirty: bool,
}

impl SsdTier {
    /// Open (or create) the tier in `cfg.dir`, replaying its index.
    pub fn open(cfg: &SsdConfig) -> Result<(Self, Recovery), SsdError> {
        std::fs::create_dir_all(&cfg.dir).map_err(|source| SsdError::CreateDir {
            path: cfg.dir.clone(),
            source,
        })?;
        let mut recovery = Recovery::default();
        let data_path = cfg.dir.join(DATA_FILE);
        let open_err = |source| SsdError::Open {
            path: data_path.clone(),
            source,
        };
        let (data, direct) = match cfg.direct_io {
            DirectIo::Off => (open_data(&data_path, false).map_err(open_err)?, false),
            DirectIo::Auto => match open_data(&data_path, true) {
                Ok(f) => (f, true),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    recovery.warnings.push(format!(
                        "{} does not support O_DIRECT; using buffered I/O",
                        cfg.dir.display()
                    ));
                    (open_data(&data_path, false).map_err(open_err)?, false)
                }
                Err(e) => return Err(open_err(e)),
            },
        };
        let data_len = data.metadata().map_err(open_err)?.len();

        let mut replayed = index::read(&cfg.dir, &mut recovery)?;
        let indexed = replayed.entries.len() as u64;
        let (live, space) = admit(&mut replayed, cfg.capacity, data_len, &mut recovery);

        let mut tier = Self {
            dir: cfg.dir.clone(),
            data,
            direct,
            index: index::open_log(&cfg.dir)?,
            index_records: replayed.records,
            entries: live,
            space,
            fs_full: false,
            data_len,
            dirty: false,
        };
        if replayed.version != INDEX_VERSION
            || replayed.valid_len.is_none()
            || recovery.blocks != indexed
        {
            // New, older-format, damaged or partly dropped index: write a clean snapshot.
            tier.snapshot()?;
        } else if let Some(len) = replayed.valid_len {
            tier.index
                .set_len(len)
                .map_err(|source| tier.write_index_err(source))?;
        }
        Ok((tier, recovery))
    }

    /// What opening a tier of `capacity` bytes would recover from the index file `bytes`
    /// with a data file of `data_len` bytes: the index replayed and its entries checked as
    /// [`SsdTier::open`] does, without touching a file (the fuzz target `ssd_index`).
    pub fn recover_index(
        bytes: &[u8],
        capacity: u64,
        data_len: u64,
    ) -> Result<(Recovery, SsdUsage), SsdError> {
        let mut recovery = Recovery::default();
        let mut replayed = index::parse(
            std::path::Path::new(index::INDEX_FILE),
            bytes,
            &mut recovery,
        )?;
        let (live, space) = admit(&mut replayed, capacity, data_len, &mut recovery);
        let usage = SsdUsage {
            capacity: space.capacity(),
            used: space.capacity() - space.free_bytes(),
            free: space.free_bytes(),
            blocks: live.len() as u64,
        };
        Ok((recovery, usage))
    }

    /// Whether O_DIRECT is in use.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.entries.contains_key(key)
    }

    /// Length of a stored block.
    pub fn len_of(&self, key: &[u8]) -> Option<u64> {
        self.entries.get(key).map(|e| e.len)
    }

    /// Keys of every stored block (for re-announcing after a restart).
    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.entries.keys().cloned().collect()
    }

    /// Whether the filesystem reported ENOSPC (cleared when space is freed inside the file).
    pub fn fs_full(&self) -> bool {
        self.fs_full
    }

    pub fn usage(&self) -> SsdUsage {
        SsdUsage {
            capacity: self.space.capacity(),
            used: self.space.capacity() - self.space.free_bytes(),
            free: self.space.free_bytes(),
            blocks: self.entries.len() as u64,
        }
    }

    /// Store a block. `data` must be `ALIGN`-padded (its length a multiple of `ALIGN`, at least
    /// `len`) and, for direct I/O, `ALIGN`-aligned in memory; [`AlignedBuf`] and DRAM tier
    /// blocks are both.
    pub fn put(&mut self, key: &[u8], data: &[u8], len: u64) -> Result<(), SsdError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(SsdError::BadKey(key.len()));
        }
        let size = padded(len);
        let Some(buf) = usize::try_from(size).ok().and_then(|s| data.get(..s)) else {
            return Err(SsdError::WriteData(std::io::Error::other(
                "buffer shorter than padded block",
            )));
        };
        // Aligned direct I/O needs an aligned source address; copy when it is not.
        let bounce;
        let buf = if self.direct && !is_aligned(buf) {
            let mut b = AlignedBuf::new(buf.len());
            b.copy_from_slice(buf);
            bounce = b;
            &bounce[..]
        } else {
            buf
        };
        self.remove(key)?;
        let limit = if self.fs_full {
            self.data_len
        } else {
            u64::MAX
        };
        let offset = self
            .space
            .allocate(size, limit)
            .ok_or(SsdError::Full { needed: size })?;
        if let Err(e) = self.write_at(buf, offset) {
            self.space.free(offset, size);
            if e.raw_os_error() == Some(libc::ENOSPC) {
                self.fs_full = true;
                return Err(SsdError::NoSpace(e));
            }
            return Err(SsdError::WriteData(e));
        }
        self.data_len = self.data_len.max(offset + size);
        let crc = crc32c::crc32c(buf.get(..usize::try_from(len).unwrap_or(0)).unwrap_or(&[]));
        let entry = Entry { offset, len, crc };
        if let Err(e) = self.append(&index::encode_put(key, &entry)) {
            self.space.free(offset, size);
            if let SsdError::WriteIndex { source, .. } = &e
                && source.raw_os_error() == Some(libc::ENOSPC)
            {
                self.fs_full = true;
                return Err(SsdError::NoSpace(std::io::Error::from_raw_os_error(
                    libc::ENOSPC,
                )));
            }
            return Err(e);
        }
        self.entries.insert(key.to_vec(), entry);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        match self.data.write_all_at(buf, offset) {
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                // Some filesystems accept O_DIRECT at open and refuse it on write.
                tracing::warn!(dir = %self.dir.display(), "direct write refused; using buffered I/O");
                self.data = open_data(&self.dir.join(DATA_FILE), false)?;
                self.direct = false;
                self.data.write_all_at(buf, offset)
            }
            other => other,
        }
    }

    /// Read a block into a fresh aligned buffer; returns it with the block's length.
    /// Corrupt or truncated blocks are dropped from the tier and reported as `Corrupt`.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<(AlignedBuf, u64)>, SsdError> {
        let Some(len) = self.len_of(key) else {
            return Ok(None);
        };
        let size =
            usize::try_from(padded(len)).map_err(|_| SsdError::Corrupt { reason: "length" })?;
        let mut buf = AlignedBuf::new(size);
        match self.read_into(key, &mut buf)? {
            Some(len) => Ok(Some((buf, len))),
            None => Ok(None),
        }
    }

    /// Read a block into `dst`, which must hold the block padded to [`ALIGN`] and, for direct
    /// I/O, start [`ALIGN`]-aligned (DRAM tier blocks and [`AlignedBuf`]s do). Returns the
    /// block's length. Corrupt or truncated blocks are dropped and reported as `Corrupt`.
    pub fn read_into(&mut self, key: &[u8], dst: &mut [u8]) -> Result<Option<u64>, SsdError> {
        let Some(entry) = self.entries.get(key).copied() else {
            return Ok(None);
        };
        let size = usize::try_from(padded(entry.len))
            .map_err(|_| SsdError::Corrupt { reason: "length" })?;
        let Some(dst) = dst.get_mut(..size) else {
            return Err(SsdError::ReadData(std::io::Error::other(
                "destination shorter than the padded block",
            )));
        };
        if self.direct && !is_aligned(dst) {
            let mut bounce = AlignedBuf::new(size);
            let got = self.read_into(key, &mut bounce)?;
            dst.copy_from_slice(&bounce[..size]);
            return Ok(got);
        }
        let read = read_fully(&self.data, dst, entry.offset).map_err(SsdError::ReadData)?;
        let len = usize::try_from(entry.len).unwrap_or(usize::MAX);
        let reason = if read < len {
            Some("truncated")
        } else if dst.get(..len).map(crc32c::crc32c) != Some(entry.crc) {
            Some("checksum mismatch")
        } else {
            None
        };
        if let Some(reason) = reason {
            self.remove(key)?;
            return Err(SsdError::Corrupt { reason });
        }
        Ok(Some(entry.len))
    }

    /// Drop a block; true when it was stored.
    pub fn remove(&mut self, key: &[u8]) -> Result<bool, SsdError> {
        let Some(entry) = self.entries.remove(key) else {
            return Ok(false);
        };
        self.space.free(entry.offset, padded(entry.len));
        if self.fs_full && entry.offset + padded(entry.len) <= self.data_len {
            // Room inside the already allocated file: demotion can resume.
            self.fs_full = false;
        }
        self.append(&index::encode_remove(key))?;
        Ok(true)
    }

    /// Flush data and index to stable storage.
    pub fn sync(&mut self) -> Result<(), SsdError> {
        if self.dirty {
            self.data.sync_data().map_err(SsdError::Sync)?;
            self.index.sync_data().map_err(SsdError::Sync)?;
            self.dirty = false;
        }
        Ok(())
    }
}
