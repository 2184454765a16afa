//! The Python methods of [`P2pEngine`] (see `p2p`): starting it, registering memory, moving
//! bytes to and from peers, batches, notifications and probes.
//! I/O boundary: through `p2p` and the transfer engine only.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvpool_transfer::{
    AuthError, AuthKey, EngineConfig, HostOptions, RequestStatus, Segment, StaticDirectory,
    TransferEngine, TransferMetrics,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{Failure, Kind};
use crate::p2p::{Local, OPEN_KEY, P2pEngine, listen_addr, random_u64};
use crate::p2p_table as table;

/// Longest `status(wait=True)` waits for a batch (its requests' own timeouts settle it first).
const BATCH_WAIT: Duration = Duration::from_secs(120);

fn internal(what: &str) -> impl FnOnce(String) -> Failure + '_ {
    move |e| Failure::new(Kind::Internal, format!("{what}: {e}"))
}

impl P2pEngine {
    fn start(hostname: &str, key_file: Option<&Path>) -> Result<Self, Failure> {
        let (key, authenticated) = match AuthKey::load(key_file) {
            Ok(k) => (k, true),
            Err(AuthError::Missing) => (
                AuthKey::new(OPEN_KEY.to_vec()).map_err(|e| internal("open key")(e.to_string()))?,
                false,
            ),
            Err(e) => return Err(Failure::new(Kind::AuthFailed, format!("pool key: {e}"))),
        };
        let addr = listen_addr(hostname)?;
        let registry = prometheus::Registry::new();
        let metrics =
            TransferMetrics::new(&registry).map_err(|e| internal("metrics")(e.to_string()))?;
        let engine = TransferEngine::new(
            EngineConfig {
                node: format!("{}/pid-{}/p2p", addr.ip(), std::process::id()),
                prefer_shm: false,
                integrity: crate::client::transfer_integrity()?,
                tls: kvpool_client::pool::transfer_tls_from_env()
                    .map_err(|e| Failure::invalid(e.to_string()))?,
                ..EngineConfig::default()
            },
            key,
            Arc::new(StaticDirectory::new()),
            metrics,
        )
        .map_err(|e| internal("starting the transfer engine")(e.to_string()))?;
        let server = engine
            .listen_tcp(addr)
            .map_err(|e| Failure::new(Kind::Unavailable, format!("listening on {addr}: {e}")))?;
        let host_seg = || {
            Segment::host(table::TABLE_BYTES, HostOptions::default())
                .map(Arc::new)
                .map_err(|e| internal("region table")(e.to_string()))
        };
        let register = |name: &str| {
            engine
                .register(name, host_seg()?)
                .map_err(|e| internal("region table")(e.to_string()))
        };
        let table_seg = register(table::TABLE_SEGMENT)?;
        let scratch = register("mooncake-engine/scratch")?;
        let me = P2pEngine {
            engine: engine.clone(),
            server,
            table: table_seg,
            scratch: Mutex::new(scratch),
            local: Mutex::new(Local {
                by_start: BTreeMap::new(),
                next_id: (random_u64() & 0xffff_ffff) << 32 | 1,
                generation: 0,
            }),
            peers: Mutex::new(HashMap::new()),
            batches: Mutex::new(HashMap::new()),
            next_batch: AtomicU64::new(1),
            authenticated,
        };
        me.publish(&mut me.local.lock())?;
        Ok(me)
    }

    fn take_batch(&self, id: u64) -> Option<Arc<kvpool_transfer::Batch>> {
        self.batches.lock().get(&id).cloned()
    }
}

#[pymethods]
impl P2pEngine {
    /// Start an engine serving this process's registered memory at `local_hostname` (`host`
    /// or `host:port`; port 0 or none picks one). The pool key: `auth_key_file`, else
    /// `KVPOOL_AUTH_KEY` or `KVPOOL_AUTH_KEY_FILE`; with none, peers are not authenticated.
    #[new]
    #[pyo3(signature = (local_hostname, auth_key_file = None))]
    fn new(
        py: Python<'_>,
        local_hostname: String,
        auth_key_file: Option<PathBuf>,
    ) -> PyResult<Self> {
        Ok(py.detach(|| Self::start(&local_hostname, auth_key_file.as_deref()))?)
    }

    /// The TCP port peers dial (the port of this engine's session id `host:port`).
    #[getter]
    fn rpc_port(&self) -> u16 {
        self.server.local_addr().port()
    }

    /// Whether peers must prove the pool key (false: no key was configured).
    #[getter]
    fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// Register `size` bytes at `ptr`; the caller keeps them valid until `unregister`.
    fn register(&self, ptr: usize, size: u64) -> PyResult<()> {
        self.add_region(ptr, size, None)
    }

    /// Unregister the region starting at `ptr`; false when none (or a managed one) starts there.
    fn unregister(&self, ptr: usize) -> PyResult<bool> {
        let mut local = self.local.lock();
        if local.by_start.get(&ptr).is_none_or(|r| r.managed) {
            return Ok(false);
        }
        local.by_start.remove(&ptr);
        self.publish(&mut local)?;
        Ok(true)
    }

