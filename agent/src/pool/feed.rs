//! The pool-mode SSD segment kept honest while the agent runs: [`SsdGuard`] verifies every read
//! of an indexed block of `ssd0` against its crc32c before the bytes leave the agent (it is the
//! transfer server's read check for the segment, and the task runner calls it before copying
//! out of `ssd0`); a block that fails is dropped from the index, counted and queued for the
//! master in the next heartbeat ([`SsdGuard::take_reports`]), and the read is refused.
//! [`apply_events`] applies the master's segment-event feed to the durable indexes (`ssd0`'s and
//! the persistent DRAM segments') and flushes them, and
//! [`FeedState`] is what the next heartbeat acknowledges. I/O boundary: the data file (through
//! [`BlockChecker`]) and the index files; the choice of what to check ([`plan_check`]) is pure.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvpool_core::master::ObjectKey;
use kvpool_core::master::state::{CorruptBlock, SegmentEvent, SegmentEventKind};
use parking_lot::Mutex;

use super::metrics::PoolMetrics;
use crate::ssd::pool::{
    BlockChecker, DropReason, PoolBlock, PoolIndexError, PoolSsdIndex, SharedIndex,
};

/// A slice that starts inside a block is served unchecked when the whole block passed a check
/// this recently (the slices of one large transfer arrive together; the first one, at the
/// block's start, verified all of it).
pub const SLICE_GRACE: Duration = Duration::from_secs(2);

/// Corrupt-block reports kept for the master at most (older ones are dropped and counted).
const MAX_REPORTS: usize = 4096;

/// What a read of `offset..offset+len` needs. Pure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckPlan {
    /// No indexed block holds these bytes (not committed yet, or free space): nothing to
    /// check against.
    Unindexed,
    /// The read runs past the end of the block holding its start.
    Straddles(PoolBlock),
    /// Verify the whole block.
    Verify(PoolBlock),
    /// A later slice of a block verified within [`SLICE_GRACE`].
    Recent(PoolBlock),
}

/// Decide how to check a read, given the block holding its first byte and the last block that
/// passed a full check (with when). Pure.
pub fn plan_check(
    block: Option<PoolBlock>,
    offset: u64,
    len: u64,
    last_ok: Option<(PoolBlock, Instant)>,
    now: Instant,
) -> CheckPlan {
    let Some(b) = block else {
        return CheckPlan::Unindexed;
    };
    if offset.saturating_add(len) > b.offset.saturating_add(b.length) {
        return CheckPlan::Straddles(b);
    }
    let recent =
        last_ok.is_some_and(|(l, at)| l == b && now.saturating_duration_since(at) <= SLICE_GRACE);
    if offset > b.offset && recent {
        CheckPlan::Recent(b)
    } else {
        CheckPlan::Verify(b)
    }
}

/// Verifies reads of `ssd0` and remembers what to report.
#[derive(Debug)]
pub struct SsdGuard {
    index: SharedIndex,
    checker: BlockChecker,
    metrics: PoolMetrics,
    last_ok: Mutex<Option<(PoolBlock, Instant)>>,
    reports: Mutex<Vec<(ObjectKey, u64)>>,
    /// Blocks dropped as bad, by offset: their bytes stay refused (they are no longer indexed,
    /// so nothing else would stop them) until the master frees them or commits new data there.
    bad: Mutex<BTreeMap<u64, PoolBlock>>,
}

impl SsdGuard {
    pub fn new(index: SharedIndex, metrics: PoolMetrics) -> Result<Self, PoolIndexError> {
        let checker = index.lock().checker()?;
        Ok(Self {
            index,
            checker,
            metrics,
            last_ok: Mutex::new(None),
            reports: Mutex::new(Vec::new()),
            bad: Mutex::new(BTreeMap::new()),
        })
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .ssd_reads_checked
            .with_label_values(&[outcome])
            .inc();
    }

