//! Agent mode's connection: a session with the node agent's engine API (gRPC over its Unix
//! socket), the session's shared-memory staging area mapped into this process, the allocator
//! over it, and the caller memory registered for puts and gets. The agent is the trusted local
//! party: no master address or pool key here, the agent stores through the pool itself. Every
//! RPC runs on a clone of one tonic client (HTTP/2 carries concurrent calls), under the
//! store's request timeout. The agent's statuses and RPC failures are sorted into the kinds of
//! `errors`, as the pool client's are in direct mode. I/O boundary: the Unix socket and the
//! staging mapping (raw copies between it and caller memory).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::transport::Channel;

use kvpool_client::engine_api::client::{ClientError as EngineError, connect_channel};
use kvpool_client::engine_api::shm::Staging;
use kvpool_proto::engine_api::engine_api_client::EngineApiClient;
use kvpool_proto::engine_api::{
    CloseSessionRequest, ExistsRequest, GetItem, GetRequest, GetResult, OpenSessionRequest,
    PutItem, PutRequest, RemoveRequest, Status,
};

use crate::buffers::Held;
use crate::errors::{Failure, Kind};
use crate::staging::{Arena, Range};

/// Largest gRPC message either side sends (the agent's limit).
const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// Most items in one RPC (the agent's `MAX_BATCH`).
pub const MAX_BATCH: usize = 4096;
/// How often an idle store touches its session, so the agent's idle reaper keeps it.
const KEEPALIVE: Duration = Duration::from_secs(60);

/// How a store reaches its agent.
#[derive(Clone, Debug)]
pub struct AgentSettings {
    pub socket: PathBuf,
    pub staging_bytes: u64,
    pub request_timeout: Duration,
    /// NUMA node of the engine's memory, told to the agent (it binds the staging area there).
    pub numa_node: Option<u32>,
    /// PCI bus id of the engine's GPU, told to the agent (it maps it to a NUMA node).
    pub gpu_pci_bus_id: Option<String>,
}

/// Where caller memory named by a raw address lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Inside a range of the staging area handed out by `alloc_buffer`: at this offset.
    Staged(u64),
    /// Inside a registered buffer: copied through a staging range.
    Caller(usize),
}

/// A caller buffer registered with `register_buffer` (agent mode needs no transfer engine:
/// registration only vouches that the memory is valid).
struct Registered {
    len: u64,
    /// The buffer's device segment when it is a GPU's own memory: copies stage through it.
    device: Option<Arc<kvpool_transfer::Segment>>,
    _view: Option<Held>,
}

/// A failed copy between caller memory and the staging area: a buffer no longer mapped is
/// the transfer failing (Mooncake's -800, as in direct mode), anything else internal.
fn fault(e: kvpool_client::engine_api::shm::ShmError) -> Failure {
    let kind = match e {
        kvpool_client::engine_api::shm::ShmError::Fault { .. } => Kind::TransferFailed,
        _ => Kind::Internal,
    };
    Failure::new(kind, format!("staging: {e}"))
}

/// A live session with the agent.
pub struct Agent {
    rpc: EngineApiClient<Channel>,
    session: u64,
    staging: Arc<Staging>,
    base: usize,
    pub arena: Arc<Arena>,
    pub node: String,
    pub timeout: Duration,
    socket: PathBuf,
    /// `alloc_buffer` ranges by address.
    allocs: Mutex<BTreeMap<usize, Range>>,
    registered: Mutex<BTreeMap<usize, Registered>>,
    keepalive: tokio::task::JoinHandle<()>,
}

