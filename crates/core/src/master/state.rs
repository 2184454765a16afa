//! The master's metadata core: segment registry, allocation, object index, put state machine,
//! read leases, pins, heartbeats and agent death, repair and demotion tasks, and eviction at
//! watermarks. Pure: no I/O, time comes from the injected [`Clock`]; the gRPC service and the
//! HA layer wrap it.
//!
//! Memory layout (the budget is 200 bytes of RSS per object): objects live in a dense slab of
//! 56-byte entries addressed by `u32` slots; the index is a `hashbrown::HashTable<u32>` (4 bytes
//! per bucket) keyed by the 128-bit key digest stored in the entry; replicas are `(segment id,
//! page)` pairs, two inline; per-tier eviction policies keep 8 bytes per slot. Leases, soft pins,
//! pending puts and tasks are rare and live in side maps.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use hashbrown::HashTable;
use smallvec::SmallVec;

use super::alloc::{ExtentAllocator, PAGE_BYTES, pages_for};
use super::clock::Clock;
use super::policy::{Policy, PolicyKind};
use super::types::{
    AdoptItem, GetResult, Lease, ObjectKey, PutOptions, PutStarted, ReplicaInfo, SegmentSpec,
    Spread, Task, TaskKind, Tier, Watermarks,
};

/// Tunables of the metadata core.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// An agent silent for longer is declared dead and its replicas dropped.
    pub heartbeat_timeout_ms: u64,
    /// A put not ended within this time is revoked.
    pub put_timeout_ms: u64,
    /// Lifetime of a read lease.
    pub lease_ttl_ms: u64,
    /// A repair or demotion not completed within this time is abandoned.
    pub task_timeout_ms: u64,
    pub policy: PolicyKind,
    /// Per tier, indexed by [`Tier::index`].
    pub watermarks: [Watermarks; 2],
    pub max_replicas: u8,
    /// Repair tasks scheduled per tick at most.
    pub repairs_per_tick: usize,
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout_ms: 10_000,
            put_timeout_ms: 30_000,
            lease_ttl_ms: 5_000,
            task_timeout_ms: 60_000,
            policy: PolicyKind::Lru,
            watermarks: [Watermarks::default(); 2],
            max_replicas: 8,
            repairs_per_tick: 256,
        }
    }
}

/// Errors of the metadata core. Each one leaves the state unchanged.
#[derive(Debug, thiserror::Error, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum MasterError {
    #[error("unknown key {0}")]
    UnknownKey(String),
    #[error("key {0} is being written by another put")]
    PutInProgress(String),
    #[error("key {key} is committed with {existing} bytes; the put asked for {requested}")]
    SizeConflict {
        key: String,
        existing: u64,
        requested: u64,
    },
    #[error("value of {size} bytes is larger than any mounted segment ({largest} bytes)")]
    TooLarge { size: u64, largest: u64 },
    #[error("no space for {size} bytes in any allowed tier, even after eviction")]
    NoSpace { size: u64 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("put {put_id:#x} of key {key} is not pending (revoked, expired or never started)")]
    StalePut { key: String, put_id: u64 },
    #[error("lease {0:#x} is unknown, released or expired")]
    StaleLease(u64),
    #[error("key {key} has {leases} active read lease(s)")]
    Leased { key: String, leases: u16 },
    #[error("key {0} has too many concurrent read leases")]
    LeaseLimit(String),
    #[error("unknown or dead node {0:?}: mount its segments again")]
    UnknownNode(String),
    #[error("segment {id} is not mounted by node {node:?}")]
    UnknownSegment { node: String, id: u32 },
    #[error("task {0} is unknown, finished or expired")]
    UnknownTask(u64),
    #[error("every replica of key {0} was lost (agent died) before the put ended")]
    ReplicasLost(String),
}

impl MasterError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// One replica inside the core: a segment id and the first page of the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rep {
    seg: u32,
    page: u32,
}

const LIVE: u8 = 1;
const PENDING: u8 = 1 << 1;
const HARD_PIN: u8 = 1 << 2;
const SOFT_PIN: u8 = 1 << 3;
/// A repair or demotion task refers to this object.
const BUSY: u8 = 1 << 4;
/// Tracked by the DRAM / SSD policy.
const IN_POLICY: [u8; 2] = [1 << 5, 1 << 6];
/// Replicas go to distinct failure domains (repairs keep to it).
const SPREAD_DOMAINS: u8 = 1 << 7;

#[derive(Clone, Debug)]
struct Entry {
    key: ObjectKey,
    size: u64,
    replicas: SmallVec<[Rep; 2]>,
    generation: u32,
    leases: u16,
    desired: u8,
    flags: u8,
}

impl Entry {
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
    fn pages(&self) -> u32 {
        pages_for(self.size).unwrap_or(u32::MAX)
    }
}

#[derive(Debug)]
struct Segment {
    spec: SegmentSpec,
    node: u32,
    alloc: ExtentAllocator,
}

#[derive(Debug)]
struct NodeState {
    name: String,
    failure_domain: String,
    last_heartbeat_ms: u64,
    alive: bool,
    segments: Vec<u32>,
    outbox: VecDeque<u64>,
    /// Events of this node's SSD segments not yet acknowledged by its agent (issue 4).
    feed: VecDeque<SegmentEvent>,
    /// Sequence number of the next event.
    feed_next_seq: u64,
    /// The feed overflowed or the agent's epoch is stale: the next heartbeat sends a full
    /// snapshot (RESET, COMMIT..., RESET_DONE) instead of the lost events.
    feed_reset: bool,
}

#[derive(Clone, Copy, Debug)]
struct LeaseRec {
    slot: u32,
    generation: u32,
    expires_ms: u64,
}

#[derive(Clone, Copy, Debug)]
struct TaskRec {
    kind: TaskKind,
    slot: u32,
    generation: u32,
    source: Rep,
    target: Rep,
    node: u32,
    deadline_ms: u64,
    /// Size of the target extent (the slot may hold another object by the time the task ends).
    pages: u32,
    /// Pages taken out of the source tier's usage while the demotion runs.
    releasing_pages: u32,
    /// The object's key (the slot may hold another object by the time the task ends).
    key: ObjectKey,
}

/// Monotonic event counts, exported as Prometheus counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Per tier: replicas dropped by eviction.
    pub evicted_dropped: [u64; 2],
    /// DRAM replicas demoted to SSD.
    pub demoted: u64,
    pub demotions_failed: u64,
    pub repairs_done: u64,
    pub repairs_failed: u64,
    /// Committed objects that lost their last replica when agents died.
    pub objects_lost: u64,
    pub nodes_died: u64,
    pub leases_expired: u64,
    pub puts_expired: u64,
    /// Replicas dropped because their agent found them corrupt on read.
    pub corrupt_dropped: u64,
}

/// Point-in-time figures for metrics and `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub objects: u64,
    pub pending_puts: u64,
    pub used_bytes: [u64; 2],
    pub capacity_bytes: [u64; 2],
    pub leases: u64,
    pub soft_pins: u64,
    pub under_replicated: u64,
    pub tasks: u64,
    pub nodes_alive: u64,
    pub segments: u64,
}

/// What a [`MasterState::tick`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    pub dead_nodes: Vec<String>,
    pub objects_lost: u64,
    pub repairs_scheduled: u64,
    pub evicted: u64,
}

/// A committed object as persisted by the HA layer.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ObjectRecord {
    pub key: ObjectKey,
    pub size: u64,
    pub desired: u8,
    pub hard_pinned: bool,
    /// Replicas are spread over failure domains rather than nodes.
    #[serde(default)]
    pub spread_failure_domain: bool,
    /// (segment id, byte offset)
    pub replicas: Vec<(u32, u64)>,
}

/// One change to persist (HA write-through). Produced only when the journal is enabled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalOp {
    PutSegment(u32, SegmentSpec),
    DelSegment(u32),
    PutObject(ObjectRecord),
    DelObject(ObjectKey),
    /// Space handed to a writer (pending put or task target) that no committed object owns
    /// yet: a new leader must not reuse it before the writer is done.
    Reserve {
        seg: u32,
        offset: u64,
        length: u64,
    },
    Unreserve {
        seg: u32,
        offset: u64,
    },
    /// Segment ids below this value were handed out (ids are never reused, across leaders too).
    SegmentIdsUsed(u32),
}

