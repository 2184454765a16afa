//! Value bytes over the pool: `put` and `get` that drive the master (locations, commit, leases)
//! and the transfer engine (WRITE to every replica, READ from the nearest one). Also the naming
//! rules that tie a master segment to its transfer-engine registration. I/O boundary: the
//! master's gRPC channel and the transfer engine's connections; naming and endpoint parsing are
//! pure.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::master::{ClientError, MasterClient, pick_nearest};
use kvpool_core::master::types::{ObjectKey, PutOptions, PutStarted, ReplicaInfo};
use kvpool_transfer::{
    self as transfer, BatchFailed, Endpoint, HostOptions, MemoryError, MemoryKind, Segment,
    SegmentDescriptor, TransferEngine, TransferError, TransferOp, TransferRequest,
};

/// Errors of pool puts and gets.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DataError {
    #[error("master call failed")]
    Master(#[source] ClientError),
    #[error("replica {segment} on {node} has no usable transport endpoint in {endpoints:?}")]
    NoEndpoint {
        node: String,
        segment: String,
        endpoints: Vec<String>,
    },
    #[error("staging buffer of {size} bytes")]
    Staging {
        size: u64,
        #[source]
        source: MemoryError,
    },
    #[error("registering a staging buffer with the transfer engine")]
    RegisterStaging(#[source] TransferError),
    #[error("opening replica segment {name}")]
    Open {
        name: String,
        #[source]
        source: TransferError,
    },
    #[error("transfer to or from replica segment {name} failed")]
    Transfer {
        name: String,
        #[source]
        source: BatchFailed,
    },
    #[error("copying to or from local segment {name}")]
    Local {
        name: String,
        #[source]
        source: MemoryError,
    },
    #[error("the master answered {got} bytes for a value of {want} bytes")]
    SizeMismatch { got: u64, want: u64 },
    #[error("the master returned no replica")]
    NoReplica,
    #[error("a value of {size} bytes does not fit the {have}-byte buffer")]
    BufferTooSmall { size: u64, have: u64 },
    #[error("striped object incomplete: part {part} of {parts} is gone (evicted or removed)")]
    StripeIncomplete {
        part: u32,
        parts: u32,
        #[source]
        source: ClientError,
    },
    #[error(
        "striped object part {part}: the master answered {got} bytes, the manifest says {want}"
    )]
    StripeMismatch { part: u32, got: u64, want: u64 },
    #[error("a transfer task was lost: {0}")]
    Join(String),
    #[error(
        "the read ended after its {ttl:?} read lease may have expired: the bytes may have been \
         overwritten and were discarded"
    )]
    LeaseExpired { ttl: std::time::Duration },
}

impl DataError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Name under which an agent registers the segment `segment` of `node` with its transfer
/// engine; the master only knows `(node, segment)`, so both sides derive it the same way.
pub fn transfer_name(node: &str, segment: &str) -> String {
    format!("{node}/{segment}")
}

/// Endpoint string for a TCP transfer target, as announced in a `SegmentSpec`.
pub fn tcp_endpoint(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

/// Parse the transfer endpoints of a replica (`tcp://host:port`, `shm:///path`); unknown
/// schemes (RDMA, announced for later) are skipped.
pub fn parse_endpoints(endpoints: &[String]) -> Vec<Endpoint> {
    endpoints
        .iter()
        .filter_map(|e| {
            if let Some(rest) = e.strip_prefix("tcp://") {
                rest.parse().ok().map(Endpoint::Tcp)
            } else {
                e.strip_prefix("shm://")
                    .filter(|p| p.starts_with('/'))
                    .map(|p| Endpoint::Shm(p.into()))
            }
        })
        .collect()
}

/// The transfer-engine descriptor of a replica's segment.
pub fn descriptor(replica: &ReplicaInfo) -> Result<SegmentDescriptor, DataError> {
    let endpoints = parse_endpoints(&replica.endpoints);
    if endpoints.is_empty() {
        return Err(DataError::NoEndpoint {
            node: replica.node.clone(),
            segment: replica.segment.clone(),
            endpoints: replica.endpoints.clone(),
        });
    }
    Ok(SegmentDescriptor {
        name: transfer_name(&replica.node, &replica.segment),
        node: replica.node.clone(),
        // Learnt from the owner when the segment is opened.
        size: 0,
        numa_node: Some(replica.numa_node),
        memory: MemoryKind::Host,
        endpoints,
        nics: Vec::new(),
    })
}

/// Segments that live in the client's own process (an agent's registered tiers), by transfer
/// name: a replica in one of them is written and read with a plain memory copy, not through a
/// transport. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct LocalSegments(Arc<RwLock<HashMap<String, Arc<Segment>>>>);

impl LocalSegments {
    pub fn insert(&self, name: &str, segment: Arc<Segment>) {
        self.0.write().insert(name.to_owned(), segment);
    }

    pub fn remove(&self, name: &str) {
        self.0.write().remove(name);
    }

    pub fn get(&self, name: &str) -> Option<Arc<Segment>> {
        self.0.read().get(name).cloned()
    }
}

/// Master client plus transfer engine: whole-value puts and gets. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PoolClient {
    master: MasterClient,
    engine: TransferEngine,
    /// The reader's node and NUMA node, for nearest-replica choice.
    node: String,
    numa_node: Option<u32>,
    staging_seq: Arc<AtomicU64>,
    staging_cache: Arc<StagingCache>,
    stripe: StripeConfig,
    local: LocalSegments,
}

/// Smallest staging buffer handed out; smaller values share this size class.
const MIN_STAGING: u64 = 64 * 1024;
/// Default bound on idle staging memory a `PoolClient` keeps for reuse.
pub const DEFAULT_STAGING_CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// When a value is striped: values larger than `threshold` bytes are cut into parts of
/// `part_size` bytes, each its own object placed by the master (most free space first, so parts
/// spread over the nodes), plus a small manifest under the caller's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeConfig {
    pub threshold: u64,
    pub part_size: u64,
}

impl Default for StripeConfig {
    fn default() -> Self {
        Self {
            threshold: 16 << 20,
            part_size: 4 << 20,
        }
    }
}

