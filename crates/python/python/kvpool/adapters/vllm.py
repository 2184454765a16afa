"""vLLM adapter: ``KvpoolStoreConnector``, a v1 KV connector keeping vLLM's KV blocks in the pool.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvpoolStoreConnector",
        "kv_connector_module_path":"kvpool.adapters.vllm","kv_role":"kv_both"}'

vLLM's connector factory does not know the name, so it imports ``kv_connector_module_path``
and takes the class of that name from it. Two implementations stand behind the name:

- ``kvpool`` (the default): :class:`KvpoolBlockConnector`, described below.
- ``engine`` (``KVPOOL_VLLM_CONNECTOR=engine``, or ``auto`` when vLLM has one): when vLLM
  ships its own ``MooncakeStoreConnector`` (in-tree since
  vllm-project/vllm#40900, ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/``),
  ``KvpoolStoreConnector`` *is* that class; only its construction differs: it runs with
  ``from mooncake.store import ...`` resolving to the store module and with
  ``MOONCAKE_CONFIG_PATH`` naming a file with the pool's settings. Everything else (lookups,
  background transfers, key layout, metrics) is vLLM's own code.
  That connector registers the GPU KV cache itself with the store, which only a store
  that moves device memory can serve (Mooncake over RDMA with GPUDirect; kvpool's TCP client
  reads registered memory with the CPU), so it is opt-in.
- :class:`KvpoolBlockConnector` is this module's synchronous implementation of
  ``KVConnectorBase_V1``: the scheduler looks up how many leading blocks of a request are in
  the pool by their block hashes, the worker loads those blocks before the forward pass, and a
  finished request's full blocks are saved before vLLM frees them. KV caches in host memory are
  read and written in place; device (GPU) caches go through a pinned host staging buffer.

The pure parts (:class:`BlockLayout`, :class:`BlockKeys`, :class:`BlockIO`) know nothing of
vLLM and are tested against real Mooncake with numpy buffers (crates/python/tests).

I/O boundary: the store (``setup``, ``register_buffer``, ``batch_is_exist``, the
``batch_*_multi_buffers`` and ``batch_put_from``/``batch_get_into`` calls) and, for device
caches, host<->device copies through torch.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import itertools
import logging
import os
import threading
from array import array
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import (
    ConfigError,
    mooncake_alias,
    mooncake_config_file,
    open_store,
    read_json_file,
    setup_args,
    store_module,
)

logger = logging.getLogger(__name__)

ENV_IMPL = "KVPOOL_VLLM_CONNECTOR"

# Keys of kv_connector_extra_config this adapter reads (besides Mooncake's config keys).
EXTRA_STORE_MODULE = "kvpool_store_module"
EXTRA_TP_RANK = "kvpool_tp_rank"
EXTRA_PP_RANK = "kvpool_pp_rank"
EXTRA_STAGING_BYTES = "kvpool_staging_bytes"
EXTRA_CACHE_PREFIX = "cache_prefix"

DEFAULT_STAGING_BYTES = 256 << 20

try:  # vLLM's own types, when vLLM imports (it does not on a machine without its CUDA stack)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - any failure means "no usable vLLM here"
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """vLLM's enum of where a connector runs."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's scheduler-to-worker metadata base class."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorBase_V1`` with the state it keeps."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


# vLLM's in-tree Mooncake store connector, newest location first.
ENGINE_CONNECTOR_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.mooncake_store_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_store_connector",
)


def find_engine_connector() -> Optional[type]:
    """vLLM's own ``MooncakeStoreConnector`` class, or None when this vLLM has none."""
    if not HAVE_VLLM:
        return None
    for name in ENGINE_CONNECTOR_MODULES:
        try:
            return importlib.import_module(name).MooncakeStoreConnector
        except Exception:  # noqa: BLE001 - try the next location
            continue
    return None