/// The pool's metadata. Not thread safe by itself: the service wraps it in a mutex.
#[derive(Debug)]
pub struct MasterState {
    config: MasterConfig,
    clock: Arc<dyn Clock>,
    entries: Vec<Entry>,
    free_slots: Vec<u32>,
    index: HashTable<u32>,
    live_objects: u64,
    policies: [Box<dyn Policy>; 2],
    segments: HashMap<u32, Segment>,
    next_segment: u32,
    nodes: Vec<NodeState>,
    node_ids: HashMap<String, u32>,
    used_pages: [u64; 2],
    capacity_pages: [u64; 2],
    releasing_pages: [u64; 2],
    pending: HashMap<u32, u64>,
    leases: HashMap<u64, LeaseRec>,
    lease_expiry: BTreeSet<(u64, u64)>,
    next_lease: u64,
    soft_pins: HashMap<u32, u64>,
    under: HashSet<u32>,
    tasks: HashMap<u64, TaskRec>,
    next_task: u64,
    counters: Counters,
    journal: Option<Vec<JournalOp>>,
    /// Restored reservations: (segment, page, pages, release time).
    quarantine: Vec<(u32, u32, u32, u64)>,
    /// No eviction before this time (readers' leases died with the previous leader).
    evict_not_before_ms: u64,
    /// Slots below this were filled by `restore` (objects whose leases a previous leader may
    /// have granted); reused slots are included, which only errs on the safe side.
    restored_slots: u32,
    /// Transfer engine: the last transport state each node reported with its heartbeat. Soft
    /// state: not journaled, refilled by the next heartbeats after a failover.
    transport: HashMap<String, TransportState>,
    /// Identifies this instance's segment-event feed; a new leader has another one, so agents
    /// that applied events of the old one resynchronise.
    feed_epoch: u64,
}

/// Victims one put may evict to make room before it gives up with `NO_SPACE`.
const MAX_EVICTIONS_PER_PUT: usize = 4096;

/// Placement preference, compared lexicographically: on the writer's node, on its NUMA node,
/// free bytes, then the lower segment id (determinism).
type PlacementScore = (bool, bool, u64, std::cmp::Reverse<u32>);

fn put_id(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(slot)
}

impl MasterState {
    pub fn new(config: MasterConfig, clock: Arc<dyn Clock>) -> Self {
        let policies = [config.policy.build(), config.policy.build()];
        Self {
            config,
            clock,
            entries: Vec::new(),
            free_slots: Vec::new(),
            index: HashTable::new(),
            live_objects: 0,
            policies,
            segments: HashMap::new(),
            next_segment: 1,
            nodes: Vec::new(),
            node_ids: HashMap::new(),
            used_pages: [0; 2],
            capacity_pages: [0; 2],
            releasing_pages: [0; 2],
            pending: HashMap::new(),
            leases: HashMap::new(),
            lease_expiry: BTreeSet::new(),
            next_lease: 1,
            soft_pins: HashMap::new(),
            under: HashSet::new(),
            tasks: HashMap::new(),
            next_task: 1,
            counters: Counters::default(),
            journal: None,
            quarantine: Vec::new(),
            evict_not_before_ms: 0,
            restored_slots: 0,
            transport: HashMap::new(),
            feed_epoch: rand::random::<u64>() | 1,
        }
    }

    /// An empty state with the same configuration and clock (a new leader's starting point).
    pub fn fresh(&self) -> Self {
        Self::new(self.config.clone(), self.clock.clone())
    }

    /// Record changes for persistence from now on; drain them with [`Self::take_journal`].
    pub fn enable_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// Changes since the last call (empty when the journal is disabled).
    pub fn take_journal(&mut self) -> Vec<JournalOp> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn log(&mut self, op: JournalOp) {
        if let Some(j) = self.journal.as_mut() {
            j.push(op);
        }
    }

    fn log_object(&mut self, slot: u32) {
        if self.journal.is_none() {
            return;
        }
        let Some(e) = self.entries.get(slot as usize) else {
            return;
        };
        if !e.has(LIVE) || e.has(PENDING) {
            return;
        }
        let key = e.key;
        if let Some(rec) = self.object_record(&key) {
            self.log(JournalOp::PutObject(rec));
        }
    }

    fn log_reserve(&mut self, r: Rep, pages: u32) {
        self.log(JournalOp::Reserve {
            seg: r.seg,
            offset: u64::from(r.page) * PAGE_BYTES,
            length: u64::from(pages) * PAGE_BYTES,
        });
    }

    fn log_unreserve(&mut self, r: Rep) {
        self.log(JournalOp::Unreserve {
            seg: r.seg,
            offset: u64::from(r.page) * PAGE_BYTES,
        });
    }

