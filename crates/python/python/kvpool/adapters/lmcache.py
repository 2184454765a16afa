"""LMCache adapter: a remote storage plugin that keeps LMCache's KV chunks in the pool.

LMCache loads it through its remote storage plugin framework (``ConnectorManager`` imports
``remote_storage_plugin.<name>.module_path``, instantiates ``class_name`` and asks each adapter
whether it can parse the remote URL):

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.adapters.lmcache
      remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter
      save_chunk_meta: false          # zero-copy puts and gets (recommended)

:class:`KvpoolConnectorAdapter` takes ``plugin://kvpool`` (the URL LMCache gives a plugin) and
``kvpool://[host:port[,host:port...]]`` (older LMCache, through ``remote_url``); the pool's
address comes from the URL, else from ``remote_storage_plugin.kvpool.master_server_address``,
else from the kvpool environment (``KVPOOL_MASTER``, ``KVPOOL_ENGINE_CONFIG``).
``class_name: KvpoolConnector`` (LMCache wraps a bare ``RemoteConnector`` class itself) and the
``external://`` URL form work too; both hand the connector no engine metadata, which it then
takes from LMCache's local CPU backend.

:class:`KvpoolConnector` is this module's own ``RemoteConnector`` rather than a subclass of
LMCache's ``MooncakestoreConnector``: that one stores chunk metadata with ``put_parts`` and reads
it back with ``batch_get_buffer``, neither of which is in the Mooncake API kvpool implements.
Here a chunk is stored either raw (``save_chunk_meta: false``: the chunk layout is known from
the model, so ``put_from``/``batch_get_into`` move it in place from LMCache's registered CPU
buffer) or behind a small self-describing header (the default ``save_chunk_meta: true``:
``put``/``get`` of bytes, one copy each way).

Start-up failures are loud. LMCache (0.5.6) creates a remote backend inside two ``except
Exception`` blocks that log the error and run on without remote storage, so a plugin that
cannot reach its pool would otherwise look like an engine that never hits the cache. The
connector therefore raises :class:`PluginInitError`, which is deliberately not an
``Exception``: it passes those blocks (and LMCache's "degraded mode" handler in
``LMCacheManager.post_init``) and fails the engine's construction. Setting
``remote_storage_plugin.kvpool.fail_on_init_error: false`` gives LMCache's own handling back.

I/O boundary: the store calls, and copies into memory objects LMCache allocates.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import json
import logging
import struct
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import ConfigError, open_store, store_module

logger = logging.getLogger(__name__)

PLUGIN_TYPE = "kvpool"
SCHEME = "kvpool://"
PLUGIN_SCHEME = "plugin://"
EXTRA_STORE_MODULE = "kvpool_store_module"
EXTRA_KEY_PREFIX = "key_prefix"
EXTRA_FAIL_ON_INIT_ERROR = "fail_on_init_error"
# Store keys of the pool's own settings, read from extra_config (plugin-prefixed or bare).
SETUP_KEYS = (
    "master_server_address",
    "metadata_server",
    "protocol",
    "device_name",
    "local_hostname",
    "global_segment_size",
    "local_buffer_size",
)

HEADER_MAGIC = b"KVP1"
_HEADER_LEN = struct.Struct("<4sI")

# MemoryFormat.KV_2LTD's value in LMCache: what the stand-in base below reports.
_KV_2LTD = 1

try:
    from lmcache.v1.storage_backend.connector import (  # type: ignore[import-not-found]
        ConnectorAdapter,
    )
    from lmcache.v1.storage_backend.connector.base_connector import (  # type: ignore[import-not-found]
        RemoteConnector,
    )

    HAVE_LMCACHE = True
except Exception:  # noqa: BLE001 - no usable LMCache here
    HAVE_LMCACHE = False

    class ConnectorAdapter:  # type: ignore[no-redef]
        """Stand-in for LMCache's ``ConnectorAdapter``."""

        def __init__(self, schema: str = "") -> None:
            self.schema = schema

        def can_parse(self, url: str) -> bool:
            return self.schema != "" and url.startswith(self.schema)

    class RemoteConnector:  # type: ignore[no-redef]
        """Stand-in for LMCache's ``RemoteConnector`` (the 0.5.x constructor): derives the
        chunk layout from the engine metadata (``get_shapes()``, ``get_dtypes()``,
        ``chunk_size``) and ``save_chunk_meta`` from ``extra_config``."""

        def __init__(self, config: Any, metadata: Any) -> None:
            extra = getattr(config, "extra_config", None)
            self.save_chunk_meta = extra is None or bool(extra.get("save_chunk_meta", True))
            self.meta_shapes = list(metadata.get_shapes())
            self.meta_dtypes = list(metadata.get_dtypes())
            self.meta_fmt = _KV_2LTD
            self.full_chunk_size_bytes = sum(
                _numel(s) * _itemsize(d) for s, d in zip(self.meta_shapes, self.meta_dtypes)
            )
            self.single_token_size = self.full_chunk_size_bytes // int(metadata.chunk_size)

        def reshape_partial_chunk(self, memory_obj: Any, bytes_read: int) -> Any:
            if (
                bytes_read <= 0
                or bytes_read % self.single_token_size
                or bytes_read > self.full_chunk_size_bytes
            ):
                raise ValueError(f"{bytes_read} bytes is not a whole number of tokens")
            if bytes_read == self.full_chunk_size_bytes:
                return memory_obj
            shape = list(memory_obj.meta.shape)
            shape[2] = bytes_read // self.single_token_size
            memory_obj.raw_data = memory_obj.raw_data[:bytes_read]
            memory_obj.meta.shape = tuple(shape)
            return memory_obj

        def post_init(self) -> None:
            return None


