//! DRAM tier: NUMA-placed memory segments with variable-size blocks carved out by
//! `offset-allocator`, in 4 KiB units (so every block is page aligned and can feed direct I/O).
//! I/O boundary: the mappings come from `memory`; everything here is in-process bookkeeping and
//! memcpy.

use std::path::{Path, PathBuf};

use offset_allocator::{Allocation, Allocator};
use serde::Serialize;

use crate::memory::{MappedRegion, MemoryError, RegionRequest};
use crate::placement::{SegmentPlan, numa_label};

/// Allocation unit inside a segment.
pub const UNIT: u64 = 4096;
/// Most blocks one segment tracks.
const MAX_ALLOCS_PER_SEGMENT: u32 = 1 << 20;

/// Errors of the DRAM tier.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DramError {
    #[error(
        "mapping segment {index} ({bytes} bytes, NUMA node {}) failed",
        numa_label(*.numa_node)
    )]
    MapSegment {
        index: usize,
        bytes: u64,
        numa_node: Option<u32>,
        #[source]
        source: MemoryError,
    },
    #[error("segment of {0} bytes exceeds what one allocator can address")]
    SegmentTooLarge(u64),
}

kvpool_runtime::error_category!(DramError);

/// Where a block lives in DRAM.
#[derive(Clone, Copy)]
pub struct DramBlock {
    pub segment: u32,
    alloc: Allocation,
    pub len: u64,
}

impl std::fmt::Debug for DramBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramBlock")
            .field("segment", &self.segment)
            .field("offset", &self.offset())
            .field("len", &self.len)
            .finish()
    }
}

impl DramBlock {
    /// Byte offset inside the segment.
    pub fn offset(&self) -> u64 {
        u64::from(self.alloc.offset) * UNIT
    }
}

struct Segment {
    numa_node: Option<u32>,
    region: MappedRegion,
    allocator: Allocator,
    used_bytes: u64,
    blocks: u64,
}

/// Description of a segment for registration with the transfer engine and for metrics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    pub index: u32,
    /// The node the segment's pages were verified on (`numa_verify`); `None`: unbound (policy
    /// `none`, or a binding that failed or could not be verified).
    pub numa_node: Option<u32>,
    pub addr: usize,
    pub bytes: u64,
    pub hugepage_size: Option<u64>,
    pub numa_bound: bool,
    pub locked: bool,
}

/// Usage of one segment.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SegmentUsage {
    /// `None`: unbound segment.
    pub numa_node: Option<u32>,
    pub capacity: u64,
    /// Bytes handed out (rounded up to units).
    pub used: u64,
    pub free: u64,
    pub largest_free: u64,
    pub blocks: u64,
}

impl SegmentUsage {
    /// 1 - largest free region / free space: 0 when free space is one piece.
    pub fn fragmentation(&self) -> f64 {
        if self.free == 0 {
            0.0
        } else {
            1.0 - self.largest_free as f64 / self.free as f64
        }
    }
}

/// A mapped segment and its description.
pub type MappedSegment = (SegmentInfo, MappedRegion);

/// Map every planned segment as the placement asked (NUMA node, huge pages, lock), without
/// an allocator: local-only mode wraps them in a [`DramTier`], pool mode hands them to the
/// transfer engine and lets the master allocate inside them. Each segment's usable size is a
/// whole number of [`UNIT`]s. Returns the warnings of degraded mappings.
pub fn map_segments(
    plans: &[SegmentPlan],
    lock: bool,
) -> Result<(Vec<MappedSegment>, Vec<String>), DramError> {
    map_segments_in(plans, lock, None, false)
}

/// [`map_segments`], each segment a memfd that engines on this node can map (pool mode with
/// same-node shared memory).
pub fn map_shared_segments(
    plans: &[SegmentPlan],
    lock: bool,
) -> Result<(Vec<MappedSegment>, Vec<String>), DramError> {
    map_segments_in(plans, lock, None, true)
}

/// File of DRAM segment `index` in a persistent tier's directory.
pub fn segment_file(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("dram{index}.dat"))
}

