//! Master tasks in pool mode: repair (copy a surviving replica into a location the master
//! reserved in this node's memory) and demotion (copy a DRAM replica of this node into this
//! node's SSD segment). Both are one copy from the task's source replica into its target: a
//! transfer-engine READ from the source's node into the target's registration, or a memory copy
//! when both live in this process. A copy into the SSD segment is checksummed, flushed and
//! recorded in its durable index ([`crate::ssd::pool`]) before the master hears of it.
//! [`TaskRunner`] runs them off the heartbeat loop, at most `max_tasks` at once, with a
//! timeout, reports each outcome to the master (`CompleteTask`) and counts it. I/O boundary:
//! the transfer engine and the master's gRPC channel; [`check`] is pure.

use kvpool_runtime::telemetry::chain;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvpool_client::master::MasterClient;
use kvpool_client::pool::{self as data, DataError};
use kvpool_core::master::{Task, TaskKind};
use kvpool_transfer::{self as transfer, BatchFailed, TransferEngine, TransferOp, TransferRequest};
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::metrics::PoolMetrics;
use super::registrar::{PoolRegistrar, SSD_SEGMENT};
use crate::ssd::pool::PoolIndexError;

/// Tasks waiting for a slot, per allowed concurrent task; beyond that a task is refused (the
/// master schedules it again later).
const QUEUE_PER_SLOT: usize = 16;

