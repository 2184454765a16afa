//! The node's block store in local-only mode: the DRAM tier in front of the optional SSD tier.
//! Puts land in DRAM (on the hinted NUMA node when given); DRAM evicts least recently used
//! blocks, demoting them to SSD unless the SSD tier is full (then they are dropped and counted);
//! a get that hits SSD promotes the block back to DRAM. Corrupt SSD blocks are misses.
//! I/O boundary: the SSD tier's files (through `ssd`); everything else is memory.

use kvpool_runtime::telemetry::chain;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::dram::{DramBlock, DramTier};
use crate::metrics::AgentMetrics;
use crate::ssd::{MAX_KEY_LEN, SsdError, SsdTier};

mod batches;
#[cfg(test)]
mod tests;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("key of {0} bytes is empty or longer than {MAX_KEY_LEN}")]
    BadKey(usize),
    #[error("block of {len} bytes exceeds the largest DRAM segment ({max} bytes)")]
    TooLarge { len: u64, max: u64 },
    #[error("no DRAM room for a block of {0} bytes even after evicting everything")]
    NoSpace(u64),
    #[error("SSD tier failed")]
    Ssd(#[source] SsdError),
}

impl StoreError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            StoreError::BadKey(_) => "bad_key",
            StoreError::TooLarge { .. } => "too_large",
            StoreError::NoSpace(_) => "no_space",
            StoreError::Ssd(e) => e.category(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Resident {
    block: DramBlock,
    tick: u64,
}

struct Inner {
    dram: DramTier,
    ssd: Option<SsdTier>,
    resident: HashMap<Vec<u8>, Resident>,
    lru: BTreeMap<u64, Vec<u8>>,
    tick: u64,
    ssd_full: bool,
}

/// Where a get was served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    Dram,
    Ssd,
}

/// Point-in-time usage, for tests and the benchmark.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub dram_blocks: u64,
    pub dram_used: u64,
    pub ssd_blocks: u64,
    pub ssd_used: u64,
    pub ssd_full: bool,
}

/// DRAM + SSD block store.
pub struct TieredStore {
    inner: Mutex<Inner>,
    metrics: Arc<AgentMetrics>,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore").finish_non_exhaustive()
    }
}

fn check_key(key: &[u8]) -> Result<(), StoreError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(StoreError::BadKey(key.len()));
    }
    Ok(())
}

