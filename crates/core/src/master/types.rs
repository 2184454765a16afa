//! Public value types of the master's metadata: keys, tiers, segment specs, replica locations,
//! put options, tasks; the records the HA layer persists (objects, journal ops); and what
//! agents exchange with the master on a heartbeat (the segment-event feed, corrupt-block
//! reports, the transport state). Pure data; shared by the core, the gRPC service, the client
//! and the agent.

use serde::{Deserialize, Serialize};

/// Storage tier of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Dram = 0,
    Ssd = 1,
}

impl Tier {
    pub const ALL: [Tier; 2] = [Tier::Dram, Tier::Ssd];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Dram => "dram",
            Tier::Ssd => "ssd",
        }
    }
}

/// Object identity: the 128-bit xxh3 digest of the caller's key bytes. The master keeps only
/// the digest (16 bytes per object); a collision needs ~2^64 keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectKey {
    pub hi: u64,
    pub lo: u64,
}

impl ObjectKey {
    pub fn from_bytes(key: &[u8]) -> Self {
        let h = xxhash_rust::xxh3::xxh3_128(key);
        Self {
            hi: (h >> 64) as u64,
            lo: h as u64,
        }
    }

    pub fn to_hex(self) -> String {
        format!("{:016x}{:016x}", self.hi, self.lo)
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 32 {
            return None;
        }
        let hi = u64::from_str_radix(s.get(..16)?, 16).ok()?;
        let lo = u64::from_str_radix(s.get(16..)?, 16).ok()?;
        Some(Self { hi, lo })
    }
}

/// What an agent announces when it mounts a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSpec {
    /// Node (agent) name, unique in the pool.
    pub node: String,
    /// Segment name, unique on its node.
    pub name: String,
    pub tier: Tier,
    pub capacity_bytes: u64,
    pub numa_node: u32,
    /// Value of the failure-domain label of the node (rack, zone...); empty when unknown.
    pub failure_domain: String,
    /// Transport endpoints of the segment (`tcp://host:port`, `rdma://dev/port/gid`...).
    pub endpoints: Vec<String>,
    /// The segment's contents outlive its agent (a DRAM tier kept in a tmpfs or hugetlbfs
    /// file): like an SSD segment, it gets the segment-event feed so its agent keeps a durable
    /// index, and its replicas are adopted again after a restart. SSD segments always are.
    #[serde(default)]
    pub persistent: bool,
}

impl SegmentSpec {
    /// The segment `name` of `node`, `capacity_bytes` on `tier`, reached at `endpoint`: on NUMA
    /// node 0, without a failure domain, not persistent.
    pub fn new(node: &str, name: &str, tier: Tier, capacity_bytes: u64, endpoint: String) -> Self {
        Self {
            node: node.to_owned(),
            name: name.to_owned(),
            tier,
            capacity_bytes,
            numa_node: 0,
            failure_domain: String::new(),
            endpoints: vec![endpoint],
            persistent: false,
        }
    }
}

/// How the replicas of one object are spread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Spread {
    /// Each replica on a distinct node.
    #[default]
    Node,
    /// Each replica in a distinct failure domain.
    FailureDomain,
}

/// Options of one put.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutOptions {
    pub replicas: u8,
    /// Node of the writer: its segments are preferred for the first replica.
    pub writer_node: Option<String>,
    /// NUMA node of the writer's buffer (or NIC): preferred on the writer's node.
    pub numa_hint: Option<u32>,
    pub spread: Spread,
    /// Tier to place the object in; `None` means DRAM, falling back to SSD when DRAM is full.
    pub tier: Option<Tier>,
    /// Nodes the writer could not reach with an earlier attempt of this put: no replica goes
    /// there, and the master stops placing anyone's replicas there until the node's next
    /// heartbeat (a dead agent is avoided before its heartbeat timeout).
    pub avoid_nodes: Vec<String>,
    /// Pin the object from its commit on: never evicted (hard) or evicted last for
    /// `soft_pin_ttl_ms` (soft). Given with the put so that no eviction can come between the
    /// commit and a separate pin call.
    pub hard_pin: bool,
    /// Soft pin TTL in milliseconds; 0: no soft pin.
    pub soft_pin_ttl_ms: u64,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self {
            replicas: 1,
            writer_node: None,
            numa_hint: None,
            spread: Spread::Node,
            tier: None,
            avoid_nodes: Vec::new(),
            hard_pin: false,
            soft_pin_ttl_ms: 0,
        }
    }
}