/// [`map_segments`], each segment a shared mapping of file [`segment_file`] in `files.0` (a
/// tmpfs or hugetlbfs directory whose page size is `files.1`) when `files` is given: the
/// persistent DRAM tier, whose contents outlive the agent. Without files, `shareable` backs
/// each segment with a memfd instead of private anonymous memory (files are always shareable).
pub fn map_segments_in(
    plans: &[SegmentPlan],
    lock: bool,
    files: Option<(&Path, u64)>,
    shareable: bool,
) -> Result<(Vec<MappedSegment>, Vec<String>), DramError> {
    let mut out = Vec::new();
    let mut warnings = Vec::new();
    for (index, plan) in plans.iter().enumerate() {
        let units =
            u32::try_from(plan.bytes / UNIT).map_err(|_| DramError::SegmentTooLarge(plan.bytes))?;
        let bytes =
            usize::try_from(plan.bytes).map_err(|_| DramError::SegmentTooLarge(plan.bytes))?;
        let req = RegionRequest {
            bytes,
            numa_node: plan.numa_node,
            hugepage_size: plan.hugepage_size,
            lock,
            shareable,
        };
        let mapped = match files {
            None => MappedRegion::map(&req),
            Some((dir, page)) => {
                // The filesystem decides the page size of a file mapping.
                if let Some(wanted) = plan.hugepage_size.filter(|w| *w != page) {
                    warnings.push(format!(
                        "segment {index}: huge pages of {wanted} bytes were planned, but the \
                         persistent tier's files in {} have pages of {page} bytes (use mode \
                         hugetlbfs on a mount of that page size)",
                        dir.display()
                    ));
                }
                MappedRegion::map_file(&req, &segment_file(dir, index), page)
            }
        };
        let (region, outcome) = mapped.map_err(|source| DramError::MapSegment {
            index,
            bytes: plan.bytes,
            numa_node: plan.numa_node,
            source,
        })?;
        warnings.extend(
            outcome
                .warnings
                .iter()
                .map(|w| format!("segment {index}: {w}")),
        );
        let numa_node = crate::numa_verify::announced_node(
            index,
            region.addr(),
            region.len(),
            plan.numa_node,
            outcome.numa_bound,
            &mut warnings,
        );
        out.push((
            SegmentInfo {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                numa_node,
                addr: region.addr(),
                bytes: u64::from(units) * UNIT,
                hugepage_size: outcome.hugepage_size,
                numa_bound: outcome.numa_bound,
                locked: outcome.locked,
            },
            region,
        ));
    }
    Ok((out, warnings))
}

/// The DRAM tier.
#[derive(derive_more::Debug)]
pub struct DramTier {
    /// Shown as their descriptions: the mappings and allocators have no useful text.
    #[debug("{infos:?}")]
    segments: Vec<Segment>,
    #[debug(skip)]
    infos: Vec<SegmentInfo>,
}

impl DramTier {
    /// Map every planned segment. Returns the tier and the warnings of degraded mappings.
    pub fn new(plans: &[SegmentPlan], lock: bool) -> Result<(Self, Vec<String>), DramError> {
        let (mapped, warnings) = map_segments(plans, lock)?;
        let mut segments = Vec::new();
        let mut infos = Vec::new();
        for (info, region) in mapped {
            let units = u32::try_from(info.bytes / UNIT)
                .map_err(|_| DramError::SegmentTooLarge(info.bytes))?;
            segments.push(Segment {
                numa_node: info.numa_node,
                region,
                allocator: Allocator::with_max_allocs(
                    units,
                    units
                        .saturating_mul(2)
                        .saturating_add(16)
                        .min(MAX_ALLOCS_PER_SEGMENT),
                ),
                used_bytes: 0,
                blocks: 0,
            });
            infos.push(info);
        }
        Ok((Self { segments, infos }, warnings))
    }

    /// Segments as mapped.
    pub fn segments(&self) -> &[SegmentInfo] {
        &self.infos
    }

    /// Total mapped bytes.
    pub fn capacity(&self) -> u64 {
        self.infos.iter().map(|i| i.bytes).sum()
    }

    /// Largest block that fits in an empty segment.
    pub fn max_block(&self) -> u64 {
        self.infos.iter().map(|i| i.bytes).max().unwrap_or(0)
    }

    /// Allocate room for `len` bytes, on `prefer_numa` first, then on the other nodes (the
    /// segment with the most free space first).
    pub fn allocate(&mut self, len: u64, prefer_numa: Option<u32>) -> Option<DramBlock> {
        let units = u32::try_from(len.div_ceil(UNIT).max(1)).ok()?;
        let mut order: Vec<usize> = (0..self.segments.len()).collect();
        order.sort_by_key(|&i| {
            let s = &self.segments[i];
            // An unbound segment is remote to every preferred node.
            let remote = prefer_numa.is_some_and(|n| s.numa_node != Some(n));
            let free = s.allocator.storage_report().total_free_space;
            (remote, u32::MAX - free)
        });
        for i in order {
            let seg = &mut self.segments[i];
            if let Some(alloc) = seg.allocator.allocate(units) {
                seg.used_bytes += u64::from(units) * UNIT;
                seg.blocks += 1;
                return Some(DramBlock {
                    segment: u32::try_from(i).ok()?,
                    alloc,
                    len,
                });
            }
        }
        None
    }

