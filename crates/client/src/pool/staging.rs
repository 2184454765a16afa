//! Registered host memory of a [`PoolClient`]: staging buffers that caller bytes are copied
//! through (kept for reuse in a bounded [`StagingCache`]), and buffers callers register for
//! zero-copy puts and gets. I/O boundary: memory mapping and registration with the transfer
//! engine.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::PoolClient;
use super::error::DataError;
use kvpool_transfer::{self as transfer, HostOptions, MemoryError, Segment};

/// Smallest staging buffer handed out; smaller values share this size class.
pub(super) const MIN_STAGING: u64 = 64 * 1024;
/// Default bound on idle staging memory a `PoolClient` keeps for reuse.
pub const DEFAULT_STAGING_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// Registered staging buffers kept for reuse, by power-of-two size class, so that a put or get
/// does not map, fault in and register fresh memory each time. Bounded by `limit` idle bytes;
/// a buffer whose transfer failed is never returned here (a late reply could still land in it).
#[derive(Debug)]
pub(super) struct StagingCache {
    limit: u64,
    idle: parking_lot::Mutex<(u64, Vec<transfer::LocalSegment>)>,
}

impl StagingCache {
    pub(super) fn new(limit: u64) -> Self {
        Self {
            limit,
            idle: parking_lot::Mutex::new((0, Vec::new())),
        }
    }

    /// Size class of a value of `size` bytes.
    pub(super) fn class(size: u64) -> u64 {
        size.max(MIN_STAGING)
            .checked_next_power_of_two()
            .unwrap_or(size)
    }

    fn take(&self, class: u64) -> Option<transfer::LocalSegment> {
        let mut g = self.idle.lock();
        let i = g.1.iter().position(|s| s.len() == class)?;
        let seg = g.1.swap_remove(i);
        g.0 -= class;
        Some(seg)
    }

    fn give(&self, seg: transfer::LocalSegment) {
        let mut g = self.idle.lock();
        let len = seg.len();
        if g.0 + len <= self.limit {
            g.0 += len;
            g.1.push(seg);
        }
        // else dropped: unregistered and unmapped.
    }

    #[cfg(test)]
    pub(super) fn idle_bytes(&self) -> u64 {
        self.idle.lock().0
    }
}

impl PoolClient {
    /// A registered staging buffer of at least `size` bytes (reused when one is idle), holding
    /// `data` at offset 0 when given.
    pub(super) fn staging(
        &self,
        data: Option<&[u8]>,
        size: u64,
    ) -> Result<transfer::LocalSegment, DataError> {
        let staging = |source| DataError::Staging { size, source };
        let class = StagingCache::class(size);
        let local = match self.staging_cache.take(class) {
            Some(seg) => seg,
            None => self.new_buffer("staging", class)?,
        };
        if let Some(d) = data {
            local.segment().write_at(0, d).map_err(staging)?;
        }
        Ok(local)
    }

    /// Return a staging buffer after a transfer that completed (successfully or with an answer
    /// from every peer); see [`StagingCache`].
    pub(super) fn unstage(&self, local: transfer::LocalSegment) {
        self.staging_cache.give(local);
    }

    /// Copy a value of `size` bytes out of the staging buffer `local` into `out` (when there
    /// is one), then give the buffer back; returns the length copied.
    pub(super) fn unstage_into(
        &self,
        local: transfer::LocalSegment,
        size: u64,
        out: Result<&mut [u8], DataError>,
    ) -> Result<usize, DataError> {
        let copied = out.and_then(|out| {
            local
                .segment()
                .read_at(0, out)
                .map_err(|source| DataError::Staging { size, source })
                .map(|()| out.len())
        });
        self.unstage(local);
        copied
    }

    /// Host memory of `len` bytes registered with this client's transfer engine, for
    /// [`Self::put_from`]. Unregistered when the last clone drops.
    pub fn register_buffer(&self, len: u64) -> Result<transfer::LocalSegment, DataError> {
        self.new_buffer("buffer", len)
    }

    /// Register memory owned elsewhere (for example a staging area shared with an engine) with
    /// this client's engine, so that [`Self::put_from`] and [`Self::get_to`] move its bytes
    /// straight between it and the wire.
    pub fn register_memory(
        &self,
        segment: Arc<Segment>,
    ) -> Result<transfer::LocalSegment, DataError> {
        let n = self.staging_seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}/memory-{}-{n}", self.node, std::process::id());
        self.engine
            .register(&name, segment)
            .map_err(DataError::RegisterStaging)
    }

    /// Fresh host memory of `len` bytes registered with the engine as `<node>/<what>-<pid>-<n>`.
    fn new_buffer(&self, what: &str, len: u64) -> Result<transfer::LocalSegment, DataError> {
        let staging = |source| DataError::Staging { size: len, source };
        let size = usize::try_from(len).map_err(|_| {
            staging(MemoryError::InvalidSize {
                size: usize::MAX,
                max: transfer::memory::MAX_SEGMENT_SIZE,
            })
        })?;
        let seg = Segment::host(size, HostOptions::default()).map_err(staging)?;
        let n = self.staging_seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}/{what}-{}-{n}", self.node, std::process::id());
        self.engine
            .register(&name, Arc::new(seg))
            .map_err(DataError::RegisterStaging)
    }
}