class PluginInitError(BaseException):
    """The kvpool LMCache plugin could not start (bad configuration, unreachable pool, wrong
    key). A ``BaseException`` so that LMCache's ``except Exception`` blocks around backend
    creation do not turn it into an engine without remote storage; the cause is chained."""


def plugin_type(plugin_name: str) -> str:
    """``fs`` of ``fs`` and ``fs.primary`` (LMCache's plugin naming)."""
    return plugin_name.split(".", 1)[0]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    import numpy

    return int(numpy.dtype(dtype).itemsize)


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch.") :]
    import numpy

    return str(numpy.dtype(dtype).name)


def _dtype_from_name(name: str) -> Any:
    try:
        torch: Any = importlib.import_module("torch")  # Any: absent where the types are checked
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    except ImportError:
        pass
    import numpy

    return numpy.dtype(name)


def _shape(dims: Sequence[int]) -> Any:
    """A shape as LMCache's allocator wants it: ``torch.Size`` (a plain list of ints would be
    read as a list of several shapes), a tuple where torch is absent."""
    try:
        torch: Any = importlib.import_module("torch")
        return torch.Size([int(d) for d in dims])
    except ImportError:
        return tuple(int(d) for d in dims)


def _fmt_value(fmt: Any) -> Optional[int]:
    if fmt is None:
        return None
    return int(getattr(fmt, "value", fmt))


def _fmt_from_value(value: Optional[int]) -> Any:
    if value is None or not HAVE_LMCACHE:
        return value
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore[import-not-found]

    return MemoryFormat(value)


def _allocation(shapes: Sequence[Any], dtypes: Sequence[Any]) -> Tuple[Any, Any]:
    """``allocate()`` arguments for a chunk of these groups: one group as a single shape and
    dtype (what every LMCache release takes), several as lists (LMCache 0.5's groups)."""
    shapes = [_shape(s) for s in shapes]
    dtypes = list(dtypes)
    if len(shapes) == 1 and len(dtypes) == 1:
        return shapes[0], dtypes[0]
    return shapes, dtypes


def _groups(owner: Any, many: str, one: str) -> List[Any]:
    """``owner.<many>`` (LMCache 0.5's per-group lists), else ``[owner.<one>]`` (earlier
    releases' single value), else ``[]``."""
    values = getattr(owner, many, None)
    if values is not None:
        return list(values)
    value = getattr(owner, one, None)
    return [] if value is None else [value]


