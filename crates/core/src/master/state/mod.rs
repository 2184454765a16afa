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
//!
//! This module holds the state itself (the struct, its configuration, errors, counters and
//! statistics, the entry layout); its methods are spread over one file per concern:
//! `segments`, `nodes` (heartbeats, agent death, transport reports), `objects` (the index),
//! `placement`, `puts`, `leases` (reads, leases, pins, removal), `eviction`, `tasks` (repairs
//! and demotions), `tick`, `feed` (the segment-event feed to agents), `events` (the pool's
//! block events for KV-event consumers) and `persistence` (the HA journal and restore).

mod events;
mod eviction;
mod feed;
mod hot;
mod leases;
mod node_report;
mod nodes;
mod objects;
mod persistence;
mod placement;
mod puts;
mod segments;
mod tasks;
mod tick;

pub use super::types::{
    CorruptBlock, EventName, HeartbeatReply, JournalOp, ObjectRecord, SegmentEvent,
    SegmentEventKind, TransportState,
};
pub use events::{POOL_EVENTS_CAP, PoolEvent, PoolEventsDrain};
pub use feed::{FEED_BATCH, FEED_CAP, fed};
pub use node_report::{NodeReport, NumaUsage, UNBOUND_NUMA_NODE};

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use hashbrown::HashTable;
use smallvec::SmallVec;

use super::alloc::{ExtentAllocator, PAGE_BYTES, pages_for};
use super::clock::Clock;
use super::policy::{Policy, PolicyKind};
use super::types::{ObjectKey, SegmentSpec, Spread, TaskKind, Tier, Watermarks};

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
    /// Per tier, indexed by [`Tier::index`](super::types::Tier::index).
    pub watermarks: [Watermarks; 2],
    pub max_replicas: u8,
    /// How every put's replicas spread at least (a put may ask for failure domains itself).
    pub spread: Spread,
    /// Repair tasks scheduled per tick at most.
    pub repairs_per_tick: usize,
    /// Space of an abandoned write (a revoked or expired put, a failed or expired copy) stays
    /// reserved this long before it is given out again, so that a write still on its way (a
    /// writer stalled past its timeout, a late retransmission, an RDMA retry) lands where no
    /// one reads. 0: given out again at once.
    pub reuse_delay_ms: u64,
    /// Count each Get's hit on the node and tier that serves it (`Stats.nodes`). Always on
    /// in a master; `kvpool bench master --node-hits-ab` turns it off to measure its cost.
    pub node_get_hits: bool,
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
            spread: Spread::Node,
            repairs_per_tick: 256,
            reuse_delay_ms: 10_000,
            node_get_hits: true,
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
    #[error("no segment is mounted yet (the agents have not joined this master): retry")]
    NoSegments,
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
    /// A persistent segment just mounted: nothing is placed in it until its agent has
    /// announced what it holds (`adopt` with `complete`), so that no new replica is written
    /// over a block that is about to be adopted.
    sealed: bool,
}

impl Segment {
    fn new(spec: SegmentSpec, node: u32, alloc: ExtentAllocator, sealed: bool) -> Self {
        Self {
            spec,
            node,
            alloc,
            sealed,
        }
    }
}

#[derive(Debug)]
struct NodeState {
    name: String,
    failure_domain: String,
    last_heartbeat_ms: u64,
    alive: bool,
    /// A writer reported it unreachable at this time: no new replicas go there until a
    /// heartbeat arrives after it.
    suspect_since_ms: Option<u64>,
    segments: Vec<u32>,
    outbox: VecDeque<u64>,
    /// Events of this node's SSD segments not yet acknowledged by its agent (issue 4).
    feed: VecDeque<SegmentEvent>,
    /// Sequence number of the next event.
    feed_next_seq: u64,
    /// The feed overflowed or the agent's epoch is stale: the next heartbeat sends a full
    /// snapshot (RESET, COMMIT..., RESET_DONE) instead of the lost events.
    feed_reset: bool,
    /// Per tier: keys whose `get` directed the reader to a replica on this node (the first
    /// replica returned). Since this state was created (the master started leading); kept
    /// across the node's deaths and returns, like any counter.
    get_hits: [u64; 2],
}