/// Start of every manifest value.
const MANIFEST_MAGIC: &[u8; 16] = b"kvpool-stripe-v1";
/// Manifest layout: magic, digest of the owning key (16), total size, part size, part count.
pub const MANIFEST_LEN: usize = 16 + 16 + 8 + 8 + 4;
/// Most parts one object may have (bounds what a manifest read from the pool can ask for).
const MAX_PARTS: u64 = 16_384;

/// What a striped object's manifest says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub total: u64,
    pub part_size: u64,
    pub parts: u32,
}

impl Manifest {
    fn new(total: u64, part_size: u64) -> Option<Self> {
        let parts = total.div_ceil(part_size.max(1));
        (part_size > 0 && total > 0 && parts <= MAX_PARTS).then_some(Self {
            total,
            part_size,
            parts: u32::try_from(parts).ok()?,
        })
    }

    /// Offset and length of part `i`.
    pub fn part(&self, i: u32) -> (u64, u64) {
        let off = u64::from(i) * self.part_size;
        (off, self.part_size.min(self.total.saturating_sub(off)))
    }

    pub fn encode(&self, key: &[u8]) -> [u8; MANIFEST_LEN] {
        let d = ObjectKey::from_bytes(key);
        let mut out = [0u8; MANIFEST_LEN];
        let fields: [&[u8]; 6] = [
            MANIFEST_MAGIC,
            &d.hi.to_le_bytes(),
            &d.lo.to_le_bytes(),
            &self.total.to_le_bytes(),
            &self.part_size.to_le_bytes(),
            &self.parts.to_le_bytes(),
        ];
        let mut at = 0;
        for f in fields {
            if let Some(dst) = out.get_mut(at..at + f.len()) {
                dst.copy_from_slice(f);
            }
            at += f.len();
        }
        out
    }

    /// The manifest of `key` if `value` is one: right length, magic, the key's own digest and
    /// consistent sizes. Anything else is an ordinary value.
    pub fn decode(key: &[u8], value: &[u8]) -> Option<Self> {
        if value.len() != MANIFEST_LEN || value.get(..16)? != MANIFEST_MAGIC {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(value.get(at..at + 8)?.try_into().ok()?))
        };
        let d = ObjectKey::from_bytes(key);
        if u64_at(16)? != d.hi || u64_at(24)? != d.lo {
            return None;
        }
        let total = u64_at(32)?;
        let part_size = u64_at(40)?;
        let parts = u32::from_le_bytes(value.get(48..52)?.try_into().ok()?);
        Self::new(total, part_size).filter(|m| m.parts == parts)
    }
}

/// Key of part `i` of the striped object `key`: a fixed-length name derived from the key's
/// digest, in a namespace (leading NUL and tag) that caller keys are not expected to use.
pub fn stripe_part_key(key: &[u8], i: u32) -> Vec<u8> {
    let d = ObjectKey::from_bytes(key);
    let mut k = Vec::with_capacity(13 + 16 + 4);
    k.extend_from_slice(b"\0kvpool-part\0");
    k.extend_from_slice(&d.hi.to_le_bytes());
    k.extend_from_slice(&d.lo.to_le_bytes());
    k.extend_from_slice(&i.to_le_bytes());
    k
}

/// Registered staging buffers kept for reuse, by power-of-two size class, so that a put or get
/// does not map, fault in and register fresh memory each time. Bounded by `limit` idle bytes;
/// a buffer whose transfer failed is never returned here (a late reply could still land in it).
#[derive(Debug)]
struct StagingCache {
    limit: u64,
    idle: parking_lot::Mutex<(u64, Vec<transfer::LocalSegment>)>,
}

impl StagingCache {
    fn new(limit: u64) -> Self {
        Self {
            limit,
            idle: parking_lot::Mutex::new((0, Vec::new())),
        }
    }

    /// Size class of a value of `size` bytes.
    fn class(size: u64) -> u64 {
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
    fn idle_bytes(&self) -> u64 {
        self.idle.lock().0
    }
}

impl PoolClient {
    pub fn new(
        master: MasterClient,
        engine: TransferEngine,
        node: String,
        numa_node: Option<u32>,
    ) -> Self {
        Self {
            master,
            engine,
            node,
            numa_node,
            staging_seq: Arc::default(),
            staging_cache: Arc::new(StagingCache::new(DEFAULT_STAGING_CACHE_BYTES)),
            stripe: StripeConfig::default(),
            local: LocalSegments::default(),
        }
    }

    /// Reach replicas in `local` (segments of this process) by memory copy.
    #[must_use]
    pub fn with_local_segments(mut self, local: LocalSegments) -> Self {
        self.local = local;
        self
    }

    /// Stripe values above `config.threshold` (see [`StripeConfig`]).
    #[must_use]
    pub fn with_striping(mut self, config: StripeConfig) -> Self {
        self.stripe = config;
        self
    }

    /// Keep at most `bytes` of idle staging memory for reuse (0 disables the cache).
    #[must_use]
    pub fn with_staging_cache(mut self, bytes: u64) -> Self {
        self.staging_cache = Arc::new(StagingCache::new(bytes));
        self
    }

    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// The segment of a replica when it lives in this process.
    fn local_segment(&self, r: &ReplicaInfo) -> Option<Arc<Segment>> {
        if r.node != self.node {
            return None;
        }
        self.local.get(&transfer_name(&r.node, &r.segment))
    }

    /// Copy `value` straight into every replica when all of them live in this process (no
    /// staging, no transport). False when some replica needs the transport.
    fn write_all_local(&self, value: &[u8], replicas: &[ReplicaInfo]) -> Result<bool, DataError> {
        let size = value.len() as u64;
        let mut segs = Vec::with_capacity(replicas.len());
        for r in replicas {
            if r.length != size {
                return Err(DataError::SizeMismatch {
                    got: r.length,
                    want: size,
                });
            }
            match self.local_segment(r) {
                Some(seg) => segs.push((seg, r)),
                None => return Ok(false),
            }
        }
        for (seg, r) in segs {
            seg.write_at(r.offset, value)
                .map_err(|source| DataError::Local {
                    name: transfer_name(&r.node, &r.segment),
                    source,
                })?;
        }
        Ok(true)
    }

