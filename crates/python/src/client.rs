//! Direct mode's connection: the transfer engine, the master client and pool client, the
//! registered buffers (and the ones `alloc_buffer` made), and the segment this process
//! contributes (when it does). Every call on it runs with the GIL released. I/O boundary: what
//! the pool client reaches (the master's gRPC channel, the agents' transfer targets) and the
//! holder's TCP target.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use std::collections::HashMap;

use parking_lot::Mutex;
use prometheus::Registry;

use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_client::pool::{LocalSegments, PoolClient, tcp_endpoint};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer::{
    self as transfer, EngineConfig, StaticDirectory, TcpServer, TransferEngine, TransferMetrics,
};

use crate::buffers::Buffers;
use crate::errors::{Failure, Kind};
use crate::holder::Holder;

/// What a store is set up with (from `setup(...)`, `setup(config)` or the environment, sorted
/// out by the Python layer).
#[derive(Clone, Debug)]
pub struct Settings {
    pub masters: Vec<String>,
    pub auth_key_file: PathBuf,
    pub local_hostname: String,
    pub global_segment_size: u64,
    pub protocol: String,
    pub request_timeout_ms: u64,
}

/// A live connection: the pool client of the calling thread (see [`Live::fork`]) over the
/// state all of the store's threads share.
pub struct Live {
    pub pool: PoolClient,
    shared: Arc<Shared>,
}

/// What every fork of a connection shares.
pub struct Shared {
    pub engine: TransferEngine,
    pub buffers: Mutex<Buffers>,
    pub node: String,
    pub registry: Registry,
    holder: Option<Holder>,
    /// Memory `alloc_buffer` made (address -> size), registered in `buffers`.
    allocs: Mutex<HashMap<usize, u64>>,
    /// Serves the contributed segment while the store is open.
    _server: Option<TcpServer>,
    /// A client that contributes nothing holds this port (listening, never accepting) so that
    /// its `host:port` name is unique on the host, as Mooncake's clients' names are.
    _name_port: Option<std::net::TcpListener>,
}

impl std::ops::Deref for Live {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.shared
    }
}

fn internal(what: &str) -> impl FnOnce(std::io::Error) -> Failure + '_ {
    move |e| Failure::new(Kind::Internal, format!("{what}: {e}"))
}

/// Alignment of `alloc_buffer` memory (a page).
const ALLOC_ALIGN: usize = 4096;

fn alloc_layout(size: u64) -> Result<std::alloc::Layout, Failure> {
    usize::try_from(size)
        .ok()
        .filter(|n| *n > 0)
        .and_then(|n| std::alloc::Layout::from_size_align(n, ALLOC_ALIGN).ok())
        .ok_or_else(|| Failure::invalid(format!("alloc_buffer size {size} must be positive")))
}

impl Live {
    /// Unmount the contributed segment, drop the registered buffers and the connection.
    pub async fn shut(live: Arc<Live>) -> Result<(), Failure> {
        live.buffers.lock().clear();
        // Memory alloc_buffer made stays allocated: Python may still hold views of it.
        live.allocs.lock().clear();
        // A call still running on another thread keeps the connection; its holder goes when
        // that call ends (the master drops the segment once heartbeats stop).
        let holder = Arc::try_unwrap(live)
            .ok()
            .and_then(|l| Arc::try_unwrap(l.shared).ok())
            .and_then(|mut s| s.holder.take());
        if let Some(h) = holder {
            h.stop().await?;
        }
        Ok(())
    }

    /// The same connection for one thread that drives its calls itself on a current-thread
    /// runtime (see [`PoolClient::fork`]); lease releases go through this one, on `runtime`.
    pub fn fork(&self, runtime: tokio::runtime::Handle) -> Live {
        Live {
            pool: self.pool.fork(runtime),
            shared: self.shared.clone(),
        }
    }

    /// `size` bytes of fresh zeroed memory, page-aligned and registered: address and size.
    pub fn alloc(&self, size: u64) -> Result<(usize, u64), Failure> {
        let layout = alloc_layout(size)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        if ptr == 0 {
            return Err(Failure::new(
                Kind::NoSpace,
                format!("cannot allocate {size} bytes"),
            ));
        }
        let registered = self
            .buffers
            .lock()
            .register(&self.engine, &self.node, ptr, size, None);
        if let Err(e) = registered {
            // SAFETY: allocated just above with this layout, never handed out.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
            return Err(e);
        }
        self.allocs.lock().insert(ptr, size);
        Ok((ptr, size))
    }

    /// Unregister and free the `alloc_buffer` memory at `ptr`; false when none starts there.
    pub fn free(&self, ptr: usize) -> bool {
        let Some(size) = self.allocs.lock().remove(&ptr) else {
            return false;
        };
        self.buffers.lock().unregister(ptr);
        if let Ok(layout) = alloc_layout(size) {
            // SAFETY: `alloc` allocated `ptr` with this layout; it is unregistered, and the
            // caller gave it back (Python must not use it any more).
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
        true
    }
}

fn protocol_wants_rdma(protocol: &str) -> Result<bool, Failure> {
    match protocol.to_ascii_lowercase().as_str() {
        "tcp" | "" => Ok(false),
        "rdma" => Ok(true),
        other => Err(Failure::invalid(format!(
            "protocol {other:?} is not supported (use \"tcp\" or \"rdma\")"
        ))),
    }
}

/// How long a call waiting alone for an answer polls before it sleeps (`KVPOOL_SPIN_WAIT_US`,
/// microseconds; default [`DEFAULT_SPIN_WAIT_US`], 0 turns polling off): an engine thread that
/// waits for its block anyway is answered sooner, for at most that much CPU per call.
fn spin_wait() -> Result<std::time::Duration, Failure> {
    match std::env::var("KVPOOL_SPIN_WAIT_US") {
        Err(_) => Ok(std::time::Duration::from_micros(DEFAULT_SPIN_WAIT_US)),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|us| *us <= 10_000)
            .map(std::time::Duration::from_micros)
            .ok_or_else(|| {
                Failure::invalid(format!(
                    "KVPOOL_SPIN_WAIT_US={v:?} must be a number of microseconds from 0 to 10000"
                ))
            }),
    }
}