    /// The injected clock's current time.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Reserve room for `n` objects up front (benchmarks; avoids rehash spikes).
    pub fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
        let entries = &self.entries;
        self.index
            .reserve(n, |s| entries.get(*s as usize).map_or(0, |e| e.key.lo));
    }

    pub fn stats(&self) -> Stats {
        Stats {
            objects: self.live_objects - self.pending.len() as u64,
            pending_puts: self.pending.len() as u64,
            used_bytes: self.used_pages.map(|p| p * PAGE_BYTES),
            capacity_bytes: self.capacity_pages.map(|p| p * PAGE_BYTES),
            leases: self.leases.len() as u64,
            soft_pins: self.soft_pins.len() as u64,
            under_replicated: self.under.len() as u64,
            tasks: self.tasks.len() as u64,
            nodes_alive: self.nodes.iter().filter(|n| n.alive).count() as u64,
            segments: self.segments.len() as u64,
        }
    }

    // ----- segments and nodes -------------------------------------------------------------

    /// Mount a segment. Mounting a name the node already has replaces the old segment (the
    /// agent restarted: its memory is new), dropping the replicas that lived there.
    pub fn mount(&mut self, spec: SegmentSpec) -> Result<u32, MasterError> {
        if spec.node.is_empty() || spec.name.is_empty() {
            return Err(MasterError::InvalidArgument(
                "segment node and name must not be empty".into(),
            ));
        }
        if spec.capacity_bytes < PAGE_BYTES {
            return Err(MasterError::InvalidArgument(format!(
                "segment {}/{} capacity {} is below one page ({PAGE_BYTES} bytes)",
                spec.node, spec.name, spec.capacity_bytes
            )));
        }
        let now = self.clock.now_ms();
        let node = match self.node_ids.get(&spec.node) {
            Some(n) => *n,
            None => {
                let n = u32::try_from(self.nodes.len())
                    .map_err(|_| MasterError::InvalidArgument("too many nodes".into()))?;
                self.nodes.push(NodeState {
                    name: spec.node.clone(),
                    failure_domain: String::new(),
                    last_heartbeat_ms: now,
                    alive: true,
                    segments: Vec::new(),
                    outbox: VecDeque::new(),
                    feed: VecDeque::new(),
                    feed_next_seq: 1,
                    feed_reset: false,
                });
                self.node_ids.insert(spec.node.clone(), n);
                n
            }
        };
        let old = self.nodes[node as usize]
            .segments
            .iter()
            .copied()
            .find(|s| {
                self.segments
                    .get(s)
                    .is_some_and(|seg| seg.spec.name == spec.name)
            });
        if let Some(old) = old {
            self.remove_segment(old);
        }
        let id = self.next_segment;
        self.next_segment += 1;
        self.log(JournalOp::SegmentIdsUsed(self.next_segment));
        let alloc = ExtentAllocator::new(spec.capacity_bytes);
        let t = spec.tier.index();
        self.capacity_pages[t] += alloc.capacity_bytes() / PAGE_BYTES;
        let ns = &mut self.nodes[node as usize];
        ns.alive = true;
        ns.last_heartbeat_ms = now;
        ns.failure_domain = spec.failure_domain.clone();
        ns.segments.push(id);
        self.log(JournalOp::PutSegment(id, spec.clone()));
        self.segments.insert(id, Segment { spec, node, alloc });
        Ok(id)
    }

    /// Unmount one segment of `node`; its replicas are dropped as if the node had died.
    pub fn unmount(&mut self, node: &str, segment: u32) -> Result<(), MasterError> {
        let owned = self
            .node_ids
            .get(node)
            .zip(self.segments.get(&segment))
            .is_some_and(|(n, s)| s.node == *n);
        if !owned {
            return Err(MasterError::UnknownSegment {
                node: node.to_owned(),
                id: segment,
            });
        }
        self.remove_segment(segment);
        Ok(())
    }

    /// Adopt replicas that `node` found in its segment `segment` after a restart (the
    /// persistent SSD tier): each item becomes a committed replica there. A key the master
    /// already knows gets an extra replica when the sizes match; an unknown key becomes an
    /// object with this one replica. The item's pages are marked used so nothing else is
    /// allocated on them. One result per item, in order; a refused item (bad bounds or
    /// alignment, overlap with used space, size mismatch, a put in progress, a replica already
    /// on this segment) changes nothing. Fails as a whole only when the segment is not this
    /// node's.
    pub fn adopt(
        &mut self,
        node: &str,
        segment: u32,
        items: &[AdoptItem],
    ) -> Result<Vec<Result<(), MasterError>>, MasterError> {
        let owned = self
            .node_ids
            .get(node)
            .zip(self.segments.get(&segment))
            .is_some_and(|(n, s)| s.node == *n && self.nodes[*n as usize].alive);
        if !owned {
            return Err(MasterError::UnknownSegment {
                node: node.to_owned(),
                id: segment,
            });
        }
        Ok(items
            .iter()
            .map(|item| self.adopt_one(segment, item))
            .collect())
    }

    fn adopt_one(&mut self, seg_id: u32, item: &AdoptItem) -> Result<(), MasterError> {
        let hex = item.key.to_hex();
        let bad = |why: String| Err(MasterError::InvalidArgument(format!("adopt {hex}: {why}")));
        if item.length == 0 {
            return bad("length must be > 0".into());
        }
        if !item.offset.is_multiple_of(PAGE_BYTES) {
            return bad(format!(
                "offset {} is not aligned to {PAGE_BYTES} bytes",
                item.offset
            ));
        }
        let Some(seg) = self.segments.get(&seg_id) else {
            return Err(MasterError::UnknownSegment {
                node: String::new(),
                id: seg_id,
            });
        };
        let capacity = seg.alloc.capacity_bytes();
        let (Some(pages), Some(end)) =
            (pages_for(item.length), item.offset.checked_add(item.length))
        else {
            return bad(format!("length {} is too large", item.length));
        };
        if end > capacity {
            return bad(format!(
                "bytes {}..{end} are outside the segment ({capacity} bytes)",
                item.offset
            ));
        }
        let page = u32::try_from(item.offset / PAGE_BYTES)
            .map_err(|_| MasterError::InvalidArgument(format!("adopt {hex}: offset too large")))?;
        let tier = seg.spec.tier;
        let existing = self.find(&item.key);
        if let Some(slot) = existing {
            let e = &self.entries[slot as usize];
            if e.has(PENDING) {
                return Err(MasterError::PutInProgress(hex));
            }
            if e.size != item.length {
                return Err(MasterError::SizeConflict {
                    key: hex,
                    existing: e.size,
                    requested: item.length,
                });
            }
            if e.replicas.iter().any(|r| r.seg == seg_id) {
                return bad(format!("it already has a replica on segment {seg_id}"));
            }
        }
        let claimed = self
            .segments
            .get_mut(&seg_id)
            .is_some_and(|s| s.alloc.claim(page, pages));
        if !claimed {
            return bad(format!(
                "bytes {}..{end} overlap space already in use on segment {seg_id}",
                item.offset
            ));
        }
        self.used_pages[tier.index()] += u64::from(pages);
        let rep = Rep { seg: seg_id, page };
        let slot = match existing {
            Some(slot) => {
                let e = &mut self.entries[slot as usize];
                e.replicas.push(rep);
                if e.replicas.len() >= usize::from(e.desired) {
                    self.under.remove(&slot);
                }
                slot
            }
            None => {
                let mut reps = SmallVec::new();
                reps.push(rep);
                self.new_object(item.key, item.length, 1, reps)
            }
        };
        self.sync_policy(slot);
        self.log_object(slot);
        Ok(())
    }

    /// Record a heartbeat and hand the node its queued tasks.
    pub fn heartbeat(&mut self, node: &str) -> Result<Vec<Task>, MasterError> {
        let now = self.clock.now_ms();
        let n = *self
            .node_ids
            .get(node)
            .filter(|n| self.nodes[**n as usize].alive)
            .ok_or_else(|| MasterError::UnknownNode(node.to_owned()))?;
        let ns = &mut self.nodes[n as usize];
        ns.last_heartbeat_ms = now;
        let ids: Vec<u64> = ns.outbox.drain(..).collect();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.task_view(id))
            .collect())
    }

    fn task_view(&self, id: u64) -> Option<Task> {
        let t = self.tasks.get(&id)?;
        let e = self.entries.get(t.slot as usize)?;
        Some(Task {
            id,
            kind: t.kind,
            key: e.key,
            source: self.replica_info(t.source, e.size)?,
            target: self.replica_info(t.target, e.size)?,
        })
    }

    fn replica_info(&self, r: Rep, size: u64) -> Option<ReplicaInfo> {
        let seg = self.segments.get(&r.seg)?;
        Some(ReplicaInfo {
            node: self.nodes.get(seg.node as usize)?.name.clone(),
            segment_id: r.seg,
            segment: seg.spec.name.clone(),
            tier: seg.spec.tier,
            numa_node: seg.spec.numa_node,
            endpoints: seg.spec.endpoints.clone(),
            offset: u64::from(r.page) * PAGE_BYTES,
            length: size,
        })
    }

    fn remove_segment(&mut self, id: u32) {
        let Some(seg) = self.segments.remove(&id) else {
            return;
        };
        let t = seg.spec.tier.index();
        self.capacity_pages[t] -= seg.alloc.capacity_bytes() / PAGE_BYTES;
        self.used_pages[t] -= seg.alloc.used_bytes() / PAGE_BYTES;
        self.log(JournalOp::DelSegment(id));
        self.quarantine.retain(|q| q.0 != id);
        if let Some(ns) = self.nodes.get_mut(seg.node as usize) {
            ns.segments.retain(|s| *s != id);
            ns.feed.retain(|e| e.segment_id != id);
        }
        // Tasks touching the segment fail; their surviving allocations are freed.
        let doomed: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.source.seg == id || t.target.seg == id)
            .map(|(k, _)| *k)
            .collect();
        for task in doomed {
            self.finish_task(task, false);
        }
        for slot in 0..self.entries.len() as u32 {
            let e = &mut self.entries[slot as usize];
            if !e.has(LIVE) || !e.replicas.iter().any(|r| r.seg == id) {
                continue;
            }
            let lost: SmallVec<[Rep; 2]> =
                e.replicas.iter().copied().filter(|r| r.seg == id).collect();
            e.replicas.retain(|r| r.seg != id);
            let (pending, empty, short) = (
                e.has(PENDING),
                e.replicas.is_empty(),
                e.replicas.len() < usize::from(e.desired),
            );
            if pending {
                // put_end will see the loss and fail or commit on the survivors.
                for r in lost {
                    self.log_unreserve(r);
                }
                continue;
            }
            if empty {
                self.counters.objects_lost += 1;
                self.drop_object(slot);
                continue;
            }
            if short {
                self.under.insert(slot);
            }
            self.sync_policy(slot);
            self.log_object(slot);
        }
    }

    fn kill_node(&mut self, n: u32) {
        let segs = std::mem::take(&mut self.nodes[n as usize].segments);
        for s in segs {
            self.remove_segment(s);
        }
        let ns = &mut self.nodes[n as usize];
        ns.alive = false;
        ns.outbox.clear();
        ns.feed.clear();
        ns.feed_reset = false;
        self.counters.nodes_died += 1;
    }

    // ----- object index -------------------------------------------------------------------

    fn find(&self, key: &ObjectKey) -> Option<u32> {
        let entries = &self.entries;
        self.index
            .find(key.lo, |s| {
                entries.get(*s as usize).is_some_and(|e| e.key == *key)
            })
            .copied()
    }

    fn new_object(
        &mut self,
        key: ObjectKey,
        size: u64,
        desired: u8,
        reps: SmallVec<[Rep; 2]>,
    ) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.entries.push(Entry {
                    key,
                    size: 0,
                    replicas: SmallVec::new(),
                    generation: 0,
                    leases: 0,
                    desired: 0,
                    flags: 0,
                });
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[slot as usize];
        e.key = key;
        e.size = size;
        e.replicas = reps;
        e.generation = e.generation.wrapping_add(1);
        e.leases = 0;
        e.desired = desired;
        e.flags = LIVE;
        let entries = &self.entries;
        self.index.insert_unique(key.lo, slot, |s| {
            entries.get(*s as usize).map_or(0, |e| e.key.lo)
        });
        self.live_objects += 1;
        slot
    }

    /// Free every replica of `slot` and forget the object.
    fn drop_object(&mut self, slot: u32) {
        let Some(e) = self.entries.get_mut(slot as usize) else {
            return;
        };
        if !e.has(LIVE) {
            return;
        }
        let key = e.key;
        let pages = e.pages();
        let was_pending = e.has(PENDING);
        let reps = std::mem::take(&mut e.replicas);
        e.flags = 0;
        e.leases = 0;
        e.generation = e.generation.wrapping_add(1);
        for r in reps {
            if was_pending {
                self.log_unreserve(r);
            }
            self.feed_free(r, key);
            self.free_rep(r, pages);
        }
        if !was_pending {
            self.log(JournalOp::DelObject(key));
        }
        for t in Tier::ALL {
            self.policies[t.index()].remove(slot);
        }
        if let Ok(found) = self.index.find_entry(key.lo, |s| *s == slot) {
            found.remove();
        }
        self.pending.remove(&slot);
        self.soft_pins.remove(&slot);
        self.under.remove(&slot);
        self.free_slots.push(slot);
        self.live_objects -= 1;
    }

    fn free_rep(&mut self, r: Rep, pages: u32) {
        if let Some(seg) = self.segments.get_mut(&r.seg)
            && seg.alloc.free(r.page, pages)
        {
            self.used_pages[seg.spec.tier.index()] -= u64::from(pages);
        }
    }

    fn tier_of(&self, r: Rep) -> Option<Tier> {
        self.segments.get(&r.seg).map(|s| s.spec.tier)
    }

    /// Make policy membership match the tiers the committed object has replicas in.
    fn sync_policy(&mut self, slot: u32) {
        let Some(e) = self.entries.get(slot as usize) else {
            return;
        };
        let committed = e.has(LIVE) && !e.has(PENDING);
        let key = e.key.lo;
        for t in Tier::ALL {
            let e = &self.entries[slot as usize];
            let has = committed && e.replicas.iter().any(|r| self.tier_of(*r) == Some(t));
            let tracked = e.has(IN_POLICY[t.index()]);
            if has && !tracked {
                self.policies[t.index()].insert(slot, key);
                self.entries[slot as usize].flags |= IN_POLICY[t.index()];
            } else if !has && tracked {
                self.policies[t.index()].remove(slot);
                self.entries[slot as usize].flags &= !IN_POLICY[t.index()];
            }
        }
    }

    fn committed_slot(&self, key: &ObjectKey) -> Result<u32, MasterError> {
        let slot = self
            .find(key)
            .ok_or_else(|| MasterError::UnknownKey(key.to_hex()))?;
        if self.entries[slot as usize].has(PENDING) {
            return Err(MasterError::UnknownKey(key.to_hex()));
        }
        Ok(slot)
    }

    // ----- allocation ----------------------------------------------------------------------

    /// Choose up to `count` segments of `tier` on distinct nodes (or failure domains) that can
    /// hold `pages`, preferring the writer's node, then its NUMA node, then free space.
    fn place(
        &mut self,
        pages: u32,
        count: u8,
        tier: Tier,
        opts: &PutOptions,
        existing: &[Rep],
    ) -> SmallVec<[Rep; 2]> {
        let writer = opts
            .writer_node
            .as_ref()
            .and_then(|n| self.node_ids.get(n))
            .copied();
        let mut used_nodes: Vec<u32> = Vec::new();
        let mut used_domains: Vec<String> = Vec::new();
        for r in existing {
            if let Some(s) = self.segments.get(&r.seg) {
                used_nodes.push(s.node);
                used_domains.push(self.nodes[s.node as usize].failure_domain.clone());
            }
        }
        let mut out: SmallVec<[Rep; 2]> = SmallVec::new();
        for _ in 0..count {
            let mut best: Option<(PlacementScore, u32)> = None;
            for (id, seg) in &self.segments {
                let ns = &self.nodes[seg.node as usize];
                if seg.spec.tier != tier
                    || !ns.alive
                    || seg.alloc.largest_free_pages() < pages
                    || used_nodes.contains(&seg.node)
                {
                    continue;
                }
                if opts.spread == Spread::FailureDomain
                    && !ns.failure_domain.is_empty()
                    && used_domains.contains(&ns.failure_domain)
                {
                    continue;
                }
                let on_writer = writer == Some(seg.node);
                let numa = on_writer && opts.numa_hint == Some(seg.spec.numa_node);
                let score = (
                    on_writer,
                    numa,
                    seg.alloc.free_bytes(),
                    std::cmp::Reverse(*id),
                );
                if best.as_ref().is_none_or(|(b, _)| score > *b) {
                    best = Some((score, *id));
                }
            }
            let Some((_, id)) = best else { break };
            let Some(seg) = self.segments.get_mut(&id) else {
                break;
            };
            let Some(page) = seg.alloc.allocate(pages) else {
                break;
            };
            self.used_pages[tier.index()] += u64::from(pages);
            used_nodes.push(seg.node);
            used_domains.push(self.nodes[seg.node as usize].failure_domain.clone());
            out.push(Rep { seg: id, page });
        }
        out
    }

    fn largest_segment(&self, tiers: &[Tier]) -> u64 {
        self.segments
            .values()
            .filter(|s| tiers.contains(&s.spec.tier) && self.nodes[s.node as usize].alive)
            .map(|s| s.alloc.capacity_bytes())
            .max()
            .unwrap_or(0)
    }

    // ----- puts ----------------------------------------------------------------------------

    /// Allocate replica locations for `key`; the caller writes them, then calls `put_end`.
    pub fn put_start(
        &mut self,
        key: ObjectKey,
        size: u64,
        opts: &PutOptions,
    ) -> Result<PutStarted, MasterError> {
        if size == 0 {
            return Err(MasterError::InvalidArgument(
                "value size must be > 0".into(),
            ));
        }
        if opts.replicas == 0 || opts.replicas > self.config.max_replicas {
            return Err(MasterError::InvalidArgument(format!(
                "replicas must be in 1..={}, got {}",
                self.config.max_replicas, opts.replicas
            )));
        }
        if let Some(slot) = self.find(&key) {
            let e = &self.entries[slot as usize];
            if e.has(PENDING) {
                return Err(MasterError::PutInProgress(key.to_hex()));
            }
            if e.size != size {
                return Err(MasterError::SizeConflict {
                    key: key.to_hex(),
                    existing: e.size,
                    requested: size,
                });
            }
            return Ok(PutStarted::AlreadyCommitted { size });
        }
        let tiers: &[Tier] = match opts.tier {
            Some(Tier::Dram) => &[Tier::Dram],
            Some(Tier::Ssd) => &[Tier::Ssd],
            None => &Tier::ALL,
        };
        let largest = self.largest_segment(tiers);
        let pages = pages_for(size).filter(|p| u64::from(*p) * PAGE_BYTES <= largest);
        let Some(pages) = pages else {
            return Err(if largest == 0 {
                MasterError::NoSpace { size }
            } else {
                MasterError::TooLarge { size, largest }
            });
        };
        for &tier in tiers {
            // Evict for room, one victim at a time, bounded so that one put on a fragmented
            // tier cannot empty it.
            let mut budget = MAX_EVICTIONS_PER_PUT;
            let reps = loop {
                let reps = self.place(pages, opts.replicas, tier, opts, &[]);
                if !reps.is_empty() || budget == 0 || !self.evict_one(tier) {
                    break reps;
                }
                budget -= 1;
            };
            if reps.is_empty() {
                continue;
            }
            for r in &reps {
                self.log_reserve(*r, pages);
            }
            let slot = self.new_object(key, size, opts.replicas, reps);
            if opts.spread == Spread::FailureDomain {
                self.entries[slot as usize].flags |= SPREAD_DOMAINS;
            }
            self.entries[slot as usize].flags |= PENDING;
            let deadline = self.clock.now_ms() + self.config.put_timeout_ms;
            self.pending.insert(slot, deadline);
            let e = &self.entries[slot as usize];
            let (generation, size) = (e.generation, e.size);
            let replicas = e
                .replicas
                .clone()
                .into_iter()
                .filter_map(|r| self.replica_info(r, size))
                .collect();
            self.evict_to_watermark(tier);
            return Ok(PutStarted::Allocated {
                put_id: put_id(slot, generation),
                replicas,
            });
        }
        Err(MasterError::NoSpace { size })
    }

    fn pending_slot(&self, key: &ObjectKey, id: u64) -> Result<u32, MasterError> {
        let stale = || MasterError::StalePut {
            key: key.to_hex(),
            put_id: id,
        };
        let slot = (id & 0xffff_ffff) as u32;
        let generation = (id >> 32) as u32;
        let e = self.entries.get(slot as usize).ok_or_else(stale)?;
        if !e.has(LIVE) || e.generation != generation || e.key != *key {
            return Err(stale());
        }
        Ok(slot)
    }

    /// Commit a put. Replicas lost to a dead agent since `put_start` are left out; if none is
    /// left the put fails with [`MasterError::ReplicasLost`]. Ending an already committed put
    /// again is a no-op success (retries after a lost reply).
    pub fn put_end(&mut self, key: ObjectKey, id: u64) -> Result<(), MasterError> {
        let slot = self.pending_slot(&key, id)?;
        let e = &mut self.entries[slot as usize];
        if !e.has(PENDING) {
            return Ok(());
        }
        if e.replicas.is_empty() {
            self.drop_object(slot);
            return Err(MasterError::ReplicasLost(key.to_hex()));
        }
        e.flags &= !PENDING;
        if e.replicas.len() < usize::from(e.desired) {
            self.under.insert(slot);
        }
        let reps = e.replicas.clone();
        let size = e.size;
        self.pending.remove(&slot);
        self.sync_policy(slot);
        for r in reps {
            self.log_unreserve(r);
            self.feed_commit(r, key, size);
        }
        self.log_object(slot);
        Ok(())
    }

    /// Abandon a pending put and free its space.
    pub fn put_revoke(&mut self, key: ObjectKey, id: u64) -> Result<(), MasterError> {
        let slot = self.pending_slot(&key, id)?;
        if !self.entries[slot as usize].has(PENDING) {
            return Err(MasterError::StalePut {
                key: key.to_hex(),
                put_id: id,
            });
        }
        self.drop_object(slot);
        Ok(())
    }

    // ----- reads ---------------------------------------------------------------------------

    /// Replica locations of a committed object, with a read lease.
    pub fn get(&mut self, key: ObjectKey) -> Result<GetResult, MasterError> {
        let slot = self.committed_slot(&key)?;
        let now = self.clock.now_ms();
        let e = &mut self.entries[slot as usize];
        if e.leases == u16::MAX {
            return Err(MasterError::LeaseLimit(key.to_hex()));
        }
        e.leases += 1;
        let (generation, size) = (e.generation, e.size);
        let reps = e.replicas.clone();
        let id = self.next_lease;
        self.next_lease += 1;
        let expires_ms = now + self.config.lease_ttl_ms;
        self.leases.insert(
            id,
            LeaseRec {
                slot,
                generation,
                expires_ms,
            },
        );
        self.lease_expiry.insert((expires_ms, id));
        for t in Tier::ALL {
            self.policies[t.index()].touch(slot);
        }
        let replicas = reps
            .into_iter()
            .filter_map(|r| self.replica_info(r, size))
            .collect();
        Ok(GetResult {
            size,
            replicas,
            lease: Lease { id, expires_ms },
        })
    }

    /// End a read lease early (the reader finished).
    pub fn release_lease(&mut self, id: u64) -> Result<(), MasterError> {
        let rec = self.leases.remove(&id).ok_or(MasterError::StaleLease(id))?;
        self.lease_expiry.remove(&(rec.expires_ms, id));
        if let Some(e) = self.entries.get_mut(rec.slot as usize)
            && e.has(LIVE)
            && e.generation == rec.generation
        {
            e.leases = e.leases.saturating_sub(1);
        }
        Ok(())
    }

    /// Whether each key is committed.
    pub fn exists(&self, keys: &[ObjectKey]) -> Vec<bool> {
        keys.iter().map(|k| self.is_committed(k)).collect()
    }

    fn is_committed(&self, k: &ObjectKey) -> bool {
        self.find(k)
            .is_some_and(|s| !self.entries[s as usize].has(PENDING))
    }

    /// Number of leading keys that are committed (the cached prefix of a block chain).
    pub fn longest_prefix(&self, keys: &[ObjectKey]) -> usize {
        keys.iter().take_while(|k| self.is_committed(k)).count()
    }

    /// Remove a committed object. Refused while readers hold leases on it.
    pub fn remove(&mut self, key: ObjectKey) -> Result<(), MasterError> {
        let slot = self
            .find(&key)
            .ok_or_else(|| MasterError::UnknownKey(key.to_hex()))?;
        let e = &self.entries[slot as usize];
        if e.has(PENDING) {
            return Err(MasterError::PutInProgress(key.to_hex()));
        }
        // Right after a failover the readers' leases on restored objects are unknown here:
        // until they have expired, a remove could free memory under one of them.
        let restored_grace =
            slot < self.restored_slots && self.clock.now_ms() < self.evict_not_before_ms;
        if e.leases > 0 || restored_grace {
            return Err(MasterError::Leased {
                key: key.to_hex(),
                leases: e.leases,
            });
        }
        self.drop_object(slot);
        Ok(())
    }

    /// Pin an object: hard pins are never evicted; soft pins (`ttl_ms`) are evicted last.
    pub fn pin(&mut self, key: ObjectKey, hard: bool, ttl_ms: u64) -> Result<(), MasterError> {
        let slot = self.committed_slot(&key)?;
        if hard {
            self.entries[slot as usize].flags |= HARD_PIN;
            self.log_object(slot);
        } else {
            if ttl_ms == 0 {
                return Err(MasterError::InvalidArgument(
                    "a soft pin needs a TTL > 0".into(),
                ));
            }
            self.entries[slot as usize].flags |= SOFT_PIN;
            let until = self.clock.now_ms() + ttl_ms;
            self.soft_pins.insert(slot, until);
        }
        Ok(())
    }

    /// Drop both kinds of pin.
    pub fn unpin(&mut self, key: ObjectKey) -> Result<(), MasterError> {
        let slot = self.committed_slot(&key)?;
        let was_hard = self.entries[slot as usize].has(HARD_PIN);
        self.entries[slot as usize].flags &= !(HARD_PIN | SOFT_PIN);
        self.soft_pins.remove(&slot);
        if was_hard {
            self.log_object(slot);
        }
        Ok(())
    }

    /// Replica count and tiers of a committed object (for status and tests).
    pub fn replica_tiers(&self, key: &ObjectKey) -> Option<Vec<Tier>> {
        let slot = self.find(key)?;
        let e = &self.entries[slot as usize];
        Some(e.replicas.iter().filter_map(|r| self.tier_of(*r)).collect())
    }

    // ----- eviction ------------------------------------------------------------------------

    fn tier_over(&self, tier: Tier, fraction: f64) -> bool {
        let t = tier.index();
        let cap = self.capacity_pages[t];
        let used = self.used_pages[t].saturating_sub(self.releasing_pages[t]);
        cap > 0 && used as f64 > fraction * cap as f64
    }

    fn evict_to_watermark(&mut self, tier: Tier) -> u64 {
        let wm = self.config.watermarks[tier.index()];
        if !self.tier_over(tier, wm.high) {
            return 0;
        }
        let mut n = 0;
        while self.tier_over(tier, wm.low) && self.evict_one(tier) {
            n += 1;
        }
        n
    }

    /// Evict one object's replicas from `tier`: never leased, hard-pinned, pending or busy
    /// objects; soft-pinned ones only when nothing else can go. Returns false when nothing
    /// could be evicted.
    fn evict_one(&mut self, tier: Tier) -> bool {
        if self.clock.now_ms() < self.evict_not_before_ms {
            return false;
        }
        let t = tier.index();
        let entries = &self.entries;
        let mut victim = None;
        for allow_soft in [false, true] {
            let blocked = HARD_PIN | PENDING | BUSY | if allow_soft { 0 } else { SOFT_PIN };
            victim = self.policies[t].evict(&mut |s| {
                entries
                    .get(s as usize)
                    .is_some_and(|e| e.has(LIVE) && e.leases == 0 && e.flags & blocked == 0)
            });
            if victim.is_some() {
                break;
            }
        }
        let Some(slot) = victim else {
            return false;
        };
        self.entries[slot as usize].flags &= !IN_POLICY[t];
        let e = &self.entries[slot as usize];
        let pages = e.pages();
        let in_tier: Vec<Rep> = e
            .replicas
            .iter()
            .copied()
            .filter(|r| self.tier_of(*r) == Some(tier))
            .collect();
        let mut demoting = false;
        for r in in_tier {
            if tier == Tier::Dram && !demoting && self.start_demotion(slot, r, pages) {
                demoting = true;
                continue;
            }
            self.entries[slot as usize].replicas.retain(|x| *x != r);
            let key = self.entries[slot as usize].key;
            self.feed_free(r, key);
            self.free_rep(r, pages);
            self.counters.evicted_dropped[t] += 1;
        }
        if self.entries[slot as usize].replicas.is_empty() {
            self.drop_object(slot);
        } else {
            self.sync_policy(slot);
            self.log_object(slot);
        }
        true
    }

    /// Demote `source` (a DRAM replica) to an SSD segment of the same node, if there is room.
    fn start_demotion(&mut self, slot: u32, source: Rep, pages: u32) -> bool {
        let Some(node) = self.segments.get(&source.seg).map(|s| s.node) else {
            return false;
        };
        let target = self
            .nodes
            .get(node as usize)
            .map(|n| n.segments.clone())
            .unwrap_or_default()
            .into_iter()
            .find_map(|sid| {
                let seg = self.segments.get_mut(&sid)?;
                if seg.spec.tier != Tier::Ssd {
                    return None;
                }
                seg.alloc.allocate(pages).map(|page| Rep { seg: sid, page })
            });
        let Some(target) = target else { return false };
        self.log_reserve(target, pages);
        self.used_pages[Tier::Ssd.index()] += u64::from(pages);
        self.releasing_pages[Tier::Dram.index()] += u64::from(pages);
        let generation = self.entries[slot as usize].generation;
        self.entries[slot as usize].flags |= BUSY;
        self.add_task(TaskRec {
            kind: TaskKind::Demote,
            slot,
            generation,
            source,
            target,
            node,
            deadline_ms: self.clock.now_ms() + self.config.task_timeout_ms,
            pages,
            releasing_pages: pages,
            key: self.entries[slot as usize].key,
        });
        true
    }

    fn add_task(&mut self, rec: TaskRec) {
        let id = self.next_task;
        self.next_task += 1;
        if let Some(n) = self.nodes.get_mut(rec.node as usize) {
            n.outbox.push_back(id);
        }
        self.tasks.insert(id, rec);
    }

    // ----- tasks ---------------------------------------------------------------------------

    /// An agent reports a task done (`ok`) or failed.
    pub fn complete_task(&mut self, node: &str, id: u64, ok: bool) -> Result<(), MasterError> {
        let n = self.node_ids.get(node).copied();
        if self.tasks.get(&id).map(|t| t.node) != n || n.is_none() {
            return Err(MasterError::UnknownTask(id));
        }
        self.finish_task(id, ok);
        Ok(())
    }

    fn finish_task(&mut self, id: u64, ok: bool) {
        let Some(t) = self.tasks.remove(&id) else {
            return;
        };
        let src_tier = self.tier_of(t.source);
        if t.kind == TaskKind::Demote {
            self.releasing_pages[Tier::Dram.index()] -= u64::from(t.releasing_pages);
        }
        let target_alive = self.segments.contains_key(&t.target.seg);
        self.log_unreserve(t.target);
        let object_ok = self
            .entries
            .get(t.slot as usize)
            .is_some_and(|e| e.has(LIVE) && e.generation == t.generation);
        if !object_ok {
            if target_alive {
                self.feed_free(t.target, t.key);
                self.free_rep(t.target, t.pages);
            }
            return;
        }
        let slot = t.slot;
        let pages = t.pages;
        self.entries[slot as usize].flags &= !BUSY;
        let success = ok && target_alive;
        if !success && target_alive {
            self.feed_free(t.target, t.key);
            self.free_rep(t.target, pages);
        }
        if success {
            let size = self.entries[slot as usize].size;
            self.feed_commit(t.target, t.key, size);
        }
        match t.kind {
            TaskKind::Repair => {
                if success {
                    self.entries[slot as usize].replicas.push(t.target);
                    self.counters.repairs_done += 1;
                } else {
                    self.counters.repairs_failed += 1;
                }
                let e = &self.entries[slot as usize];
                if e.replicas.len() < usize::from(e.desired) {
                    self.under.insert(slot);
                } else {
                    self.under.remove(&slot);
                }
            }
            TaskKind::Demote => {
                if success {
                    self.entries[slot as usize].replicas.push(t.target);
                    self.counters.demoted += 1;
                } else {
                    self.counters.demotions_failed += 1;
                }
                // The DRAM copy was chosen for eviction; free it unless a reader now holds a
                // lease on the object (then it stays and is evicted again later).
                let e = &self.entries[slot as usize];
                let src_present = e.replicas.contains(&t.source);
                if src_present && e.leases == 0 && src_tier == Some(Tier::Dram) {
                    self.entries[slot as usize]
                        .replicas
                        .retain(|r| *r != t.source);
                    self.free_rep(t.source, pages);
                    if !success {
                        self.counters.evicted_dropped[Tier::Dram.index()] += 1;
                    }
                }
            }
        }
        if self.entries[slot as usize].replicas.is_empty() {
            self.drop_object(slot);
        } else {
            self.sync_policy(slot);
            self.log_object(slot);
        }
    }

    fn schedule_repairs(&mut self) -> u64 {
        let mut scheduled = 0;
        let candidates: Vec<u32> = self
            .under
            .iter()
            .copied()
            .take(self.config.repairs_per_tick)
            .collect();
        for slot in candidates {
            let e = &self.entries[slot as usize];
            if !e.has(LIVE) || e.has(PENDING) || e.replicas.len() >= usize::from(e.desired) {
                self.under.remove(&slot);
                continue;
            }
            if e.has(BUSY) {
                continue;
            }
            let Some(&source) = e.replicas.first() else {
                continue;
            };
            let existing: SmallVec<[Rep; 2]> = e.replicas.clone();
            let (pages, generation) = (e.pages(), e.generation);
            let Some(tier) = self.tier_of(source) else {
                continue;
            };
            let opts = PutOptions {
                spread: if self.entries[slot as usize].has(SPREAD_DOMAINS) {
                    Spread::FailureDomain
                } else {
                    Spread::Node
                },
                ..PutOptions::default()
            };
            let mut target = self.place(pages, 1, tier, &opts, &existing);
            if target.is_empty() && tier == Tier::Dram {
                target = self.place(pages, 1, Tier::Ssd, &opts, &existing);
            }
            let Some(&target) = target.first() else {
                continue;
            };
            let Some(node) = self.segments.get(&target.seg).map(|s| s.node) else {
                continue;
            };
            self.log_reserve(target, pages);
            self.entries[slot as usize].flags |= BUSY;
            self.add_task(TaskRec {
                kind: TaskKind::Repair,
                slot,
                generation,
                source,
                target,
                node,
                deadline_ms: self.clock.now_ms() + self.config.task_timeout_ms,
                pages,
                releasing_pages: 0,
                key: self.entries[slot as usize].key,
            });
            scheduled += 1;
        }
        scheduled
    }

    // ----- time ----------------------------------------------------------------------------

    /// Expire leases, soft pins, pending puts and tasks; declare silent agents dead; schedule
    /// repairs; evict tiers above their high watermark. Call periodically.
    pub fn tick(&mut self) -> TickReport {
        let now = self.clock.now_ms();
        let mut report = TickReport::default();
        while let Some(&(exp, id)) = self.lease_expiry.first() {
            if exp > now {
                break;
            }
            if self.release_lease(id).is_ok() {
                self.counters.leases_expired += 1;
            }
        }
        let expired_pins: Vec<u32> = self
            .soft_pins
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(s, _)| *s)
            .collect();
        for s in expired_pins {
            self.soft_pins.remove(&s);
            self.entries[s as usize].flags &= !SOFT_PIN;
        }
        let expired_puts: Vec<u32> = self
            .pending
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(s, _)| *s)
            .collect();
        for s in expired_puts {
            self.drop_object(s);
            self.counters.puts_expired += 1;
        }
        let expired_tasks: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.deadline_ms <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired_tasks {
            self.finish_task(id, false);
        }
        let released: Vec<(u32, u32, u32, u64)> = self
            .quarantine
            .iter()
            .copied()
            .filter(|q| q.3 <= now)
            .collect();
        self.quarantine.retain(|q| q.3 > now);
        for (seg, page, pages, _) in released {
            self.free_rep(Rep { seg, page }, pages);
            self.log_unreserve(Rep { seg, page });
        }
        let lost_before = self.counters.objects_lost;
        for n in 0..self.nodes.len() as u32 {
            let ns = &self.nodes[n as usize];
            if ns.alive && ns.last_heartbeat_ms + self.config.heartbeat_timeout_ms < now {
                report.dead_nodes.push(ns.name.clone());
                self.kill_node(n);
            }
        }
        report.objects_lost = self.counters.objects_lost - lost_before;
        report.repairs_scheduled = self.schedule_repairs();
        for t in Tier::ALL {
            report.evicted += self.evict_to_watermark(t);
        }
        report
    }

    // ----- persistence (HA) ------------------------------------------------------------------

    /// Never hand out segment ids below `n` (a new leader, from the persisted high-water mark).
    pub fn reserve_segment_ids(&mut self, n: u32) {
        self.next_segment = self.next_segment.max(n);
    }

    /// Next segment id to be handed out.
    pub fn next_segment_id(&self) -> u32 {
        self.next_segment
    }

    /// Mounted segments with their ids.
    pub fn segment_records(&self) -> Vec<(u32, SegmentSpec)> {
        let mut v: Vec<_> = self
            .segments
            .iter()
            .map(|(id, s)| (*id, s.spec.clone()))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// The committed object `key`, as the HA layer persists it.
    pub fn object_record(&self, key: &ObjectKey) -> Option<ObjectRecord> {
        let slot = self.find(key)?;
        let e = &self.entries[slot as usize];
        if e.has(PENDING) {
            return None;
        }
        Some(ObjectRecord {
            key: e.key,
            size: e.size,
            desired: e.desired,
            hard_pinned: e.has(HARD_PIN),
            spread_failure_domain: e.has(SPREAD_DOMAINS),
            replicas: e
                .replicas
                .iter()
                .map(|r| (r.seg, u64::from(r.page) * PAGE_BYTES))
                .collect(),
        })
    }

    /// All committed objects.
    pub fn object_records(&self) -> Vec<ObjectRecord> {
        self.entries
            .iter()
            .filter(|e| e.has(LIVE) && !e.has(PENDING))
            .filter_map(|e| self.object_record(&e.key))
            .collect()
    }

    /// Rebuild state from persisted records (a new leader taking over). Agents count as
    /// alive from now and must heartbeat within the timeout. Records naming unknown
    /// segments or overlapping space are skipped and counted in the returned value.
    pub fn restore(
        &mut self,
        segments: Vec<(u32, SegmentSpec)>,
        objects: Vec<ObjectRecord>,
        reservations: Vec<(u32, u64, u64)>,
    ) -> usize {
        let now = self.clock.now_ms();
        self.evict_not_before_ms = now + self.config.lease_ttl_ms;
        let mut skipped = 0;
        for (id, spec) in segments {
            let node = match self.node_ids.get(&spec.node) {
                Some(n) => *n,
                None => {
                    let n = self.nodes.len() as u32;
                    self.nodes.push(NodeState {
                        name: spec.node.clone(),
                        failure_domain: spec.failure_domain.clone(),
                        last_heartbeat_ms: now,
                        alive: true,
                        segments: Vec::new(),
                        outbox: VecDeque::new(),
                        feed: VecDeque::new(),
                        feed_next_seq: 1,
                        feed_reset: false,
                    });
                    self.node_ids.insert(spec.node.clone(), n);
                    n
                }
            };
            let alloc = ExtentAllocator::new(spec.capacity_bytes);
            self.capacity_pages[spec.tier.index()] += alloc.capacity_bytes() / PAGE_BYTES;
            self.nodes[node as usize].segments.push(id);
            self.next_segment = self.next_segment.max(id + 1);
            self.segments.insert(id, Segment { spec, node, alloc });
        }
        for rec in objects {
            if self.find(&rec.key).is_some() {
                skipped += 1;
                continue;
            }
            let Some(pages) = pages_for(rec.size) else {
                skipped += 1;
                continue;
            };
            let mut reps: SmallVec<[Rep; 2]> = SmallVec::new();
            for (seg, offset) in rec.replicas {
                let page = u32::try_from(offset / PAGE_BYTES).unwrap_or(u32::MAX);
                let Some(s) = self.segments.get_mut(&seg) else {
                    continue;
                };
                if s.alloc.claim(page, pages) {
                    self.used_pages[s.spec.tier.index()] += u64::from(pages);
                    reps.push(Rep { seg, page });
                }
            }
            if reps.is_empty() {
                skipped += 1;
                continue;
            }
            let short = reps.len() < usize::from(rec.desired);
            let slot = self.new_object(rec.key, rec.size, rec.desired.max(1), reps);
            if rec.spread_failure_domain {
                self.entries[slot as usize].flags |= SPREAD_DOMAINS;
            }
            if rec.hard_pinned {
                self.entries[slot as usize].flags |= HARD_PIN;
            }
            if short {
                self.under.insert(slot);
            }
            self.sync_policy(slot);
        }
        self.restored_slots = u32::try_from(self.entries.len()).unwrap_or(u32::MAX);
        let until = now + self.config.put_timeout_ms.max(self.config.task_timeout_ms);
        for (seg, offset, length) in reservations {
            let page = u32::try_from(offset / PAGE_BYTES).unwrap_or(u32::MAX);
            let Some(pages) = pages_for(length) else {
                skipped += 1;
                continue;
            };
            let claimed = self
                .segments
                .get_mut(&seg)
                .filter(|s| s.alloc.free_bytes() > 0)
                .and_then(|s| s.alloc.claim(page, pages).then_some(s.spec.tier));
            match claimed {
                Some(tier) => {
                    self.used_pages[tier.index()] += u64::from(pages);
                    self.quarantine.push((seg, page, pages, until));
                }
                None => skipped += 1,
            }
        }
        skipped
    }

    // ----- transfer engine: transport state per node -----------------------------------------

    /// Keep the transport state `node` reported with its heartbeat (replacing the previous one).
    /// Unknown or dead nodes are refused as a heartbeat would be.
    pub fn record_transport(
        &mut self,
        node: &str,
        state: TransportState,
    ) -> Result<(), MasterError> {
        let known = self
            .node_ids
            .get(node)
            .is_some_and(|n| self.nodes.get(*n as usize).is_some_and(|ns| ns.alive));
        if !known {
            return Err(MasterError::UnknownNode(node.to_owned()));
        }
        self.transport.insert(node.to_owned(), state);
        Ok(())
    }

    /// The transport state of every live node that reported one, sorted by node name.
    pub fn transports(&self) -> Vec<(String, TransportState)> {
        let mut out: Vec<(String, TransportState)> = self
            .transport
            .iter()
            .filter(|(name, _)| {
                self.node_ids
                    .get(*name)
                    .and_then(|n| self.nodes.get(*n as usize))
                    .is_some_and(|ns| ns.alive)
            })
            .map(|(name, t)| (name.clone(), t.clone()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Transfer engine: how one node's agent moves bytes, as its heartbeat reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransportState {
    /// The pool asked the agent for RDMA.
    pub rdma_requested: bool,
    /// RDMA was requested but transfers went over TCP.
    pub fallback: bool,
    /// The last fallback's reason (empty without one).
    pub fallback_reason: String,
    /// RDMA devices the agent's engine opened.
    pub rdma_devices: Vec<String>,
}

// ----- segment-event feed (agent, issue 4) ---------------------------------------------------

/// Events kept per node before the feed gives up and resynchronises with a snapshot.
pub const FEED_CAP: usize = 1 << 16;
/// Events sent per heartbeat answer at most.
pub const FEED_BATCH: usize = 4096;

/// What happened to a node's SSD segment; see `SegmentEventKind` in master.proto.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentEventKind {
    Commit,
    Free,
    Reset,
    ResetDone,
}

/// One event of a node's feed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentEvent {
    pub seq: u64,
    pub kind: SegmentEventKind,
    pub segment_id: u32,
    /// Zero for `Reset` and `ResetDone`.
    pub key: ObjectKey,
    pub offset: u64,
    pub length: u64,
}

/// A block an agent found corrupt or truncated while reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CorruptBlock {
    pub segment_id: u32,
    pub key: ObjectKey,
    pub offset: u64,
}

