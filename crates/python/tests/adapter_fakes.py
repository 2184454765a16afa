"""Stand-ins for what the engines hand the adapters, for test_adapters.py.

The engines do not import here (vLLM and SGLang need their CUDA stacks, LMCache its torch
build), so the tests drive the adapters with the objects the engines would pass, built on
numpy host memory:

- `FakeTensor`: the part of `torch.Tensor` the adapters touch (`data_ptr`, `numel`,
  `element_size`) over a numpy array;
- `HostPool`: SGLang's host KV pool (`kv_buffer`, `page_size`, `get_page_buffer_meta`) in the
  `page_first` layout, MHA (a K and a V object per page) or MLA (one);
- `CpuBackend` / `MemoryObj` / `Metadata`: LMCache's local CPU backend, the memory objects it
  allocates from one registered buffer, and the engine metadata a connector takes its chunk
  layout from;
- `fake_vllm` / `fake_sglang`: module trees that stand where vLLM's and SGLang's Mooncake
  connectors live, each importing `mooncake.store` the way the real one does, so the tests see
  which store module the adapters make them build;
- `recording_store_module`: a store module that wraps another and records the stores made.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import importlib
import json
import os
import sys
import types
from typing import Iterator, List

import numpy as np

from kvpool.adapters import restore_entries


class FakeTensor:
    """A numpy array seen through torch's pointer API."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return int(self.array.itemsize)

    @property
    def shape(self):
        return self.array.shape


class HostPool:
    """SGLang's host KV pool in the page_first layout over numpy.

    MHA: `kv_buffer` is (2, tokens, layers, token_bytes): a page's K bytes are contiguous, then
    its V bytes elsewhere, so `get_page_buffer_meta` returns two pointers per page (K, V).
    MLA: (tokens, layers, token_bytes), one pointer per page.
    """

    def __init__(
        self,
        pages: int,
        page_size: int = 4,
        layers: int = 2,
        token_bytes: int = 16,
        mla: bool = False,
        seed: int = 0,
    ):
        rng = np.random.default_rng(seed)
        shape = (
            (pages * page_size, layers, token_bytes)
            if mla
            else (2, pages * page_size, layers, token_bytes)
        )
        self.array = rng.integers(0, 256, size=shape, dtype=np.uint8)
        self.kv_buffer = FakeTensor(self.array)
        self.page_size = page_size
        self.mla = mla
        self.layout = "page_first"
        self.page_bytes = page_size * layers * token_bytes

    def indices(self, pages: List[int]) -> np.ndarray:
        """host_indices of whole pages, as SGLang passes them (token indices)."""
        return np.concatenate(
            [np.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        )

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for start in indices[:: self.page_size]:
            start = int(start)
            if self.mla:
                ptrs.append(self.array[start].ctypes.data)
                sizes.append(self.page_bytes)
            else:
                ptrs.append(self.array[0, start].ctypes.data)
                ptrs.append(self.array[1, start].ctypes.data)
                sizes += [self.page_bytes, self.page_bytes]
        return ptrs, sizes

    def page(self, p: int) -> bytes:
        s = slice(p * self.page_size, (p + 1) * self.page_size)
        if self.mla:
            return self.array[s].tobytes()
        return self.array[0, s].tobytes() + self.array[1, s].tobytes()


class MemoryObj:
    """An LMCache (0.5) memory object: a flat byte view `raw_data` of the backend's buffer, its
    metadata `meta` (`shape`, `dtype`, `fmt`) and the accessors a connector uses."""

    def __init__(self, backend: "CpuBackend", raw: np.ndarray, shape, dtype, fmt):
        self.backend = backend
        self.raw_data = raw
        self.meta = types.SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype), fmt=fmt)
        self.refs = 1

    @property
    def tensor(self) -> FakeTensor:
        return FakeTensor(self.raw_data.view(self.meta.dtype).reshape(self.meta.shape))

    def get_size(self) -> int:
        return int(self.raw_data.size)

    def get_shape(self):
        return self.meta.shape

    def get_dtype(self):
        return self.meta.dtype

    def get_shapes(self):
        return [self.meta.shape]

    def get_dtypes(self):
        return [self.meta.dtype]

    def get_memory_format(self):
        return self.meta.fmt

    def ref_count_down(self):
        self.refs -= 1

    def bytes(self) -> bytes:
        return self.raw_data.tobytes()


class _Allocator:
    def __init__(self, size: int):
        self.array = np.zeros(size, dtype=np.uint8)
        self.buffer = FakeTensor(self.array)
        self.next = 0


class Metadata:
    """LMCacheMetadata as a remote connector reads it: one group of KV_2LTD chunks of
    `chunk_shape` (kv, layers, tokens, hidden) and `dtype`."""

    def __init__(self, chunk_shape, dtype):
        self.chunk_shape = tuple(chunk_shape)
        self.chunk_size = self.chunk_shape[2]
        self.dtype = np.dtype(dtype)
        self.use_mla = False

    def get_shapes(self, num_tokens=None):
        kv, layers, tokens, hidden = self.chunk_shape
        return [(kv, layers, tokens if num_tokens is None else num_tokens, hidden)]

    def get_dtypes(self):
        return [self.dtype]

    def get_num_groups(self):
        return 1


