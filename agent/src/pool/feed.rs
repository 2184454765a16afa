//! The pool-mode SSD segment kept honest while the agent runs: [`SsdGuard`] verifies every read
//! of an indexed block of `ssd0` against its crc32c before the bytes leave the agent (it is the
//! transfer server's read check for the segment, and the task runner calls it before copying
//! out of `ssd0`); a block that fails is dropped from the index, counted and queued for the
//! master in the next heartbeat ([`SsdGuard::take_reports`]), and the read is refused.
//! [`apply_events`] applies the master's segment-event feed to the durable indexes (`ssd0`'s and
//! the persistent DRAM segments') and flushes them, and
//! [`FeedState`] is what the next heartbeat acknowledges. I/O boundary: the data file (through
//! [`BlockChecker`]) and the index files; the choice of what to check ([`plan_check`]) is pure.

use kvpool_runtime::telemetry::chain;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvpool_core::master::ObjectKey;
use kvpool_core::master::state::{CorruptBlock, FEED_BATCH, SegmentEvent, SegmentEventKind};
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
                tracing::warn!(error = %chain(&e), "recording a dropped SSD block failed");
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
/// segment id from before a remount) are skipped. When the answer was complete (fewer than
/// [`FEED_BATCH`] events: every event the master held) and applied in full, the commits
/// checksummed while applying earlier answers are confirmed and become durable
/// ([`PoolSsdIndex::confirm`], per index); call this once per heartbeat answer, in order, each
/// heartbeat sent only after the previous answer was applied. Returns the state to
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
    let earlier: Vec<u64> = targets
        .iter()
        .map(|(_, index)| index.lock().begin_feed_round())
        .collect();
    let mut failed = None;
    for e in events {
        if let Some((_, index)) = targets.iter().find(|(id, _)| *id == e.segment_id) {
            if let Err(err) = index.lock().apply(e) {
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
    if failed.is_none() && events.len() < FEED_BATCH {
        for ((_, index), through) in targets.iter().zip(earlier) {
            match index.lock().confirm(through) {
                Ok(n) => {
                    if let Some(m) = metrics {
                        m.ssd_commits_confirmed.inc_by(n as u64);
                    }
                }
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
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
        Ok(Err(e)) => tracing::warn!(error = %chain(&e), category = e.category(), "{failed}"),
        Err(e) => tracing::warn!(error = %chain(&e), "{worker_failed}"),
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
        dir: tempfile::TempDir,
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

        /// The agent is SIGKILLed and starts again: the index is reopened from what was
        /// appended to its log (no sync: a killed process loses nothing it wrote, and
        /// unconfirmed commits were never written). Returns the blocks the restart recovered
        /// (what the agent would announce to the master).
        fn crash_and_restart(&self) -> Vec<PoolBlock> {
            let dir = self.dir.path();
            let (index, recovery) =
                PoolSsdIndex::open(dir, &dir.join("pool-ssd.dat"), 1 << 20).expect("reopen");
            *self.index.lock() = index;
            recovery.blocks
        }

        /// Write `value(n, seed)` at `offset` of the data file, as a replica's writer does, and
        /// return it.
        fn write_value(&self, n: usize, seed: u8, offset: u64) -> Vec<u8> {
            let v = value(n, seed);
            self.data.write_all_at(&v, offset).expect("write");
            v
        }

        /// Every block in `blocks` holds exactly the value its key was written with.
        fn assert_right_bytes(&self, blocks: &[PoolBlock], values: &[(u64, &[u8])]) {
            for b in blocks {
                let (_, want) = values
                    .iter()
                    .find(|(k, _)| key(*k) == b.key)
                    .expect("a key that was written");
                let mut got = vec![0; want.len()];
                self.data.read_exact_at(&mut got, b.offset).expect("read");
                assert_eq!(b.length, want.len() as u64);
                assert!(
                    got == *want,
                    "block {} holds another key's bytes",
                    b.key.to_hex()
                );
            }
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
            dir,
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

    /// `event` as the feed of segment `segment_id` reports it.
    fn on_segment(segment_id: u32, event: SegmentEvent) -> SegmentEvent {
        SegmentEvent {
            segment_id,
            ..event
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
        let a = f.write_value(5000, 2, 0);
        let b = f.write_value(7000, 3, 8192);
        // A commit of a replica someone else wrote: checksummed from the file.
        let events = [
            ev(1, SegmentEventKind::Commit, 1, 0, 5000),
            ev(2, SegmentEventKind::Commit, 2, 8192, 7000),
            // Another segment (before a remount): skipped but acknowledged.
            on_segment(4, ev(3, SegmentEventKind::Free, 1, 0, 0)),
        ];
        let st = f.apply(11, &events, FeedState::default());
        assert_eq!(
            st,
            FeedState {
                epoch: 11,
                acked: 3
            }
        );
        // Indexed (reads are checked against them) but not durable until confirmed.
        {
            let idx = f.index.lock();
            assert_eq!((idx.len(), idx.unconfirmed()), (0, 2));
            assert_eq!(idx.block_at(0).map(|b| b.crc), Some(crc32c::crc32c(&a)));
            assert_eq!(idx.block_at(8192).map(|b| b.crc), Some(crc32c::crc32c(&b)));
        }
        // A free of another key at that offset is ignored; of the right key it drops it. The
        // answer is complete, so it confirms what survives of the earlier commits.
        let frees = [
            ev(4, SegmentEventKind::Free, 9, 0, 0),
            ev(5, SegmentEventKind::Free, 1, 0, 0),
        ];
        let st = f.apply(11, &frees, st);
        assert_eq!(st.acked, 5);
        let blocks = f.index.lock().blocks();
        assert_eq!(blocks.len(), 1);
        assert_eq!((blocks[0].key, blocks[0].crc), (key(2), crc32c::crc32c(&b)));
        assert_eq!(f.index.lock().unconfirmed(), 0);
        assert_eq!(f.metrics.ssd_commits_confirmed.get(), 1);
        // A resync (new epoch) that lists only block 3: block 2 goes at RESET_DONE.
        f.write_value(3000, 4, 65_536);
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
        assert!(
            f.index.lock().blocks().is_empty(),
            "2 dropped, 3 unconfirmed"
        );
        f.apply(12, &[], st);
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

    /// The COMMIT->FREE window, forced: the master commits key 1 at offset 0, and before the
    /// agent applies that commit it frees key 1 and hands the range to key 2, whose writer
    /// overwrites it. The agent then checksums key 2's bytes under key 1. Killed before the
    /// FREE arrives, it must not bring key 1 back (it would validate against key 2's bytes and
    /// be served as key 1); after the FREE and a later answer, key 2 is durable and key 1 gone.
    #[test]
    fn a_commit_checksummed_after_its_range_was_reused_never_survives_a_crash() {
        let f = fixture();
        let old = value(5000, 7);
        let new = value(5000, 8);
        let values: [(u64, &[u8]); 2] = [(1, old.as_slice()), (2, new.as_slice())];
        let commit_1 = [ev(1, SegmentEventKind::Commit, 1, 0, 5000)];
        let free_1_commit_2 = [
            ev(2, SegmentEventKind::Free, 1, 0, 0),
            ev(3, SegmentEventKind::Commit, 2, 0, 5000),
        ];
        let reuse = || {
            f.data.write_all_at(&old, 0).expect("key 1's writer");
            f.data.write_all_at(&new, 0).expect("key 2's writer");
        };

        // Killed right after applying (and acknowledging) the commit.
        reuse();
        let st = f.apply(11, &commit_1, FeedState::default());
        assert_eq!(st.acked, 1);
        let b = f.index.lock().block_at(0).expect("indexed in memory");
        assert_eq!(
            (b.key, b.crc),
            (key(1), crc32c::crc32c(&new)),
            "the bad checksum"
        );
        let recovered = f.crash_and_restart();
        assert!(recovered.is_empty(), "key 1 came back: {recovered:?}");

        // Killed after a heartbeat more, which carried the FREE and key 2's commit.
        reuse();
        let st = f.apply(12, &commit_1, FeedState::default());
        let st = f.apply(12, &free_1_commit_2, st);
        assert_eq!(st.acked, 3);
        let recovered = f.crash_and_restart();
        assert!(recovered.is_empty(), "nothing confirmed yet: {recovered:?}");

        // Killed once the answer after that confirmed key 2.
        reuse();
        let st = f.apply(13, &commit_1, FeedState::default());
        let st = f.apply(13, &free_1_commit_2, st);
        f.apply(13, &[], st);
        let recovered = f.crash_and_restart();
        assert_eq!(recovered.len(), 1);
        assert_eq!(recovered[0].key, key(2));
        f.assert_right_bytes(&recovered, &values);
    }

    /// Commits become durable only through a complete answer (fewer than `FEED_BATCH` events)
    /// to a later heartbeat; a snapshot that does not list an unconfirmed commit drops it, and
    /// a remount discards what is unconfirmed.
    #[test]
    fn commits_are_confirmed_only_by_a_later_complete_answer() {
        let f = fixture();
        let a = f.write_value(5000, 2, 0);
        let b = f.write_value(3000, 3, 8192);
        let c = f.write_value(4000, 4, 65_536);
        let values: [(u64, &[u8]); 3] = [(1, a.as_slice()), (2, b.as_slice()), (3, c.as_slice())];
        let st = f.apply(
            11,
            &[ev(1, SegmentEventKind::Commit, 1, 0, 5000)],
            FeedState::default(),
        );
        // A full answer may leave events behind (a FREE of key 1 among them): no confirmation.
        let full: Vec<SegmentEvent> = (0..FEED_BATCH as u64)
            .map(|i| on_segment(4, ev(2 + i, SegmentEventKind::Free, 9, 0, 0)))
            .collect();
        let st = f.apply(11, &full, st);
        {
            let idx = f.index.lock();
            assert_eq!((idx.len(), idx.unconfirmed()), (0, 1));
        }
        // The same answer's commits wait for the next one.
        let st = f.apply(11, &[ev(5000, SegmentEventKind::Commit, 2, 8192, 3000)], st);
        let keys = |f: &Fixture| -> Vec<ObjectKey> {
            f.index.lock().blocks().iter().map(|b| b.key).collect()
        };
        assert_eq!(keys(&f), vec![key(1)]);
        assert_eq!(f.index.lock().unconfirmed(), 1);
        // A resync that lists only key 3: unconfirmed key 2 is dropped at RESET_DONE (never
        // confirmed), key 1 too (durable: a drop record), key 3 waits for the next answer.
        let resync = [
            ev(1, SegmentEventKind::Reset, 0, 0, 0),
            ev(2, SegmentEventKind::Commit, 3, 65_536, 4000),
            ev(3, SegmentEventKind::ResetDone, 0, 0, 0),
        ];
        let st = f.apply(12, &resync, st);
        assert!(keys(&f).is_empty());
        assert_eq!(f.index.lock().block_at(8192), None);
        f.apply(12, &[], st);
        assert_eq!(keys(&f), vec![key(3)]);
        let recovered = f.crash_and_restart();
        assert_eq!(
            recovered.iter().map(|b| b.key).collect::<Vec<_>>(),
            vec![key(3)]
        );
        f.assert_right_bytes(&recovered, &values);
        // A remount (new segment id) discards unconfirmed commits: not announced, not kept.
        f.apply(
            13,
            &[ev(1, SegmentEventKind::Commit, 1, 0, 5000)],
            FeedState::default(),
        );
        assert_eq!(f.index.lock().discard_unconfirmed().expect("discard"), 1);
        assert_eq!(f.index.lock().block_at(0), None);
        assert_eq!(keys(&f), vec![key(3)]);
        assert_eq!(f.crash_and_restart().len(), 1);
        assert_eq!(f.metrics.ssd_commits_confirmed.get(), 2);
    }

    #[test]
    fn events_go_to_the_index_of_their_segment() {
        let f = fixture();
        let g = fixture();
        let a = f.write_value(4096, 1, 0);
        let b = g.write_value(4096, 2, 8192);
        let events = [
            ev(1, SegmentEventKind::Commit, 1, 0, 4096),
            on_segment(6, ev(2, SegmentEventKind::Commit, 2, 8192, 4096)),
        ];
        let targets = [(5, Arc::clone(&f.index)), (6, Arc::clone(&g.index))];
        let st = apply_events(&targets, 3, &events, FeedState::default(), None).expect("apply");
        assert_eq!(st, FeedState { epoch: 3, acked: 2 });
        assert_eq!(
            f.index.lock().block_at(0).map(|b| b.crc),
            Some(crc32c::crc32c(&a))
        );
        assert_eq!(
            g.index.lock().block_at(8192).map(|b| b.crc),
            Some(crc32c::crc32c(&b))
        );
        // The next complete answer confirms them, each in its own index.
        apply_events(&targets, 3, &[], st, None).expect("confirm");
        assert_eq!(f.index.lock().len(), 1);
        assert_eq!(g.index.lock().len(), 1);
    }
}