    /// Check a read of `len` bytes at `offset` of `ssd0`. `Err` names why it is refused; a
    /// corrupt or truncated block has then been dropped from the index and queued for the
    /// master.
    pub fn check_read(&self, offset: u64, len: u64) -> Result<(), String> {
        if let Some(b) = overlapping(&self.bad.lock(), offset, len) {
            self.count("dropped");
            return Err(format!(
                "SSD block {} at offset {} was dropped as bad; waiting for the master to free it",
                b.key.to_hex(),
                b.offset
            ));
        }
        let block = self.index.lock().block_at(offset);
        let last_ok = *self.last_ok.lock();
        match plan_check(block, offset, len, last_ok, Instant::now()) {
            CheckPlan::Unindexed => {
                self.count("unindexed");
                Ok(())
            }
            CheckPlan::Recent(_) => {
                self.count("recent");
                Ok(())
            }
            CheckPlan::Straddles(b) => {
                self.count("straddles");
                Err(format!(
                    "read {offset}+{len} runs past block {} at {}+{}",
                    b.key.to_hex(),
                    b.offset,
                    b.length
                ))
            }
            CheckPlan::Verify(b) => match self.checker.verify(&b) {
                Ok(None) => {
                    self.count("ok");
                    *self.last_ok.lock() = Some((b, Instant::now()));
                    Ok(())
                }
                Ok(Some(reason)) => {
                    self.drop_block(&b, reason);
                    Err(format!(
                        "SSD block {} at offset {} is {}; dropped and reported",
                        b.key.to_hex(),
                        b.offset,
                        reason.as_str()
                    ))
                }
                Err(e) => {
                    self.count("error");
                    Err(format!("verifying SSD block at offset {}: {e}", b.offset))
                }
            },
        }
    }

    fn drop_block(&self, b: &PoolBlock, reason: DropReason) {
        self.count(reason.as_str());
        tracing::warn!(key = %b.key.to_hex(), offset = b.offset, length = b.length,
            reason = reason.as_str(), "an SSD block failed its check on read; dropping it");
        {
            let mut idx = self.index.lock();
            // Only the block that was checked (a newer one may have replaced it meanwhile).
            if idx.block_at(b.offset) == Some(*b)
                && let Err(e) = idx.forget(b.key, b.offset)
            {
                tracing::warn!(error = %e, "recording a dropped SSD block failed");
            }
        }
        self.metrics
            .ssd_blocks_dropped
            .with_label_values(&[reason.as_str()])
            .inc();
        self.bad.lock().insert(b.offset, *b);
        let mut reports = self.reports.lock();
        if reports.len() >= MAX_REPORTS {
            reports.remove(0);
            self.metrics.ssd_reports_dropped.inc();
        }
        reports.push((b.key, b.offset));
    }

    /// The corrupt blocks not reported yet, for segment `segment_id` (the mounted `ssd0`).
    pub fn take_reports(&self, segment_id: u32) -> Vec<CorruptBlock> {
        std::mem::take(&mut *self.reports.lock())
            .into_iter()
            .map(|(key, offset)| CorruptBlock {
                segment_id,
                key,
                offset,
            })
            .collect()
    }

    /// Forget bad blocks the master has now freed, or whose bytes it committed to new data.
    pub fn settle(&self, events: &[SegmentEvent]) {
        let mut bad = self.bad.lock();
        if bad.is_empty() {
            return;
        }
        for e in events {
            match e.kind {
                SegmentEventKind::Free => {
                    if bad.get(&e.offset).is_some_and(|b| b.key == e.key) {
                        bad.remove(&e.offset);
                    }
                }
                SegmentEventKind::Commit => {
                    while let Some(b) = overlapping(&bad, e.offset, e.length) {
                        bad.remove(&b.offset);
                    }
                }
                SegmentEventKind::Reset | SegmentEventKind::ResetDone => {}
            }
        }
    }

    /// Put back reports a failed heartbeat did not deliver.
    pub fn requeue(&self, blocks: &[CorruptBlock]) {
        let mut reports = self.reports.lock();
        let mut merged: Vec<(ObjectKey, u64)> = blocks.iter().map(|c| (c.key, c.offset)).collect();
        merged.append(&mut reports);
        let excess = merged.len().saturating_sub(MAX_REPORTS);
        merged.drain(..excess);
        *reports = merged;
    }
}

/// A block of `blocks` (non-overlapping, by offset) that shares a byte with `offset..+len`.
fn overlapping(blocks: &BTreeMap<u64, PoolBlock>, offset: u64, len: u64) -> Option<PoolBlock> {
    let end = offset.saturating_add(len.max(1));
    blocks
        .range(..end)
        .next_back()
        .map(|(_, b)| *b)
        .filter(|b| b.offset.saturating_add(b.length.max(1)) > offset)
}

/// Where the agent stands in the master's feed: the epoch its applied events came from (0 right
/// after a mount and announcement) and the last event it applied durably.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedState {
    pub epoch: u64,
    pub acked: u64,
}

