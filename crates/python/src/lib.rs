//! `kvpool._native`: the pool client for Python. One class, `Client`, that the package's
//! Python layers (`kvpool.Store`, `kvpool.mooncake`) wrap: every call releases the GIL while
//! it waits on the pool, takes keys as `str` or `bytes`, values as any object with the buffer
//! protocol, and registered memory as raw addresses. Failures raise the exceptions of
//! `errors`, each with kvpool's `kind` and Mooncake's `code`; the batch calls that Mooncake's
//! API answers with codes return them per item.
//!
//! - `link`: the runtime and the connection, direct or through the node agent, and the one
//!   place each call picks its path.
//! - direct mode: `client` (connection, contributed segment), `holder` (that segment), `ops`
//!   (the calls), `buffers` (registered memory).
//! - agent mode: `agent` (engine-API session, staging mapping), `staging` (its allocator),
//!   `agent_ops` (the calls).
//! - `errors`: kinds, codes and exceptions.

use std::path::PathBuf;

use crate::link::Link;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

mod agent;
mod agent_ops;
mod buffers;
mod client;
mod device;
mod errors;
mod holder;
mod link;
mod ops;
mod p2p;
mod p2p_api;
mod p2p_table;
mod pending;
mod placement;
mod staging;
mod threads;

use buffers::Held;
use client::Settings;
use errors::{Failure, Kind};
use link::{Conn, Mode, Options};
use pending::PendingGet;
use placement::{Placement, placed};

/// A key with the registered ranges its value spans.
type PartsItem = (Vec<u8>, Vec<(usize, u64)>);

/// Staging area an agent-mode store asks for when not told (`staging_bytes`).
const DEFAULT_STAGING_BYTES: u64 = 64 << 20;

/// A key: `str` (UTF-8 bytes) or `bytes`.
#[derive(FromPyObject)]
enum Key {
    Str(String),
    Bytes(Vec<u8>),
}

/// Prefix of the stand-in for a key longer than the master takes; NUL bytes keep it apart
/// from any text key.
const LONG_KEY_PREFIX: &[u8] = b"\0kvpool-sha256\0";

impl Key {
    /// The key as the master gets it: its bytes, or for a key longer than the master's limit
    /// a SHA-256 digest of them (the same in every client, so long keys work like any other).
    fn into_bytes(self) -> Vec<u8> {
        let bytes = match self {
            Key::Str(s) => s.into_bytes(),
            Key::Bytes(b) => b,
        };
        if bytes.len() <= kvpool_proto::master::MAX_KEY_BYTES {
            return bytes;
        }
        use sha2::Digest;
        let mut out = LONG_KEY_PREFIX.to_vec();
        out.extend_from_slice(&sha2::Sha256::digest(&bytes));
        out
    }
}

fn keys(keys: Vec<Key>) -> Vec<Vec<u8>> {
    keys.into_iter().map(Key::into_bytes).collect()
}

/// Three lists of one length.
fn same_length(keys: usize, ptrs: usize, sizes: usize) -> Result<(), Failure> {
    if keys == ptrs && keys == sizes {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "{keys} keys, {ptrs} buffer addresses and {sizes} sizes: the lists must have one \
             length"
        )))
    }
}

/// An exception object for a failed batch item.
fn exception(py: Python<'_>, f: Failure) -> Py<PyAny> {
    PyErr::from(f).into_value(py).into_any()
}

/// A connection to a kvpool pool (see the module docs).
#[pyclass(module = "kvpool._native", frozen)]
struct Client {
    conn: Conn,
}

/// What a call is, for where it runs (see [`Client::block`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// One operation, or a batch that makes one master call and one transfer batch for all
    /// of its items (the registered-memory batches): on the calling thread when it is the
    /// store's only call in flight.
    One,
    /// A batch of calls made item by item: always on the shared runtime, where its items
    /// share master calls and lanes.
    Batch,
}