/// Per-frame integrity of the engine's TCP lanes (`KVPOOL_TRANSFER_INTEGRITY`: `off`, `allow`,
/// the default, or `require`: every frame to and from the pool's agents sealed, see
/// docs/transfer.md "Per-frame integrity").
pub fn transfer_integrity() -> Result<transfer::Integrity, Failure> {
    match std::env::var("KVPOOL_TRANSFER_INTEGRITY") {
        Err(_) => Ok(transfer::Integrity::Allow),
        Ok(v) => match v.trim() {
            "" | "allow" => Ok(transfer::Integrity::Allow),
            "off" => Ok(transfer::Integrity::Off),
            "require" => Ok(transfer::Integrity::Require),
            _ => Err(Failure::invalid(format!(
                "KVPOOL_TRANSFER_INTEGRITY={v:?} must be one of off, allow, require"
            ))),
        },
    }
}

/// Whether replicas on this node's agent are mapped through its shared memory
/// (`KVPOOL_SAME_NODE_SHM`: `on`, the default, or `off`: every replica over TCP; see
/// docs/transfer.md "Same-node shared memory in pool mode").
pub fn same_node_shm() -> Result<bool, Failure> {
    match std::env::var("KVPOOL_SAME_NODE_SHM") {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "" | "on" | "1" | "true" => Ok(true),
            "off" | "0" | "false" => Ok(false),
            _ => Err(Failure::invalid(format!(
                "KVPOOL_SAME_NODE_SHM={v:?} must be on or off"
            ))),
        },
    }
}

/// Default of `KVPOOL_SPIN_WAIT_US`.
pub const DEFAULT_SPIN_WAIT_US: u64 = 50;

pub async fn connect(s: &Settings) -> Result<Live, Failure> {
    if s.masters.is_empty() {
        return Err(Failure::invalid(
            "no master address: pass master_server_addr, or set KVPOOL_MASTER",
        ));
    }
    let want_rdma = protocol_wants_rdma(&s.protocol)?;
    let master_key = MasterKey::from_file(&s.auth_key_file).map_err(|e| {
        Failure::new(
            Kind::AuthFailed,
            format!("auth key file {}: {e}", s.auth_key_file.display()),
        )
    })?;
    let transfer_key = transfer::AuthKey::from_file(&s.auth_key_file).map_err(|e| {
        Failure::new(
            Kind::AuthFailed,
            format!("auth key file {}: {e}", s.auth_key_file.display()),
        )
    })?;
    let registry = Registry::new();
    let metrics = TransferMetrics::new(&registry)
        .map_err(|e| Failure::new(Kind::Internal, format!("client metrics: {e}")))?;
    let spin = spin_wait()?;
    let host = s.local_hostname.trim();
    let host = if host.is_empty() { "127.0.0.1" } else { host };
    let engine = TransferEngine::new(
        EngineConfig {
            node: format!("{host}/pid-{}", std::process::id()),
            want_rdma,
            prefer_shm: false,
            spin_wait: spin,
            integrity: transfer_integrity()?,
            tls: kvpool_client::pool::transfer_tls_from_env()
                .map_err(|e| Failure::invalid(e.to_string()))?,
            ..EngineConfig::default()
        },
        transfer_key,
        Arc::new(StaticDirectory::new()),
        metrics,
    )
    .map_err(|e| Failure::new(Kind::Internal, format!("starting the transfer engine: {e}")))?;
    let config = ClientConfig {
        request_timeout: std::time::Duration::from_millis(s.request_timeout_ms.max(1)),
        spin_wait: spin,
        ..ClientConfig::default()
    };
    let master = MasterClient::new(s.masters.clone(), master_key, config)?;
    let local = LocalSegments::default();
    let mut name_port = None;
    let (node, server, holder) = if s.global_segment_size > 0 {
        let ip: IpAddr = host.parse().map_err(|_| {
            Failure::invalid(format!(
                "local_hostname {host:?} must be an IP address when contributing memory \
                 (global_segment_size > 0): peers reach the segment there"
            ))
        })?;
        let server = engine
            .listen_tcp(SocketAddr::new(ip, 0))
            .map_err(|e| Failure::new(Kind::Unavailable, format!("listening on {ip}: {e}")))?;
        let addr = server.local_addr();
        let node = addr.to_string();
        let holder = Holder::start(
            &engine,
            master.clone(),
            &node,
            &tcp_endpoint(addr),
            s.global_segment_size,
            &local,
        )
        .await?;
        (node, Some(server), Some(holder))
    } else {
        let ip: IpAddr = host.parse().unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let held = std::net::TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(internal("reserving a port for the client's name"))?;
        let port = held
            .local_addr()
            .map_err(internal("reserving a port for the client's name"))?
            .port();
        name_port = Some(held);
        (format!("{host}:{port}"), None, None)
    };
    let pool = PoolClient::new(master, engine.clone(), node.clone(), None)
        .with_local_segments(local)
        .with_same_node_shm(same_node_shm()?);
    Ok(Live {
        pool,
        shared: Arc::new(Shared {
            engine,
            buffers: Mutex::new(Buffers::default()),
            node,
            registry,
            holder,
            allocs: Mutex::new(HashMap::new()),
            _server: server,
            _name_port: name_port,
        }),
    })
}
