//! SSD tier: blocks demoted from DRAM live in one data file on the configured path, written with
//! aligned direct I/O where the filesystem allows it (buffered I/O with a warning otherwise),
//! each with a crc32c; a versioned append-only index log (compacted into a snapshot on
//! shutdown) records where every block is, so a restarted or upgraded agent recovers the tier.
//! A block whose bytes are truncated or do not match their checksum is dropped, reported and
//! never served. I/O boundary: the files `blocks.dat` and `index.log` under the tier's
//! directory. `AlignedBuf` holds this module's only `unsafe`.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::extent::ExtentAllocator;

/// The durable index of the pool-mode SSD segment.
pub mod pool;

/// Alignment and size granularity of direct I/O.
pub const ALIGN: u64 = 4096;
const DATA_FILE: &str = "blocks.dat";
const INDEX_FILE: &str = "index.log";
const INDEX_TMP: &str = "index.log.tmp";
const MAGIC: &[u8; 8] = b"KVPSSDIX";
/// Version of the index format this build writes. Older versions are read and upgraded on the
/// next snapshot; newer ones are refused.
pub const INDEX_VERSION: u32 = 1;
const HEADER_LEN: u64 = 16;
const REC_PUT: u8 = 1;
const REC_REMOVE: u8 = 2;
/// Longest key the index stores.
pub const MAX_KEY_LEN: usize = 1024;
/// Compact the log when it holds this many more records than live blocks.
const COMPACT_SLACK: u64 = 65_536;

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

impl SsdError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

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