/// Why a task failed.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TaskError {
    #[error("task {id} targets node {target}, not this node ({node})")]
    WrongNode {
        id: u64,
        target: String,
        node: String,
    },
    #[error("task {id}: source holds {source_len} bytes, target {target_len}")]
    Length {
        id: u64,
        source_len: u64,
        target_len: u64,
    },
    #[error("task {id}: a demotion must copy from this node, not from {from}")]
    RemoteDemotion { id: u64, from: String },
    #[error("segment {0} is not registered on this node")]
    UnknownSegment(String),
    #[error("source replica")]
    Source(#[source] DataError),
    #[error("opening source segment {name}")]
    Open {
        name: String,
        #[source]
        source: transfer::TransferError,
    },
    #[error("reading source segment {name}")]
    Transfer {
        name: String,
        #[source]
        source: BatchFailed,
    },
    #[error("copying between local segments")]
    Copy(#[source] transfer::MemoryError),
    #[error("the copy worker failed: {0}")]
    Join(String),
    #[error("reading back the copied block to checksum it")]
    ReadBack(#[source] transfer::MemoryError),
    #[error("recording the block in the SSD index")]
    Index(#[source] PoolIndexError),
    #[error("task {id}: the source block in the SSD segment failed its check: {reason}")]
    SourceCheck { id: u64, reason: String },
}

kvpool_runtime::error_category!(TaskError);

/// Whether `node` can execute `task` as described. Pure.
pub fn check(task: &Task, node: &str) -> Result<(), TaskError> {
    if task.target.node != node {
        return Err(TaskError::WrongNode {
            id: task.id,
            target: task.target.node.clone(),
            node: node.to_owned(),
        });
    }
    if task.source.length != task.target.length || task.target.length == 0 {
        return Err(TaskError::Length {
            id: task.id,
            source_len: task.source.length,
            target_len: task.target.length,
        });
    }
    if task.kind == TaskKind::Demote && task.source.node != node {
        return Err(TaskError::RemoteDemotion {
            id: task.id,
            from: task.source.node.clone(),
        });
    }
    Ok(())
}

/// Copy the task's source replica into its target (blocking). Returns the bytes copied.
pub fn execute(
    engine: &TransferEngine,
    registrar: &PoolRegistrar,
    task: &Task,
) -> Result<u64, TaskError> {
    check(task, registrar.node())?;
    let (src, dst) = (&task.source, &task.target);
    let target = registrar
        .local(&dst.segment)
        .ok_or_else(|| TaskError::UnknownSegment(dst.segment.clone()))?;
    if src.node == registrar.node() {
        let source = registrar
            .local(&src.segment)
            .ok_or_else(|| TaskError::UnknownSegment(src.segment.clone()))?;
        // Bytes leaving this node's SSD segment are verified first, as a peer's read would be.
        if src.segment == SSD_SEGMENT
            && let Some(guard) = registrar.ssd_guard()
        {
            guard
                .check_read(src.offset, src.length)
                .map_err(|reason| TaskError::SourceCheck {
                    id: task.id,
                    reason,
                })?;
        }
        let len = usize::try_from(dst.length).map_err(|_| TaskError::Length {
            id: task.id,
            source_len: src.length,
            target_len: dst.length,
        })?;
        transfer::memory::copy_between(
            source.segment(),
            src.offset,
            target.segment(),
            dst.offset,
            len,
        )
        .map_err(TaskError::Copy)?;
        record_ssd_write(registrar, task, &target)?;
        return Ok(dst.length);
    }
    let desc = data::descriptor(src).map_err(TaskError::Source)?;
    let remote = engine
        .open_descriptor(&desc, None)
        .map_err(|source| TaskError::Open {
            name: desc.name.clone(),
            source,
        })?;
    engine
        .transfer(vec![TransferRequest {
            op: TransferOp::Read,
            local: target.clone(),
            local_offset: dst.offset,
            remote,
            remote_offset: src.offset,
            len: dst.length,
        }])
        .map_err(|source| TaskError::Transfer {
            name: desc.name.clone(),
            source,
        })?;
    record_ssd_write(registrar, task, &target)?;
    Ok(dst.length)
}

/// After a copy into the SSD segment: checksum the bytes as they landed, flush the data file
/// and record the block in the durable index (before the master hears of the success).
fn record_ssd_write(
    registrar: &PoolRegistrar,
    task: &Task,
    target: &transfer::LocalSegment,
) -> Result<(), TaskError> {
    let dst = &task.target;
    if dst.segment != SSD_SEGMENT {
        return Ok(());
    }
    let Some(index) = registrar.ssd_index() else {
        return Ok(());
    };
    let segment = target.segment();
    let crc = crate::ssd::log::crc_of_range(dst.offset, dst.length, |pos, chunk| {
        segment.read_at(pos, chunk)
    })
    .map_err(TaskError::ReadBack)?;
    index
        .lock()
        .record(task.key, dst.offset, dst.length, crc)
        .map_err(TaskError::Index)
}

struct Inner {
    engine: TransferEngine,
    registrar: Arc<PoolRegistrar>,
    master: MasterClient,
    slots: Arc<Semaphore>,
    max_queued: usize,
    queued: AtomicUsize,
    timeout: Duration,
    metrics: PoolMetrics,
    /// Ids accepted and not reported yet (a task is never run twice at once).
    active: Mutex<HashSet<u64>>,
}

/// Runs master tasks in the background. Cheap to clone.
#[derive(Clone)]
pub struct TaskRunner {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TaskRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskRunner")
            .field("node", &self.inner.registrar.node())
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

/// How a task ended, as counted in `kvpool_agent_pool_tasks_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Failed,
    Timeout,
    Rejected,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Timeout => "timeout",
            Outcome::Rejected => "rejected",
        }
    }
}

impl TaskRunner {
    pub fn new(
        engine: TransferEngine,
        registrar: Arc<PoolRegistrar>,
        master: MasterClient,
        max_tasks: usize,
        timeout: Duration,
        metrics: PoolMetrics,
    ) -> Self {
        let max_tasks = max_tasks.max(1);
        Self {
            inner: Arc::new(Inner {
                engine,
                registrar,
                master,
                slots: Arc::new(Semaphore::new(max_tasks)),
                max_queued: max_tasks.saturating_mul(QUEUE_PER_SLOT),
                queued: AtomicUsize::new(0),
                timeout,
                metrics,
                active: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// Start `tasks` in the background (call from the runtime); returns at once.
    pub fn submit(&self, tasks: Vec<Task>) {
        for task in tasks {
            if !self.inner.active.lock().insert(task.id) {
                tracing::debug!(task = task.id, "task already running");
                continue;
            }
            let queued = self.inner.queued.fetch_add(1, Ordering::SeqCst);
            let this = self.clone();
            if queued >= self.inner.max_queued {
                tokio::spawn(async move {
                    tracing::warn!(task = task.id, "task queue full; refusing the task");
                    this.report(&task, Outcome::Rejected, 0).await;
                });
            } else {
                tokio::spawn(async move { this.run(task).await });
            }
        }
    }

    async fn run(&self, task: Task) {
        let Ok(_slot) = Arc::clone(&self.inner.slots).acquire_owned().await else {
            // The semaphore is never closed.
            self.report(&task, Outcome::Failed, 0).await;
            return;
        };
        self.inner.metrics.tasks_running.inc();
        let inner = Arc::clone(&self.inner);
        let job = task.clone();
        let mut copy =
            tokio::task::spawn_blocking(move || execute(&inner.engine, &inner.registrar, &job));
        let (outcome, bytes) = match tokio::time::timeout(self.inner.timeout, &mut copy).await {
            Ok(joined) => self.outcome_of(&task, joined),
            Err(_) => {
                // The copy is bounded by the transfer engine's own timeouts; wait for it before
                // reporting, so no byte lands in the target after the master reuses it.
                tracing::warn!(task = task.id, kind = task.kind.as_str(),
                    timeout = ?self.inner.timeout, "task timed out");
                let _ = copy.await;
                (Outcome::Timeout, 0)
            }
        };
        self.inner.metrics.tasks_running.dec();
        self.report(&task, outcome, bytes).await;
    }

    fn outcome_of(
        &self,
        task: &Task,
        joined: Result<Result<u64, TaskError>, tokio::task::JoinError>,
    ) -> (Outcome, u64) {
        let failed = match joined {
            Ok(Ok(bytes)) => return (Outcome::Ok, bytes),
            Ok(Err(e)) => e,
            Err(e) => TaskError::Join(e.to_string()),
        };
        tracing::warn!(task = task.id, kind = task.kind.as_str(), error = %chain(&failed),
            category = failed.category(),
            "task failed");
        (Outcome::Failed, 0)
    }

    async fn report(&self, task: &Task, outcome: Outcome, bytes: u64) {
        let kind = task.kind.as_str();
        let ok = outcome == Outcome::Ok;
        match self
            .inner
            .master
            .complete_task(self.inner.registrar.node(), task.id, ok)
            .await
        {
            Ok(()) => tracing::info!(task = task.id, kind, outcome = outcome.as_str(),
                key = %task.key.to_hex(), bytes, "task reported"),
            // The master expires the task by itself; a success it never hears of becomes a
            // failure there, which is safe (it frees the target and schedules again).
            Err(e) => tracing::warn!(task = task.id, kind, error = %chain(&e),
                "reporting a task to the master failed"),
        }
        let m = &self.inner.metrics;
        m.tasks.with_label_values(&[kind, outcome.as_str()]).inc();
        if ok {
            m.task_bytes.with_label_values(&[kind]).inc_by(bytes);
        }
        self.inner.queued.fetch_sub(1, Ordering::SeqCst);
        self.inner.active.lock().remove(&task.id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_fixtures::{KEY, engine, memory};
    use super::*;
    use kvpool_client::pool::{tcp_endpoint, transfer_name};
    use kvpool_core::master::{ObjectKey, ReplicaInfo, Tier};

    fn replica(node: &str, segment: &str, tier: Tier, offset: u64, len: u64) -> ReplicaInfo {
        ReplicaInfo {
            node: node.into(),
            segment_id: 1,
            segment: segment.into(),
            tier,
            numa_node: 0,
            endpoints: vec!["tcp://127.0.0.1:1".into()],
            offset,
            length: len,
        }
    }

    fn task(kind: TaskKind, source: ReplicaInfo, target: ReplicaInfo) -> Task {
        Task {
            id: 9,
            kind,
            key: ObjectKey::from_bytes(b"k"),
            source,
            target,
        }
    }

    /// A demotion on node "a" of `len` bytes at `from` of `dram0` to `to` of the SSD segment
    /// `ssd`.
    fn demotion(from: u64, ssd: &str, to: u64, len: u64) -> Task {
        task(
            TaskKind::Demote,
            replica("a", "dram0", Tier::Dram, from, len),
            replica("a", ssd, Tier::Ssd, to, len),
        )
    }

    fn registrar(node: &str, engine: &TransferEngine) -> PoolRegistrar {
        let r = PoolRegistrar::new(engine.clone(), node.into(), "tcp://127.0.0.1:1".into());
        r.register("dram0", Tier::Dram, 0, memory(1 << 16))
            .expect("dram0");
        r.register("ssd0", Tier::Ssd, 0, memory(1 << 16))
            .expect("ssd0");
        r
    }

    /// Write `bytes` at `offset` of `r`'s segment `name`.
    fn seed(r: &PoolRegistrar, name: &str, offset: u64, bytes: &[u8]) {
        let local = r.local(name).expect("registered");
        local.segment().write_at(offset, bytes).expect("seed");
    }

    /// `len` bytes at `offset` of `r`'s segment `name`.
    fn read_back(r: &PoolRegistrar, name: &str, offset: u64, len: usize) -> Vec<u8> {
        let mut got = vec![0u8; len];
        let local = r.local(name).expect("registered");
        local.segment().read_at(offset, &mut got).expect("read");
        got
    }

    fn dead_master() -> MasterClient {
        MasterClient::new(
            vec!["127.0.0.1:1".into()],
            kvpool_proto::auth::AuthKey::from_bytes(KEY).expect("key"),
            kvpool_client::master::ClientConfig {
                connect_timeout: Duration::from_millis(200),
                request_timeout: Duration::from_millis(200),
                failover_budget: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .expect("client")
    }

    fn count(m: &PoolMetrics, kind: &str, outcome: &str) -> u64 {
        m.tasks.with_label_values(&[kind, outcome]).get()
    }

    // A current-thread runtime: spawned tasks only start once the test yields, so the queue
    // bound is hit deterministically by one `submit`.
    #[tokio::test]
    async fn the_runner_bounds_its_queue_skips_duplicates_and_counts_outcomes() {
        let e = engine("a");
        let r = Arc::new(registrar("a", &e));
        let metrics = PoolMetrics::new(&prometheus::Registry::new()).expect("metrics");
        // One slot, so at most 16 tasks wait; the master is unreachable (reports only log).
        let runner = TaskRunner::new(
            e.clone(),
            Arc::clone(&r),
            dead_master(),
            1,
            Duration::from_secs(30),
            metrics.clone(),
        );
        let demote = |id: u64| Task {
            id,
            ..demotion(id * 4096, "ssd0", id * 4096, 4096)
        };
        let mut batch: Vec<Task> = (0..16).map(demote).collect();
        batch.push(demote(0)); // a duplicate of a task already accepted
        batch.extend((16..20).map(demote));
        runner.submit(batch);
        let started = std::time::Instant::now();
        while count(&metrics, "demote", "ok") + count(&metrics, "demote", "rejected") < 20 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "tasks never finished"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(count(&metrics, "demote", "ok"), 16);
        assert_eq!(
            count(&metrics, "demote", "rejected"),
            4,
            "beyond the queue bound"
        );
        assert_eq!(
            metrics.task_bytes.with_label_values(&["demote"]).get(),
            16 * 4096
        );
        assert_eq!(metrics.tasks_running.get(), 0);

        // A repair whose source node is gone fails, and is counted as such.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut source = replica("b", "dram0", Tier::Dram, 0, 4096);
        source.endpoints = vec![tcp_endpoint(dead.local_addr().expect("addr"))];
        drop(dead);
        runner.submit(vec![Task {
            id: 99,
            ..task(
                TaskKind::Repair,
                source,
                replica("a", "dram0", Tier::Dram, 0, 4096),
            )
        }]);
        while count(&metrics, "repair", "failed") == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "repair never failed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(count(&metrics, "repair", "ok"), 0);
    }

    #[test]
    fn tasks_meant_for_another_node_or_inconsistent_are_refused() {
        let here = replica("a", "dram0", Tier::Dram, 0, 10);
        let there = replica("b", "dram0", Tier::Dram, 0, 10);
        let c = |t: &Task| check(t, "a").map_err(|e| e.category());
        assert_eq!(
            c(&task(TaskKind::Repair, there.clone(), here.clone())),
            Ok(())
        );
        assert_eq!(
            c(&task(TaskKind::Repair, here.clone(), there.clone())),
            Err("wrong_node")
        );
        let mut short = here.clone();
        short.length = 9;
        assert_eq!(
            c(&task(TaskKind::Repair, there.clone(), short)),
            Err("length")
        );
        assert_eq!(
            c(&task(TaskKind::Demote, there, here.clone())),
            Err("remote_demotion")
        );
        let ssd = replica("a", "ssd0", Tier::Ssd, 4096, 10);
        assert_eq!(c(&task(TaskKind::Demote, here, ssd)), Ok(()));
    }

    #[test]
    fn demotion_copies_between_local_segments() {
        let e = engine("a");
        let r = registrar("a", &e);
        let value: Vec<u8> = (0..5000u32).map(|i| (i % 199) as u8).collect();
        let len = value.len() as u64;
        seed(&r, "dram0", 8192, &value);
        let t = demotion(8192, "ssd0", 4096, len);
        assert_eq!(execute(&e, &r, &t).expect("demote"), len);
        let got = read_back(&r, "ssd0", 4096, value.len());
        assert!(got == value);
        // A target range past the end of the segment fails, it does not wrap or truncate.
        let bad = demotion(0, "ssd0", (1 << 16) - 4096, len);
        assert_eq!(
            execute(&e, &r, &bad).expect_err("bounds").category(),
            "copy"
        );
        let unknown = demotion(0, "ssd9", 0, len);
        assert_eq!(
            execute(&e, &r, &unknown).expect_err("unknown").category(),
            "unknown_segment"
        );
    }

    #[test]
    fn a_demotion_into_ssd0_is_recorded_in_the_index_with_its_checksum() {
        let e = engine("a");
        let r = registrar("a", &e);
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("pool-ssd.dat");
        let (index, _) =
            crate::ssd::pool::PoolSsdIndex::open(dir.path(), &data, 1 << 16).expect("index");
        // Without an index nothing is recorded (and nothing fails).
        let value: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let len = value.len() as u64;
        seed(&r, "dram0", 0, &value);
        let t = demotion(0, "ssd0", 8192, len);
        assert_eq!(execute(&e, &r, &t).expect("demote"), len);
        r.set_ssd_index(index);
        let shared = r.ssd_index().expect("index set");
        assert!(shared.lock().is_empty());
        assert_eq!(execute(&e, &r, &t).expect("demote"), len);
        let blocks = shared.lock().blocks();
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].key, ObjectKey::from_bytes(b"k"));
        assert_eq!((blocks[0].offset, blocks[0].length), (8192, len));
        assert_eq!(blocks[0].crc, crc32c::crc32c(&value));
        // A copy into DRAM is not indexed.
        let into_dram = task(
            TaskKind::Repair,
            replica("a", "ssd0", Tier::Ssd, 8192, len),
            replica("a", "dram0", Tier::Dram, 16384, len),
        );
        assert_eq!(execute(&e, &r, &into_dram).expect("copy"), len);
        assert_eq!(shared.lock().len(), 1);
    }

    #[test]
    fn repair_reads_the_source_over_tcp_into_the_target() {
        // Node "b" holds the surviving replica and serves it on loopback.
        let eb = engine("b");
        let seg_b = eb
            .register(&transfer_name("b", "dram0"), Arc::new(memory(1 << 16)))
            .expect("register b");
        let server = eb
            .listen_tcp("127.0.0.1:0".parse().expect("addr"))
            .expect("listen");
        let value: Vec<u8> = (0..30_000u32).map(|i| (i * 7 % 253) as u8).collect();
        let len = value.len() as u64;
        seg_b.segment().write_at(4096, &value).expect("seed");
        let mut source = replica("b", "dram0", Tier::Dram, 4096, len);
        source.endpoints = vec![tcp_endpoint(server.local_addr())];

        let ea = engine("a");
        let ra = registrar("a", &ea);
        let t = task(
            TaskKind::Repair,
            source.clone(),
            replica("a", "dram0", Tier::Dram, 12_288, len),
        );
        assert_eq!(execute(&ea, &ra, &t).expect("repair"), len);
        let got = read_back(&ra, "dram0", 12_288, value.len());
        assert!(got == value, "the repaired copy is byte-exact");

        // The source node is gone: the task fails with the transport's error.
        drop(server);
        let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        source.endpoints = vec![tcp_endpoint(dead.local_addr().expect("addr"))];
        drop(dead);
        let t = task(
            TaskKind::Repair,
            source,
            replica("a", "dram0", Tier::Dram, 0, len),
        );
        assert_eq!(execute(&ea, &ra, &t).expect_err("dead").category(), "open");
    }
}