/// A failed RPC: an agent that is gone or unreachable is `Unavailable` (Mooncake's -900).
fn rpc_failure(socket: &Path, call: &str, s: &tonic::Status) -> Failure {
    let kind = match s.code() {
        tonic::Code::InvalidArgument => Kind::InvalidArgument,
        tonic::Code::ResourceExhausted => Kind::NoSpace,
        tonic::Code::Internal => Kind::Internal,
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Kind::AuthFailed,
        // NotFound names the session: the agent restarted or reaped it.
        _ => Kind::Unavailable,
    };
    let what = if s.code() == tonic::Code::NotFound {
        " (the agent no longer knows this session: it restarted or closed it; open a new store)"
    } else {
        ""
    };
    Failure::new(
        kind,
        format!(
            "agent at {}: {call} failed: {}{what}",
            socket.display(),
            s.message()
        ),
    )
}

fn connect_failure(socket: &Path, e: &EngineError) -> Failure {
    let mut msg = format!("cannot reach the kvpool agent at {}: {e}", socket.display());
    let mut next = std::error::Error::source(e);
    while let Some(s) = next {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        next = s.source();
    }
    Failure::new(Kind::Unavailable, msg)
}

/// The failure of an item's status (None for OK).
pub fn status_failure(status: Status, key: &[u8], length: u64) -> Option<Failure> {
    let key = String::from_utf8_lossy(key);
    let (kind, msg) = match status {
        Status::Ok => return None,
        Status::NotFound => (Kind::NotFound, format!("no object under key {key:?}")),
        Status::Invalid => (
            Kind::InvalidArgument,
            format!("the agent refused the item of key {key:?} as invalid"),
        ),
        Status::BufferTooSmall => (
            Kind::BufferTooSmall,
            format!("the value of key {key:?} ({length} bytes) does not fit the buffer"),
        ),
        Status::NoSpace => (
            Kind::NoSpace,
            format!("the pool has no room for key {key:?}"),
        ),
        Status::Unavailable => (
            Kind::Unavailable,
            format!("the pool's master cannot take key {key:?} now (unreachable or starting)"),
        ),
        Status::Internal | Status::Unspecified => (
            Kind::Internal,
            format!("the agent failed on key {key:?} (see the agent's log)"),
        ),
    };
    Some(Failure::new(kind, msg))
}

fn status_of(code: i32) -> Status {
    Status::try_from(code).unwrap_or(Status::Unspecified)
}

/// `len` bytes of a raw copy as a slice length; `None` when there is nothing to copy.
fn copy_len(len: u64) -> Result<Option<usize>, Failure> {
    let len = usize::try_from(len).map_err(|_| Failure::invalid("size too large"))?;
    Ok((len > 0).then_some(len))
}