impl Client {
    /// Run `call` with the GIL released. A [`Call::One`] alone in flight (direct mode) runs on
    /// the calling thread's own runtime and connection (see `threads`); anything else on the
    /// shared runtime, with the calls it can share master calls and transfer lanes with.
    fn block<T: Send + 'static, F>(
        &self,
        py: Python<'_>,
        kind: Call,
        call: impl FnOnce(Link) -> F,
    ) -> PyResult<T>
    where
        F: Future<Output = Result<T, Failure>> + Send + 'static,
    {
        let in_flight = self.conn.forks.enter();
        if kind == Call::One
            && in_flight.alone
            && let Some(fork) = self.conn.fork()?
        {
            let call = call(fork.link.clone());
            return Ok(py.detach(|| fork.runtime.block_on(call))?);
        }
        self.on_shared(py, call(self.conn.link()?))
    }

    /// Spawn `call` as a task on the shared runtime's workers and wait for it with the GIL
    /// released.
    fn on_shared<T: Send + 'static>(
        &self,
        py: Python<'_>,
        call: impl Future<Output = Result<T, Failure>> + Send + 'static,
    ) -> PyResult<T> {
        let rt = &self.conn.runtime;
        let task = rt.spawn(call);
        let joined = py.detach(|| rt.block_on(task));
        match joined {
            Ok(r) => Ok(r?),
            Err(e) => {
                Err(Failure::new(Kind::Internal, format!("the call's task failed: {e}")).into())
            }
        }
    }
}