/// What the master answers a heartbeat with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeartbeatReply {
    pub tasks: Vec<Task>,
    pub feed_epoch: u64,
    pub events: Vec<SegmentEvent>,
}

impl MasterState {
    /// This instance's feed epoch (never 0).
    pub fn feed_epoch(&self) -> u64 {
        self.feed_epoch
    }

    /// Queue `kind` for the agent of the SSD segment `r` lives in (DRAM segments have no feed).
    fn feed_push(&mut self, r: Rep, kind: SegmentEventKind, key: ObjectKey, length: u64) {
        let Some(seg) = self.segments.get(&r.seg) else {
            return;
        };
        if seg.spec.tier != Tier::Ssd {
            return;
        }
        let Some(ns) = self.nodes.get_mut(seg.node as usize) else {
            return;
        };
        if ns.feed_reset {
            // The coming snapshot covers this change.
            return;
        }
        if ns.feed.len() >= FEED_CAP {
            ns.feed.clear();
            ns.feed_reset = true;
            return;
        }
        let seq = ns.feed_next_seq;
        ns.feed_next_seq += 1;
        ns.feed.push_back(SegmentEvent {
            seq,
            kind,
            segment_id: r.seg,
            key,
            offset: u64::from(r.page) * PAGE_BYTES,
            length,
        });
    }