impl TieredStore {
    pub fn new(dram: DramTier, ssd: Option<SsdTier>, metrics: Arc<AgentMetrics>) -> Self {
        let store = Self {
            inner: Mutex::new(Inner {
                dram,
                ssd,
                resident: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                ssd_full: false,
            }),
            metrics,
        };
        store.refresh_gauges(&store.inner.lock());
        store
    }

    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }

    /// Store a block whose bytes `fill` writes into the (exactly `len` bytes) DRAM room.
    pub fn put_with(
        &self,
        key: &[u8],
        len: u64,
        numa_hint: Option<u32>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), StoreError> {
        check_key(key)?;
        let mut inner = self.inner.lock();
        let max = inner.dram.max_block();
        if len > max {
            return Err(StoreError::TooLarge { len, max });
        }
        // A new value replaces every old copy.
        if let Some(old) = inner.resident.remove(key) {
            inner.lru.remove(&old.tick);
            inner.dram.free(old.block);
        }
        if let Some(ssd) = inner.ssd.as_mut() {
            ssd.remove(key).map_err(StoreError::Ssd)?;
        }
        let block = self.allocate_evicting(&mut inner, len, numa_hint)?;
        fill(inner.dram.bytes_mut(&block));
        self.insert_resident(&mut inner, key.to_vec(), block);
        self.metrics
            .bytes_written
            .with_label_values(&["dram"])
            .inc_by(len);
        self.refresh_gauges(&inner);
        Ok(())
    }

    /// Store a block from a slice.
    pub fn put(&self, key: &[u8], data: &[u8], numa_hint: Option<u32>) -> Result<(), StoreError> {
        self.put_with(key, data.len() as u64, numa_hint, |dst| {
            dst.copy_from_slice(data);
        })
    }

    /// Hand the block's bytes to `read`; None when no tier has the key.
    pub fn get_with<R>(
        &self,
        key: &[u8],
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<(R, Served)>, StoreError> {
        check_key(key)?;
        let mut inner = self.inner.lock();
        if let Some(res) = inner.resident.get(key).copied() {
            // Touch for LRU (moving the key, no allocation).
            inner.tick += 1;
            let tick = inner.tick;
            let lru_key = inner.lru.remove(&res.tick).unwrap_or_else(|| key.to_vec());
            inner.lru.insert(tick, lru_key);
            if let Some(r) = inner.resident.get_mut(key) {
                r.tick = tick;
            }
            let out = read(inner.dram.bytes(&res.block));
            self.metrics.hits.with_label_values(&["dram"]).inc();
            self.metrics
                .bytes_read
                .with_label_values(&["dram"])
                .inc_by(res.block.len);
            return Ok(Some((out, Served::Dram)));
        }
        let Some(len) = inner.ssd.as_ref().and_then(|s| s.len_of(key)) else {
            self.metrics.misses.inc();
            return Ok(None);
        };
        // Promote: read straight into a fresh DRAM block (page aligned, so direct I/O needs
        // no bounce buffer). The SSD copy stays, so a later eviction needs no write.
        let promoted = self.allocate_evicting(&mut inner, len, None).ok();
        let outcome = {
            let Inner { dram, ssd, .. } = &mut *inner;
            let Some(ssd) = ssd.as_mut() else {
                self.metrics.misses.inc();
                return Ok(None);
            };
            match promoted.as_ref().and_then(|b| dram.padded_mut(b)) {
                Some(dst) => ssd.read_into(key, dst).map(|found| found.map(|_| None)),
                // No DRAM room: serve from a temporary buffer without promoting.
                None => ssd.get(key).map(|found| found.map(|(buf, _)| Some(buf))),
            }
        };
        let served = match outcome {
            Ok(Some(buf)) => buf,
            Ok(None) => {
                if let Some(b) = promoted {
                    inner.dram.free(b);
                }
                self.metrics.misses.inc();
                return Ok(None);
            }
            Err(e) => {
                if let Some(b) = promoted {
                    inner.dram.free(b);
                }
                if let SsdError::Corrupt { reason } = e {
                    tracing::warn!(key = %hex(key), reason, "corrupt SSD block dropped");
                    self.metrics.ssd_corrupt.inc();
                    self.metrics.misses.inc();
                    self.refresh_gauges(&inner);
                    return Ok(None);
                }
                return Err(StoreError::Ssd(e));
            }
        };
        self.metrics.hits.with_label_values(&["ssd"]).inc();
        self.metrics
            .bytes_read
            .with_label_values(&["ssd"])
            .inc_by(len);
        let out = match (served, promoted) {
            (Some(buf), unused) => {
                if let Some(b) = unused {
                    inner.dram.free(b);
                }
                read(buf.get(..usize::try_from(len).unwrap_or(0)).unwrap_or(&[]))
            }
            (None, Some(block)) => {
                self.insert_resident(&mut inner, key.to_vec(), block);
                self.metrics.promotions.inc();
                read(inner.dram.bytes(&block))
            }
            (None, None) => read(&[]),
        };
        self.refresh_gauges(&inner);
        Ok(Some((out, Served::Ssd)))
    }

    /// Whether any tier holds the key.
    pub fn exists(&self, key: &[u8]) -> bool {
        let inner = self.inner.lock();
        inner.resident.contains_key(key) || inner.ssd.as_ref().is_some_and(|s| s.contains(key))
    }

    /// Drop the key from every tier; true when some tier held it.
    pub fn remove(&self, key: &[u8]) -> Result<bool, StoreError> {
        check_key(key)?;
        let mut inner = self.inner.lock();
        let mut found = false;
        if let Some(old) = inner.resident.remove(key) {
            inner.lru.remove(&old.tick);
            inner.dram.free(old.block);
            found = true;
        }
        if let Some(ssd) = inner.ssd.as_mut() {
            found |= ssd.remove(key).map_err(StoreError::Ssd)?;
        }
        self.refresh_gauges(&inner);
        Ok(found)
    }

    /// Flush the SSD tier's data and index.
    pub fn sync(&self) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        if let Some(ssd) = inner.ssd.as_mut() {
            ssd.sync().map_err(StoreError::Ssd)?;
        }
        Ok(())
    }

    /// Shutdown: optionally demote every DRAM block that has no SSD copy (so the cache
    /// survives a restart), then write the SSD index snapshot. Returns blocks demoted.
    pub fn persist(&self, demote_dram: bool) -> Result<u64, StoreError> {
        let mut inner = self.inner.lock();
        let mut demoted = 0;
        if demote_dram && inner.ssd.is_some() {
            let keys: Vec<Vec<u8>> = inner.lru.values().cloned().collect();
            for key in keys {
                if inner.ssd_full {
                    break;
                }
                if let Some(res) = inner.resident.get(&key).copied()
                    && self.demote(&mut inner, &key, &res.block)
                {
                    demoted += 1;
                }
            }
        }
        if let Some(ssd) = inner.ssd.as_mut() {
            ssd.snapshot().map_err(StoreError::Ssd)?;
        }
        self.refresh_gauges(&inner);
        Ok(demoted)
    }

    /// Keys held by the SSD tier (re-announced after a restart).
    pub fn ssd_keys(&self) -> Vec<Vec<u8>> {
        self.inner
            .lock()
            .ssd
            .as_ref()
            .map(SsdTier::keys)
            .unwrap_or_default()
    }

    pub fn stats(&self) -> StoreStats {
        let inner = self.inner.lock();
        let usage = inner.dram.usage();
        let ssd = inner.ssd.as_ref().map(SsdTier::usage).unwrap_or_default();
        StoreStats {
            dram_blocks: usage.iter().map(|u| u.blocks).sum(),
            dram_used: usage.iter().map(|u| u.used).sum(),
            ssd_blocks: ssd.blocks,
            ssd_used: ssd.used,
            ssd_full: inner.ssd_full,
        }
    }

    /// Segments of the DRAM tier (for registration).
    pub fn dram_segments(&self) -> Vec<crate::dram::SegmentInfo> {
        self.inner.lock().dram.segments().to_vec()
    }

    fn insert_resident(&self, inner: &mut Inner, key: Vec<u8>, block: DramBlock) {
        inner.tick += 1;
        let tick = inner.tick;
        inner.lru.insert(tick, key.clone());
        inner.resident.insert(key, Resident { block, tick });
    }

    fn allocate_evicting(
        &self,
        inner: &mut Inner,
        len: u64,
        numa_hint: Option<u32>,
    ) -> Result<DramBlock, StoreError> {
        loop {
            if let Some(block) = inner.dram.allocate(len, numa_hint) {
                return Ok(block);
            }
            let Some((&tick, _)) = inner.lru.iter().next() else {
                return Err(StoreError::NoSpace(len));
            };
            let Some(key) = inner.lru.remove(&tick) else {
                return Err(StoreError::NoSpace(len));
            };
            let Some(res) = inner.resident.remove(&key) else {
                continue;
            };
            let has_copy = inner.ssd.as_ref().is_some_and(|s| s.contains(&key));
            if !has_copy {
                if inner.ssd.is_none() {
                    self.metrics.dropped.with_label_values(&["no_ssd"]).inc();
                } else if !self.demote(inner, &key, &res.block) {
                    let reason = if inner.ssd_full {
                        "ssd_full"
                    } else {
                        "ssd_error"
                    };
                    self.metrics.dropped.with_label_values(&[reason]).inc();
                }
            }
            inner.dram.free(res.block);
        }
    }

    /// Write a DRAM block to SSD; false when it could not be written.
    fn demote(&self, inner: &mut Inner, key: &[u8], block: &DramBlock) -> bool {
        let Inner {
            dram,
            ssd,
            ssd_full,
            ..
        } = inner;
        let Some(ssd) = ssd.as_mut() else {
            return false;
        };
        if *ssd_full {
            // Space may have come back since (removals, corrupt blocks dropped).
            let u = ssd.usage();
            if ssd.fs_full() || u.free < block.len.div_ceil(crate::ssd::ALIGN) * crate::ssd::ALIGN {
                return false;
            }
            *ssd_full = false;
            self.metrics.ssd_full.set(0);
            tracing::info!("SSD tier has room again; demotion resumed");
        }
        let Some(padded) = dram.padded(block) else {
            return false;
        };
        match ssd.put(key, padded, block.len) {
            Ok(()) => {
                self.metrics.demotions.inc();
                self.metrics
                    .bytes_written
                    .with_label_values(&["ssd"])
                    .inc_by(block.len);
                true
            }
            Err(e) if e.is_full() => {
                *ssd_full = true;
                self.metrics.ssd_full.set(1);
                tracing::warn!(error = %chain(&e), "SSD tier full; demotion stopped");
                false
            }
            Err(e) => {
                self.metrics.errors.with_label_values(&[e.category()]).inc();
                tracing::warn!(error = %chain(&e), "demotion failed");
                false
            }
        }
    }

    fn refresh_gauges(&self, inner: &Inner) {
        let m = &self.metrics;
        let mut per_node: BTreeMap<Option<u32>, (u64, u64, u64, u64, u64)> = BTreeMap::new();
        let mut blocks = 0;
        for u in inner.dram.usage() {
            let e = per_node.entry(u.numa_node).or_default();
            e.0 += u.capacity;
            e.1 += u.used;
            e.2 += u.free;
            e.3 = e.3.max(u.largest_free);
            e.4 += u.free;
            blocks += u.blocks;
        }
        for (node, (cap, used, free, largest, free_sum)) in per_node {
            let n = crate::placement::numa_label(node);
            m.capacity_bytes
                .with_label_values(&["dram", &n])
                .set(cap as f64);
            m.used_bytes
                .with_label_values(&["dram", &n])
                .set(used as f64);
            m.free_bytes
                .with_label_values(&["dram", &n])
                .set(free as f64);
            let frag = if free_sum == 0 {
                0.0
            } else {
                1.0 - largest as f64 / free_sum as f64
            };
            m.dram_fragmentation.with_label_values(&[&n]).set(frag);
        }
        m.blocks.with_label_values(&["dram"]).set(blocks as f64);
        if let Some(ssd) = inner.ssd.as_ref() {
            let u = ssd.usage();
            m.capacity_bytes
                .with_label_values(&["ssd", "all"])
                .set(u.capacity as f64);
            m.used_bytes
                .with_label_values(&["ssd", "all"])
                .set(u.used as f64);
            m.free_bytes
                .with_label_values(&["ssd", "all"])
                .set(u.free as f64);
            m.blocks.with_label_values(&["ssd"]).set(u.blocks as f64);
        }
    }
}

/// Short hex form of a key for logs.
pub fn hex(key: &[u8]) -> String {
    key.iter().take(16).map(|b| format!("{b:02x}")).collect()
}