impl Agent {
    /// Connect to the agent's socket and open a session of `staging_bytes`.
    pub async fn connect(s: &AgentSettings) -> Result<Self, Failure> {
        if !s.socket.exists() {
            return Err(Failure::new(
                Kind::Unavailable,
                format!(
                    "no kvpool agent socket at {} (is the node agent running? set \
                     KVPOOL_AGENT_SOCKET / agent_socket, or use mode=\"direct\")",
                    s.socket.display()
                ),
            ));
        }
        let timeout = s.request_timeout.max(Duration::from_millis(1));
        let channel = tokio::time::timeout(timeout, connect_channel(&s.socket))
            .await
            .map_err(|_| {
                Failure::new(
                    Kind::Unavailable,
                    format!("the agent at {} did not answer", s.socket.display()),
                )
            })?
            .map_err(|e| connect_failure(&s.socket, &e))?;
        let mut rpc = EngineApiClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let name = format!("kvpool-python/pid-{}", std::process::id());
        let call = rpc.open_session(OpenSessionRequest {
            staging_bytes: s.staging_bytes,
            client_name: name,
            numa_node: s.numa_node,
            gpu_pci_bus_id: s.gpu_pci_bus_id.clone().unwrap_or_default(),
        });
        let opened = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(st)) => return Err(rpc_failure(&s.socket, "open_session", &st)),
            Err(_) => {
                return Err(Failure::new(
                    Kind::Unavailable,
                    format!("the agent at {} did not open a session", s.socket.display()),
                ));
            }
        };
        let staging = Staging::open(Path::new(&opened.staging_path), opened.staging_bytes)
            .map_err(|e| {
                Failure::new(
                    Kind::Unavailable,
                    format!(
                        "mapping the agent's staging file {}: {e}: {}",
                        opened.staging_path,
                        std::error::Error::source(&e).map_or_else(String::new, |s| s.to_string())
                    ),
                )
            })?;
        let staging = Arc::new(staging);
        let base = staging.as_ptr() as usize;
        let keepalive = tokio::spawn(keep_alive(rpc.clone(), opened.session_id));
        Ok(Self {
            rpc,
            session: opened.session_id,
            arena: Arena::new(staging.size()),
            base,
            staging,
            node: format!("agent:{}#{}", s.socket.display(), opened.session_id),
            timeout,
            socket: s.socket.clone(),
            allocs: Mutex::new(BTreeMap::new()),
            registered: Mutex::new(BTreeMap::new()),
            keepalive,
        })
    }

    /// Run `call` on a clone of the client under the request timeout.
    async fn call<T, F>(
        &self,
        name: &str,
        call: impl FnOnce(EngineApiClient<Channel>) -> F,
    ) -> Result<T, Failure>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.timeout, call(self.rpc.clone())).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(st)) => Err(rpc_failure(&self.socket, name, &st)),
            Err(_) => Err(Failure::new(
                Kind::Unavailable,
                format!(
                    "agent at {}: {name} got no answer within {} ms",
                    self.socket.display(),
                    self.timeout.as_millis()
                ),
            )),
        }
    }

    /// One put RPC: `(key, offset, length)` items of the staging area; one status each.
    pub async fn put_rpc(&self, items: Vec<PutItem>) -> Result<Vec<Status>, Failure> {
        let sent = items.len();
        let req = PutRequest {
            session_id: self.session,
            items,
            numa_hint: None,
        };
        let resp = self
            .call("put", |mut c| async move { c.put(req).await })
            .await?;
        self.expect(sent, resp.statuses.len())?;
        Ok(resp.statuses.into_iter().map(status_of).collect())
    }

    /// One get RPC: `(key, offset, capacity)` items; one (status, length) each.
    pub async fn get_rpc(&self, items: Vec<GetItem>) -> Result<Vec<(Status, u64)>, Failure> {
        let sent = items.len();
        let req = GetRequest {
            session_id: self.session,
            items,
        };
        let resp = self
            .call("get", |mut c| async move { c.get(req).await })
            .await?;
        self.expect(sent, resp.results.len())?;
        Ok(resp
            .results
            .into_iter()
            .map(|GetResult { status, length }| (status_of(status), length))
            .collect())
    }

    pub async fn exists_rpc(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>, Failure> {
        let sent = keys.len();
        let req = ExistsRequest { keys };
        let resp = self
            .call("exists", |mut c| async move { c.exists(req).await })
            .await?;
        self.expect(sent, resp.present.len())?;
        Ok(resp.present)
    }

    pub async fn remove_rpc(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>, Failure> {
        let sent = keys.len();
        let req = RemoveRequest { keys };
        let resp = self
            .call("remove", |mut c| async move { c.remove(req).await })
            .await?;
        self.expect(sent, resp.removed.len())?;
        Ok(resp.removed)
    }

    fn expect(&self, sent: usize, got: usize) -> Result<(), Failure> {
        if sent == got {
            return Ok(());
        }
        Err(Failure::new(
            Kind::Internal,
            format!("the agent answered {got} results for {sent} items"),
        ))
    }

    /// Copy `src` into the staging area at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), Failure> {
        self.staging
            .write_from(offset, src)
            .map_err(|e| Failure::new(Kind::Internal, format!("staging: {e}")))
    }

    /// Copy the staging area at `offset` into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), Failure> {
        self.staging
            .read_into(offset, dst)
            .map_err(|e| Failure::new(Kind::Internal, format!("staging: {e}")))
    }

    /// Copy `len` bytes of caller memory at `ptr` (checked by [`Agent::place`]) into the
    /// staging area at `offset`.
    pub fn write_raw(&self, offset: u64, ptr: usize, len: u64) -> Result<(), Failure> {
        let Some(len) = copy_len(len)? else {
            return Ok(());
        };
        if let Some((dev, at)) = self.on_device(ptr) {
            // Device -> pinned staging -> the staging area: no host view of the GPU memory.
            let mut done = 0u64;
            return dev
                .device_memory_backing()
                .map(|mem| {
                    kvpool_transfer::memory::device::stream_out(mem, at, len, |chunk| {
                        self.staging
                            .write_from(offset + done, chunk)
                            .map_err(std::io::Error::other)?;
                        done += chunk.len() as u64;
                        Ok(())
                    })
                })
                .unwrap_or(Ok(()))
                .map_err(|e| Failure::new(Kind::Internal, format!("GPU buffer: {e}")));
        }
        // SAFETY: `place` found `ptr..ptr+len` inside a registered buffer or inside this
        // session's mapping; the kernel checks that it is still mapped (a buffer unmapped since
        // it was registered is an error, not a signal).
        unsafe {
            self.staging
                .write_from_caller(offset, ptr as *const u8, len)
        }
        .map_err(fault)
    }

    /// Copy `len` bytes of the staging area at `offset` to caller memory at `ptr` (checked by
    /// [`Agent::place`]).
    pub fn read_raw(&self, offset: u64, ptr: usize, len: u64) -> Result<(), Failure> {
        let Some(len) = copy_len(len)? else {
            return Ok(());
        };
        if let Some((dev, at)) = self.on_device(ptr) {
            let mut done = 0u64;
            return dev
                .device_memory_backing()
                .map(|mem| {
                    kvpool_transfer::memory::device::stream_in(mem, at, len, |chunk| {
                        self.staging
                            .read_into(offset + done, chunk)
                            .map_err(std::io::Error::other)?;
                        done += chunk.len() as u64;
                        Ok(())
                    })
                })
                .unwrap_or(Ok(()))
                .map_err(|e| Failure::new(Kind::Internal, format!("GPU buffer: {e}")));
        }
        // SAFETY: as in `write_raw`, for memory the caller registered as writable, an
        // `alloc_buffer` range of the mapping (distinct from the staging range read here), or
        // a Python buffer the calling op holds writable for the whole call (`get_into_slice`);
        // no reference to it exists here, and the kernel checks it is mapped and writable.
        unsafe { self.staging.read_into_caller(offset, ptr as *mut u8, len) }.map_err(fault)
    }

    /// The device segment of the registered GPU buffer holding `ptr`, and `ptr`'s offset in
    /// it (`place` already checked the range).
    fn on_device(&self, ptr: usize) -> Option<(Arc<kvpool_transfer::Segment>, u64)> {
        let reg = self.registered.lock();
        let (&start, r) = reg.range(..=ptr).next_back()?;
        let dev = r.device.clone()?;
        Some((dev, (ptr - start) as u64))
    }

    /// Where `ptr..ptr+len` lies: inside one `alloc_buffer` range, or inside one registered
    /// buffer; `NotRegistered` otherwise.
    pub fn place(&self, ptr: usize, len: u64) -> Result<Place, Failure> {
        let end = u64::try_from(ptr)
            .ok()
            .and_then(|p| p.checked_add(len))
            .ok_or_else(|| Failure::invalid(format!("memory {ptr:#x}+{len} wraps around")))?;
        let inside = |start: usize, size: u64| (start as u64) + size >= end;
        if let Some((&start, r)) = self.allocs.lock().range(..=ptr).next_back()
            && inside(start, r.len)
        {
            return Ok(Place::Staged(r.offset + (ptr - start) as u64));
        }
        if let Some((&start, r)) = self.registered.lock().range(..=ptr).next_back()
            && inside(start, r.len)
        {
            return Ok(Place::Caller(ptr));
        }
        let in_staging = ptr >= self.base && end <= (self.base as u64) + self.staging.size();
        Err(Failure::new(
            Kind::NotRegistered,
            if in_staging {
                format!(
                    "memory {ptr:#x}+{len} is in the staging area but not inside one range \
                     that alloc_buffer handed out"
                )
            } else {
                format!("memory {ptr:#x}+{len} is not inside a registered buffer or alloc_buffer")
            },
        ))
    }

    /// Hand `size` bytes of the staging area to the caller (no wait): address and length.
    pub fn alloc(&self, size: u64) -> Result<(usize, u64), Failure> {
        if size == 0 {
            return Err(Failure::invalid("alloc_buffer size must be positive"));
        }
        let range = self.arena.try_take(size).ok_or_else(|| {
            Failure::new(
                Kind::NoSpace,
                format!(
                    "the agent session's staging area ({} bytes, {} free) has no free range of \
                     {size} bytes",
                    self.arena.size(),
                    self.arena.free_bytes()
                ),
            )
        })?;
        let ptr = self.base + range.offset as usize;
        self.allocs.lock().insert(ptr, range);
        Ok((ptr, size))
    }

    /// Give back the `alloc_buffer` range at `ptr`; false when none starts there.
    pub fn free(&self, ptr: usize) -> bool {
        self.allocs.lock().remove(&ptr).is_some()
    }

    pub fn register(&self, ptr: usize, len: u64, view: Option<Held>) -> Result<(), Failure> {
        if len == 0 || ptr == 0 {
            return Err(Failure::invalid(format!(
                "buffer {ptr:#x}+{len}: address and size must be positive"
            )));
        }
        let end = ptr
            .checked_add(usize::try_from(len).map_err(|_| Failure::invalid("size too large"))?)
            .ok_or_else(|| Failure::invalid("buffer wraps around the address space"))?;
        let mut reg = self.registered.lock();
        if reg
            .range(..end)
            .next_back()
            .is_some_and(|(s, r)| s.saturating_add(r.len as usize) > ptr)
        {
            return Err(Failure::invalid(format!(
                "buffer {ptr:#x}+{len} overlaps a registered buffer"
            )));
        }
        let device = crate::device::segment(ptr, len as usize)?;
        reg.insert(
            ptr,
            Registered {
                len,
                device,
                _view: view,
            },
        );
        Ok(())
    }

    pub fn unregister(&self, ptr: usize) -> bool {
        self.registered.lock().remove(&ptr).is_some()
    }

    pub fn registered_count(&self) -> usize {
        self.registered.lock().len()
    }

    /// Close the session (the agent removes the staging file; this process's mapping stays
    /// until the store is dropped, and for good while `alloc_buffer` ranges are out, so their
    /// memory stays valid). An agent already gone is not an error.
    pub async fn close(&self) {
        self.keepalive.abort();
        self.registered.lock().clear();
        {
            let mut allocs = self.allocs.lock();
            if !allocs.is_empty() {
                std::mem::forget(Arc::clone(&self.staging));
                // The ranges are never reused: the arena goes with the store.
                allocs.clear();
            }
        }
        let req = CloseSessionRequest {
            session_id: self.session,
        };
        let _ = self
            .call("close_session", |mut c| async move {
                c.close_session(req).await
            })
            .await;
    }

    /// A get of no items: the agent answers and knows the session.
    pub async fn ping(&self) -> Result<(), Failure> {
        self.get_rpc(Vec::new()).await.map(|_| ())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}

/// Touch the session every [`KEEPALIVE`] so that an idle store keeps it.
async fn keep_alive(mut rpc: EngineApiClient<Channel>, session_id: u64) {
    loop {
        tokio::time::sleep(KEEPALIVE).await;
        let req = GetRequest {
            session_id,
            items: Vec::new(),
        };
        let _ = tokio::time::timeout(KEEPALIVE, rpc.get(req)).await;
    }
}