def encode_header(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[Any], fmt: Any, length: int
) -> bytes:
    """The header put before a chunk's bytes when chunk metadata is stored: the shape and dtype
    of each group, the memory format and the byte length."""
    body = json.dumps(
        {
            "shapes": [[int(d) for d in s] for s in shapes],
            "dtypes": [_dtype_name(d) for d in dtypes],
            "fmt": _fmt_value(fmt),
            "len": int(length),
        },
        separators=(",", ":"),
    ).encode()
    return _HEADER_LEN.pack(HEADER_MAGIC, len(body)) + body


def decode_header(data: bytes) -> Tuple[Dict[str, Any], int]:
    """The header fields (``shapes``, ``dtypes``, ``fmt``, ``len``) and the offset of the
    chunk's bytes; ValueError when malformed. Headers of one ``shape``/``dtype`` (earlier
    kvpool releases) read as one group."""
    if len(data) < _HEADER_LEN.size:
        raise ValueError(f"{len(data)} bytes is shorter than a chunk header")
    magic, n = _HEADER_LEN.unpack_from(data)
    if magic != HEADER_MAGIC:
        raise ValueError(f"not a kvpool chunk (magic {magic!r})")
    start = _HEADER_LEN.size + n
    if start > len(data):
        raise ValueError(f"a {n}-byte header in {len(data)} bytes")
    fields = json.loads(bytes(data[_HEADER_LEN.size : start]))
    if "shapes" not in fields and "shape" in fields:
        fields["shapes"], fields["dtypes"] = [fields.pop("shape")], [fields.pop("dtype")]
    if len(fields["shapes"]) != len(fields["dtypes"]) or not fields["shapes"]:
        raise ValueError(
            f"header has {len(fields['shapes'])} shapes, {len(fields['dtypes'])} dtypes"
        )
    if len(data) - start != fields["len"]:
        raise ValueError(f"chunk holds {len(data) - start} bytes, header says {fields['len']}")
    return fields, start


def _object_span(memory_obj: Any) -> Tuple[int, int]:
    """Address and length of a memory object's bytes: LMCache's flat ``raw_data`` and
    ``get_size()`` (every group, or the used part of a partial chunk); else its ``tensor``."""
    raw = getattr(memory_obj, "raw_data", None)
    if raw is not None and hasattr(memory_obj, "get_size"):
        ptr = raw.data_ptr() if hasattr(raw, "data_ptr") else raw.ctypes.data
        return int(ptr), int(memory_obj.get_size())
    t = memory_obj.tensor
    if t is None:
        raise ValueError("memory object has no tensor")
    if hasattr(t, "data_ptr"):
        return int(t.data_ptr()), int(t.numel() * t.element_size())
    return int(t.ctypes.data), int(t.nbytes)


def _object_layout(memory_obj: Any) -> Tuple[List[Any], List[Any]]:
    """The shape and dtype of each group of a memory object."""
    shapes = dtypes = None
    try:
        shapes, dtypes = memory_obj.get_shapes(), memory_obj.get_dtypes()
    except (AttributeError, AssertionError, NotImplementedError):
        pass
    if not shapes or not dtypes or len(shapes) != len(dtypes):
        return [memory_obj.get_shape()], [memory_obj.get_dtype()]
    if len(shapes) == 1:
        # A partial chunk read back narrows `shape`, not `shapes`.
        return [memory_obj.get_shape()], [dtypes[0]]
    return list(shapes), list(dtypes)


