//! Which way a store reaches the pool, and the one place every call picks its path: directly
//! (`client`/`ops`: the pool client talks to the master and moves bytes by the transfer
//! engine) or through the node agent's engine socket (`agent`/`agent_ops`: shared-memory
//! staging, the agent stores through the pool). [`Conn`] holds the runtime and the [`Link`];
//! each method of [`Link`] is one call of the Python API. I/O boundary: none of its own (each
//! path names its own).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::agent::{Agent, AgentSettings};
use crate::agent_ops::{self as aops, Dst, Piece, Src};
use crate::buffers::Held;
use crate::client::{Live, Settings, connect};
use crate::errors::{Failure, Kind};
use crate::ops::{self, PartsItems, PutArgs, code_of};
use crate::threads::{Fork, Forks};

/// How a store connects (`mode=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Direct,
    Agent,
}

/// `mode` as asked ("direct", "agent", "auto" or empty), settled: "auto" is agent mode when an
/// agent socket is named, its file exists and the store contributes no memory (only a direct
/// store can: `global_segment_size`), direct mode otherwise.
pub fn choose_mode(
    mode: &str,
    agent_socket: Option<&Path>,
    global_segment_size: u64,
) -> Result<Mode, Failure> {
    match mode.trim().to_ascii_lowercase().as_str() {
        "direct" => Ok(Mode::Direct),
        "agent" => Ok(Mode::Agent),
        "auto" | "" => Ok(match agent_socket {
            Some(p) if !p.as_os_str().is_empty() && p.exists() && global_segment_size == 0 => {
                Mode::Agent
            }
            _ => Mode::Direct,
        }),
        other => Err(Failure::invalid(format!(
            "mode {other:?} is not one of \"direct\", \"agent\", \"auto\""
        ))),
    }
}

/// Whether the credential `s` names may mount segments (lend memory): the pool key or an agent
/// credential. An unreadable file counts as allowed here; connecting reports it.
fn may_lend(s: &Settings) -> bool {
    use kvpool_proto::auth::{AuthKey, Role};
    AuthKey::from_file(&s.auth_key_file)
        .map_or(true, |k| matches!(k.role(), Role::Admin | Role::Agent))
}

/// Everything a store may be opened with.
pub struct Options {
    pub mode: String,
    pub direct: Settings,
    pub agent_socket: Option<PathBuf>,
    pub staging_bytes: u64,
    /// Agent mode: where the engine runs (NUMA node, GPU PCI bus id), told to the agent.
    pub numa_node: Option<u32>,
    pub gpu_pci_bus_id: Option<String>,
}

/// A live connection, one way or the other.
#[derive(Clone)]
pub enum Link {
    Direct(Arc<Live>),
    Agent(Arc<Agent>),
}

/// A store's runtime and its connection (none once closed).
pub struct Conn {
    pub runtime: tokio::runtime::Runtime,
    link: RwLock<Option<Link>>,
    pub mode: Mode,
    /// Calling threads' own runtimes and connections (direct mode).
    pub forks: Forks<Link>,
}

impl Conn {
    /// Start the runtime and connect as `opts` say.
    pub fn open(opts: &Options) -> Result<Self, Failure> {
        // (Python's `Settings.resolve` already gave an engine credential beside an agent
        // agent mode; here a direct store that may not lend memory is refused before it
        // mounts anything.)
        let direct = &opts.direct;
        let mode = choose_mode(
            &opts.mode,
            opts.agent_socket.as_deref(),
            direct.global_segment_size,
        )?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvpool-py")
            .enable_all()
            .build()
            .map_err(|e| Failure::new(Kind::Internal, format!("starting the runtime: {e}")))?;
        let link = match mode {
            Mode::Direct => {
                if direct.global_segment_size > 0 && !may_lend(direct) {
                    return Err(Failure::new(
                        Kind::AuthFailed,
                        format!(
                            "global_segment_size {}: the credential in {} may not lend memory \
                             to the pool (only agent and admin credentials mount segments); \
                             set global_segment_size to 0, or run beside a kvpool node agent \
                             (agent mode)",
                            direct.global_segment_size,
                            direct.auth_key_file.display()
                        ),
                    ));
                }
                Link::Direct(Arc::new(runtime.block_on(connect(direct))?))
            }
            Mode::Agent => {
                if direct.global_segment_size > 0 {
                    return Err(Failure::invalid(
                        "global_segment_size must be 0 in agent mode: the node agent owns the \
                         node's memory (use mode=\"direct\" to contribute memory)",
                    ));
                }
                let socket = opts.agent_socket.clone().unwrap_or_default();
                if socket.as_os_str().is_empty() {
                    return Err(Failure::invalid(
                        "agent mode needs the agent's socket: pass agent_socket or set \
                         KVPOOL_AGENT_SOCKET",
                    ));
                }
                let settings = AgentSettings {
                    socket,
                    staging_bytes: opts.staging_bytes,
                    request_timeout: Duration::from_millis(opts.direct.request_timeout_ms),
                    numa_node: opts.numa_node,
                    gpu_pci_bus_id: opts.gpu_pci_bus_id.clone(),
                };
                Link::Agent(Arc::new(runtime.block_on(Agent::connect(&settings))?))
            }
        };
        Ok(Self {
            runtime,
            link: RwLock::new(Some(link)),
            mode,
            forks: Forks::default(),
        })
    }

