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
else from the kvpool environment (``KVPOOL_MASTER_ADDR``, ``KVPOOL_ENGINE_CONFIG``).

:class:`KvpoolConnector` is this module's own ``RemoteConnector`` rather than a subclass of
LMCache's ``MooncakestoreConnector``: that one stores chunk metadata with ``put_parts`` and reads
it back with ``batch_get_buffer``, neither of which is in the Mooncake API kvpool implements.
Here a chunk is stored either raw (``save_chunk_meta: false``: the chunk shape is known from the
model, so ``put_from``/``batch_get_into`` move it in place from LMCache's registered CPU
buffer) or behind a small self-describing header (the default ``save_chunk_meta: true``:
``put``/``get`` of bytes, one copy each way).

I/O boundary: the store calls, and copies into memory objects LMCache allocates.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import struct
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from . import ConfigError, open_store, store_module

logger = logging.getLogger(__name__)

PLUGIN_TYPE = "kvpool"
SCHEME = "kvpool://"
PLUGIN_SCHEME = "plugin://"
EXTRA_STORE_MODULE = "kvpool_store_module"
EXTRA_KEY_PREFIX = "key_prefix"
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

try:
    from lmcache.v1.storage_backend.connector import ConnectorAdapter  # type: ignore
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector  # type: ignore

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
        """Stand-in for LMCache's ``RemoteConnector`` with the chunk-metadata state it keeps."""

        save_chunk_meta: bool = True
        meta_shape: Any = None
        meta_dtype: Any = None
        meta_fmt: Any = None
        full_chunk_size: Optional[int] = None
        single_token_size: Optional[int] = None

        def init_chunk_meta(self, config: Any, metadata: Any) -> None:
            return None

        def reshape_partial_chunk(self, memory_obj: Any, bytes_read: int) -> Any:
            return memory_obj

        def post_init(self) -> None:
            return None


def plugin_type(plugin_name: str) -> str:
    """``fs`` of ``fs`` and ``fs.primary`` (LMCache's plugin naming)."""
    return plugin_name.split(".", 1)[0]


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch.") :]
    import numpy

    return numpy.dtype(dtype).name


def _dtype_from_name(name: str) -> Any:
    try:
        import torch

        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    except ImportError:
        pass
    import numpy

    return numpy.dtype(name)


def _fmt_value(fmt: Any) -> Optional[int]:
    if fmt is None:
        return None
    return int(getattr(fmt, "value", fmt))


def _fmt_from_value(value: Optional[int]) -> Any:
    if value is None or not HAVE_LMCACHE:
        return value
    from lmcache.v1.memory_management import MemoryFormat  # type: ignore

    return MemoryFormat(value)


def encode_header(shape: Sequence[int], dtype: Any, fmt: Any, length: int) -> bytes:
    """The header put before a chunk's bytes when chunk metadata is stored."""
    body = json.dumps(
        {
            "shape": [int(d) for d in shape],
            "dtype": _dtype_name(dtype),
            "fmt": _fmt_value(fmt),
            "len": int(length),
        },
        separators=(",", ":"),
    ).encode()
    return _HEADER_LEN.pack(HEADER_MAGIC, len(body)) + body


def decode_header(data: bytes) -> Tuple[dict, int]:
    """The header fields and the offset of the chunk's bytes; ValueError when malformed."""
    if len(data) < _HEADER_LEN.size:
        raise ValueError(f"{len(data)} bytes is shorter than a chunk header")
    magic, n = _HEADER_LEN.unpack_from(data)
    if magic != HEADER_MAGIC:
        raise ValueError(f"not a kvpool chunk (magic {magic!r})")
    start = _HEADER_LEN.size + n
    fields = json.loads(bytes(data[_HEADER_LEN.size : start]))
    if len(data) - start != fields["len"]:
        raise ValueError(f"chunk holds {len(data) - start} bytes, header says {fields['len']}")
    return fields, start


def _tensor_span(memory_obj: Any) -> Tuple[int, int]:
    t = memory_obj.tensor
    if t is None:
        raise ValueError("memory object has no tensor")
    if hasattr(t, "data_ptr"):
        return int(t.data_ptr()), int(t.numel() * t.element_size())
    return int(t.ctypes.data), int(t.nbytes)


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


class KvpoolConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache ``RemoteConnector`` on the pool (see the module docs for the two chunk forms).

    ``config``/``metadata`` are LMCache's engine config and metadata; ``local_cpu_backend``
    allocates the memory objects gets return; ``plugin_name`` selects the
    ``remote_storage_plugin.<name>.*`` keys of ``extra_config``; ``url`` may name the masters.
    ``store`` (tests) replaces the store the connector would open.
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
        try:
            super().__init__(config, metadata)  # LMCache releases whose base takes them
        except TypeError:
            super().__init__()
        self.config = config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name or PLUGIN_TYPE
        settings = self._settings(config, url)
        self.module = store_module(module or settings.pop(EXTRA_STORE_MODULE, None))
        self.key_prefix = str(settings.pop(EXTRA_KEY_PREFIX, "") or "")
        self.store = store if store is not None else open_store(settings, module=self.module)
        self.replicate_config = self.module.ReplicateConfig()
        self._registered: List[int] = []
        if config is not None and metadata is not None:
            self.init_chunk_meta(config, metadata)
        extra = getattr(config, "extra_config", None) or {}
        if "save_chunk_meta" in extra and not extra["save_chunk_meta"] and self.meta_shape is None:
            logger.warning(
                "save_chunk_meta is false but the chunk shape is unknown; storing chunk metadata"
            )
        for ptr, size in _host_buffers(local_cpu_backend):
            rc = self.store.register_buffer(ptr, size)
            if rc == 0:
                self._registered.append(ptr)
            else:
                logger.warning("register_buffer of LMCache's CPU buffer returned %d", rc)

    def _settings(self, config: Any, url: Optional[str]) -> dict:
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
        ptr, size = _tensor_span(memory_obj)
        if self.save_chunk_meta:
            header = encode_header(
                memory_obj.get_shape(), memory_obj.get_dtype(), memory_obj.get_memory_format(), size
            )
            return int(
                self.store.put(key, header + ctypes.string_at(ptr, size), self.replicate_config)
            )
        return int(self.store.put_from(key, ptr, size, self.replicate_config))

    def _put_many(self, keys: List[str], memory_objs: Sequence[Any]) -> List[int]:
        if self.save_chunk_meta:
            return [self._put_one(k, o) for k, o in zip(keys, memory_objs)]
        spans = [_tensor_span(o) for o in memory_objs]
        return [
            int(c)
            for c in self.store.batch_put_from(
                keys, [p for p, _ in spans], [s for _, s in spans], self.replicate_config
            )
        ]

    def _allocate(self, shape: Any, dtype: Any, fmt: Any) -> Any:
        if self.local_cpu_backend is None:
            raise RuntimeError("no local_cpu_backend to allocate memory objects from")
        return self.local_cpu_backend.allocate(shape, dtype, fmt)

    def _from_bytes(self, key: str, data: bytes) -> Any:
        if not data:
            return None
        try:
            fields, start = decode_header(data)
        except (ValueError, KeyError) as e:
            logger.warning("kvpool: %s holds no chunk: %s", key, e)
            return None
        obj = self._allocate(
            fields["shape"], _dtype_from_name(fields["dtype"]), _fmt_from_value(fields["fmt"])
        )
        if obj is None:
            return None
        ptr, size = _tensor_span(obj)
        if size < fields["len"]:
            obj.ref_count_down()
            raise ValueError(f"{key}: a {size}-byte memory object for a {fields['len']}-byte chunk")
        ctypes.memmove(ptr, data[start:], fields["len"])
        return obj

    def _get_many(self, keys: List[str]) -> List[Any]:
        if self.save_chunk_meta:
            return [self._from_bytes(k, self.store.get(k)) for k in keys]
        objs = [self._allocate(self.meta_shape, self.meta_dtype, self.meta_fmt) for _ in keys]
        live = [i for i, o in enumerate(objs) if o is not None]
        spans = [_tensor_span(objs[i]) for i in live]
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
            out[i] = self.reshape_partial_chunk(objs[i], int(n))
        return out

    # -- RemoteConnector -------------------------------------------------------------------

    def exists_sync(self, key: Any) -> bool:
        return self.store.is_exist(self._key(key)) == 1

    async def exists(self, key: Any) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

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
        return self.store.remove(self._key(key)) == 0

    async def list(self) -> List[str]:
        # Mooncake's API has no key listing; LMCache only uses it for diagnostics.
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        return int(await asyncio.to_thread(self.store.health_check))

    async def close(self) -> None:
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
    "decode_header",
    "encode_header",
    "plugin_type",
]