def _host_buffers(local_cpu_backend: Any) -> List[Tuple[int, int]]:
    """The CPU buffers LMCache allocates memory objects from (to register for zero copy)."""
    allocator = getattr(local_cpu_backend, "memory_allocator", None)
    found = []
    for owner in (
        allocator,
        getattr(allocator, "pin_allocator", None),
        getattr(allocator, "cpu_allocator", None),
    ):
        buf = getattr(owner, "buffer", None) if owner is not None else None
        if buf is not None and hasattr(buf, "data_ptr"):
            found.append((int(buf.data_ptr()), int(buf.numel() * buf.element_size())))
    return sorted(set(found))


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def _plugin_value(config: Any, plugin_name: str, key: str, default: Any = None) -> Any:
    extra: Mapping[str, Any] = getattr(config, "extra_config", None) or {}
    full = f"remote_storage_plugin.{plugin_name}.{key}"
    if full in extra:
        return extra[full]
    return extra.get(key, default)


def _end_loop_at_exit(loop: Any) -> None:
    """Let the interpreter exit after a failed start: LMCache runs its storage event loop in a
    non-daemon thread that nothing stops once the storage manager's construction has failed,
    so a process dying of :class:`PluginInitError` would wait for it forever. The loop is
    stopped when the interpreter shuts down, not before."""
    register = getattr(threading, "_register_atexit", None)
    if loop is None or register is None or not hasattr(loop, "call_soon_threadsafe"):
        return

    def stop() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)

    try:
        register(stop)
    except RuntimeError:  # the interpreter is already shutting down
        pass


_BASE_TAKES_CONFIG = len(inspect.signature(RemoteConnector.__init__).parameters) > 1


class KvpoolConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache ``RemoteConnector`` on the pool (see the module docs for the two chunk forms).

    ``config``/``metadata`` are LMCache's engine config and metadata (without metadata, that
    of ``local_cpu_backend``); ``local_cpu_backend`` allocates the memory objects gets return;
    ``plugin_name`` selects the ``remote_storage_plugin.<name>.*`` keys of ``extra_config``;
    ``url`` may name the masters. ``store`` (tests) replaces the store the connector would
    open. Raises :class:`PluginInitError` when it cannot start (unless
    ``fail_on_init_error`` is false: then the cause itself).
    """

    def __init__(
        self,
        config: Any = None,
        metadata: Any = None,
        *,
        loop: Any = None,
        local_cpu_backend: Any = None,
        url: Optional[str] = None,
        plugin_name: Optional[str] = None,
        store: Any = None,
        module: Any = None,
    ):
        self.plugin_name = plugin_name or PLUGIN_TYPE
        self.store: Any = None
        self._registered: List[int] = []
        try:
            self._start(config, metadata, loop, local_cpu_backend, url, store, module)
        except Exception as e:
            self._abandon()
            if not _flag(_plugin_value(config, self.plugin_name, EXTRA_FAIL_ON_INIT_ERROR, True)):
                raise
            _end_loop_at_exit(loop)
            where = f" ({url})" if url else ""
            raise PluginInitError(
                f"kvpool LMCache plugin {self.plugin_name!r}{where} could not start: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _start(
        self,
        config: Any,
        metadata: Any,
        loop: Any,
        local_cpu_backend: Any,
        url: Optional[str],
        store: Any,
        module: Any,
    ) -> None:
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise ConfigError("LMCache gave the connector no engine metadata (chunk layout)")
        if _BASE_TAKES_CONFIG:  # LMCache 0.5: the base derives the chunk layout
            super().__init__(config, metadata)
        else:  # earlier releases: a bare base and init_chunk_meta
            super().__init__()
            init = getattr(self, "init_chunk_meta", None)
            if init is not None:
                init(config, metadata)
        self.config = config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.save_chunk_meta = bool(getattr(self, "save_chunk_meta", True))
        self.chunk_shapes = _groups(self, "meta_shapes", "meta_shape")
        self.chunk_dtypes = _groups(self, "meta_dtypes", "meta_dtype")
        self.chunk_fmt = getattr(self, "meta_fmt", None)
        if not self.save_chunk_meta and (
            not self.chunk_shapes or len(self.chunk_shapes) != len(self.chunk_dtypes)
        ):
            raise ConfigError(
                "save_chunk_meta is false but LMCache gave no chunk layout "
                f"(shapes {self.chunk_shapes}, dtypes {self.chunk_dtypes})"
            )
        settings = self._settings(config, url)
        self.module = store_module(module or settings.pop(EXTRA_STORE_MODULE, None))
        self.key_prefix = str(settings.pop(EXTRA_KEY_PREFIX, "") or "")
        self.store = store if store is not None else open_store(settings, module=self.module)
        self.replicate_config = self.module.ReplicateConfig()
        for ptr, size in _host_buffers(local_cpu_backend):
            rc = self.store.register_buffer(ptr, size)
            if rc == 0:
                self._registered.append(ptr)
            else:
                logger.warning("register_buffer of LMCache's CPU buffer returned %d", rc)

    def _abandon(self) -> None:
        """Undo a half-finished start (best effort: the start error is what matters)."""
        store, self.store = self.store, None
        if store is None:
            return
        try:
            for ptr in self._registered:
                store.unregister_buffer(ptr)
            store.close()
        except Exception:  # noqa: BLE001
            logger.debug("kvpool: closing a store that failed to start", exc_info=True)
        self._registered.clear()

    def _settings(self, config: Any, url: Optional[str]) -> Dict[str, Any]:
        extra: Mapping[str, Any] = getattr(config, "extra_config", None) or {}
        out = {}
        prefix = f"remote_storage_plugin.{self.plugin_name}."
        for key in SETUP_KEYS + (EXTRA_STORE_MODULE, EXTRA_KEY_PREFIX):
            if prefix + key in extra:
                out[key] = extra[prefix + key]
            elif key in extra:
                out[key] = extra[key]
        if url and url.startswith(SCHEME):
            hosts = url[len(SCHEME) :].split("/", 1)[0].split("?", 1)[0]
            if hosts:
                out["master_server_address"] = hosts
        return out

    # -- keys ------------------------------------------------------------------------------

    def _key(self, key: Any) -> str:
        text = key.to_string() if hasattr(key, "to_string") else str(key)
        return self.key_prefix + text

    # -- blocking primitives ---------------------------------------------------------------

    def _put_one(self, key: str, memory_obj: Any) -> int:
        ptr, size = _object_span(memory_obj)
        if self.save_chunk_meta:
            shapes, dtypes = _object_layout(memory_obj)
            header = encode_header(shapes, dtypes, memory_obj.get_memory_format(), size)
            return int(
                self.store.put(key, header + ctypes.string_at(ptr, size), self.replicate_config)
            )
        return int(self.store.put_from(key, ptr, size, self.replicate_config))

    def _put_many(self, keys: List[str], memory_objs: Sequence[Any]) -> List[int]:
        if self.save_chunk_meta:
            return [self._put_one(k, o) for k, o in zip(keys, memory_objs)]
        spans = [_object_span(o) for o in memory_objs]
        return [
            int(c)
            for c in self.store.batch_put_from(
                keys, [p for p, _ in spans], [s for _, s in spans], self.replicate_config
            )
        ]

    def _allocate(self, shapes: Sequence[Any], dtypes: Sequence[Any], fmt: Any) -> Any:
        if self.local_cpu_backend is None:
            raise RuntimeError("no local_cpu_backend to allocate memory objects from")
        shape, dtype = _allocation(shapes, dtypes)
        return self.local_cpu_backend.allocate(shape, dtype, fmt)

    def _from_bytes(self, key: str, data: bytes) -> Any:
        if not data:
            return None
        try:
            fields, start = decode_header(data)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("kvpool: %s holds no chunk: %s", key, e)
            return None
        obj = self._allocate(
            fields["shapes"],
            [_dtype_from_name(d) for d in fields["dtypes"]],
            _fmt_from_value(fields["fmt"]),
        )
        if obj is None:
            return None
        ptr, size = _object_span(obj)
        if size != fields["len"]:
            obj.ref_count_down()
            logger.warning(
                "kvpool: %s: a %d-byte memory object for a %d-byte chunk", key, size, fields["len"]
            )
            return None
        ctypes.memmove(ptr, data[start:], size)
        return obj

    def _get_many(self, keys: List[str]) -> List[Any]:
        if self.save_chunk_meta:
            return [self._from_bytes(k, self.store.get(k)) for k in keys]
        objs = [self._allocate(self.chunk_shapes, self.chunk_dtypes, self.chunk_fmt) for _ in keys]
        live = [i for i, o in enumerate(objs) if o is not None]
        spans = [_object_span(objs[i]) for i in live]
        got = (
            self.store.batch_get_into(
                [keys[i] for i in live], [p for p, _ in spans], [s for _, s in spans]
            )
            if live
            else []
        )
        out: List[Any] = [None] * len(keys)
        for i, n in zip(live, got):
            if n <= 0:
                objs[i].ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(objs[i], int(n))
            except ValueError as e:  # not a chunk of this layout: a miss, not a failed batch
                logger.warning("kvpool: %s holds no chunk of this layout: %s", keys[i], e)
                objs[i].ref_count_down()
        return out

    def _exist_prefix(self, keys: List[str]) -> int:
        if not keys:
            return 0
        found = self.store.batch_is_exist(keys)
        for i, hit in enumerate(found):
            if hit != 1:
                return i
        return len(keys)

    # -- RemoteConnector -------------------------------------------------------------------

    def exists_sync(self, key: Any) -> bool:
        return bool(self.store.is_exist(self._key(key)) == 1)

    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[Any]) -> int:
        """How many of ``keys``, from the first, are in the pool (one round trip)."""
        return self._exist_prefix([self._key(k) for k in keys])

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: List[Any], pin: bool = False
    ) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    async def get(self, key: Any) -> Any:
        return (await asyncio.to_thread(self._get_many, [self._key(key)]))[0]

    async def put(self, key: Any, memory_obj: Any) -> None:
        k = self._key(key)
        rc = await asyncio.to_thread(self._put_one, k, memory_obj)
        if rc != 0:
            logger.warning("kvpool put of %s returned %d", k, rc)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Any]:
        return await asyncio.to_thread(self._get_many, [self._key(k) for k in keys])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[Any]) -> None:
        ks = [self._key(k) for k in keys]
        codes = await asyncio.to_thread(self._put_many, ks, memory_objs)
        failed = [(k, c) for k, c in zip(ks, codes) if c != 0]
        if failed:
            logger.warning(
                "kvpool: %d of %d puts failed, first %s", len(failed), len(ks), failed[0]
            )

    def remove_sync(self, key: Any) -> bool:
        return bool(self.store.remove(self._key(key)) == 0)

    async def list(self) -> List[str]:
        # Mooncake's API has no key listing; LMCache only uses it for diagnostics.
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        return int(await asyncio.to_thread(self.store.health_check))

    async def close(self) -> None:
        if self.store is None:
            return
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()
        self.store.close()

    def __repr__(self) -> str:
        return f"<KvpoolConnector {self.plugin_name}>"


class KvpoolConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """LMCache ``ConnectorAdapter`` for ``plugin://kvpool[.instance]`` and ``kvpool://`` URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        if url.startswith(PLUGIN_SCHEME):
            return plugin_type(url[len(PLUGIN_SCHEME) :]) == PLUGIN_TYPE
        return False

    def create_connector(self, context: Any) -> KvpoolConnector:
        url = getattr(context, "url", "") or ""
        name = getattr(context, "plugin_name", None)
        if not name and url.startswith(PLUGIN_SCHEME):
            name = url[len(PLUGIN_SCHEME) :]
        if not url.startswith((SCHEME, PLUGIN_SCHEME)):
            raise ConfigError(f"remote url {url!r} is not a kvpool:// or plugin://kvpool URL")
        return KvpoolConnector(
            getattr(context, "config", None),
            getattr(context, "metadata", None),
            loop=getattr(context, "loop", None),
            local_cpu_backend=getattr(context, "local_cpu_backend", None),
            url=url,
            plugin_name=name or PLUGIN_TYPE,
        )


__all__ = [
    "KvpoolConnector",
    "KvpoolConnectorAdapter",
    "PluginInitError",
    "decode_header",
    "encode_header",
    "plugin_type",
]