    /// The calling thread's own runtime and fork of the connection (see `threads`); `None` in
    /// agent mode or when too many threads have one.
    pub fn fork(&self) -> Result<Option<Arc<Fork<Link>>>, Failure> {
        if self.mode == Mode::Agent {
            return Ok(None);
        }
        self.forks.get(|| match self.link()? {
            Link::Direct(live) => Ok(Some(Link::Direct(Arc::new(
                live.fork(self.runtime.handle().clone()),
            )))),
            Link::Agent(_) => Ok(None),
        })
    }

    /// The connection, or `Closed`.
    pub fn link(&self) -> Result<Link, Failure> {
        self.link
            .read()
            .clone()
            .ok_or_else(|| Failure::new(Kind::Closed, "the store is closed"))
    }

    /// Drop the connection (direct: unmount the contributed segment; agent: close the
    /// session). Closing twice is a no-op.
    pub fn close(&self) -> Result<(), Failure> {
        let Some(link) = self.link.write().take() else {
            return Ok(());
        };
        self.forks.clear();
        match link {
            Link::Direct(live) => self.runtime.block_on(Live::shut(live)),
            Link::Agent(agent) => {
                self.runtime.block_on(agent.close());
                Ok(())
            }
        }
    }
}

fn empty_value() -> Failure {
    Failure::invalid("the value is empty")
}

impl Link {
    pub fn node(&self) -> String {
        match self {
            Link::Direct(l) => l.node.clone(),
            Link::Agent(a) => a.node.clone(),
        }
    }

    pub async fn put(&self, key: &[u8], value: &[u8], args: &PutArgs) -> Result<(), Failure> {
        match self {
            Link::Direct(l) => ops::put(l, key, value, args).await,
            Link::Agent(a) => {
                aops::check_args(args)?;
                if value.is_empty() {
                    return Err(empty_value());
                }
                aops::put_one(a, key, Src::Copy(vec![Piece::Bytes(value)])).await
            }
        }
    }

    pub async fn put_from(
        &self,
        key: &[u8],
        ptr: usize,
        len: u64,
        args: &PutArgs,
    ) -> Result<(), Failure> {
        match self {
            Link::Direct(l) => ops::put_from(l, key, ptr, len, args).await,
            Link::Agent(a) => {
                aops::check_args(args)?;
                if len == 0 {
                    return if key.is_empty() {
                        Err(Failure::invalid("the key is empty"))
                    } else {
                        Ok(())
                    };
                }
                aops::put_one(a, key, aops::src_of(a, ptr, len)?).await
            }
        }
    }

    pub async fn get(&self, key: &[u8]) -> Result<Vec<u8>, Failure> {
        match self {
            Link::Direct(l) => ops::get(l, key).await,
            Link::Agent(a) => {
                let (_, value) = aops::get_one(a, key, Dst::Bytes(aops::guess(a))).await?;
                Ok(value.unwrap_or_default())
            }
        }
    }

    /// Read into a Python buffer; its length.
    pub async fn get_into_slice(&self, key: &[u8], out: &mut [u8]) -> Result<u64, Failure> {
        match self {
            Link::Direct(l) => ops::get_into_slice(l, key, out).await,
            Link::Agent(a) => {
                let ptr = out.as_mut_ptr() as usize;
                let dst = Dst::Copy(
                    vec![(crate::agent::Place::Caller(ptr), out.len() as u64)],
                    false,
                );
                // `out` is borrowed for the whole call: the copy lands in it before this returns.
                Ok(aops::get_one(a, key, dst).await?.0)
            }
        }
    }

    pub async fn get_into(&self, key: &[u8], ptr: usize, len: u64) -> Result<u64, Failure> {
        match self {
            Link::Direct(l) => ops::get_into(l, key, ptr, len).await,
            Link::Agent(a) => Ok(aops::get_one(a, key, aops::dst_of(a, ptr, len)?).await?.0),
        }
    }