/// A heap buffer aligned for direct I/O, length a multiple of [`ALIGN`], zero-filled.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to [`ALIGN`]).
    pub fn new(len: usize) -> Self {
        let align = ALIGN as usize;
        let len = len.max(1).div_ceil(align) * align;
        let layout = match Layout::from_size_align(len, align) {
            Ok(l) => l,
            Err(_) => std::alloc::handle_alloc_error(Layout::new::<u8>()),
        };
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    fn layout(&self) -> Option<Layout> {
        Layout::from_size_align(self.len, ALIGN as usize).ok()
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(layout) = self.layout() {
            // SAFETY: allocated in `new` with this same layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    offset: u64,
    len: u64,
    crc: u32,
}

/// One block handed out by [`SsdTier::read_each`].
pub type BlockRead<'a> = Result<Option<&'a [u8]>, SsdError>;

/// Read into `dst` at `offset` until it is full or the file ends; returns the bytes read.
fn read_fully(f: &File, dst: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut read = 0usize;
    while read < dst.len() {
        let Some(rest) = dst.get_mut(read..) else {
            break;
        };
        match f.read_at(rest, offset + read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(read)
}

fn padded(len: u64) -> u64 {
    len.max(1).div_ceil(ALIGN) * ALIGN
}

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

/// The SSD tier.
pub struct SsdTier {
    dir: PathBuf,
    data: File,
    direct: bool,
    index: File,
    index_records: u64,
    entries: HashMap<Vec<u8>, Entry>,
    space: ExtentAllocator,
    /// Set after ENOSPC: allocations must stay inside the file as it is.
    fs_full: bool,
    data_len: u64,
    dirty: bool,
}

impl std::fmt::Debug for SsdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdTier")
            .field("dir", &self.dir)
            .field("direct", &self.direct)
            .field("blocks", &self.entries.len())
            .finish()
    }
}

fn open_data(path: &Path, direct: bool) -> std::io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(true).truncate(false);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path)
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

        let index_path = cfg.dir.join(INDEX_FILE);
        let (entries, records, version, good_len) = read_index(&index_path, &mut recovery)?;
        recovery.version_found = version;
        let indexed = entries.len() as u64;
        let mut space = ExtentAllocator::new(cfg.capacity / ALIGN * ALIGN);
        let mut live = HashMap::new();
        // Replay order does not matter any more: `entries` holds the last word per key.
        let mut sorted: Vec<(Vec<u8>, Entry)> = entries.into_iter().collect();
        sorted.sort_by_key(|(_, e)| e.offset);
        for (key, e) in sorted {
            if !e.offset.is_multiple_of(ALIGN) || !space.reserve(e.offset, padded(e.len)) {
                recovery.warnings.push(format!(
                    "index entry at offset {} ({} bytes) lies outside the capacity or overlaps \
                     another; dropped",
                    e.offset, e.len
                ));
                continue;
            }
            if e.offset + e.len > data_len {
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

        let index = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&index_path)
            .map_err(|source| SsdError::Open {
                path: index_path.clone(),
                source,
            })?;
        let mut tier = Self {
            dir: cfg.dir.clone(),
            data,
            direct,
            index,
            index_records: records,
            entries: live,
            space,
            fs_full: false,
            data_len,
            dirty: false,
        };
        if version != INDEX_VERSION || good_len.is_none() || recovery.blocks != indexed {
            // New, older-format, damaged or partly dropped index: write a clean snapshot.
            tier.snapshot()?;
        } else if let Some(len) = good_len {
            tier.index
                .set_len(len)
                .map_err(|source| tier.write_index_err(source))?;
        }
        Ok((tier, recovery))
    }

    fn write_index_err(&self, source: std::io::Error) -> SsdError {
        SsdError::WriteIndex {
            path: self.dir.join(INDEX_FILE),
            source,
        }
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
        let buf = if self.direct && !(buf.as_ptr() as u64).is_multiple_of(ALIGN) {
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
        if let Err(e) = self.append(&encode_put(key, &entry)) {
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
        if self.direct && !(dst.as_ptr() as u64).is_multiple_of(ALIGN) {
            let mut bounce = AlignedBuf::new(size);
            let got = self.read_into(key, &mut bounce)?;
            dst.copy_from_slice(&bounce[..size]);
            return Ok(got);
        }
        let mut read = 0usize;
        while read < size {
            let Some(rest) = dst.get_mut(read..) else {
                break;
            };
            match self.data.read_at(rest, entry.offset + read as u64) {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(SsdError::ReadData(e)),
            }
        }
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

    /// Read the blocks of `keys` in order, handing each verified block to `sink` with its
    /// index in `keys`: `Ok(Some(bytes))`, `Ok(None)` for a key the tier does not hold, or
    /// `Err(Corrupt)` for a corrupt or truncated block (dropped from the tier, never handed
    /// out). A reader thread reads block N+1 into one of two aligned buffers while this thread
    /// checks block N's crc32c and runs `sink`, so the checksum overlaps the next read.
    pub fn read_each(
        &mut self,
        keys: &[&[u8]],
        sink: &mut dyn FnMut(usize, BlockRead<'_>),
    ) -> Result<(), SsdError> {
        let entries: Vec<Option<Entry>> =
            keys.iter().map(|k| self.entries.get(*k).copied()).collect();
        let largest = entries
            .iter()
            .flatten()
            .map(|e| padded(e.len))
            .max()
            .unwrap_or(ALIGN);
        let size = usize::try_from(largest).map_err(|_| SsdError::Corrupt { reason: "length" })?;
        let data = &self.data;
        let mut bad: Vec<usize> = Vec::new();
        let mut failed: Option<SsdError> = None;
        std::thread::scope(|scope| {
            let (free_tx, free_rx) = std::sync::mpsc::sync_channel::<AlignedBuf>(2);
            let (full_tx, full_rx) =
                std::sync::mpsc::sync_channel::<(usize, AlignedBuf, std::io::Result<usize>)>(2);
            for _ in 0..2 {
                let _ = free_tx.send(AlignedBuf::new(size));
            }
            let entries_ref = &entries;
            scope.spawn(move || {
                for (i, entry) in entries_ref.iter().enumerate() {
                    let Some(e) = entry else { continue };
                    let Ok(mut buf) = free_rx.recv() else { return };
                    let want = usize::try_from(padded(e.len)).unwrap_or(usize::MAX);
                    let got = read_fully(data, buf.get_mut(..want).unwrap_or_default(), e.offset);
                    if full_tx.send((i, buf, got)).is_err() {
                        return;
                    }
                }
            });
            let mut next = 0;
            for (i, buf, got) in full_rx.iter() {
                // Keys the tier does not hold come in order, between the blocks read.
                for j in next..i {
                    sink(j, Ok(None));
                }
                next = i + 1;
                let Some(e) = entries.get(i).copied().flatten() else {
                    continue;
                };
                let len = usize::try_from(e.len).unwrap_or(usize::MAX);
                match got {
                    Ok(n) if n >= len => {
                        let bytes = buf.get(..len).unwrap_or_default();
                        if crc32c::crc32c(bytes) == e.crc {
                            sink(i, Ok(Some(bytes)));
                        } else {
                            bad.push(i);
                            sink(
                                i,
                                Err(SsdError::Corrupt {
                                    reason: "checksum mismatch",
                                }),
                            );
                        }
                    }
                    Ok(_) => {
                        bad.push(i);
                        sink(
                            i,
                            Err(SsdError::Corrupt {
                                reason: "truncated",
                            }),
                        );
                    }
                    Err(err) => {
                        failed = Some(SsdError::ReadData(err));
                        break;
                    }
                }
                // Fails only once the reader is done (it dropped its end): nothing to refill.
                let _ = free_tx.send(buf);
            }
            drop(free_tx);
            if failed.is_none() {
                for j in next..keys.len() {
                    sink(j, Ok(None));
                }
            }
        });
        for i in bad {
            if let Some(k) = keys.get(i) {
                self.remove(k)?;
            }
        }
        failed.map_or(Ok(()), Err)
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
        self.append(&encode_remove(key))?;
        Ok(true)
    }

    fn append(&mut self, payload: &[u8]) -> Result<(), SsdError> {
        let mut rec = Vec::with_capacity(payload.len() + 8);
        let plen = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        rec.extend_from_slice(&plen.to_le_bytes());
        rec.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        rec.extend_from_slice(payload);
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

    /// Flush data and index to stable storage.
    pub fn sync(&mut self) -> Result<(), SsdError> {
        if self.dirty {
            self.data.sync_data().map_err(SsdError::Sync)?;
            self.index.sync_data().map_err(SsdError::Sync)?;
            self.dirty = false;
        }
        Ok(())
    }

    /// Rewrite the index as a snapshot of the live blocks (atomically: temp file, fsync, rename,
    /// fsync of the directory). Called on shutdown and when the log grows.
    pub fn snapshot(&mut self) -> Result<(), SsdError> {
        self.data.sync_data().map_err(SsdError::Sync)?;
        let tmp = self.dir.join(INDEX_TMP);
        let final_path = self.dir.join(INDEX_FILE);
        let werr = |source| SsdError::WriteIndex {
            path: tmp.clone(),
            source,
        };
        let mut out = Vec::with_capacity(64 + self.entries.len() * 64);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&INDEX_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        let mut keys: Vec<&Vec<u8>> = self.entries.keys().collect();
        keys.sort();
        for key in keys {
            if let Some(e) = self.entries.get(key) {
                let payload = encode_put(key, e);
                let plen = u32::try_from(payload.len()).unwrap_or(u32::MAX);
                out.extend_from_slice(&plen.to_le_bytes());
                out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
                out.extend_from_slice(&payload);
            }
        }
        let mut f = File::create(&tmp).map_err(werr)?;
        f.write_all(&out).map_err(werr)?;
        f.sync_all().map_err(werr)?;
        std::fs::rename(&tmp, &final_path).map_err(werr)?;
        if let Ok(d) = File::open(&self.dir) {
            d.sync_all().map_err(SsdError::Sync)?;
        }
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

fn encode_put(key: &[u8], e: &Entry) -> Vec<u8> {
    let mut p = Vec::with_capacity(key.len() + 23);
    p.push(REC_PUT);
    p.extend_from_slice(&u16::try_from(key.len()).unwrap_or(u16::MAX).to_le_bytes());
    p.extend_from_slice(key);
    p.extend_from_slice(&e.offset.to_le_bytes());
    p.extend_from_slice(&e.len.to_le_bytes());
    p.extend_from_slice(&e.crc.to_le_bytes());
    p
}

fn encode_remove(key: &[u8]) -> Vec<u8> {
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

/// Replay the index: (last entry per key, records read, version, Some(valid length) when the
/// whole file was valid, None when a damaged tail was cut).
#[allow(clippy::type_complexity)]
fn read_index(
    path: &Path,
    recovery: &mut Recovery,
) -> Result<(HashMap<Vec<u8>, Entry>, u64, u32, Option<u64>), SsdError> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)
                .map_err(|source| SsdError::ReadIndex {
                    path: path.to_owned(),
                    source,
                })?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((HashMap::new(), 0, 0, Some(0)));
        }
        Err(source) => {
            return Err(SsdError::ReadIndex {
                path: path.to_owned(),
                source,
            });
        }
    }
    if bytes.is_empty() {
        return Ok((HashMap::new(), 0, 0, Some(0)));
    }
    if bytes.get(..8) != Some(&MAGIC[..]) {
        return Err(SsdError::BadMagic {
            path: path.to_owned(),
        });
    }
    let version = bytes
        .get(8..12)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(SsdError::BadMagic {
            path: path.to_owned(),
        })?;
    if version > INDEX_VERSION || version == 0 {
        return Err(SsdError::UnsupportedVersion {
            path: path.to_owned(),
            found: version,
        });
    }
    let mut entries = HashMap::new();
    let mut records = 0u64;
    let mut pos = HEADER_LEN as usize;
    let total = bytes.len();
    let mut damaged = false;
    while pos < total {
        let header = bytes.get(pos..pos + 8).map(|h| (h.get(..4), h.get(4..8)));
        let Some((Some(l), Some(c))) = header else {
            damaged = true;
            break;
        };
        let plen = u32::from_le_bytes(l.try_into().unwrap_or([0; 4])) as usize;
        let crc = u32::from_le_bytes(c.try_into().unwrap_or([0; 4]));
        let Some(payload) = bytes.get(pos + 8..pos + 8 + plen) else {
            damaged = true;
            break;
        };
        if crc32c::crc32c(payload) != crc {
            damaged = true;
            break;
        }
        match decode(payload) {
            Some(Record::Put(k, e)) => {
                entries.insert(k, e);
            }
            Some(Record::Remove(k)) => {
                entries.remove(&k);
            }
            None => {
                damaged = true;
                break;
            }
        }
        records += 1;
        pos += 8 + plen;
    }
    if damaged {
        recovery.warnings.push(format!(
            "index {} is damaged after byte {pos} of {total}; the tail is ignored",
            path.display()
        ));
    }
    let valid = (!damaged).then_some(pos as u64);
    Ok((entries, records, version, valid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, capacity: u64) -> SsdConfig {
        SsdConfig {
            dir: dir.to_owned(),
            capacity,
            direct_io: DirectIo::Auto,
        }
    }

    fn block(fill: u8, len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        b[..len].fill(fill);
        b
    }

    #[test]
    fn aligned_buf_is_aligned_and_padded() {
        let b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_ptr() as u64 % ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn read_each_verifies_every_block_and_drops_corrupt_ones() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut t, _) = SsdTier::open(&cfg(dir.path(), 64 * ALIGN)).expect("open");
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
        let (mut t, rec) = SsdTier::open(&cfg(dir.path(), 3 * ALIGN)).expect("open");
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
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&99u32.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        std::fs::write(dir.path().join(INDEX_FILE), header).expect("write");
        let err = SsdTier::open(&cfg(dir.path(), 1 << 20)).expect_err("refused");
        assert_eq!(err.category(), "unsupported_version");
        std::fs::write(dir.path().join(INDEX_FILE), b"not an index at all").expect("write");
        let err = SsdTier::open(&cfg(dir.path(), 1 << 20)).expect_err("refused");
        assert_eq!(err.category(), "bad_magic");
    }
}