    /// Allocate and register `size` zeroed bytes; returns their address.
    fn allocate(&self, size: u64) -> PyResult<usize> {
        let n = usize::try_from(size)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Failure::invalid(format!("size {size} must be positive")))?;
        let seg =
            Arc::new(Segment::host(n, HostOptions::default()).map_err(|e| {
                Failure::new(Kind::NoSpace, format!("allocating {size} bytes: {e}"))
            })?);
        let ptr = seg.addr();
        self.add_region(ptr, size, Some(seg))?;
        Ok(ptr)
    }

    /// Free memory from `allocate`; false when `ptr` is not such memory.
    fn free(&self, ptr: usize) -> PyResult<bool> {
        let mut local = self.local.lock();
        if !local.by_start.get(&ptr).is_some_and(|r| r.managed) {
            return Ok(false);
        }
        local.by_start.remove(&ptr);
        self.publish(&mut local)?;
        Ok(true)
    }

    /// Copy `data` to `ptr`, which must be inside a registered region.
    fn write_local(&self, ptr: usize, data: &[u8]) -> PyResult<()> {
        let local = self.local.lock();
        let (seg, off) = Self::local_span(&local, ptr, data.len() as u64)?;
        seg.segment()
            .write_at(off, data)
            .map_err(|e| Failure::invalid(e.to_string()))?;
        Ok(())
    }

    /// The `size` bytes at `ptr`, which must be inside a registered region.
    fn read_local<'py>(
        &self,
        py: Python<'py>,
        ptr: usize,
        size: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let n = usize::try_from(size).map_err(|_| Failure::invalid("size too large"))?;
        let local = self.local.lock();
        let (seg, off) = Self::local_span(&local, ptr, size)?;
        let mut out = vec![0u8; n];
        seg.segment()
            .read_at(off, &mut out)
            .map_err(|e| Failure::invalid(e.to_string()))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Move `lengths[i]` bytes between local `buffers[i]` and the peer's `peer_addresses[i]`
    /// (`write`: to the peer), then send `notify` (name, message) when given.
    #[pyo3(signature = (session, write, buffers, peer_addresses, lengths, notify = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        session: &str,
        write: bool,
        buffers: Vec<usize>,
        peer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        notify: Option<(String, Vec<u8>)>,
    ) -> PyResult<()> {
        py.detach(|| {
            self.transfer_blocking(session, write, &buffers, &peer_addresses, &lengths)?;
            match &notify {
                Some((name, msg)) => self.notify_blocking(session, name, msg),
                None => Ok(()),
            }
        })?;
        Ok(())
    }

    /// Start the same moves as `transfer` (no notification); returns a batch id for `status`.
    fn submit(
        &self,
        py: Python<'_>,
        session: &str,
        write: bool,
        buffers: Vec<usize>,
        peer_addresses: Vec<u64>,
        lengths: Vec<u64>,
    ) -> PyResult<u64> {
        let batch = py.detach(|| {
            let reqs = self.requests(session, write, &buffers, &peer_addresses, &lengths)?;
            self.engine.submit(reqs).map_err(|e| {
                self.forget(session);
                Failure::new(Kind::TransferFailed, e.to_string())
            })
        })?;
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        self.batches.lock().insert(id, Arc::new(batch));
        Ok(id)
    }

    /// A batch's state: 1 done, 0 still moving, -1 failed or unknown. With `wait`, waits for
    /// it to settle. A settled batch is forgotten (its id is unknown afterwards).
    #[pyo3(signature = (batch_id, wait = false))]
    fn status(&self, py: Python<'_>, batch_id: u64, wait: bool) -> i32 {
        let Some(batch) = self.take_batch(batch_id) else {
            return -1;
        };
        let statuses = if wait {
            match py.detach(|| batch.wait(BATCH_WAIT)) {
                Ok(s) => s,
                Err(_) => return 0,
            }
        } else {
            if !batch.is_finished() {
                return 0;
            }
            batch.statuses()
        };
        self.batches.lock().remove(&batch_id);
        if statuses.iter().all(|s| *s == RequestStatus::Done) {
            1
        } else {
            -1
        }
    }

    /// The address of the first region the peer `session` registered (0: none).
    fn first_buffer(&self, py: Python<'_>, session: &str) -> PyResult<u64> {
        Ok(py.detach(|| -> Result<u64, Failure> {
            let peer = self.peer(session)?;
            let mut peer = peer.lock();
            self.refresh(&mut peer)?;
            Ok(peer
                .regions
                .values()
                .min_by_key(|e| e.id)
                .map_or(0, |e| e.start))
        })?)
    }

    /// Check that `session` is a reachable engine that knows this pool's key (its region
    /// table is read again).
    fn probe(&self, py: Python<'_>, session: &str) -> PyResult<()> {
        Ok(py.detach(|| -> Result<(), Failure> {
            self.forget(session);
            let peer = self.peer(session)?;
            let r = self.refresh(&mut peer.lock());
            if r.is_err() {
                self.forget(session);
            }
            r
        })?)
    }

    /// The notifications received since the last call: (name, message) pairs.
    fn notifications<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        let mut out = Vec::new();
        while let Some(n) = self.engine.recv_notification(Duration::ZERO) {
            let p = &n.payload;
            let Some(len) = p
                .get(..4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            else {
                continue;
            };
            let Some(name) = p.get(4..4 + len as usize) else {
                continue;
            };
            let name = String::from_utf8_lossy(name).into_owned();
            out.push((name, PyBytes::new(py, &p[4 + len as usize..])));
        }
        out
    }

    /// Regions registered (including allocated ones).
    fn region_count(&self) -> usize {
        self.local.lock().by_start.len()
    }
}