    pub async fn batch_put_from(
        &self,
        items: &[(Vec<u8>, usize, u64)],
        args: &PutArgs,
    ) -> Vec<i64> {
        let a = match self {
            Link::Direct(l) => return ops::batch_put_from(l, items, args).await,
            Link::Agent(a) => a,
        };
        let planned = items
            .iter()
            .map(|(key, ptr, len)| {
                aops::check_put(key, args)?;
                if *len == 0 {
                    return Err(empty_value());
                }
                aops::src_of(a, *ptr, *len)
            })
            .collect();
        codes(put_planned(a, items.iter().map(|i| i.0.as_slice()), planned).await)
    }

    pub async fn batch_get_into(&self, items: &[(Vec<u8>, usize, u64)]) -> Vec<i64> {
        let a = match self {
            Link::Direct(l) => return ops::batch_get_into(l, items).await,
            Link::Agent(a) => a,
        };
        let planned = items
            .iter()
            .map(|(_, ptr, len)| aops::dst_of(a, *ptr, *len))
            .collect();
        lengths(get_planned(a, items.iter().map(|i| i.0.as_slice()), planned).await)
    }

    pub async fn batch_put_parts(&self, items: &PartsItems, args: &PutArgs) -> Vec<i64> {
        let a = match self {
            Link::Direct(l) => return ops::batch_put_parts(l, items, args).await,
            Link::Agent(a) => a,
        };
        let planned = items
            .iter()
            .map(|(key, parts)| {
                aops::check_put(key, args)?;
                aops::parts_src(a, parts)
            })
            .collect();
        codes(put_planned(a, items.iter().map(|i| i.0.as_slice()), planned).await)
    }

    pub async fn batch_get_parts(&self, items: &PartsItems, parts: Option<&[u64]>) -> Vec<i64> {
        let a = match self {
            Link::Direct(l) => return ops::batch_get_parts(l, items, parts).await,
            Link::Agent(a) => a,
        };
        if parts.is_some() {
            // The engine API moves whole values only.
            let code = Failure::new(
                Kind::NotSupported,
                "reading part of a value is not offered in agent mode",
            )
            .code();
            return vec![code; items.len()];
        }
        let planned = items
            .iter()
            .map(|(_, parts)| aops::parts_dst(a, parts))
            .collect();
        lengths(get_planned(a, items.iter().map(|i| i.0.as_slice()), planned).await)
    }

    pub async fn batch_put(
        &self,
        items: &[(Vec<u8>, &[u8])],
        args: &PutArgs,
    ) -> Vec<Result<(), Failure>> {
        let a = match self {
            Link::Direct(l) => return ops::batch_put(l, items, args).await,
            Link::Agent(a) => a,
        };
        let planned = items
            .iter()
            .map(|(key, value)| {
                aops::check_put(key, args)?;
                if value.is_empty() {
                    return Err(empty_value());
                }
                Ok(Src::Copy(vec![Piece::Bytes(value)]))
            })
            .collect();
        put_planned(a, items.iter().map(|i| i.0.as_slice()), planned).await
    }

    pub async fn batch_get(&self, keys: &[Vec<u8>]) -> Vec<Result<Vec<u8>, Failure>> {
        let a = match self {
            Link::Direct(l) => return ops::batch_get(l, keys).await,
            Link::Agent(a) => a,
        };
        let guess = aops::guess(a);
        let planned = keys.iter().map(|_| Ok(Dst::Bytes(guess))).collect();
        let got = get_planned(a, keys.iter().map(Vec::as_slice), planned).await;
        got.into_iter()
            .map(|r| r.map(|g| g.1.unwrap_or_default()))
            .collect()
    }