/// Apply the feed's `events` (in order) to the durable indexes of `targets` (master segment id,
/// index: `ssd0` and the persistent DRAM segments) and flush them. Events of other segments (a
/// segment id from before a remount) are skipped. A commit whose replica the same batch frees
/// again is not checksummed nor recorded (its range may already hold another key's bytes, and a
/// crash between the two records must not leave the old key naming them). Returns the state to
/// acknowledge: the answer's epoch and the last event applied (`prev` when nothing could be
/// flushed, so everything is sent again).
pub fn apply_events(
    targets: &[(u32, SharedIndex)],
    epoch: u64,
    events: &[SegmentEvent],
    prev: FeedState,
    metrics: Option<&PoolMetrics>,
) -> Result<FeedState, (FeedState, PoolIndexError)> {
    // Acknowledging under a new epoch restarts the count: nothing of it is applied yet.
    let mut applied = if epoch == prev.epoch { prev.acked } else { 0 };
    let freed_later = freed_later(events);
    let mut failed = None;
    for (i, e) in events.iter().enumerate() {
        if let Some((_, index)) = targets.iter().find(|(id, _)| *id == e.segment_id) {
            let mut event = *e;
            if e.kind == SegmentEventKind::Commit && freed_later.contains(&i) {
                // Only the limbo bookkeeping of a resynchronisation; nothing is indexed.
                event.length = 0;
            }
            if let Err(err) = index.lock().apply(&event) {
                failed = Some(err);
                break;
            }
            if let Some(m) = metrics {
                m.ssd_feed_events
                    .with_label_values(&[kind_label(e.kind)])
                    .inc();
            }
        }
        applied = e.seq;
    }
    for (_, index) in targets {
        if let Err(err) = index.lock().sync() {
            return Err((prev, err));
        }
    }
    let state = FeedState {
        epoch,
        acked: applied,
    };
    match failed {
        Some(err) => Err((state, err)),
        None => Ok(state),
    }
}

/// Positions of the commits in `events` whose replica (segment, key, offset) a later event of
/// the same batch frees. Pure.
fn freed_later(events: &[SegmentEvent]) -> std::collections::BTreeSet<usize> {
    let mut open: BTreeMap<(u32, ObjectKey, u64), usize> = BTreeMap::new();
    let mut out = std::collections::BTreeSet::new();
    for (i, e) in events.iter().enumerate() {
        let at = (e.segment_id, e.key, e.offset);
        match e.kind {
            SegmentEventKind::Commit => {
                open.insert(at, i);
            }
            SegmentEventKind::Free => {
                if let Some(c) = open.remove(&at) {
                    out.insert(c);
                }
            }
            SegmentEventKind::Reset | SegmentEventKind::ResetDone => {}
        }
    }
    out
}

/// Run `update` on the SSD index on the blocking pool. A failure only costs persistence across
/// a restart, so it is logged (`failed`, or `worker_failed` when the worker itself died), not
/// returned.
pub async fn update_index(
    index: SharedIndex,
    failed: &'static str,
    worker_failed: &'static str,
    update: impl FnOnce(&mut PoolSsdIndex) -> Result<(), PoolIndexError> + Send + 'static,
) {
    match tokio::task::spawn_blocking(move || update(&mut index.lock())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, category = e.category(), "{failed}"),
        Err(e) => tracing::warn!(error = %e, "{worker_failed}"),
    }
}