class CpuBackend:
    """LMCache's LocalCPUBackend as a connector sees it: `memory_allocator.buffer` (the memory
    to register), `allocate(shape, dtype, fmt)` and, where given, the engine `metadata`."""

    def __init__(self, size: int = 4 << 20, metadata: "Metadata" = None):
        self.memory_allocator = _Allocator(size)
        self.allocated: List[MemoryObj] = []
        self.metadata = metadata

    def allocate(self, shape, dtype, fmt):
        if isinstance(shape, list):  # LMCache's list of groups
            assert len(shape) == 1 and isinstance(shape[0], tuple), shape
            shape, dtype = shape[0], dtype[0]
        assert isinstance(shape, tuple) and all(isinstance(d, int) for d in shape), shape
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        a = self.memory_allocator
        if a.next + n > a.array.size:
            return None
        raw = a.array[a.next : a.next + n]
        a.next += n
        obj = MemoryObj(self, raw, shape, dtype, fmt)
        self.allocated.append(obj)
        return obj

    def filled(self, shape, dtype, seed: int) -> MemoryObj:
        obj = self.allocate(tuple(shape), dtype, 1)
        rng = np.random.default_rng(seed)
        obj.raw_data[...] = rng.integers(0, 256, size=obj.raw_data.shape, dtype=np.uint8)
        return obj


def recording_store_module(inner: types.ModuleType, name: str) -> types.ModuleType:
    """A store module named `name` whose stores wrap `inner`'s and are recorded in `made`."""
    module = types.ModuleType(name)
    module.made = []

    class MooncakeDistributedStore:
        def __init__(self):
            self._inner = inner.MooncakeDistributedStore()
            module.made.append(self)

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

    module.MooncakeDistributedStore = MooncakeDistributedStore
    module.ReplicateConfig = inner.ReplicateConfig
    return module


@contextlib.contextmanager
def modules(tree: dict) -> Iterator[None]:
    """Install the modules of `tree` (dotted name -> module) in sys.modules; restore on exit."""
    saved = {name: sys.modules.get(name) for name in tree}
    sys.modules.update(tree)
    try:
        yield
    finally:
        restore_entries(sys.modules, saved)


def _packages(dotted: str) -> dict:
    parts = dotted.split(".")
    out = {}
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        out[name] = pkg
    return out


def fake_vllm() -> dict:
    """vLLM's v1 connector base and an in-tree MooncakeStoreConnector that, like vLLM's, imports
    `mooncake.store` in its constructor and reads MOONCAKE_CONFIG_PATH."""
    base_name = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    conn_name = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
    tree = {**_packages(base_name), **_packages(conn_name)}
    base = types.ModuleType(base_name)

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(abc.ABC):  # noqa: B024
        pass

    class KVConnectorBase_V1(abc.ABC):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._role = role
            self._connector_metadata = None

    base.KVConnectorRole = KVConnectorRole
    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorBase_V1 = KVConnectorBase_V1
    conn = types.ModuleType(conn_name)

    class MooncakeStoreConnector(KVConnectorBase_V1):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig

            with open(os.environ["MOONCAKE_CONFIG_PATH"], encoding="utf-8") as f:
                self.config_seen = json.load(f)
            cfg = self.config_seen
            if cfg["mode"] == "embedded" and cfg["global_segment_size"] == 0:
                raise ValueError("embedded mode requires global_segment_size > 0")
            self.store = MooncakeDistributedStore()
            rc = self.store.setup(
                "127.0.0.1",
                cfg["metadata_server"],
                cfg["global_segment_size"],
                cfg["local_buffer_size"],
                cfg["protocol"],
                cfg["device_name"],
                cfg["master_server_address"],
            )
            if rc != 0:
                raise RuntimeError(f"setup returned {rc}")
            self.replicate_config = ReplicateConfig()

    conn.MooncakeStoreConnector = MooncakeStoreConnector
    tree[base_name] = base
    tree[conn_name] = conn
    return tree


def fake_sglang() -> dict:
    """SGLang's HiCacheStorage and a MooncakeStore that gets its store class through the
    `_import_mooncake_store` hook and ReplicateConfig by an inline import (older releases)."""
    hs_name = "sglang.srt.mem_cache.hicache_storage"
    ms_name = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
    tree = {**_packages(hs_name), **_packages(ms_name)}
    hs = types.ModuleType(hs_name)

    class HiCacheStorage(abc.ABC):
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

    hs.HiCacheStorage = HiCacheStorage
    ms = types.ModuleType(ms_name)

    class MooncakeStore(HiCacheStorage):
        def _import_mooncake_store(self):
            from mooncake.store import MooncakeDistributedStore

            return MooncakeDistributedStore

        def __init__(self, storage_config=None, mem_pool=None):
            extra = storage_config.extra_config
            self.store = self._import_mooncake_store()()
            rc = self.store.setup(
                extra["local_hostname"],
                extra["metadata_server"],
                int(extra["global_segment_size"]),
                16 << 20,
                extra["protocol"],
                extra["device_name"],
                extra["master_server_address"],
                None,
            )
            if rc != 0:
                raise RuntimeError(f"setup returned {rc}")
            from mooncake.store import ReplicateConfig

            self.replicate_config_cls = ReplicateConfig
            assert self.store.put("warmup", b"x" * 4096) == 0
            assert self.store.get("warmup") == b"x" * 4096

    ms.MooncakeStore = MooncakeStore
    tree[hs_name] = hs
    tree[ms_name] = ms
    return tree


@contextlib.contextmanager
def engine_installed(tree: dict, adapter: str) -> Iterator[types.ModuleType]:
    """`adapter` (a kvpool.adapters module name) re-imported with the fake engine `tree`
    installed; re-imported again without it on exit."""
    with modules(tree):
        yield importlib.reload(importlib.import_module(adapter))
    importlib.reload(importlib.import_module(adapter))