    pub async fn exists(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>, Failure> {
        match self {
            Link::Direct(l) => ops::exists(l, keys).await,
            Link::Agent(a) => aops::exists(a, keys).await,
        }
    }

    pub async fn size(&self, key: &[u8]) -> Result<u64, Failure> {
        match self {
            Link::Direct(l) => ops::size(l, key).await,
            Link::Agent(a) => aops::size(a, key).await,
        }
    }

    pub async fn remove(&self, key: &[u8], force: bool) -> Result<(), Failure> {
        match self {
            Link::Direct(l) => ops::remove(l, key, force).await,
            Link::Agent(a) => aops::remove(a, key, force).await,
        }
    }

    pub async fn remove_all(&self, force: bool) -> Result<u64, Failure> {
        match self {
            Link::Direct(l) => ops::remove_all(l, force).await,
            Link::Agent(_) => Err(Failure::new(
                Kind::NotSupported,
                "remove_all is not offered in agent mode (the engine API removes named keys \
                 only); use mode=\"direct\"",
            )),
        }
    }

    pub async fn health(&self) -> Result<(), Failure> {
        match self {
            Link::Direct(l) => ops::health(l).await,
            Link::Agent(a) => aops::health(a).await,
        }
    }

    /// Register caller memory (`view`: the Python object holding it in place).
    pub fn register(&self, ptr: usize, len: u64, view: Option<Held>) -> Result<(), Failure> {
        match self {
            Link::Direct(l) => l
                .buffers
                .lock()
                .register(&l.engine, &l.node, ptr, len, view),
            Link::Agent(a) => a.register(ptr, len, view),
        }
    }

    pub fn unregister(&self, ptr: usize) -> bool {
        match self {
            Link::Direct(l) => l.buffers.lock().unregister(ptr),
            Link::Agent(a) => a.unregister(ptr),
        }
    }

    pub fn registered(&self) -> usize {
        match self {
            Link::Direct(l) => l.buffers.lock().count(),
            Link::Agent(a) => a.registered_count(),
        }
    }

    /// Memory for zero-copy puts and gets: a range of the staging area in agent mode; in
    /// direct mode a fresh buffer, registered.
    pub fn alloc(&self, size: u64) -> Result<(usize, u64), Failure> {
        match self {
            Link::Direct(l) => l.alloc(size),
            Link::Agent(a) => a.alloc(size),
        }
    }

    pub fn free(&self, ptr: usize) -> bool {
        match self {
            Link::Direct(l) => l.free(ptr),
            Link::Agent(a) => a.free(ptr),
        }
    }

    /// The client's metrics registry (direct mode's transfer engine; empty in agent mode).
    pub fn metrics(&self) -> Vec<prometheus::proto::MetricFamily> {
        match self {
            Link::Direct(l) => l.registry.gather(),
            Link::Agent(_) => Vec::new(),
        }
    }
}

fn codes(results: Vec<Result<(), Failure>>) -> Vec<i64> {
    results
        .into_iter()
        .map(|r| code_of(r.map(|()| 0)))
        .collect()
}

/// The lengths read (or Mooncake's negative codes) of gets.
fn lengths(got: Vec<Result<aops::Got, Failure>>) -> Vec<i64> {
    got.into_iter().map(|r| code_of(r.map(|g| g.0))).collect()
}

/// Puts of the items whose sources could be planned; the others keep their failure.
async fn put_planned<'k>(
    a: &Agent,
    keys: impl Iterator<Item = &'k [u8]>,
    planned: Vec<Result<Src<'_>, Failure>>,
) -> Vec<Result<(), Failure>> {
    let planned = Planned::new(keys, planned);
    let answers = aops::put_all(a, &planned.items).await;
    planned.answered(answers)
}

/// Gets of the items whose destinations could be planned; the others keep their failure.
async fn get_planned<'k>(
    a: &Agent,
    keys: impl Iterator<Item = &'k [u8]>,
    planned: Vec<Result<Dst, Failure>>,
) -> Vec<Result<aops::Got, Failure>> {
    let planned = Planned::new(keys, planned);
    let answers = aops::get_all(a, &planned.items).await;
    planned.answered(answers)
}

/// The items of a batch whose plan succeeded, with their places among all items, and every
/// item's answer so far (its planning failure, or a stand-in until the batch answers).
struct Planned<'k, P, R> {
    items: Vec<(&'k [u8], P)>,
    at: Vec<usize>,
    out: Vec<Result<R, Failure>>,
}

impl<'k, P, R: Default> Planned<'k, P, R> {
    fn new(keys: impl Iterator<Item = &'k [u8]>, planned: Vec<Result<P, Failure>>) -> Self {
        let mut split = Self {
            items: Vec::new(),
            at: Vec::new(),
            out: Vec::with_capacity(planned.len()),
        };
        for (i, (key, p)) in keys.zip(planned).enumerate() {
            match p {
                Ok(plan) => {
                    split.items.push((key, plan));
                    split.at.push(i);
                    split.out.push(Ok(R::default()));
                }
                Err(f) => split.out.push(Err(f)),
            }
        }
        split
    }

    /// Every item's answer: `answers` (one per planned item, in order) in their places.
    fn answered(mut self, answers: Vec<Result<R, Failure>>) -> Vec<Result<R, Failure>> {
        for (i, r) in self.at.into_iter().zip(answers) {
            self.out[i] = r;
        }
        self.out
    }
}