fn kind_label(k: SegmentEventKind) -> &'static str {
    match k {
        SegmentEventKind::Commit => "commit",
        SegmentEventKind::Free => "free",
        SegmentEventKind::Reset => "reset",
        SegmentEventKind::ResetDone => "reset_done",
    }
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use super::*;
    use crate::ssd::pool::PoolSsdIndex;

    fn key(i: u64) -> ObjectKey {
        ObjectKey::from_bytes(&i.to_le_bytes())
    }

    fn block(offset: u64, length: u64) -> PoolBlock {
        PoolBlock {
            key: key(offset),
            offset,
            length,
            crc: 1,
        }
    }

    #[test]
    fn the_plan_verifies_block_starts_and_trusts_only_recent_slices() {
        let now = Instant::now();
        let b = block(8192, 10_000);
        assert_eq!(plan_check(None, 0, 10, None, now), CheckPlan::Unindexed);
        assert_eq!(
            plan_check(Some(b), 8192, 10_000, None, now),
            CheckPlan::Verify(b)
        );
        assert_eq!(
            plan_check(Some(b), 8192, 10_001, None, now),
            CheckPlan::Straddles(b)
        );
        // A later slice: trusted only right after the block passed, never for another block.
        assert_eq!(
            plan_check(Some(b), 9000, 100, Some((b, now)), now),
            CheckPlan::Recent(b)
        );
        assert_eq!(
            plan_check(Some(b), 9000, 100, Some((block(0, 10), now)), now),
            CheckPlan::Verify(b)
        );
        let later = now + SLICE_GRACE + Duration::from_millis(1);
        assert_eq!(
            plan_check(Some(b), 9000, 100, Some((b, now)), later),
            CheckPlan::Verify(b)
        );
        // The first slice is always verified again.
        assert_eq!(
            plan_check(Some(b), 8192, 100, Some((b, now)), now),
            CheckPlan::Verify(b)
        );
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        data: std::fs::File,
        index: SharedIndex,
        metrics: PoolMetrics,
    }

    impl Fixture {
        /// Apply the feed's `events` of `epoch` for segment 5 after `prev`, counting them.
        fn apply(&self, epoch: u64, events: &[SegmentEvent], prev: FeedState) -> FeedState {
            apply_events(
                &[(5, Arc::clone(&self.index))],
                epoch,
                events,
                prev,
                Some(&self.metrics),
            )
            .expect("apply")
        }
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pool-ssd.dat");
        let (index, _) = PoolSsdIndex::open(dir.path(), &path, 1 << 20).expect("index");
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("data");
        data.set_len(1 << 20).expect("size");
        let metrics = PoolMetrics::new(&prometheus::Registry::new()).expect("metrics");
        Fixture {
            _dir: dir,
            data,
            index: Arc::new(Mutex::new(index)),
            metrics,
        }
    }

    fn value(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    fn ev(seq: u64, kind: SegmentEventKind, k: u64, offset: u64, length: u64) -> SegmentEvent {
        SegmentEvent {
            seq,
            kind,
            segment_id: 5,
            key: key(k),
            offset,
            length,
        }
    }

    #[test]
    fn a_corrupted_block_is_refused_dropped_and_reported_once() {
        let f = fixture();
        let v = value(20_000, 1);
        f.data.write_all_at(&v, 4096).expect("write");
        f.index
            .lock()
            .record(key(1), 4096, v.len() as u64, crc32c::crc32c(&v))
            .expect("record");
        let guard = SsdGuard::new(Arc::clone(&f.index), f.metrics.clone()).expect("guard");
        guard.check_read(4096, v.len() as u64).expect("intact");
        guard.check_read(8192, 100).expect("a later slice");
        assert_eq!(guard.check_read(0, 100), Ok(()), "free space: unindexed");
        assert!(guard.check_read(4096, v.len() as u64 + 1).is_err());
        // One flipped byte on disk.
        f.data
            .write_all_at(&[v[500] ^ 0xff], 4096 + 500)
            .expect("corrupt");
        let e = guard.check_read(4096, v.len() as u64).expect_err("corrupt");
        assert!(e.contains("corrupt"), "{e}");
        assert!(f.index.lock().is_empty(), "dropped from the index");
        let dropped = |r: &str| f.metrics.ssd_blocks_dropped.with_label_values(&[r]).get();
        assert_eq!(dropped("corrupt"), 1);
        assert_eq!(
            guard.take_reports(7),
            vec![CorruptBlock {
                segment_id: 7,
                key: key(1),
                offset: 4096
            }]
        );
        assert!(guard.take_reports(7).is_empty());
        // Requeued reports survive for the next heartbeat.
        guard.requeue(&[CorruptBlock {
            segment_id: 7,
            key: key(1),
            offset: 4096,
        }]);
        assert_eq!(guard.take_reports(9).len(), 1);
        // Once dropped, the bytes stay refused (nothing is reported twice) until the master
        // frees the block; a free of another key changes nothing.
        assert!(guard.check_read(4096, v.len() as u64).is_err());
        assert!(guard.check_read(8192, 10).is_err(), "any slice of it");
        assert_eq!(dropped("corrupt"), 1);
        assert!(guard.take_reports(7).is_empty());
        guard.settle(&[ev(1, SegmentEventKind::Free, 2, 4096, 0)]);
        assert!(guard.check_read(4096, 10).is_err());
        guard.settle(&[ev(2, SegmentEventKind::Free, 1, 4096, 0)]);
        assert_eq!(guard.check_read(4096, 10), Ok(()), "freed: unindexed space");
    }

    #[test]
    fn feed_events_commit_free_and_resync_the_index() {
        let f = fixture();
        let a = value(5000, 2);
        let b = value(7000, 3);
        f.data.write_all_at(&a, 0).expect("a");
        f.data.write_all_at(&b, 8192).expect("b");
        // A commit of a replica someone else wrote: checksummed from the file.
        let events = [
            ev(1, SegmentEventKind::Commit, 1, 0, 5000),
            ev(2, SegmentEventKind::Commit, 2, 8192, 7000),
            // Another segment (before a remount): skipped but acknowledged.
            SegmentEvent {
                segment_id: 4,
                ..ev(3, SegmentEventKind::Free, 1, 0, 0)
            },
        ];
        let st = f.apply(11, &events, FeedState::default());
        assert_eq!(
            st,
            FeedState {
                epoch: 11,
                acked: 3
            }
        );
        let blocks = f.index.lock().blocks();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].crc, crc32c::crc32c(&a));
        assert_eq!(blocks[1].crc, crc32c::crc32c(&b));
        // A free of another key at that offset is ignored; of the right key it drops it.
        let frees = [
            ev(4, SegmentEventKind::Free, 9, 0, 0),
            ev(5, SegmentEventKind::Free, 1, 0, 0),
        ];
        let st = f.apply(11, &frees, st);
        assert_eq!(st.acked, 5);
        assert_eq!(f.index.lock().len(), 1);
        // A resync (new epoch) that lists only block 3: block 2 goes at RESET_DONE.
        let c = value(3000, 4);
        f.data.write_all_at(&c, 65_536).expect("c");
        let resync = [
            ev(1, SegmentEventKind::Reset, 0, 0, 0),
            ev(2, SegmentEventKind::Commit, 3, 65_536, 3000),
            ev(3, SegmentEventKind::ResetDone, 0, 0, 0),
        ];
        let st = f.apply(12, &resync, st);
        assert_eq!(
            st,
            FeedState {
                epoch: 12,
                acked: 3
            }
        );
        let keys: Vec<ObjectKey> = f.index.lock().blocks().iter().map(|b| b.key).collect();
        assert_eq!(keys, vec![key(3)]);
        assert_eq!(
            f.metrics
                .ssd_feed_events
                .with_label_values(&["commit"])
                .get(),
            3,
            "every commit applied is counted"
        );
    }

    #[test]
    fn a_commit_freed_in_the_same_batch_is_never_recorded() {
        let f = fixture();
        // Key 1 was committed at 0, then freed, and key 2 written over the same bytes before
        // the agent saw any of it: the file holds key 2's bytes.
        let b = value(5000, 7);
        f.data.write_all_at(&b, 0).expect("b");
        let events = [
            ev(1, SegmentEventKind::Commit, 1, 0, 5000),
            ev(2, SegmentEventKind::Free, 1, 0, 0),
            ev(3, SegmentEventKind::Commit, 2, 0, 5000),
        ];
        assert_eq!(
            freed_later(&events).into_iter().collect::<Vec<_>>(),
            vec![0]
        );
        let st = f.apply(11, &events, FeedState::default());
        assert_eq!(st.acked, 3);
        let blocks = f.index.lock().blocks();
        assert_eq!(blocks.len(), 1);
        assert_eq!((blocks[0].key, blocks[0].crc), (key(2), crc32c::crc32c(&b)));
        // The log itself never named key 1 (a crash between the records could not bring it
        // back with key 2's bytes): replaying it from the file finds key 2 only.
        let dir = f._dir.path();
        let log = std::fs::read(dir.join(crate::ssd::pool::POOL_INDEX_FILE)).expect("log");
        let replayed = crate::ssd::pool::replay(&log[crate::ssd::log::HEADER_LEN..]);
        assert!(replayed.damaged_at.is_none());
        let keys: Vec<ObjectKey> = replayed.blocks.values().map(|b| b.key).collect();
        assert_eq!(keys, vec![key(2)]);
    }

    #[test]
    fn events_go_to_the_index_of_their_segment() {
        let f = fixture();
        let g = fixture();
        let a = value(4096, 1);
        let b = value(4096, 2);
        f.data.write_all_at(&a, 0).expect("a");
        g.data.write_all_at(&b, 8192).expect("b");
        let events = [
            ev(1, SegmentEventKind::Commit, 1, 0, 4096),
            SegmentEvent {
                segment_id: 6,
                ..ev(2, SegmentEventKind::Commit, 2, 8192, 4096)
            },
        ];
        let targets = [(5, Arc::clone(&f.index)), (6, Arc::clone(&g.index))];
        let st = apply_events(&targets, 3, &events, FeedState::default(), None).expect("apply");
        assert_eq!(st, FeedState { epoch: 3, acked: 2 });
        assert_eq!(f.index.lock().blocks()[0].crc, crc32c::crc32c(&a));
        assert_eq!(g.index.lock().blocks()[0].crc, crc32c::crc32c(&b));
        assert_eq!(f.index.lock().len(), 1);
        assert_eq!(g.index.lock().len(), 1);
    }
}