    /// Return a block's room.
    pub fn free(&mut self, block: DramBlock) {
        if let Some(seg) = self.segments.get_mut(block.segment as usize) {
            let size = u64::from(seg.allocator.allocation_size(block.alloc)) * UNIT;
            seg.allocator.free(block.alloc);
            seg.used_bytes = seg.used_bytes.saturating_sub(size);
            seg.blocks = seg.blocks.saturating_sub(1);
        }
    }

    /// NUMA node of a block (`None` for an unbound segment or an unknown block).
    pub fn numa_of(&self, block: &DramBlock) -> Option<u32> {
        self.segments
            .get(block.segment as usize)
            .and_then(|s| s.numa_node)
    }

    /// The block's bytes.
    pub fn bytes(&self, block: &DramBlock) -> &[u8] {
        self.padded(block)
            .and_then(|s| s.get(..usize::try_from(block.len).ok()?))
            .unwrap_or(&[])
    }

    /// The block's bytes including the padding up to the next unit (page aligned, for direct
    /// I/O).
    pub fn padded(&self, block: &DramBlock) -> Option<&[u8]> {
        let seg = self.segments.get(block.segment as usize)?;
        let start = usize::try_from(block.offset()).ok()?;
        let len = usize::try_from(block.len.div_ceil(UNIT).max(1) * UNIT).ok()?;
        seg.region.as_slice().get(start..start.checked_add(len)?)
    }

    /// The block's bytes including the padding, writable (page aligned, for direct I/O).
    pub fn padded_mut(&mut self, block: &DramBlock) -> Option<&mut [u8]> {
        let seg = self.segments.get_mut(block.segment as usize)?;
        let start = usize::try_from(block.offset()).ok()?;
        let len = usize::try_from(block.len.div_ceil(UNIT).max(1) * UNIT).ok()?;
        seg.region
            .as_mut_slice()
            .get_mut(start..start.checked_add(len)?)
    }

    /// The block's bytes, writable.
    pub fn bytes_mut(&mut self, block: &DramBlock) -> &mut [u8] {
        let Some(seg) = self.segments.get_mut(block.segment as usize) else {
            return &mut [];
        };
        let (Ok(start), Ok(len)) = (usize::try_from(block.offset()), usize::try_from(block.len))
        else {
            return &mut [];
        };
        let end = start.saturating_add(len);
        seg.region
            .as_mut_slice()
            .get_mut(start..end)
            .unwrap_or(&mut [])
    }