    fn feed_commit(&mut self, r: Rep, key: ObjectKey, size: u64) {
        self.feed_push(r, SegmentEventKind::Commit, key, size);
    }

    fn feed_free(&mut self, r: Rep, key: ObjectKey) {
        self.feed_push(r, SegmentEventKind::Free, key, 0);
    }

    /// Replace node `n`'s feed by a snapshot of its SSD segments: RESET, one COMMIT per
    /// committed replica, RESET_DONE, per segment.
    fn feed_snapshot(&mut self, n: u32) {
        let Some(ns) = self.nodes.get_mut(n as usize) else {
            return;
        };
        ns.feed.clear();
        ns.feed_reset = false;
        let ssd: Vec<u32> = ns
            .segments
            .iter()
            .copied()
            .filter(|s| {
                self.segments
                    .get(s)
                    .is_some_and(|g| g.spec.tier == Tier::Ssd)
            })
            .collect();
        let none = ObjectKey { hi: 0, lo: 0 };
        for seg in ssd {
            self.feed_push(Rep { seg, page: 0 }, SegmentEventKind::Reset, none, 0);
            let held: Vec<(Rep, ObjectKey, u64)> = self
                .entries
                .iter()
                .filter(|e| e.has(LIVE) && !e.has(PENDING))
                .flat_map(|e| {
                    e.replicas
                        .iter()
                        .filter(|r| r.seg == seg)
                        .map(|r| (*r, e.key, e.size))
                })
                .collect();
            for (r, key, size) in held {
                self.feed_commit(r, key, size);
            }
            self.feed_push(Rep { seg, page: 0 }, SegmentEventKind::ResetDone, none, 0);
        }
    }

