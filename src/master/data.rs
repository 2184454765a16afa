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

use super::client::{ClientError, MasterClient, pick_nearest};
use super::types::{PutOptions, PutStarted, ReplicaInfo};
use crate::transfer::{
    self, BatchFailed, Endpoint, HostOptions, MemoryError, MemoryKind, Segment, SegmentDescriptor,
    TransferEngine, TransferError, TransferOp, TransferRequest,
};

/// Errors of pool puts and gets.
#[derive(Debug, thiserror::Error)]
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
    #[error("a transfer task was lost: {0}")]
    Join(String),
}

impl DataError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            DataError::Master(_) => "master",
            DataError::NoEndpoint { .. } => "no_endpoint",
            DataError::Staging { .. } => "staging",
            DataError::RegisterStaging(_) => "register_staging",
            DataError::Open { .. } => "open",
            DataError::Transfer { .. } => "transfer",
            DataError::Local { .. } => "local",
            DataError::SizeMismatch { .. } => "size_mismatch",
            DataError::NoReplica => "no_replica",
            DataError::Join(_) => "join",
        }
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
    local: LocalSegments,
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
            local: LocalSegments::default(),
        }
    }

    /// Reach replicas in `local` (segments of this process) by memory copy.
    pub fn with_local_segments(mut self, local: LocalSegments) -> Self {
        self.local = local;
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

    fn staging(&self, data: Option<&[u8]>, size: u64) -> Result<transfer::LocalSegment, DataError> {
        let staging = |source| DataError::Staging { size, source };
        let len = usize::try_from(size.max(1)).map_err(|_| {
            staging(MemoryError::InvalidSize {
                size: usize::MAX,
                max: transfer::memory::MAX_SEGMENT_SIZE,
            })
        })?;
        let seg = Segment::host(len, HostOptions::default()).map_err(staging)?;
        if let Some(d) = data {
            seg.write_at(0, d).map_err(staging)?;
        }
        let n = self.staging_seq.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}/staging-{}-{n}", self.node, std::process::id());
        self.engine
            .register(&name, Arc::new(seg))
            .map_err(DataError::RegisterStaging)
    }

    /// Write `value` to every replica the master allocates, then commit. A failed write
    /// revokes the put. Returns the replicas written (empty when the key was already committed).
    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<Vec<ReplicaInfo>, DataError> {
        let size = value.len() as u64;
        let started = self
            .master
            .put_start(key, size, opts)
            .await
            .map_err(DataError::Master)?;
        let (put_id, replicas) = match started {
            PutStarted::AlreadyCommitted { .. } => return Ok(Vec::new()),
            PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        };
        let written = {
            let this = self.clone();
            let value = value.to_vec();
            let replicas = replicas.clone();
            tokio::task::spawn_blocking(move || this.write_replicas(&value, &replicas))
                .await
                .map_err(|e| DataError::Join(e.to_string()))
                .and_then(|r| r)
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

    fn write_replicas(&self, value: &[u8], replicas: &[ReplicaInfo]) -> Result<(), DataError> {
        let size = value.len() as u64;
        if let Some(r) = replicas.iter().find(|r| r.length != size) {
            return Err(DataError::SizeMismatch {
                got: r.length,
                want: size,
            });
        }
        let mut remote_replicas = Vec::with_capacity(replicas.len());
        for r in replicas {
            match self.local_segment(r) {
                Some(seg) => seg
                    .write_at(r.offset, value)
                    .map_err(|source| DataError::Local {
                        name: transfer_name(&r.node, &r.segment),
                        source,
                    })?,
                None => remote_replicas.push(r),
            }
        }
        if remote_replicas.is_empty() {
            return Ok(());
        }
        let local = self.staging(Some(value), size)?;
        let mut requests = Vec::with_capacity(remote_replicas.len());
        for r in remote_replicas.iter().copied() {
            let remote = self.open(r)?;
            requests.push(TransferRequest {
                op: TransferOp::Write,
                local: local.clone(),
                local_offset: 0,
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
    /// others if it fails, then release the lease.
    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, DataError> {
        let located = self.master.get(key).await.map_err(DataError::Master)?;
        let this = self.clone();
        let size = located.size;
        let replicas = located.replicas.clone();
        let read = tokio::task::spawn_blocking(move || this.read_any(size, &replicas))
            .await
            .map_err(|e| DataError::Join(e.to_string()))
            .and_then(|r| r);
        if let Err(e) = self.master.release_lease(located.lease_id).await {
            tracing::debug!(error = %e, "releasing a read lease failed; it expires by itself");
        }
        read
    }

    fn read_any(&self, size: u64, replicas: &[ReplicaInfo]) -> Result<Vec<u8>, DataError> {
        let first = pick_nearest(replicas, &self.node, self.numa_node);
        let order = first.into_iter().chain(
            replicas
                .iter()
                .filter(|r| !first.is_some_and(|f| std::ptr::eq(f, *r))),
        );
        let mut last = DataError::NoReplica;
        for r in order {
            match self.read_one(size, r) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    tracing::warn!(node = %r.node, segment = %r.segment, error = %e,
                        "replica read failed, trying the next");
                    last = e;
                }
            }
        }
        Err(last)
    }

    fn read_one(&self, size: u64, r: &ReplicaInfo) -> Result<Vec<u8>, DataError> {
        if r.length != size {
            return Err(DataError::SizeMismatch {
                got: r.length,
                want: size,
            });
        }
        if let Some(seg) = self.local_segment(r) {
            let mut out = vec![0u8; usize::try_from(size).unwrap_or(0)];
            seg.read_at(r.offset, &mut out)
                .map_err(|source| DataError::Local {
                    name: transfer_name(&r.node, &r.segment),
                    source,
                })?;
            return Ok(out);
        }
        let local = self.staging(None, size)?;
        let remote = self.open(r)?;
        let name = remote.name().to_owned();
        self.engine
            .transfer(vec![TransferRequest {
                op: TransferOp::Read,
                local: local.clone(),
                local_offset: 0,
                remote,
                remote_offset: r.offset,
                len: size,
            }])
            .map_err(|source| DataError::Transfer { name, source })?;
        let mut out = vec![
            0u8;
            local
                .segment()
                .len()
                .min(usize::try_from(size).unwrap_or(0))
        ];
        local
            .segment()
            .read_at(0, &mut out)
            .map_err(|source| DataError::Staging { size, source })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::types::Tier;

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
            crate::master::auth::AuthKey::from_bytes(KEY).expect("master key"),
            crate::master::client::ClientConfig::default(),
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
            .read_any(len, &[dead.clone(), rb])
            .expect("fallback read");
        assert!(got == value);
        // Nothing readable: the last failure is reported.
        let err = pool.read_any(len, &[dead]).expect_err("no replica left");
        assert_eq!(err.category(), "open");
        assert_eq!(
            pool.read_any(len, &[]).expect_err("empty").category(),
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
            pool.read_any(4096, &[wrong])
                .expect_err("unknown")
                .category(),
            "open"
        );
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
            pool.read_any(r.length, std::slice::from_ref(&r))
                .expect("local read")
                == value
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
        assert_eq!(
            pool.read_any(r.length, &[r])
                .expect_err("no transport")
                .category(),
            "open"
        );
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