    /// A registered staging buffer of at least `size` bytes (reused when one is idle), holding
    /// `data` at offset 0 when given.
    fn staging(&self, data: Option<&[u8]>, size: u64) -> Result<transfer::LocalSegment, DataError> {
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
    fn unstage(&self, local: transfer::LocalSegment) {
        self.staging_cache.give(local);
    }

    /// Write `value` to every replica the master allocates, then commit. A failed write
    /// revokes the put. Returns the replicas written (empty when the key was already committed).
    /// The value is copied once into a (reused) registered staging buffer; [`Self::put_from`]
    /// avoids that copy.
    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        self.put_source(key, Source::Bytes(value), opts).await
    }

    /// Zero-copy put: write `len` bytes at `offset` of a buffer registered with this client's
    /// engine (see [`Self::register_buffer`]) to every replica, then commit. The buffer must
    /// not change until this returns.
    pub async fn put_from(
        &self,
        key: &[u8],
        buffer: &transfer::LocalSegment,
        offset: u64,
        len: u64,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        buffer
            .segment()
            .check_range(offset, len)
            .map_err(|source| DataError::Staging { size: len, source })?;
        self.put_source(key, Source::Registered(buffer.clone(), offset, len), opts)
            .await
    }

    /// Host memory of `len` bytes registered with this client's transfer engine, for
    /// [`Self::put_from`]. Unregistered when the last clone drops.
    pub fn register_buffer(&self, len: u64) -> Result<transfer::LocalSegment, DataError> {
        self.new_buffer("buffer", len)
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

    async fn put_source(
        &self,
        key: &[u8],
        source: Source<'_>,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        let size = source.len();
        if size > self.stripe.threshold
            && self.stripe.part_size < size
            && let Some(m) = Manifest::new(size, self.stripe.part_size)
        {
            return self.put_striped(key, source, m, opts).await;
        }
        self.put_plain(key, source, opts).await
    }

    /// Parts first (one `put_start` batch, one transfer batch, one `put_end` batch), then the
    /// manifest: the object becomes visible only once every part is committed. Any failure
    /// revokes or removes the parts already placed.
    async fn put_striped(
        &self,
        key: &[u8],
        source: Source<'_>,
        m: Manifest,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        if self
            .master
            .exists(&[key])
            .await
            .map_err(DataError::Master)?
            == [true]
        {
            return Ok(Vec::new());
        }
        let part_keys: Vec<Vec<u8>> = (0..m.parts).map(|i| stripe_part_key(key, i)).collect();
        let items: Vec<(&[u8], u64)> = part_keys
            .iter()
            .zip(0..)
            .map(|(k, i)| (k.as_slice(), m.part(i).1))
            .collect();
        let started = self
            .master
            .put_start_batch(&items, opts)
            .await
            .map_err(DataError::Master)?;
        let mut allocated: Vec<(u32, u64, Vec<ReplicaInfo>)> = Vec::new();
        let mut refused = None;
        for (i, r) in (0..).zip(started) {
            match r {
                Ok(PutStarted::Allocated { put_id, replicas }) => {
                    allocated.push((i, put_id, replicas));
                }
                // A part of an earlier identical put: same key, same bytes.
                Ok(PutStarted::AlreadyCommitted { .. }) => {}
                Err(e) => {
                    refused.get_or_insert(e);
                }
            }
        }
        let written = match refused {
            Some(e) => Err(DataError::Master(e)),
            None => {
                let staged = match source {
                    Source::Bytes(value) => {
                        self.staging(Some(value), m.total).map(|l| (l, 0, true))
                    }
                    Source::Registered(buf, offset, _) => Ok((buf, offset, false)),
                };
                match staged {
                    Ok((local, base, staged)) => {
                        let this = self.clone();
                        let parts = allocated.clone();
                        tokio::task::spawn_blocking(move || {
                            this.write_parts(&local, base, &m, &parts)?;
                            if staged {
                                this.unstage(local);
                            }
                            Ok(())
                        })
                        .await
                        .map_err(|e| DataError::Join(e.to_string()))
                        .and_then(|r| r)
                    }
                    Err(e) => Err(e),
                }
            }
        };
        let pending: Vec<(&[u8], u64)> = allocated
            .iter()
            .filter_map(|(i, id, _)| Some((part_keys.get(*i as usize)?.as_slice(), *id)))
            .collect();
        if let Err(e) = written {
            for (k, id) in &pending {
                if let Err(revoke) = self.master.put_revoke(k, *id).await {
                    tracing::warn!(error = %revoke, "revoking a striped part failed");
                }
            }
            return Err(e);
        }
        let ended = self.master.put_end_batch(&pending).await;
        let failed = match ended {
            Ok(items) => items.into_iter().find_map(Result::err),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            self.drop_parts(&part_keys).await;
            return Err(DataError::Master(e));
        }
        let manifest = m.encode(key);
        if let Err(e) = self.put_plain(key, Source::Bytes(&manifest), opts).await {
            self.drop_parts(&part_keys).await;
            return Err(e);
        }
        Ok(allocated.into_iter().flat_map(|(_, _, r)| r).collect())
    }

    /// Best-effort removal of parts (missing ones are fine: that is the goal).
    async fn drop_parts(&self, keys: &[Vec<u8>]) {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        if let Err(e) = self.master.remove_batch(&refs).await {
            tracing::warn!(error = %e, "removing the parts of a striped object failed");
        }
    }

    /// WRITE every allocated part (all replicas) from `local` at `base` in one batch.
    fn write_parts(
        &self,
        local: &transfer::LocalSegment,
        base: u64,
        m: &Manifest,
        parts: &[(u32, u64, Vec<ReplicaInfo>)],
    ) -> Result<(), DataError> {
        let mut requests = Vec::new();
        let mut names = Vec::new();
        for (i, _, replicas) in parts {
            let (off, len) = m.part(*i);
            for r in replicas {
                if r.length != len {
                    return Err(DataError::StripeMismatch {
                        part: *i,
                        got: r.length,
                        want: len,
                    });
                }
                requests.push(TransferRequest {
                    op: TransferOp::Write,
                    local: local.clone(),
                    local_offset: base + off,
                    remote: self.open(r)?,
                    remote_offset: r.offset,
                    len,
                });
                names.push(transfer_name(&r.node, &r.segment));
            }
        }
        self.engine
            .transfer(requests)
            .map_err(|source| DataError::Transfer {
                name: names.join(","),
                source,
            })
    }

    async fn put_plain(
        &self,
        key: &[u8],
        source: Source<'_>,
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        let size = source.len();
        let started = self
            .master
            .put_start(key, size, opts)
            .await
            .map_err(DataError::Master)?;
        let (put_id, replicas) = match started {
            PutStarted::AlreadyCommitted { .. } => return Ok(Vec::new()),
            PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        };
        if let Source::Bytes(value) = &source {
            match self.write_all_local(value, &replicas) {
                Ok(true) => {
                    self.master
                        .put_end(key, put_id)
                        .await
                        .map_err(DataError::Master)?;
                    return Ok(replicas);
                }
                Ok(false) => {}
                Err(e) => {
                    if let Err(revoke) = self.master.put_revoke(key, put_id).await {
                        tracing::warn!(error = %revoke, "revoking a failed put failed");
                    }
                    return Err(e);
                }
            }
        }
        // Staged here (one copy into registered memory) unless the caller's buffer is
        // registered already; sent from the blocking pool.
        let (local, offset, staged) = match source {
            Source::Bytes(value) => match self.staging(Some(value), size) {
                Ok(local) => (Ok(local), 0, true),
                Err(e) => (Err(e), 0, true),
            },
            Source::Registered(buf, offset, _) => (Ok(buf), offset, false),
        };
        let written = match local {
            Ok(local) => {
                let this = self.clone();
                let replicas = replicas.clone();
                tokio::task::spawn_blocking(move || {
                    this.write_from(&local, offset, size, &replicas)?;
                    if staged {
                        this.unstage(local);
                    }
                    Ok(())
                })
                .await
                .map_err(|e| DataError::Join(e.to_string()))
                .and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            if let Err(revoke) = self.master.put_revoke(key, put_id).await {
                tracing::warn!(error = %revoke, "revoking a failed put failed");
            }
            return Err(e);
        }
        self.master
            .put_end(key, put_id)
            .await
            .map_err(DataError::Master)?;
        Ok(replicas)
    }

    #[cfg(test)]
    fn write_replicas(&self, value: &[u8], replicas: &[ReplicaInfo]) -> Result<(), DataError> {
        let size = value.len() as u64;
        let local = self.staging(Some(value), size)?;
        self.write_from(&local, 0, size, replicas)?;
        self.unstage(local);
        Ok(())
    }

    /// WRITE `size` bytes at `offset` of `local` to every replica.
    fn write_from(
        &self,
        local: &transfer::LocalSegment,
        offset: u64,
        size: u64,
        replicas: &[ReplicaInfo],
    ) -> Result<(), DataError> {
        if let Some(r) = replicas.iter().find(|r| r.length != size) {
            return Err(DataError::SizeMismatch {
                got: r.length,
                want: size,
            });
        }
        let len = usize::try_from(size).map_err(|_| DataError::SizeMismatch {
            got: size,
            want: size,
        })?;
        let mut remote_replicas = Vec::with_capacity(replicas.len());
        for r in replicas {
            match self.local_segment(r) {
                Some(seg) => {
                    transfer::memory::copy_between(local.segment(), offset, &seg, r.offset, len)
                        .map_err(|source| DataError::Local {
                            name: transfer_name(&r.node, &r.segment),
                            source,
                        })?
                }
                None => remote_replicas.push(r),
            }
        }
        if remote_replicas.is_empty() {
            return Ok(());
        }
        let mut requests = Vec::with_capacity(remote_replicas.len());
        for r in remote_replicas.iter().copied() {
            let remote = self.open(r)?;
            requests.push(TransferRequest {
                op: TransferOp::Write,
                local: local.clone(),
                local_offset: offset,
                remote,
                remote_offset: r.offset,
                len: size,
            });
        }
        self.engine
            .transfer(requests)
            .map_err(|source| DataError::Transfer {
                name: remote_replicas
                    .iter()
                    .map(|r| transfer_name(&r.node, &r.segment))
                    .collect::<Vec<_>>()
                    .join(","),
                source,
            })
    }

    fn open(&self, r: &ReplicaInfo) -> Result<transfer::RemoteSegment, DataError> {
        let desc = descriptor(r)?;
        self.engine
            .open_descriptor(&desc, None)
            .map_err(|source| DataError::Open {
                name: desc.name.clone(),
                source,
            })
    }

    /// Read a value: locate it (taking a read lease), read the nearest replica, trying the
    /// others if it fails, then release the lease in the background.
    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::new();
        self.get_with(key, |size| {
            // The size comes from the master: bound it before allocating.
            let n = usize::try_from(size)
                .ok()
                .filter(|n| *n <= transfer::memory::MAX_SEGMENT_SIZE)
                .ok_or(DataError::Staging {
                    size,
                    source: MemoryError::InvalidSize {
                        size: usize::try_from(size).unwrap_or(usize::MAX),
                        max: transfer::memory::MAX_SEGMENT_SIZE,
                    },
                })?;
            out = vec![0u8; n];
            Ok(out.as_mut_slice())
        })
        .await?;
        Ok(out)
    }

    /// Read a value into `buf` (which must be at least as long as the value); returns its
    /// length. Saves the allocation of [`Self::get`] when a caller reuses its buffer; the
    /// bytes still pass through a staging buffer ([`Self::get_to`] avoids that copy).
    pub async fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<usize, DataError> {
        let have = buf.len() as u64;
        self.get_with(key, move |size| {
            let n = usize::try_from(size)
                .ok()
                .filter(|n| *n <= buf.len())
                .ok_or(DataError::BufferTooSmall { size, have })?;
            buf.get_mut(..n)
                .ok_or(DataError::BufferTooSmall { size, have })
        })
        .await
    }

    /// Zero-copy get: read a value straight into `buffer` (registered with this client's
    /// engine, see [`Self::register_buffer`]) at `offset`; returns its length. The transport
    /// receives into the buffer itself, with no staging copy. On error the bytes of the buffer
    /// after `offset` are unspecified.
    pub async fn get_to(
        &self,
        key: &[u8],
        buffer: &transfer::LocalSegment,
        offset: u64,
    ) -> Result<u64, DataError> {
        let dest = Dest::Buffer(buffer.clone(), offset);
        match self.read_value(key, &dest).await? {
            Value::Plain { size, .. } => Ok(size),
            Value::Striped(m) => {
                dest.check_fits(m.total)?;
                self.get_striped(key, m, &dest).await.map(|_| m.total)
            }
        }
    }

    /// Read into staging, then copy into the slice `sink(size)` returns.
    async fn get_with<'b>(
        &self,
        key: &[u8],
        sink: impl FnOnce(u64) -> Result<&'b mut [u8], DataError>,
    ) -> Result<usize, DataError> {
        let (size, local) = match self.read_value(key, &Dest::Staging).await? {
            Value::Plain { size, local, .. } => (size, local),
            Value::Striped(m) => (m.total, self.get_striped(key, m, &Dest::Staging).await?),
        };
        let copied = sink(size).and_then(|out| {
            local
                .segment()
                .read_at(0, out)
                .map_err(|source| DataError::Staging { size, source })
                .map(|()| out.len())
        });
        self.unstage(local);
        copied
    }