    /// A heartbeat with the segment-event feed: record it, apply the agent's corrupt-block
    /// reports, drop the events it acknowledged (`acked` under `epoch`; epoch 0 means it just
    /// mounted and announced its index), and answer its queued tasks and up to [`FEED_BATCH`]
    /// pending events. An epoch from another master instance (a failover) or an overflowed
    /// feed is answered with a snapshot.
    pub fn heartbeat_feed(
        &mut self,
        node: &str,
        epoch: u64,
        acked: u64,
        corrupt: &[CorruptBlock],
    ) -> Result<HeartbeatReply, MasterError> {
        let tasks = self.heartbeat(node)?;
        let n = *self
            .node_ids
            .get(node)
            .ok_or_else(|| MasterError::UnknownNode(node.to_owned()))?;
        for c in corrupt {
            self.drop_corrupt(n, c);
        }
        let stale = epoch != 0 && epoch != self.feed_epoch;
        let ns = &mut self.nodes[n as usize];
        if stale {
            ns.feed_reset = true;
        } else {
            while ns.feed.front().is_some_and(|e| e.seq <= acked) {
                ns.feed.pop_front();
            }
        }
        if ns.feed_reset {
            self.feed_snapshot(n);
        }
        let events = self.nodes[n as usize]
            .feed
            .iter()
            .take(FEED_BATCH)
            .copied()
            .collect();
        Ok(HeartbeatReply {
            tasks,
            feed_epoch: self.feed_epoch,
            events,
        })
    }