# ---------------------------------------------------------------------------------------------
# Pure parts: block layout, keys, block I/O
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous run of every block's bytes: block ``b`` is ``block_bytes`` at
    ``base + b * block_stride``."""

    base: int
    block_bytes: int
    block_stride: int


@dataclasses.dataclass(frozen=True)
class _Cache:
    """One KV cache tensor as this module sees it."""

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # bytes
    itemsize: int
    region: Tuple[int, int]  # (address, length) of the memory it lives in
    on_host: bool
    tensor: Any


def _describe(t: Any) -> _Cache:
    """Address, shape and byte strides of a torch tensor or a numpy array."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch.Tensor
        item = int(t.element_size())
        storage = t.untyped_storage()
        return _Cache(
            ptr=int(t.data_ptr()),
            shape=tuple(int(d) for d in t.shape),
            strides=tuple(int(s) * item for s in t.stride()),
            itemsize=item,
            region=(int(storage.data_ptr()), int(storage.nbytes())),
            on_host=t.device.type == "cpu",
            tensor=t,
        )
    if hasattr(t, "__array_interface__") and hasattr(t, "ctypes"):  # numpy.ndarray
        return _Cache(
            ptr=int(t.ctypes.data),
            shape=tuple(int(d) for d in t.shape),
            strides=tuple(int(s) for s in t.strides),
            itemsize=int(t.itemsize),
            region=(int(t.ctypes.data), int(t.nbytes)),
            on_host=True,
            tensor=t,
        )
    raise TypeError(f"a KV cache must be a torch tensor or a numpy array, got {type(t).__name__}")