/// Where one replica lives, as clients and agents see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaInfo {
    pub node: String,
    pub segment_id: u32,
    pub segment: String,
    pub tier: Tier,
    pub numa_node: u32,
    pub endpoints: Vec<String>,
    /// Byte offset inside the segment (4 KiB aligned).
    pub offset: u64,
    /// Bytes of the value (the object size).
    pub length: u64,
}

/// Result of `put_start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutStarted {
    /// Write the value to every replica, then `put_end(put_id)`.
    Allocated {
        put_id: u64,
        replicas: Vec<ReplicaInfo>,
    },
    /// The key is already committed with the same size: nothing to write (keys name content,
    /// so a duplicate put is an idempotent success).
    AlreadyCommitted { size: u64 },
}

/// A read lease: until it expires or is released, no replica returned with it is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub expires_ms: u64,
}

/// Result of `get`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GetResult {
    pub size: u64,
    pub replicas: Vec<ReplicaInfo>,
    pub lease: Lease,
}

/// Kind of background copy the master asks an agent to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    /// Copy a surviving replica to a new location to restore the replica count.
    Repair,
    /// Copy a DRAM replica to the SSD tier of the same node; the DRAM copy is then freed.
    Demote,
}

impl TaskKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskKind::Repair => "repair",
            TaskKind::Demote => "demote",
        }
    }
}

/// A copy for the agent of `target.node` to execute, then report with `complete_task`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    pub id: u64,
    pub kind: TaskKind,
    pub key: ObjectKey,
    pub source: ReplicaInfo,
    pub target: ReplicaInfo,
}

/// Eviction watermarks of one tier, as fractions of its capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Watermarks {
    pub high: f64,
    pub low: f64,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self {
            high: 0.95,
            low: 0.85,
        }
    }
}

/// A replica an agent found in one of its segments after a restart (its persistent SSD tier)
/// and announces so the master adopts it instead of forgetting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdoptItem {
    pub key: ObjectKey,
    /// Byte offset inside the segment (must be 4 KiB aligned, as the master allocated it).
    pub offset: u64,
    /// Bytes of the value (the object size).
    pub length: u64,
}

/// How an object is named in published events: the engine's own block hash when the key is
/// one of the pool's block keys (docs/engine-contract.md, "Pool keys"), else the key itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EventName {
    /// The key is a vLLM connector's block of rank 0 (its 32-byte block hash: the integer
    /// vLLM itself publishes, the hash's last 8 bytes big-endian), or its last `/`-segment was
    /// exactly 16 hex digits (the synthetic engines' keys, `kvpool/synthetic/<model>/<hash>`).
    Int(u64),
    /// Any other key, as its bytes.
    Bytes(Vec<u8>),
}

impl EventName {
    /// The name of the object stored under `key`.
    pub fn of_key(key: &[u8]) -> Self {
        if let Some(v) = crate::sched::parse_vllm_name(key) {
            // Other ranks' shards of the same block keep their own names: one event per block.
            if v.tp_rank == 0 && v.pp_rank == 0 {
                return Self::Int(v.hash.as_u64());
            }
            return Self::Bytes(key.to_vec());
        }
        let last = key.rsplit(|b| *b == b'/').next().unwrap_or(key);
        if last.len() == 16 && last.iter().all(u8::is_ascii_hexdigit) {
            // Sixteen hex digits always parse into a u64.
            if let Some(v) = std::str::from_utf8(last)
                .ok()
                .and_then(|s| u64::from_str_radix(s, 16).ok())
            {
                return Self::Int(v);
            }
        }
        Self::Bytes(key.to_vec())
    }
}

/// A committed object as persisted by the HA layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// How the object is named in the pool's block events, when the master learnt its key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_name: Option<EventName>,
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