impl NodeState {
    /// A live node heard from at `now_ms`, with no segments, tasks or feed events yet.
    fn new(name: String, failure_domain: String, now_ms: u64) -> Self {
        Self {
            name,
            failure_domain,
            last_heartbeat_ms: now_ms,
            alive: true,
            suspect_since_ms: None,
            segments: Vec::new(),
            outbox: VecDeque::new(),
            feed: VecDeque::new(),
            feed_next_seq: 1,
            feed_reset: false,
            get_hits: [0; 2],
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct LeaseRec {
    slot: u32,
    generation: u32,
    granted_ms: u64,
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
    /// Nodes a writer reported unreachable (placements paused there until a heartbeat).
    pub nodes_suspected: u64,
    pub leases_expired: u64,
    pub puts_expired: u64,
    /// Replicas dropped because their agent found them corrupt on read.
    pub corrupt_dropped: u64,
    /// Abandoned writes whose space was held back for `reuse_delay_ms`.
    pub reuse_deferred: u64,
    /// `replicate_hot` calls that raised an object's replica count (or extended the time).
    pub hot_requests: u64,
    /// Copies freed when a hot object's time ran out.
    pub hot_replicas_trimmed: u64,
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

/// Bytes of one tier on one node, summed over the node's segments of that tier.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NodeUsage {
    pub node: String,
    pub tier: Tier,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
}

/// What a [`MasterState::tick`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    pub dead_nodes: Vec<String>,
    pub objects_lost: u64,
    pub repairs_scheduled: u64,
    pub evicted: u64,
    /// How long each lease that expired in this tick held its object, in ms.
    pub expired_lease_holds_ms: Vec<u64>,
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
    /// Hot objects (`replicate_hot`): their own desired replica count and when the raised
    /// count ends. Not journaled: after a failover the raised count stays with the object.
    hot: HashMap<u32, (u8, u64)>,
    under: HashSet<u32>,
    tasks: HashMap<u64, TaskRec>,
    next_task: u64,
    counters: Counters,
    journal: Option<Vec<JournalOp>>,
    /// Space held back before reuse: restored reservations and abandoned writes (segment,
    /// page, pages, release time); still reserved in the journal until released.
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
    /// The outbox of pool block events, when they are published.
    pool_events: Option<events::PoolEvents>,
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
            hot: HashMap::new(),
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
            pool_events: None,
        }
    }

    /// An empty state with the same configuration and clock (a new leader's starting point).
    /// Pool events stay on, and the new state's first drain is a snapshot.
    pub fn fresh(&self) -> Self {
        let mut s = Self::new(self.config.clone(), self.clock.clone());
        s.pool_events = self.pool_events.as_ref().map(events::PoolEvents::fresh);
        s
    }

    /// The injected clock's current time.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    /// Turn the per-node Get hit accounting on or off (benchmarks measuring what it costs).
    pub fn set_node_get_hits(&mut self, on: bool) {
        self.config.node_get_hits = on;
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

    /// Per node and tier with a segment mounted: allocated and mounted bytes, sorted by node
    /// name then tier (for metrics; a node without segments is absent).
    pub fn node_usage(&self) -> Vec<NodeUsage> {
        let mut by: std::collections::BTreeMap<(&str, usize), (u64, u64)> = Default::default();
        for seg in self.segments.values() {
            let Some(node) = self.nodes.get(seg.node as usize) else {
                continue;
            };
            let e = by
                .entry((node.name.as_str(), seg.spec.tier.index()))
                .or_default();
            e.0 += seg.alloc.used_bytes();
            e.1 += seg.alloc.capacity_bytes();
        }
        by.into_iter()
            .filter_map(|((node, t), (used, capacity))| {
                Some(NodeUsage {
                    node: node.to_owned(),
                    tier: Tier::ALL.get(t).copied()?,
                    used_bytes: used,
                    capacity_bytes: capacity,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod node_report_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod usage_tests;