#[pymethods]
impl Client {
    /// Connect to the pool. `mode`: "direct" (the masters at `masters`, with the pool key in
    /// `auth_key_file`), "agent" (the node agent's engine socket `agent_socket`, with a
    /// shared-memory staging area of `staging_bytes`; no master or key needed), or "auto"
    /// (agent mode when `agent_socket` names a socket file that exists, else direct). With
    /// `global_segment_size > 0` (direct mode only) this process contributes that much
    /// memory to the pool, served at `local_hostname` (an IP address) on a port the system
    /// picks. In agent mode `numa_node` (of this process's memory) or `gpu` (the PCI bus id of
    /// its GPU) tell the agent where the engine runs: it binds the staging area to that NUMA
    /// node and sends transfers through the NICs there.
    #[new]
    #[pyo3(signature = (masters = Vec::new(), auth_key_file = PathBuf::new(),
        local_hostname = "127.0.0.1".to_owned(), global_segment_size = 0,
        protocol = "tcp".to_owned(), request_timeout_ms = 10_000, mode = "auto".to_owned(),
        agent_socket = None, staging_bytes = DEFAULT_STAGING_BYTES, numa_node = None,
        gpu = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        masters: Vec<String>,
        auth_key_file: PathBuf,
        local_hostname: String,
        global_segment_size: u64,
        protocol: String,
        request_timeout_ms: u64,
        mode: String,
        agent_socket: Option<PathBuf>,
        staging_bytes: u64,
        numa_node: Option<u32>,
        gpu: Option<String>,
    ) -> PyResult<Self> {
        let opts = Options {
            mode,
            direct: Settings {
                masters,
                auth_key_file,
                local_hostname,
                global_segment_size,
                protocol,
                request_timeout_ms,
            },
            agent_socket,
            staging_bytes,
            numa_node,
            gpu_pci_bus_id: gpu,
        };
        let conn = py.detach(|| Conn::open(&opts))?;
        Ok(Self { conn })
    }

    /// "direct" or "agent": how this store reaches the pool.
    fn mode(&self) -> &'static str {
        match self.conn.mode {
            Mode::Direct => "direct",
            Mode::Agent => "agent",
        }
    }

    /// `size` bytes for zero-copy puts and gets, until `free_buffer(ptr)`: in agent mode a
    /// range of the session's shared staging area (puts from it and gets into it copy
    /// nothing); in direct mode fresh page-aligned memory, registered. Returns its address
    /// and size. After `close()` the memory stays mapped (never reused) until the process ends.
    fn alloc_buffer(&self, size: u64) -> PyResult<(usize, u64)> {
        Ok(self.conn.link()?.alloc(size)?)
    }

    /// Give back memory from `alloc_buffer`; False when none starts at `ptr`.
    fn free_buffer(&self, ptr: usize) -> PyResult<bool> {
        Ok(self.conn.link()?.free(ptr))
    }

    /// This process's node name in the pool (`host:port` when it contributes memory).
    fn node(&self) -> PyResult<String> {
        Ok(self.conn.link()?.node())
    }

    /// Store `value` (any object with the buffer protocol) under `key`.
    #[pyo3(signature = (key, value, placement = None))]
    fn put(
        &self,
        py: Python<'_>,
        key: Key,
        value: &Bound<'_, PyAny>,
        placement: Option<Bound<'_, Placement>>,
    ) -> PyResult<()> {
        let args = placed(placement);
        let view = Held::new(value, false)?;
        let key = key.into_bytes();
        self.block(py, Call::One, move |link| async move {
            link.put(&key, view.bytes(), &args).await
        })
    }

    /// Store `size` bytes at address `ptr` (inside a registered buffer) under `key`.
    #[pyo3(signature = (key, ptr, size, placement = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: Key,
        ptr: usize,
        size: u64,
        placement: Option<Bound<'_, Placement>>,
    ) -> PyResult<()> {
        let args = placed(placement);
        let key = key.into_bytes();
        self.block(py, Call::One, move |link| async move {
            link.put_from(&key, ptr, size, &args).await
        })
    }

    /// The value of `key` as `bytes`.
    fn get<'py>(&self, py: Python<'py>, key: Key) -> PyResult<Bound<'py, PyBytes>> {
        let key = key.into_bytes();
        let value = self.block(
            py,
            Call::One,
            move |link| async move { link.get(&key).await },
        )?;
        Ok(PyBytes::new(py, &value))
    }

    /// Read the value of `key` into `buffer` (a writable object with the buffer protocol);
    /// returns its length.
    fn get_into_buffer(
        &self,
        py: Python<'_>,
        key: Key,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let mut view = Held::new(buffer, true)?;
        let key = key.into_bytes();
        self.block(py, Call::One, move |link| async move {
            link.get_into_slice(&key, view.bytes_mut()).await
        })
    }

    /// Read the value of `key` into the `size` bytes at `ptr` (inside a registered buffer);
    /// returns its length.
    fn get_into(&self, py: Python<'_>, key: Key, ptr: usize, size: u64) -> PyResult<u64> {
        let key = key.into_bytes();
        self.block(py, Call::One, move |link| async move {
            link.get_into(&key, ptr, size).await
        })
    }

    /// Puts from registered memory: per item 0 or Mooncake's negative code.
    #[pyo3(signature = (keys, ptrs, sizes, placement = None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
        placement: Option<Bound<'_, Placement>>,
    ) -> PyResult<Vec<i64>> {
        let args = placed(placement);
        let items = items(keys, ptrs, sizes)?;
        self.block(py, Call::One, move |link| async move {
            Ok(link.batch_put_from(&items, &args).await)
        })
    }

    /// Gets into registered memory: per item the length read or Mooncake's negative code.
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        ptrs: Vec<usize>,
        sizes: Vec<u64>,
    ) -> PyResult<Vec<i64>> {
        let items = items(keys, ptrs, sizes)?;
        self.block(py, Call::One, move |link| async move {
            Ok(link.batch_get_into(&items).await)
        })
    }

    /// Puts of values spread over several registered ranges each: per key 0 or Mooncake's
    /// negative code.
    #[pyo3(signature = (keys, all_ptrs, all_sizes, placement = None))]
    fn batch_put_parts(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        all_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<u64>>,
        placement: Option<Bound<'_, Placement>>,
    ) -> PyResult<Vec<i64>> {
        let args = placed(placement);
        let items = ops::parts(keys, all_ptrs, all_sizes)?;
        self.block(py, Call::One, move |link| async move {
            Ok(link.batch_put_parts(&items, &args).await)
        })
    }

    /// Gets of values into several registered ranges each: per key the length read or
    /// Mooncake's negative code. With `value_offsets` (one per key) each reads only its
    /// ranges' bytes, from that offset of the value on (direct mode).
    #[pyo3(signature = (keys, all_ptrs, all_sizes, value_offsets = None))]
    fn batch_get_parts(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        all_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<u64>>,
        value_offsets: Option<Vec<u64>>,
    ) -> PyResult<Vec<i64>> {
        let items = parts_with_offsets(keys, all_ptrs, all_sizes, value_offsets.as_deref())?;
        self.block(py, Call::One, move |link| async move {
            Ok(link.batch_get_parts(&items, value_offsets.as_deref()).await)
        })
    }

    /// `batch_get_parts`, started on the store's runtime and collected with the answer's
    /// `wait()`: the caller goes on (the GIL held or not) while the bytes move. The memory
    /// must stay registered and unused by anything else until `wait()` returns.
    #[pyo3(signature = (keys, all_ptrs, all_sizes, value_offsets = None))]
    fn start_batch_get_parts(
        &self,
        keys: Vec<Key>,
        all_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<u64>>,
        value_offsets: Option<Vec<u64>>,
    ) -> PyResult<PendingGet> {
        let items = parts_with_offsets(keys, all_ptrs, all_sizes, value_offsets.as_deref())?;
        let link = self.conn.link()?;
        let n = items.len();
        Ok(PendingGet::start(
            self.conn.runtime.handle().clone(),
            n,
            async move { link.batch_get_parts(&items, value_offsets.as_deref()).await },
        ))
    }

    /// Puts of several values: per item None or the exception it failed with.
    #[pyo3(signature = (keys, values, placement = None))]
    fn batch_put(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        values: Vec<Bound<'_, PyAny>>,
        placement: Option<Bound<'_, Placement>>,
    ) -> PyResult<Vec<Option<Py<PyAny>>>> {
        same_length(keys.len(), values.len(), values.len())?;
        let args = placed(placement);
        let views = values
            .iter()
            .map(|v| Held::new(v, false))
            .collect::<Result<Vec<_>, _>>()?;
        let keys = self::keys(keys);
        let results = self.block(py, Call::Batch, move |link| async move {
            let items: Vec<(Vec<u8>, &[u8])> = keys
                .into_iter()
                .zip(views.iter().map(Held::bytes))
                .collect();
            Ok(link.batch_put(&items, &args).await)
        })?;
        Ok(results
            .into_iter()
            .map(|r| r.err().map(|f| exception(py, f)))
            .collect())
    }

    /// Gets of several values: per item the `bytes`, or the exception it failed with.
    fn batch_get(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<Vec<Py<PyAny>>> {
        let keys = self::keys(keys);
        let results = self.block(py, Call::Batch, move |link| async move {
            Ok(link.batch_get(&keys).await)
        })?;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(v) => PyBytes::new(py, &v).into_any().unbind(),
                Err(f) => exception(py, f),
            })
            .collect())
    }

    /// Whether each key is stored.
    fn exists(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<Vec<bool>> {
        let keys = self::keys(keys);
        self.block(py, Call::One, move |link| async move {
            link.exists(&keys).await
        })
    }

    /// The size of the value of `key`.
    fn size(&self, py: Python<'_>, key: Key) -> PyResult<u64> {
        let key = key.into_bytes();
        self.block(
            py,
            Call::One,
            move |link| async move { link.size(&key).await },
        )
    }

    /// Remove `key`; `force` waits for reads in flight instead of failing with `Leased`.
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: Key, force: bool) -> PyResult<()> {
        let key = key.into_bytes();
        self.block(py, Call::One, move |link| async move {
            link.remove(&key, force).await
        })
    }

    /// Remove every object no reader holds a lease on; how many were removed.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> PyResult<u64> {
        self.block(py, Call::One, move |link| async move {
            link.remove_all(force).await
        })
    }

    /// Register `size` bytes at address `ptr` for zero-copy puts and gets. The memory must
    /// stay valid until `unregister_buffer(ptr)` or `close()`.
    fn register_buffer(&self, ptr: usize, size: u64) -> PyResult<()> {
        Ok(self.conn.link()?.register(ptr, size, None)?)
    }

    /// Register the memory of `obj` (a writable object with the buffer protocol, such as a
    /// numpy array or bytearray), holding it in place until unregistered; returns its address
    /// and length.
    fn register_object(&self, obj: &Bound<'_, PyAny>) -> PyResult<(usize, u64)> {
        let view = Held::new(obj, true)?;
        let (ptr, len) = (view.as_ptr() as usize, view.len() as u64);
        self.conn.link()?.register(ptr, len, Some(view))?;
        Ok((ptr, len))
    }

    /// Unregister the buffer that starts at `ptr`; False when none does.
    fn unregister_buffer(&self, ptr: usize) -> PyResult<bool> {
        Ok(self.conn.link()?.unregister(ptr))
    }

    /// Registered buffers.
    fn registered_buffers(&self) -> PyResult<usize> {
        Ok(self.conn.link()?.registered())
    }

    /// Whether the master answers.
    fn health(&self, py: Python<'_>) -> PyResult<()> {
        self.block(
            py,
            Call::One,
            move |link| async move { link.health().await },
        )
    }

    /// The client's Prometheus metrics (transfer engine), in the text format.
    fn metrics(&self) -> PyResult<String> {
        let families = self.conn.link()?.metrics();
        prometheus::TextEncoder::new()
            .encode_to_string(&families)
            .map_err(|e| Failure::new(Kind::Internal, format!("encoding metrics: {e}")).into())
    }

    /// Whether `close()` was called (every other call then raises `Closed`).
    fn is_closed(&self) -> bool {
        self.conn.link().is_err()
    }

    /// Unmount the contributed segment and drop the connection; later calls raise `Closed`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.conn.close())?)
    }
}