    /// Usage per segment.
    pub fn usage(&self) -> Vec<SegmentUsage> {
        self.segments
            .iter()
            .zip(&self.infos)
            .map(|(s, info)| {
                let report = s.allocator.storage_report();
                SegmentUsage {
                    numa_node: s.numa_node,
                    capacity: info.bytes,
                    used: s.used_bytes,
                    free: u64::from(report.total_free_space) * UNIT,
                    largest_free: u64::from(report.largest_free_region) * UNIT,
                    blocks: s.blocks,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(sizes: &[(Option<u32>, u64)]) -> DramTier {
        let plans: Vec<SegmentPlan> = sizes
            .iter()
            .map(|&(numa_node, bytes)| SegmentPlan {
                numa_node,
                bytes,
                hugepage_size: None,
            })
            .collect();
        DramTier::new(&plans, false).expect("tier").0
    }

    #[test]
    fn allocates_on_preferred_node_then_spills() {
        // Segments are announced on the node their pages were verified on (`numa_verify`):
        // node 0 exists everywhere, the unbound segment is the spill-over.
        let mut t = tier(&[(None, 64 * 1024), (Some(0), 64 * 1024)]);
        let a = t.allocate(40 * 1024, Some(0)).expect("a");
        assert_eq!(t.numa_of(&a), Some(0));
        let b = t.allocate(40 * 1024, Some(0)).expect("b");
        assert_eq!(
            t.numa_of(&b),
            None,
            "node 0 is full, spills to the unbound segment"
        );
        assert!(t.allocate(40 * 1024, None).is_none());
        t.free(a);
        assert!(t.allocate(40 * 1024, None).is_some());
    }

    #[test]
    fn bytes_round_trip_and_usage_counts_units() {
        let mut t = tier(&[(Some(0), 1 << 20)]);
        let blk = t.allocate(5000, None).expect("alloc");
        assert_eq!(blk.offset() % UNIT, 0);
        t.bytes_mut(&blk).copy_from_slice(&[9u8; 5000]);
        assert_eq!(t.bytes(&blk), &[9u8; 5000][..]);
        assert_eq!(t.padded(&blk).map(<[u8]>::len), Some(8192));
        let u = &t.usage()[0];
        assert_eq!(u.used, 8192);
        assert_eq!(u.blocks, 1);
        assert_eq!(u.free, (1 << 20) - 8192);
        t.free(blk);
        assert_eq!(t.usage()[0].used, 0);
    }

    #[test]
    fn fragmentation_grows_with_holes() {
        let mut t = tier(&[(Some(0), 16 * UNIT)]);
        let blocks: Vec<DramBlock> = (0..16)
            .map(|_| t.allocate(UNIT, None).expect("a"))
            .collect();
        assert_eq!(t.usage()[0].fragmentation(), 0.0);
        for b in blocks.into_iter().step_by(2) {
            t.free(b);
        }
        let u = &t.usage()[0];
        assert_eq!(u.free, 8 * UNIT);
        assert_eq!(u.largest_free, UNIT);
        assert!((u.fragmentation() - 0.875).abs() < 1e-9);
        assert!(
            t.allocate(2 * UNIT, None).is_none(),
            "no two adjacent free units"
        );
    }

    #[test]
    fn unbound_segments_map_without_binding_and_report_no_node() {
        // Policy `none`: real anonymous mappings, no mbind, so no binding warning either.
        let plans = crate::placement::plan(
            &crate::topology::Topology {
                numa_nodes: vec![crate::topology::NumaNode {
                    id: 0,
                    mem_free_bytes: 1 << 30,
                    ..Default::default()
                }],
                ..Default::default()
            },
            &crate::placement::PlacementRequest {
                capacity: 3 * 64 * 1024,
                policy: crate::placement::NumaPolicy::None,
                hugepage_size: None,
                max_segment: 128 * 1024,
            },
        )
        .expect("plan")
        .segments;
        let (mut t, warnings) = DramTier::new(&plans, false).expect("tier");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(t.segments().len(), 2);
        assert!(
            t.segments()
                .iter()
                .all(|i| i.numa_node.is_none() && !i.numa_bound && !i.locked),
            "{:?}",
            t.segments()
        );
        assert_eq!(t.capacity(), 3 * 64 * 1024);
        // A preferred node still finds room, and the block reports no node.
        let blk = t.allocate(5000, Some(0)).expect("alloc");
        assert_eq!(t.numa_of(&blk), None);
        t.bytes_mut(&blk).copy_from_slice(&[7u8; 5000]);
        assert_eq!(t.bytes(&blk), &[7u8; 5000][..]);
        assert!(t.usage().iter().all(|u| u.numa_node.is_none()));
        assert_eq!(t.usage().iter().map(|u| u.used).sum::<u64>(), 8192);

        // Locking still applies without a binding: locked, or (no CAP_IPC_LOCK / low
        // RLIMIT_MEMLOCK) a lock warning, never a binding attempt.
        let (locked, warnings) = DramTier::new(&plans, true).expect("locked tier");
        for info in locked.segments() {
            assert!(info.numa_node.is_none() && !info.numa_bound, "{info:?}");
            assert!(
                info.locked
                    || warnings
                        .iter()
                        .any(|w| w.starts_with(&format!("segment {}: cannot lock", info.index))),
                "{info:?} {warnings:?}"
            );
        }
        assert!(warnings.iter().all(|w| !w.contains("NUMA")), "{warnings:?}");
    }

    #[test]
    fn a_preferred_node_ranks_bound_segments_before_unbound_ones() {
        let mut t = tier(&[(None, 64 * 1024), (Some(0), 32 * 1024)]);
        let a = t.allocate(4096, Some(0)).expect("a");
        assert_eq!(
            t.numa_of(&a),
            Some(0),
            "the bound segment on the hinted node"
        );
        let b = t.allocate(4096, None).expect("b");
        assert_eq!(
            t.numa_of(&b),
            None,
            "no hint: the segment with most free space"
        );
    }
}