    /// Locate `key` and read its value into `dest`; the lease is released in the background.
    /// A value that is the manifest of `key` comes back as [`Value::Striped`] (its bytes
    /// dropped). Fails with [`DataError::LeaseExpired`] when the read ended after the lease
    /// may have run out: by then eviction may have given the memory to another object.
    async fn read_value(&self, key: &[u8], dest: &Dest) -> Result<Value, DataError> {
        let located = self.master.get(key).await.map_err(DataError::Master)?;
        let size = located.size;
        if let Err(e) = dest.check_fits(size) {
            self.master.release_lease_later(located.lease_id);
            return Err(e);
        }
        let this = self.clone();
        let replicas = located.replicas.clone();
        let d = dest.clone();
        let read = tokio::task::spawn_blocking(move || this.read_any(size, &replicas, &d))
            .await
            .map_err(|e| DataError::Join(e.to_string()))
            .and_then(|r| r);
        let held = located.lease_held();
        self.master.release_lease_later(located.lease_id);
        let (local, base) = read?;
        if !held {
            self.done_with(dest, local);
            return Err(DataError::LeaseExpired {
                ttl: located.lease_ttl,
            });
        }
        if size == MANIFEST_LEN as u64 {
            let mut head = [0u8; MANIFEST_LEN];
            local
                .segment()
                .read_at(base, &mut head)
                .map_err(|source| DataError::Staging { size, source })?;
            if let Some(m) = Manifest::decode(key, &head) {
                self.done_with(dest, local);
                return Ok(Value::Striped(m));
            }
        }
        Ok(Value::Plain { size, local })
    }