/// Keys with their ranges (see `ops::parts`), and the value offsets, when given, checked to be
/// one per key.
fn parts_with_offsets(
    keys: Vec<Key>,
    all_ptrs: Vec<Vec<usize>>,
    all_sizes: Vec<Vec<u64>>,
    value_offsets: Option<&[u64]>,
) -> Result<Vec<PartsItem>, Failure> {
    if value_offsets.is_some_and(|o| o.len() != keys.len()) {
        return Err(Failure::invalid(
            "value_offsets must hold one offset per key",
        ));
    }
    ops::parts(keys, all_ptrs, all_sizes)
}

/// Keys with their ranges, checked: one address and one size per key.
fn items(
    keys: Vec<Key>,
    ptrs: Vec<usize>,
    sizes: Vec<u64>,
) -> Result<Vec<(Vec<u8>, usize, u64)>, Failure> {
    same_length(keys.len(), ptrs.len(), sizes.len())?;
    Ok(keys
        .into_iter()
        .map(Key::into_bytes)
        .zip(ptrs)
        .zip(sizes)
        .map(|((k, p), s)| (k, p, s))
        .collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The crate's version is the package's (maturin takes the wheel's from Cargo.toml too).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(device::device_memory_supported, m)?)?;
    m.add_class::<Client>()?;
    m.add_class::<Placement>()?;
    m.add_class::<PendingGet>()?;
    m.add_class::<p2p::P2pEngine>()?;
    errors::add_to(m)
}