def _dense(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether dims (shape, byte strides) cover one gap-free run of bytes, in any order."""
    dims = sorted((s, n) for s, n in zip(strides, shape) if n != 1)
    expected = itemsize
    for stride, n in dims:
        if stride != expected:
            return False
        expected *= n
    return True


def segments_of(cache: _Cache, num_blocks: int) -> List[Segment]:
    """The segments of one KV cache tensor of ``num_blocks`` blocks.

    The block dimension is the first of size ``num_blocks`` whose inner dimensions are dense
    (FlashAttention's ``(2, num_blocks, ...)`` gives two segments, K then V; FlashInfer's and
    MLA's blocks-outermost layouts give one).
    """
    for d, n in enumerate(cache.shape):
        if n != num_blocks:
            continue
        inner_shape, inner_strides = cache.shape[d + 1 :], cache.strides[d + 1 :]
        if not _dense(inner_shape, inner_strides, cache.itemsize):
            continue
        block_bytes = cache.itemsize
        for m in inner_shape:
            block_bytes *= m
        outer = [range(m) for m in cache.shape[:d]]
        out = []
        for idx in itertools.product(*outer):
            base = cache.ptr + sum(i * s for i, s in zip(idx, cache.strides[:d]))
            out.append(Segment(base, block_bytes, cache.strides[d]))
        return out
    raise ValueError(
        f"no block dimension of size {num_blocks} with dense inner dimensions in a KV cache "
        f"of shape {cache.shape} and byte strides {cache.strides}"
    )


class BlockLayout:
    """Where each block's bytes are, across all layers: the value stored under a block's key is
    its bytes in every segment, in order."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caches: List[_Cache] = []
        self.segments: List[Segment] = []
        self._cache_of_segment: List[int] = []
        seen: Set[Tuple[int, Tuple[Segment, ...]]] = set()
        for name, value in kv_caches.items():
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            cache = _describe(tensor)
            segs = tuple(segments_of(cache, num_blocks))
            if (cache.region[0], segs) in seen:  # a layer sharing another layer's cache
                continue
            seen.add((cache.region[0], segs))
            self.caches.append(cache)
            for s in segs:
                self.segments.append(s)
                self._cache_of_segment.append(len(self.caches) - 1)
            logger.debug("kv cache %s: %d segment(s)", name, len(segs))
        if not self.segments:
            raise ValueError("no KV caches to register")
        self.bytes_per_block = sum(s.block_bytes for s in self.segments)
        self.on_host = all(c.on_host for c in self.caches)

    def regions(self) -> List[Tuple[int, int]]:
        """The memory to register with the store, each region once."""
        return sorted({c.region for c in self.caches})

    def parts(self, block_id: int) -> Tuple[List[int], List[int]]:
        """Addresses and lengths of one block's bytes."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range 0..{self.num_blocks}")
        return (
            [s.base + block_id * s.block_stride for s in self.segments],
            [s.block_bytes for s in self.segments],
        )


def hash_hex(block_hash: Any) -> str:
    """A block hash as key text: vLLM's ``BlockHash`` is ``bytes`` (0.11+); older releases
    used ints or a named tuple with ``hash_value``; a ``str`` is taken as key text already."""
    if isinstance(block_hash, str):
        return block_hash
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return bytes(block_hash).hex()
    if isinstance(block_hash, int):
        return format(block_hash & ((1 << 128) - 1), "x")
    inner = getattr(block_hash, "hash_value", None)
    if inner is not None:
        return hash_hex(inner)
    return hashlib.sha256(repr(block_hash).encode()).hexdigest()


def token_block_hashes(token_ids: Sequence[int], block_size: int) -> List[bytes]:
    """Chained SHA-256 of each full block of ``token_ids`` (for requests that carry no
    ``block_hashes``): equal prefixes give equal hashes in every process."""
    out: List[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", (int(t) for t in token_ids[start : start + block_size])).tobytes()
        parent = hashlib.sha256(parent + tokens).digest()
        out.append(parent)
    return out


class BlockKeys:
    """Pool keys of vLLM blocks: one per block hash and (tensor, pipeline) parallel rank, since
    each rank holds its own shard of every block."""

    def __init__(self, namespace: str, tp_size: int = 1, pp_size: int = 1):
        if tp_size < 1 or pp_size < 1:
            raise ValueError("tp_size and pp_size must be at least 1")
        self.namespace = namespace
        self.tp_size = tp_size
        self.pp_size = pp_size

    def key(self, block_hash: Any, tp_rank: int = 0, pp_rank: int = 0) -> str:
        return (
            f"{self.namespace}@tp{tp_rank}of{self.tp_size}@pp{pp_rank}of{self.pp_size}"
            f"@{hash_hex(block_hash)}"
        )

    def all_ranks(self, block_hash: Any) -> List[str]:
        return [
            self.key(block_hash, t, p) for p in range(self.pp_size) for t in range(self.tp_size)
        ]


def prefix_hits(store: Any, key_groups: Sequence[Sequence[str]]) -> int:
    """How many leading groups have every key in the store (one ``batch_is_exist``)."""
    flat = [k for group in key_groups for k in group]
    if not flat:
        return 0
    found = store.batch_is_exist(flat)
    pos = 0
    for n, group in enumerate(key_groups):
        if not all(found[pos + i] == 1 for i in range(len(group))):
            return n
        pos += len(group)
    return len(key_groups)


class BlockIO:
    """Saves and loads whole blocks of a :class:`BlockLayout` under given keys.

    Host caches are registered with the store and moved with the multi-buffer calls, in place;
    device caches go through a registered pinned host buffer of ``staging_bytes`` (torch).
    """

    def __init__(
        self,
        store: Any,
        layout: BlockLayout,
        *,
        replicate_config: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ):
        self.store = store
        self.layout = layout
        self.replicate_config = replicate_config
        self._registered: List[int] = []
        self._lock = threading.Lock()
        self._staging: Optional[_Staging] = None
        if layout.on_host:
            for ptr, size in layout.regions():
                rc = store.register_buffer(ptr, size)
                if rc != 0:
                    raise RuntimeError(f"register_buffer({ptr:#x}, {size}) returned {rc}")
                self._registered.append(ptr)
        else:
            self._staging = _Staging(store, layout, staging_bytes)

    def _put_args(self, block_ids: Sequence[int]) -> Tuple[List[List[int]], List[List[int]]]:
        ptrs, sizes = [], []
        for b in block_ids:
            p, s = self.layout.parts(b)
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    def save(self, keys: Sequence[str], block_ids: Sequence[int]) -> List[int]:
        """Store each block under its key unless the key is already there; per key 0 (stored
        or already present) or a negative Mooncake error code."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return []
        present = self.store.batch_is_exist(list(keys))
        todo = [i for i, e in enumerate(present) if e != 1]
        results = [0] * len(keys)
        if not todo:
            return results
        with self._lock:
            if self._staging is not None:
                codes = self._staging.save(
                    [keys[i] for i in todo], [block_ids[i] for i in todo], self.replicate_config
                )
            else:
                ptrs, sizes = self._put_args([block_ids[i] for i in todo])
                args = [[keys[i] for i in todo], ptrs, sizes]
                if self.replicate_config is not None:
                    args.append(self.replicate_config)
                codes = self.store.batch_put_from_multi_buffers(*args)
        for i, code in zip(todo, codes):
            results[i] = int(code)
        return results

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> List[int]:
        """Read each key into its block; per key the bytes read or a negative error code."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return []
        with self._lock:
            if self._staging is not None:
                return self._staging.load(list(keys), list(block_ids))
            ptrs, sizes = self._put_args(block_ids)
            return [
                int(r) for r in self.store.batch_get_into_multi_buffers(list(keys), ptrs, sizes)
            ]

    def close(self) -> None:
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()
        if self._staging is not None:
            self._staging.close()
            self._staging = None


class _Staging:
    """Device caches through a registered pinned host buffer: rows of ``bytes_per_block``,
    filled and drained with torch copies (``index_select`` to host, ``index_copy_`` back)."""

    def __init__(self, store: Any, layout: BlockLayout, staging_bytes: int):
        import torch  # device caches only exist where torch does

        self.torch = torch
        self.store = store
        self.layout = layout
        self.rows = max(1, staging_bytes // layout.bytes_per_block)
        self.host = torch.empty(
            (self.rows, layout.bytes_per_block),
            dtype=torch.uint8,
            pin_memory=torch.cuda.is_available(),
        )
        rc = store.register_buffer(self.host.data_ptr(), self.host.numel())
        if rc != 0:
            raise RuntimeError(f"register_buffer of the staging buffer returned {rc}")
        # A uint8 (num_blocks, block_bytes) view of each segment, on its device.
        self.views = []
        self.offsets = []
        offset = 0
        for seg, cache_idx in zip(layout.segments, layout._cache_of_segment):
            cache = layout.caches[cache_idx]
            storage = cache.tensor.untyped_storage()
            flat = torch.tensor([], dtype=torch.uint8, device=cache.tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            view = flat.as_strided(
                (layout.num_blocks, seg.block_bytes),
                (seg.block_stride, 1),
                seg.base - cache.region[0],
            )
            self.views.append(view)
            self.offsets.append(offset)
            offset += seg.block_bytes

    def _chunks(self, n: int) -> Iterable[Tuple[int, int]]:
        for start in range(0, n, self.rows):
            yield start, min(n, start + self.rows)

    def _row_ptrs(self, n: int) -> Tuple[List[int], List[int]]:
        base, bpb = self.host.data_ptr(), self.layout.bytes_per_block
        return [base + i * bpb for i in range(n)], [bpb] * n

    def save(self, keys: List[str], block_ids: List[int], replicate_config: Any) -> List[int]:
        torch, out = self.torch, []
        for start, end in self._chunks(len(keys)):
            n = end - start
            for view, off in zip(self.views, self.offsets):
                ids = torch.tensor(block_ids[start:end], dtype=torch.long, device=view.device)
                self.host[:n, off : off + view.shape[1]].copy_(view.index_select(0, ids))
            ptrs, sizes = self._row_ptrs(n)
            args = [keys[start:end], ptrs, sizes] + ([replicate_config] if replicate_config else [])
            out.extend(int(c) for c in self.store.batch_put_from(*args))
        return out

    def load(self, keys: List[str], block_ids: List[int]) -> List[int]:
        torch, out = self.torch, []
        for start, end in self._chunks(len(keys)):
            n = end - start
            ptrs, sizes = self._row_ptrs(n)
            got = [int(r) for r in self.store.batch_get_into(keys[start:end], ptrs, sizes)]
            ok = [i for i, r in enumerate(got) if r == self.layout.bytes_per_block]
            if ok:
                rows = torch.tensor(ok, dtype=torch.long)
                ids_host = [block_ids[start + i] for i in ok]
                for view, off in zip(self.views, self.offsets):
                    ids = torch.tensor(ids_host, dtype=torch.long, device=view.device)
                    src = self.host[:, off : off + view.shape[1]].index_select(0, rows)
                    view.index_copy_(0, ids, src.to(view.device))
            out.extend(got)
        return out

    def close(self) -> None:
        self.store.unregister_buffer(self.host.data_ptr())


# ---------------------------------------------------------------------------------------------
# kvpool's own connector (KVConnectorBase_V1)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BlockJob:
    """Blocks of one request to load or save: ``hashes[i]`` (hex) names block
    ``block_ids[i]``; each worker makes its own rank's key of it."""

    req_id: str
    block_ids: List[int]
    hashes: List[str]


@dataclasses.dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers each step."""

    loads: List[BlockJob] = dataclasses.field(default_factory=list)
    saves: List[BlockJob] = dataclasses.field(default_factory=list)


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def _namespace(
    vllm_config: Any, extra: Mapping[str, Any], block_size: int, tp: int, pp: int
) -> str:
    """Key prefix: the model's last path component plus a digest of what changes a block's
    bytes (model, dtypes, block size, parallel layout), so incompatible engines never share
    blocks."""
    model_cfg = getattr(vllm_config, "model_config", None)
    model = str(getattr(model_cfg, "model", "") or "model").rstrip("/")
    cache_cfg = getattr(vllm_config, "cache_config", None)
    fingerprint = "|".join(
        str(x)
        for x in (
            model,
            getattr(model_cfg, "dtype", ""),
            getattr(cache_cfg, "cache_dtype", ""),
            block_size,
            tp,
            pp,
        )
    )
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    prefix = str(extra.get(EXTRA_CACHE_PREFIX) or "")
    return f"{prefix + '@' if prefix else ''}{model.split('/')[-1]}@kvpool-vllm@{digest}"


def _parallel_ranks(vllm_config: Any, extra: Mapping[str, Any]) -> Tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this process."""
    par = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(par, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    tp_rank = extra.get(EXTRA_TP_RANK)
    pp_rank = extra.get(EXTRA_PP_RANK)
    if tp_rank is None or pp_rank is None:
        try:
            from vllm.distributed.parallel_state import (  # type: ignore
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
            pp_rank = get_pp_group().rank_in_group if pp_rank is None else pp_rank
        except Exception:  # noqa: BLE001 - no vLLM parallel state (tests, scheduler)
            rank = int(getattr(par, "rank", 0) or 0)
            tp_rank = rank % tp_size if tp_rank is None else tp_rank
            pp_rank = (rank // tp_size) % pp_size if pp_rank is None else pp_rank
    return int(tp_rank), tp_size, int(pp_rank), pp_size


def _block_ids(blocks: Any) -> List[int]:
    """Block ids of the first KV cache group, from ``KVCacheBlocks`` or a plain list."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):  # one list per KV cache group
        ids = ids[0]
    return [int(b) for b in ids]


class KvpoolBlockConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvpool's ``KVConnectorBase_V1``: synchronous loads of pool hits, saves on finish.

    Scheduler side: :meth:`get_num_new_matched_tokens` counts the request's leading full blocks
    whose keys exist for every parallel rank (always leaving the last token to compute), and
    the blocks vLLM then allocates for them are loaded in the next step;
    :meth:`request_finished` keeps a finished request's blocks until its full blocks are saved.
    Worker side: :meth:`start_load_kv` loads, :meth:`wait_for_save` saves (skipping keys the
    pool has), :meth:`get_finished` reports the saved requests so vLLM frees their blocks.
    ``kv_role``: ``kv_consumer`` only loads, ``kv_producer`` only saves, ``kv_both`` does both.
    """

    kvpool_impl = "kvpool"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM releases whose base takes (vllm_config, role)
            super().__init__(vllm_config, role)
            self._kv_cache_config = kv_cache_config
        extra = _extra(vllm_config)
        self._extra = extra
        kv_role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        self._loads_enabled = kv_role in ("kv_consumer", "kv_both")
        self._saves_enabled = kv_role in ("kv_producer", "kv_both")
        cache_cfg = vllm_config.cache_config
        self._block_size = int(cache_cfg.block_size)
        hash_block = int(getattr(cache_cfg, "hash_block_size", None) or self._block_size)
        self._hashes_per_block = max(1, self._block_size // hash_block)
        tp_rank, tp_size, pp_rank, pp_size = _parallel_ranks(vllm_config, extra)
        self._tp_rank, self._pp_rank = tp_rank, pp_rank
        self._keys = BlockKeys(
            _namespace(vllm_config, extra, self._block_size, tp_size, pp_size), tp_size, pp_size
        )
        self._module = store_module(extra.get(EXTRA_STORE_MODULE))
        self._store: Any = None
        self._io: Optional[BlockIO] = None
        # scheduler state
        self._lookups: Dict[str, Tuple[int, int]] = {}  # req -> (local tokens, hit tokens)
        self._pending_loads: List[BlockJob] = []
        self._pending_saves: List[BlockJob] = []
        # worker state
        self._saved: Set[str] = set()
        self._seen_finished: Set[str] = set()
        self._load_errors: Set[int] = set()

    # -- shared ----------------------------------------------------------------------------

    def _open(self, contribute: bool) -> Any:
        if self._store is None:
            overrides = dict(self._extra)
            if not contribute:
                overrides["global_segment_size"] = 0
            self._store = open_store(overrides, module=self._module)
        return self._store

    def _block_hashes(self, request: Any) -> List[str]:
        """One hash (hex) per full block of the request's tokens."""
        hashes = getattr(request, "block_hashes", None)
        if hashes is None:
            tokens = getattr(request, "all_token_ids", None) or getattr(
                request, "prompt_token_ids", []
            )
            hashes = token_block_hashes(list(tokens), self._block_size)
            step = 1
        else:
            step = self._hashes_per_block
        hashes = list(hashes)
        return [hash_hex(hashes[i]) for i in range(step - 1, len(hashes), step)]

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the pool can supply (loaded synchronously,
        hence ``False``)."""
        if not self._loads_enabled:
            return 0, False
        num_tokens = int(getattr(request, "num_tokens", 0) or len(request.prompt_token_ids))
        hashes = self._block_hashes(request)
        # Leave at least one token to compute: vLLM needs the last token's logits.
        usable = min(len(hashes), (num_tokens - 1) // self._block_size)
        first = num_computed_tokens // self._block_size
        if usable <= first:
            self._lookups[request.request_id] = (num_computed_tokens, num_computed_tokens)
            return 0, False
        try:
            store = self._open(contribute=False)
            hits = prefix_hits(store, [self._keys.all_ranks(h) for h in hashes[first:usable]])
        except Exception as e:  # noqa: BLE001 - a pool outage is a cache miss, not a failure
            logger.warning("kvpool lookup failed for %s: %s", request.request_id, e)
            hits = 0
        hit_tokens = (first + hits) * self._block_size
        self._lookups[request.request_id] = (num_computed_tokens, hit_tokens)
        return max(0, hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local, _hit = self._lookups.pop(request.request_id, (0, 0))
        if num_external_tokens <= 0:
            return
        first = local // self._block_size
        count = num_external_tokens // self._block_size
        ids = _block_ids(blocks)[first : first + count]
        hashes = self._block_hashes(request)[first : first + count]
        if len(ids) != count or len(hashes) != count:
            logger.warning(
                "kvpool: %s has %d blocks and %d hashes for %d pool blocks",
                request.request_id,
                len(ids),
                len(hashes),
                count,
            )
            count = min(len(ids), len(hashes))
        self._pending_loads.append(BlockJob(request.request_id, ids[:count], hashes[:count]))

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        meta = KvpoolConnectorMetadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = [], []
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> Tuple[bool, Optional[dict]]:
        """Queue the request's full blocks for saving; True keeps them until they are saved."""
        self._lookups.pop(request.request_id, None)
        if not self._saves_enabled:
            return False, None
        ids = _block_ids(block_ids)
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        hashes = self._block_hashes(request)
        n = min(len(ids), len(hashes), computed // self._block_size)
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n = min(n, publishable // self._hashes_per_block)
        if n <= 0:
            return False, None
        self._pending_saves.append(BlockJob(request.request_id, ids[:n], hashes[:n]))
        return True, None

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        num_blocks = getattr(self._vllm_config.cache_config, "num_gpu_blocks", None)
        if not num_blocks and self._kv_cache_config is not None:
            num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if not num_blocks:
            raise ConfigError("num_gpu_blocks: unknown, cannot lay out the KV cache blocks")
        layout = BlockLayout(kv_caches, int(num_blocks))
        replicate = self._module.ReplicateConfig()
        self._io = BlockIO(
            self._open(contribute=True),
            layout,
            replicate_config=replicate,
            staging_bytes=int(self._extra.get(EXTRA_STAGING_BYTES) or DEFAULT_STAGING_BYTES),
        )
        logger.info(
            "kvpool: %d KV segment(s), %d bytes per block, %s",
            len(layout.segments),
            layout.bytes_per_block,
            "in place" if layout.on_host else "through host staging",
        )

    def _worker_keys(self, job: BlockJob) -> List[str]:
        return [self._keys.key(h, self._tp_rank, self._pp_rank) for h in job.hashes]

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        if self._io is None:
            raise RuntimeError("start_load_kv before register_kv_caches")
        for job in meta.loads:
            try:
                got = self._io.load(self._worker_keys(job), job.block_ids)
            except Exception as e:  # noqa: BLE001 - report the blocks, vLLM recomputes them
                logger.warning("kvpool load of %s failed: %s", job.req_id, e)
                got = [-1] * len(job.block_ids)
            bad = [b for b, r in zip(job.block_ids, got) if r != self._io.layout.bytes_per_block]
            if bad:
                logger.warning(
                    "kvpool: %d of %d blocks of %s not loaded", len(bad), len(got), job.req_id
                )
                self._load_errors.update(bad)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        if self._io is None:
            raise RuntimeError("wait_for_save before register_kv_caches")
        for job in meta.saves:
            try:
                codes = self._io.save(self._worker_keys(job), job.block_ids)
                failed = sum(1 for c in codes if c != 0)
                if failed:
                    logger.warning(
                        "kvpool: %d of %d blocks of %s not saved (codes %s)",
                        failed,
                        len(codes),
                        job.req_id,
                        sorted(set(codes)),
                    )
            except Exception as e:  # noqa: BLE001 - a lost save is a later cache miss
                logger.warning("kvpool save of %s failed: %s", job.req_id, e)
            self._saved.add(job.req_id)

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Saved requests, once vLLM has told this worker they finished."""
        self._seen_finished |= set(finished_req_ids)
        done = self._saved & self._seen_finished
        self._saved -= done
        self._seen_finished -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._store is not None:
            store, self._store = self._store, None
            store.close()


# ---------------------------------------------------------------------------------------------
# vLLM's own connector on the pool
# ---------------------------------------------------------------------------------------------


def engine_mooncake_config(extra: Mapping[str, Any]) -> dict:
    """What vLLM's in-tree connector reads from ``MOONCAKE_CONFIG_PATH``: the file already
    named there (the operator's engine.json), completed with the pool's setup arguments and a
    ``mode`` that agrees with the segment size (``standalone-store`` for 0: the node agents, not
    the engine, hold the memory)."""
    base = read_json_file(os.environ.get("MOONCAKE_CONFIG_PATH"))
    args = setup_args({**base, **dict(extra)})
    merged = {**args.mooncake_json(), **base}
    merged["master_server_address"] = args.master_server_addr
    merged["global_segment_size"] = args.global_segment_size
    merged["local_buffer_size"] = args.local_buffer_size
    merged.setdefault("mode", "embedded" if args.global_segment_size > 0 else "standalone-store")
    return merged


def _engine_subclass(base: type) -> type:
    class KvpoolStoreConnector(base):  # type: ignore[misc, valid-type]
        """vLLM's ``MooncakeStoreConnector``, built on the pool's store module."""

        kvpool_impl = "engine"

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            extra = _extra(vllm_config)
            module = store_module(extra.get(EXTRA_STORE_MODULE))
            with mooncake_alias(module), mooncake_config_file(engine_mooncake_config(extra)):
                super().__init__(vllm_config, role, kv_cache_config)

    KvpoolStoreConnector.__qualname__ = "KvpoolStoreConnector"
    KvpoolStoreConnector.__module__ = __name__
    return KvpoolStoreConnector


def select_connector(impl: Optional[str] = None) -> type:
    """The class behind ``KvpoolStoreConnector``: ``impl`` (or ``KVPOOL_VLLM_CONNECTOR``) is
    ``kvpool`` (the default: this module's connector, which stages device caches through
    pinned host memory), ``engine`` (vLLM's own Mooncake store connector over kvpool's store,
    which registers device memory) or ``auto`` (``engine`` when this vLLM has one)."""
    impl = (impl or os.environ.get(ENV_IMPL) or "kvpool").lower()
    if impl not in ("auto", "engine", "kvpool"):
        raise ConfigError(f"{ENV_IMPL}: {impl!r} is not auto, engine or kvpool")
    if impl == "kvpool":
        return KvpoolBlockConnector
    engine = find_engine_connector()
    if engine is None:
        if impl == "engine":
            raise ImportError(
                f"{ENV_IMPL}=engine, but this vLLM has no MooncakeStoreConnector "
                f"(looked in {', '.join(ENGINE_CONNECTOR_MODULES)})"
            )
        return KvpoolBlockConnector
    return _engine_subclass(engine)


KvpoolStoreConnector = select_connector()

__all__ = [
    "BlockIO",
    "BlockJob",
    "BlockKeys",
    "BlockLayout",
    "KvpoolBlockConnector",
    "KvpoolConnectorMetadata",
    "KvpoolStoreConnector",
    "Segment",
    "engine_mooncake_config",
    "find_engine_connector",
    "hash_hex",
    "prefix_hits",
    "segments_of",
    "select_connector",
    "token_block_hashes",
]