    /// Drop the replica of `c.key` at `c.offset` in node `n`'s segment `c.segment_id` (its
    /// agent found it corrupt); the object is repaired from another replica, or forgotten when
    /// this was its last one.
    fn drop_corrupt(&mut self, n: u32, c: &CorruptBlock) {
        let owned = self
            .segments
            .get(&c.segment_id)
            .is_some_and(|s| s.node == n);
        let Some(slot) = self.find(&c.key).filter(|_| owned) else {
            return;
        };
        let Ok(page) = u32::try_from(c.offset / PAGE_BYTES) else {
            return;
        };
        let r = Rep {
            seg: c.segment_id,
            page,
        };
        let e = &self.entries[slot as usize];
        if e.has(PENDING) || !e.replicas.contains(&r) || !c.offset.is_multiple_of(PAGE_BYTES) {
            return;
        }
        let pages = e.pages();
        self.entries[slot as usize].replicas.retain(|x| *x != r);
        self.feed_free(r, c.key);
        self.free_rep(r, pages);
        self.counters.corrupt_dropped += 1;
        let e = &self.entries[slot as usize];
        if e.replicas.is_empty() {
            self.counters.objects_lost += 1;
            self.drop_object(slot);
            return;
        }
        if e.replicas.len() < usize::from(e.desired) {
            self.under.insert(slot);
        }
        self.sync_policy(slot);
        self.log_object(slot);
    }
}

#[cfg(test)]
mod tests;