    /// Give back a staging buffer (a caller's buffer stays with the caller).
    fn done_with(&self, dest: &Dest, local: transfer::LocalSegment) {
        if matches!(dest, Dest::Staging) {
            self.unstage(local);
        }
    }

    /// Locate every part (one batch, leases on all), read them into `dest`. A missing part
    /// means the object was partly evicted: what is left of it is removed so that no orphan
    /// part stays, and the read fails with `StripeIncomplete`.
    async fn get_striped(
        &self,
        key: &[u8],
        m: Manifest,
        dest: &Dest,
    ) -> Result<transfer::LocalSegment, DataError> {
        let part_keys: Vec<Vec<u8>> = (0..m.parts).map(|i| stripe_part_key(key, i)).collect();
        let refs: Vec<&[u8]> = part_keys.iter().map(Vec::as_slice).collect();
        let located = self
            .master
            .get_batch(&refs)
            .await
            .map_err(DataError::Master)?;
        let mut leases = Vec::with_capacity(located.len());
        let mut parts = Vec::with_capacity(located.len());
        let mut problem = None;
        for (i, r) in (0..).zip(located) {
            match r {
                Ok(l) => {
                    leases.push((l.lease_id, l.lease_deadline, l.lease_ttl));
                    if l.size == m.part(i).1 {
                        parts.push(l.replicas);
                    } else {
                        problem.get_or_insert(DataError::StripeMismatch {
                            part: i,
                            got: l.size,
                            want: m.part(i).1,
                        });
                    }
                }
                Err(source) => {
                    problem.get_or_insert(DataError::StripeIncomplete {
                        part: i,
                        parts: m.parts,
                        source,
                    });
                }
            }
        }
        let result = match problem {
            Some(e) => Err(e),
            None => {
                let this = self.clone();
                let d = dest.clone();
                tokio::task::spawn_blocking(move || this.read_parts(&m, &parts, &d))
                    .await
                    .map_err(|e| DataError::Join(e.to_string()))
                    .and_then(|r| r)
            }
        };
        let now = std::time::Instant::now();
        let expired = leases.iter().find(|(_, deadline, _)| now >= *deadline);
        let result = match (result, expired) {
            (Ok(local), Some((_, _, ttl))) => {
                self.done_with(dest, local);
                Err(DataError::LeaseExpired { ttl: *ttl })
            }
            (r, _) => r,
        };
        for (id, _, _) in leases {
            self.master.release_lease_later(id);
        }
        if matches!(result, Err(DataError::StripeIncomplete { .. })) {
            let mut all = part_keys;
            all.push(key.to_vec());
            self.drop_parts(&all).await;
        }
        result
    }

    /// Read every part into `dest`: nearest replicas in one batch, then, if that fails, part
    /// by part through every replica.
    fn read_parts(
        &self,
        m: &Manifest,
        parts: &[Vec<ReplicaInfo>],
        dest: &Dest,
    ) -> Result<transfer::LocalSegment, DataError> {
        let (local, base) = self.destination(dest, m.total)?;
        let request = |local: &transfer::LocalSegment,
                       i: u32,
                       r: &ReplicaInfo|
         -> Result<TransferRequest, DataError> {
            let (off, len) = m.part(i);
            if r.length != len {
                return Err(DataError::StripeMismatch {
                    part: i,
                    got: r.length,
                    want: len,
                });
            }
            Ok(TransferRequest {
                op: TransferOp::Read,
                local: local.clone(),
                local_offset: base + off,
                remote: self.open(r)?,
                remote_offset: r.offset,
                len,
            })
        };
        let nearest: Result<Vec<_>, DataError> = (0..)
            .zip(parts)
            .map(|(i, replicas)| {
                let r = pick_nearest(replicas, &self.node, self.numa_node)
                    .ok_or(DataError::NoReplica)?;
                request(&local, i, r)
            })
            .collect();
        let failed = match nearest.map(|reqs| self.engine.transfer(reqs)) {
            Ok(Ok(())) => return Ok(local),
            Ok(Err(e)) => Some(e),
            Err(_) => None,
        };
        // Slow path. Staging: a fresh buffer (the failed batch may still hold the old one).
        // A caller's buffer is reused unless the batch was abandoned unsettled.
        let local = match dest {
            Dest::Staging => {
                drop(local);
                self.staging(None, m.total)?
            }
            Dest::Buffer(..) => {
                if let Some(source) = failed.filter(|f| f.index.is_none()) {
                    return Err(DataError::Transfer {
                        name: "striped parts".into(),
                        source,
                    });
                }
                local
            }
        };
        for (i, replicas) in (0..).zip(parts) {
            let mut last = DataError::NoReplica;
            let mut done = false;
            for r in replicas {
                let name = transfer_name(&r.node, &r.segment);
                match request(&local, i, r).and_then(|q| {
                    self.engine
                        .transfer(vec![q])
                        .map_err(|source| DataError::Transfer { name, source })
                }) {
                    Ok(()) => {
                        done = true;
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            if !done {
                return Err(last);
            }
        }
        Ok(local)
    }

    /// Remove an object; for a striped one, its parts too.
    pub async fn remove(&self, key: &[u8]) -> Result<(), DataError> {
        let located = self.master.get(key).await.map_err(DataError::Master)?;
        let manifest = if located.size == MANIFEST_LEN as u64 {
            let this = self.clone();
            let replicas = located.replicas.clone();
            let read = tokio::task::spawn_blocking(move || {
                this.read_vec_any(MANIFEST_LEN as u64, &replicas)
            })
            .await
            .map_err(|e| DataError::Join(e.to_string()))
            .and_then(|r| r);
            match read {
                Ok(v) => Manifest::decode(key, &v),
                Err(e) => {
                    self.master.release_lease_later(located.lease_id);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // Our own lease would make the master refuse the remove; `remove` flushes the
        // queued releases before it asks.
        self.master.release_lease_later(located.lease_id);
        if let Some(m) = manifest {
            // The manifest first: from then on no reader finds the parts.
            self.master.remove(key).await.map_err(DataError::Master)?;
            let parts: Vec<Vec<u8>> = (0..m.parts).map(|i| stripe_part_key(key, i)).collect();
            self.drop_parts(&parts).await;
            return Ok(());
        }
        self.master.remove(key).await.map_err(DataError::Master)
    }

    /// Wait until the lease releases this client queued in the background reached the master.
    pub async fn flush_releases(&self) {
        self.master.flush_releases().await;
    }

    fn read_vec_any(&self, size: u64, replicas: &[ReplicaInfo]) -> Result<Vec<u8>, DataError> {
        let (local, _) = self.read_any(size, replicas, &Dest::Staging)?;
        let mut out = vec![0u8; usize::try_from(size).unwrap_or(0)];
        local
            .segment()
            .read_at(0, &mut out)
            .map_err(|source| DataError::Staging { size, source })?;
        self.unstage(local);
        Ok(out)
    }

    /// The buffer a read of `size` bytes lands in, and where in it.
    fn destination(
        &self,
        dest: &Dest,
        size: u64,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        match dest {
            Dest::Staging => Ok((self.staging(None, size)?, 0)),
            Dest::Buffer(b, off) => {
                dest.check_fits(size)?;
                Ok((b.clone(), *off))
            }
        }
    }

    /// Read `size` bytes from the nearest replica (then the others) into `dest`; returns the
    /// buffer and the offset of the value in it.
    fn read_any(
        &self,
        size: u64,
        replicas: &[ReplicaInfo],
        dest: &Dest,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        let first = pick_nearest(replicas, &self.node, self.numa_node);
        let order = first.into_iter().chain(
            replicas
                .iter()
                .filter(|r| !first.is_some_and(|f| std::ptr::eq(f, *r))),
        );
        let mut last = DataError::NoReplica;
        for r in order {
            match self.read_one(size, r, dest) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    tracing::warn!(node = %r.node, segment = %r.segment, error = %e,
                        "replica read failed, trying the next");
                    // A transfer abandoned unsettled may still land in a caller's buffer:
                    // never reuse it for another replica.
                    let unsettled = matches!(&e,
                        DataError::Transfer { source, .. } if source.index.is_none());
                    if unsettled && matches!(dest, Dest::Buffer(..)) {
                        return Err(e);
                    }
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn read_one(
        &self,
        size: u64,
        r: &ReplicaInfo,
        dest: &Dest,
    ) -> Result<(transfer::LocalSegment, u64), DataError> {
        if r.length != size {
            return Err(DataError::SizeMismatch {
                got: r.length,
                want: size,
            });
        }
        let (local, base) = self.destination(dest, size)?;
        if let Some(seg) = self.local_segment(r) {
            let len = usize::try_from(size).map_err(|_| DataError::SizeMismatch {
                got: size,
                want: size,
            })?;
            transfer::memory::copy_between(&seg, r.offset, local.segment(), base, len).map_err(
                |source| DataError::Local {
                    name: transfer_name(&r.node, &r.segment),
                    source,
                },
            )?;
            return Ok((local, base));
        }
        let remote = self.open(r)?;
        let name = remote.name().to_owned();
        self.engine
            .transfer(vec![TransferRequest {
                op: TransferOp::Read,
                local: local.clone(),
                local_offset: base,
                remote,
                remote_offset: r.offset,
                len: size,
            }])
            .map_err(|source| DataError::Transfer { name, source })?;
        Ok((local, base))
    }

    #[cfg(test)]
    fn read_vec(&self, size: u64, replicas: &[ReplicaInfo]) -> Result<Vec<u8>, DataError> {
        self.read_vec_any(size, replicas)
    }
}

/// Where a read lands.
#[derive(Clone)]
enum Dest {
    /// A (reused) staging buffer of the client, at offset 0.
    Staging,
    /// A caller's registered buffer, at this offset.
    Buffer(transfer::LocalSegment, u64),
}

impl Dest {
    fn check_fits(&self, size: u64) -> Result<(), DataError> {
        match self {
            Dest::Staging => Ok(()),
            Dest::Buffer(b, off) => {
                let have = b.len().saturating_sub(*off);
                if size > have {
                    Err(DataError::BufferTooSmall { size, have })
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// A value read by [`PoolClient::read_value`].
enum Value {
    Plain {
        size: u64,
        local: transfer::LocalSegment,
    },
    /// The manifest of a striped object.
    Striped(Manifest),
}

/// Where a put's bytes come from.
enum Source<'a> {
    /// Caller memory, copied into a staging buffer.
    Bytes(&'a [u8]),
    /// A registered buffer, offset and length: written from directly.
    Registered(transfer::LocalSegment, u64, u64),
}

impl Source<'_> {
    fn len(&self) -> u64 {
        match self {
            Source::Bytes(v) => v.len() as u64,
            Source::Registered(_, _, len) => *len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::master::types::Tier;

    fn replica(endpoints: &[&str]) -> ReplicaInfo {
        ReplicaInfo {
            node: "n1".into(),
            segment_id: 7,
            segment: "dram0".into(),
            tier: Tier::Dram,
            numa_node: 1,
            endpoints: endpoints.iter().map(|s| (*s).to_owned()).collect(),
            offset: 4096,
            length: 10,
        }
    }

    const KEY: &[u8] = b"data-module-test-key-0123456789";

    fn engine(node: &str) -> TransferEngine {
        TransferEngine::new(
            transfer::EngineConfig {
                node: node.into(),
                lanes: 2,
                ..transfer::EngineConfig::default()
            },
            transfer::AuthKey::new(KEY.to_vec()).expect("key"),
            Arc::new(transfer::StaticDirectory::new()),
            transfer::TransferMetrics::unregistered().expect("metrics"),
        )
        .expect("engine")
    }

    /// An in-process "agent": an engine with segment `<node>/dram0` served over TCP.
    fn target(node: &str) -> (TransferEngine, transfer::LocalSegment, transfer::TcpServer) {
        let e = engine(node);
        let seg = Segment::host(1 << 20, HostOptions::default()).expect("segment");
        let local = e
            .register(&transfer_name(node, "dram0"), Arc::new(seg))
            .expect("register");
        let server = e
            .listen_tcp("127.0.0.1:0".parse().expect("addr"))
            .expect("listen");
        (e, local, server)
    }

    fn located(node: &str, server: &transfer::TcpServer, offset: u64, len: u64) -> ReplicaInfo {
        ReplicaInfo {
            node: node.into(),
            segment_id: 1,
            segment: "dram0".into(),
            tier: Tier::Dram,
            numa_node: 0,
            endpoints: vec![tcp_endpoint(server.local_addr())],
            offset,
            length: len,
        }
    }

    fn pool_client() -> PoolClient {
        // The master is never called by the data-path helpers tested here.
        let master = MasterClient::new(
            vec!["127.0.0.1:1".into()],
            kvpool_proto::auth::AuthKey::from_bytes(KEY).expect("master key"),
            crate::master::ClientConfig::default(),
        )
        .expect("client");
        PoolClient::new(master, engine("reader"), "reader".into(), None)
    }

    #[test]
    fn writes_reach_every_replica_and_reads_fall_back() {
        let (_ea, seg_a, server_a) = target("a");
        let (_eb, seg_b, server_b) = target("b");
        let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let len = value.len() as u64;
        let ra = located("a", &server_a, 8192, len);
        let rb = located("b", &server_b, 4096, len);
        let pool = pool_client();
        pool.write_replicas(&value, &[ra.clone(), rb.clone()])
            .expect("write");
        for (seg, off) in [(&seg_a, 8192), (&seg_b, 4096)] {
            let mut got = vec![0u8; value.len()];
            seg.segment().read_at(off, &mut got).expect("read back");
            assert!(got == value, "replica at {off} holds the value");
        }
        // A replica whose owner is gone: the read moves on to the next one.
        let dead_addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let mut dead = ra.clone();
        dead.endpoints = vec![tcp_endpoint(dead_addr)];
        let got = pool
            .read_vec(len, &[dead.clone(), rb])
            .expect("fallback read");
        assert!(got == value);
        // Nothing readable: the last failure is reported.
        let err = pool.read_vec(len, &[dead]).expect_err("no replica left");
        assert_eq!(err.category(), "open");
        assert_eq!(
            pool.read_vec(len, &[]).expect_err("empty").category(),
            "no_replica"
        );
    }

    #[test]
    fn bad_locations_are_refused_before_any_transfer() {
        let (_e, seg, server) = target("a");
        let pool = pool_client();
        let value = vec![7u8; 4096];
        // Length differing from the value: refused, nothing written.
        let short = located("a", &server, 0, 100);
        assert_eq!(
            pool.write_replicas(&value, &[short])
                .expect_err("size mismatch")
                .category(),
            "size_mismatch"
        );
        let mut got = vec![1u8; 4096];
        seg.segment().read_at(0, &mut got).expect("read");
        assert!(got.iter().all(|b| *b == 0), "nothing was written");
        // Past the end of the remote segment: the engine refuses the request.
        let beyond = located("a", &server, (1 << 20) - 1024, 4096);
        assert_eq!(
            pool.write_replicas(&value, &[beyond])
                .expect_err("out of bounds")
                .category(),
            "transfer"
        );
        // Wrong segment name on the right endpoint.
        let mut wrong = located("a", &server, 0, 4096);
        wrong.segment = "dram9".into();
        assert_eq!(
            pool.read_vec(4096, &[wrong])
                .expect_err("unknown")
                .category(),
            "open"
        );
    }

    #[test]
    fn staging_buffers_are_reused_and_never_leak_old_bytes() {
        let (_e, seg, server) = target("a");
        let pool = pool_client();
        let a: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let b: Vec<u8> = (0..70_000u32).map(|i| (i % 7) as u8 + 1).collect();
        let ra = located("a", &server, 0, a.len() as u64);
        let rb = located("a", &server, 200_000, b.len() as u64);
        pool.write_replicas(&a, std::slice::from_ref(&ra))
            .expect("write a");
        // One 128 KiB buffer (the class of 100,000 bytes) is idle now and is reused below.
        assert_eq!(pool.staging_cache.idle_bytes(), 128 * 1024);
        pool.write_replicas(&b, std::slice::from_ref(&rb))
            .expect("write b");
        assert_eq!(pool.staging_cache.idle_bytes(), 128 * 1024);
        // The reused buffer still holds b's bytes: reads must see exactly what the replica holds.
        assert!(pool.read_vec(a.len() as u64, &[ra]).expect("read a") == a);
        assert!(pool.read_vec(b.len() as u64, &[rb]).expect("read b") == b);
        let mut stored = vec![0u8; b.len()];
        seg.segment()
            .read_at(200_000, &mut stored)
            .expect("replica");
        assert!(stored == b);
        // A failed transfer does not return its buffer (a late reply could land in it).
        let beyond = located("a", &server, (1 << 20) - 1024, a.len() as u64);
        pool.write_replicas(&a, &[beyond])
            .expect_err("out of bounds");
        assert_eq!(pool.staging_cache.idle_bytes(), 0);
        // With the cache disabled nothing is kept.
        let uncached = pool_client().with_staging_cache(0);
        let rc = located("a", &server, 0, a.len() as u64);
        uncached.write_replicas(&a, &[rc]).expect("write");
        assert_eq!(uncached.staging_cache.idle_bytes(), 0);
        assert_eq!(StagingCache::class(1), MIN_STAGING);
        assert_eq!(StagingCache::class(MIN_STAGING + 1), 2 * MIN_STAGING);
        assert_eq!(StagingCache::class(4 << 20), 4 << 20);
    }

    #[test]
    fn replicas_in_local_segments_are_copied_without_a_transport() {
        let local = LocalSegments::default();
        let seg = Arc::new(Segment::host(1 << 16, HostOptions::default()).expect("segment"));
        local.insert("reader/dram0", Arc::clone(&seg));
        let pool = pool_client().with_local_segments(local.clone());
        let value: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
        let mut r = replica(&["tcp://127.0.0.1:1"]);
        r.node = "reader".into();
        r.length = value.len() as u64;
        // Nothing listens on the endpoint: only the in-process copy can succeed.
        pool.write_replicas(&value, std::slice::from_ref(&r))
            .expect("local write");
        let mut got = vec![0u8; value.len()];
        seg.read_at(r.offset, &mut got).expect("read back");
        assert!(got == value);
        assert!(
            pool.read_vec(r.length, std::slice::from_ref(&r))
                .expect("local read")
                == value
        );
        assert!(
            pool.write_all_local(&value, std::slice::from_ref(&r))
                .expect("direct")
        );
        // Past the end of the segment: refused with the local category, nothing written.
        r.offset = (1 << 16) - 4096;
        assert_eq!(
            pool.write_replicas(&value, std::slice::from_ref(&r))
                .expect_err("out of bounds")
                .category(),
            "local"
        );
        // Once withdrawn, the same replica needs the transport (and fails: nobody listens).
        local.remove("reader/dram0");
        assert!(
            !pool
                .write_all_local(&value, std::slice::from_ref(&r))
                .expect("not local")
        );
        assert_eq!(
            pool.read_vec(r.length, &[r])
                .expect_err("no transport")
                .category(),
            "open"
        );
    }

    #[test]
    fn manifests_round_trip_and_only_match_their_own_key() {
        let m = Manifest::new(10 * 1024 + 5, 4096).expect("manifest");
        assert_eq!(m.parts, 3);
        assert_eq!(m.part(0), (0, 4096));
        assert_eq!(m.part(2), (8192, 2053), "the last part is short");
        let bytes = m.encode(b"big-object");
        assert_eq!(Manifest::decode(b"big-object", &bytes), Some(m));
        assert_eq!(
            Manifest::decode(b"other-key", &bytes),
            None,
            "another key's manifest"
        );
        assert_eq!(
            Manifest::decode(b"big-object", &bytes[..40]),
            None,
            "short value"
        );
        let mut bad = bytes;
        bad[0] ^= 1;
        assert_eq!(Manifest::decode(b"big-object", &bad), None, "no magic");
        let mut parts = bytes;
        parts[48] = 9;
        assert_eq!(
            Manifest::decode(b"big-object", &parts),
            None,
            "inconsistent part count"
        );
        let mut zero = bytes;
        zero[40..48].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            Manifest::decode(b"big-object", &zero),
            None,
            "zero part size"
        );
        assert!(Manifest::new(1 << 40, 1).is_none(), "too many parts");
        // Part keys: fixed length, distinct per part and per object.
        let k0 = stripe_part_key(b"big-object", 0);
        assert_eq!(k0.len(), 33);
        assert_ne!(k0, stripe_part_key(b"big-object", 1));
        assert_ne!(k0, stripe_part_key(b"other-key", 0));
    }

    #[test]
    fn endpoints_parse_and_unknown_schemes_are_skipped() {
        let eps = parse_endpoints(&[
            "rdma://mlx5_0/1/3".into(),
            "tcp://127.0.0.1:7000".into(),
            "tcp://not-an-address".into(),
            "shm:///run/kvpool/transfer.sock".into(),
            "shm://relative".into(),
        ]);
        assert_eq!(
            eps,
            vec![
                Endpoint::Tcp("127.0.0.1:7000".parse().expect("addr")),
                Endpoint::Shm("/run/kvpool/transfer.sock".into()),
            ]
        );
        assert_eq!(
            tcp_endpoint("10.0.0.1:5".parse().expect("addr")),
            "tcp://10.0.0.1:5"
        );
    }

    #[test]
    fn descriptor_names_the_agent_registration() {
        let d = descriptor(&replica(&["tcp://127.0.0.1:7000"])).expect("descriptor");
        assert_eq!(d.name, transfer_name("n1", "dram0"));
        assert_eq!(d.name, "n1/dram0");
        assert_eq!(d.node, "n1");
        assert_eq!(d.numa_node, Some(1));
        assert_eq!(
            d.tcp_endpoint(),
            Some("127.0.0.1:7000".parse().expect("addr"))
        );
        let e = descriptor(&replica(&["rdma://x"])).expect_err("no usable endpoint");
        assert_eq!(e.category(), "no_endpoint");
    }
}
