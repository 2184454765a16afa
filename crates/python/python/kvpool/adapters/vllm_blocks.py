"""The pure parts of the vLLM adapter (``kvpool.adapters.vllm``), which know nothing of vLLM:
where each KV block's bytes lie in the caches (:class:`BlockLayout`), the pool keys of a
request's blocks (:class:`BlockKeys`), and the block moves through a store (:class:`BlockIO`,
with pinned host staging for device caches). Tested against real Mooncake and kvpool with
numpy buffers (crates/python/tests/test_adapters.py).

I/O boundary: the store calls of :class:`BlockIO`, and host<->device copies through torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import logging
import threading
import time
from array import array
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

logger = logging.getLogger("kvpool.adapters.vllm")

DEFAULT_STAGING_BYTES = 256 << 20

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
        # Each layer's cache (index into ``caches``): its segments are one run of every
        # block's value (:meth:`cache_part`).
        self.layer_cache: Dict[str, int] = {}
        seen: Dict[Tuple[int, Tuple[Segment, ...]], int] = {}
        for name, value in kv_caches.items():
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            cache = _describe(tensor)
            segs = tuple(segments_of(cache, num_blocks))
            shared = seen.get((cache.region[0], segs))
            if shared is not None:  # a layer sharing another layer's cache
                self.layer_cache[name] = shared
                continue
            seen[(cache.region[0], segs)] = len(self.caches)
            self.layer_cache[name] = len(self.caches)
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

    def parts(self, block_id: int, cache: Optional[int] = None) -> Tuple[List[int], List[int]]:
        """Addresses and lengths of one block's bytes (of one cache's segments only, when
        ``cache`` is given)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range 0..{self.num_blocks}")
        segs = [
            s
            for s, c in zip(self.segments, self._cache_of_segment)
            if cache is None or c == cache
        ]
        return (
            [s.base + block_id * s.block_stride for s in segs],
            [s.block_bytes for s in segs],
        )

    def cache_part(self, cache: int) -> Tuple[int, int]:
        """Where one cache's bytes lie in every block's value: (offset, length)."""
        offset = length = 0
        for s, c in zip(self.segments, self._cache_of_segment):
            if c < cache:
                offset += s.block_bytes
            elif c == cache:
                length += s.block_bytes
        return offset, length


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


class KnownBlocks:
    """Block hashes an engine knows to be in the pool: found there by one of its lookups, or
    saved by one of its steps, within the last ``ttl_s`` seconds (at most ``capacity`` of them,
    the oldest forgotten first). The scheduler does not queue saves of these blocks: the worker
    would only find every key present, at the cost of a pool call before the step's output. The
    pool may evict a block after it was seen; until the entry expires the engine then does not
    put it back, which costs a later cache miss, never a wrong answer."""

    def __init__(
        self,
        capacity: int = 1 << 16,
        ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("capacity must be at least 1 and ttl_s positive")
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._seen: "OrderedDict[str, float]" = OrderedDict()

    def add(self, hashes: Iterable[str]) -> None:
        now = self._clock()
        for h in hashes:
            self._seen[h] = now
            self._seen.move_to_end(h)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def __contains__(self, block_hash: object) -> bool:
        seen = self._seen.get(block_hash)  # type: ignore[call-overload]
        if seen is None:
            return False
        if self._clock() - seen > self._ttl_s:
            del self._seen[block_hash]  # type: ignore[arg-type]
            return False
        return True

    def __len__(self) -> int:
        return len(self._seen)


DEVICE_MEMORY_MODES = ("auto", "direct", "staging")


def store_takes_device_memory(store: Any) -> bool:
    """Whether ``store`` registers a GPU's own memory and moves it itself (kvpool built with
    feature ``cuda`` on a host with a GPU driver: ``device_memory_supported()``). A store
    without that method (real Mooncake, or any other) is given host memory only."""
    probe = getattr(store, "device_memory_supported", None)
    if not callable(probe):
        return False
    try:
        return bool(probe())
    except Exception:  # noqa: BLE001 - a store that cannot answer gets host memory
        return False


class BlockIO:
    """Saves and loads whole blocks of a :class:`BlockLayout` under given keys.

    Host caches are registered with the store and moved with the multi-buffer calls, in place.
    Device caches are too when the store takes device memory (``device_memory`` "auto" or
    "direct"; see :func:`store_takes_device_memory`): the store copies between the GPU and its
    own pinned staging, with no torch copy here. Otherwise ("staging", or a store that takes
    host memory only) they go through a registered pinned host buffer of ``staging_bytes``,
    filled and drained with torch copies. "direct" with a store that cannot take device
    memory is a ValueError.
    """

    def __init__(
        self,
        store: Any,
        layout: BlockLayout,
        *,
        replicate_config: Any = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        device_memory: str = "auto",
    ):
        if device_memory not in DEVICE_MEMORY_MODES:
            raise ValueError(
                f"device_memory {device_memory!r}: expected one of {', '.join(DEVICE_MEMORY_MODES)}"
            )
        self.store = store
        self.layout = layout
        self.replicate_config = replicate_config
        self._registered: List[int] = []
        self._lock = threading.Lock()
        self._staging: Optional[_Staging] = None
        in_place = layout.on_host
        if not in_place and device_memory != "staging":
            takes = store_takes_device_memory(store)
            if device_memory == "direct" and not takes:
                raise ValueError(
                    "device_memory 'direct': this store does not take GPU memory (kvpool "
                    "needs a build with feature cuda and a CUDA driver)"
                )
            in_place = takes
        self.in_place = in_place
        if in_place:
            for ptr, size in layout.regions():
                rc = store.register_buffer(ptr, size)
                if rc != 0:
                    raise RuntimeError(f"register_buffer({ptr:#x}, {size}) returned {rc}")
                self._registered.append(ptr)
        else:
            self._staging = _Staging(store, layout, staging_bytes)

    def _put_args(
        self, block_ids: Sequence[int], cache: Optional[int] = None
    ) -> Tuple[List[List[int]], List[List[int]]]:
        """Addresses and lengths of each block's bytes (of one cache's only, when given)."""
        ptrs, sizes = [], []
        for b in block_ids:
            p, s = self.layout.parts(b, cache)
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

    def reads_parts(self) -> bool:
        """Whether :meth:`load_cache` can read one cache's part of each block: caches read in
        place, through a store that reads parts of values (kvpool in direct mode)."""
        probe = getattr(self.store, "reads_value_parts", None)
        if self._staging is not None or not callable(probe):
            return False
        try:
            return bool(probe())
        except Exception:  # noqa: BLE001 - a store that cannot answer reads whole values
            return False

    def load_cache(self, keys: Sequence[str], block_ids: Sequence[int], cache: int) -> List[int]:
        """Read one cache's part of each key's value into its block (see :meth:`reads_parts`);
        per key the bytes read (``cache_part(cache)[1]``) or a negative error code."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return []
        offset, _length = self.layout.cache_part(cache)
        ptrs, sizes = self._put_args(block_ids, cache)
        with self._lock:
            got = self.store.batch_get_parts_into_multi_buffers(
                list(keys), [offset] * len(keys), ptrs, sizes
            )
        return [int(r) for r in got]

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

    def start_load(self, keys: Sequence[str], block_ids: Sequence[int]) -> Optional[Any]:
        """:meth:`load` started on the store's own threads: an object whose ``wait()``
        answers what :meth:`load` would have; None where the store cannot start a get that
        way (another store, or device caches through staging), and the caller loads with
        :meth:`load` instead. The blocks must not be touched until ``wait()`` returns."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        start = getattr(self.store, "start_batch_get_into_multi_buffers", None)
        if self._staging is not None or not callable(start) or not keys:
            return None
        with self._lock:
            ptrs, sizes = self._put_args(block_ids)
            return start(list(keys), ptrs, sizes)

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
        # Device caches only exist where torch does (Any: absent where the types are checked).
        torch: Any = importlib.import_module("torch")

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
        torch: Any = self.torch
        out: List[int] = []
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
        torch: Any = self.torch
        out: List[int] = []
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


class LayeredLoad:
    """The pool loads of one engine step, one KV cache (layer) at a time in a thread of its
    own, so that the forward pass starts at once and each attention layer waits only for its
    own cache (:meth:`wait`): the load of a long prefix overlaps the compute of the layers
    before. ``jobs`` are (keys, block ids) pairs; a block whose load of any cache failed is in
    :meth:`join`'s answer."""

    def __init__(self, io: BlockIO, jobs: Sequence[Tuple[Sequence[str], Sequence[int]]]):
        self._io = io
        self._keys = [k for keys, _ in jobs for k in keys]
        self._ids = [b for _, ids in jobs for b in ids]
        self._ready = [threading.Event() for _ in io.layout.caches]
        self._failed: Set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kvpool-layer-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        done = 0
        try:
            for cache, ready in enumerate(self._ready):
                want = self._io.layout.cache_part(cache)[1]
                try:
                    got = self._io.load_cache(self._keys, self._ids, cache)
                except Exception as e:  # noqa: BLE001 - reported as failed blocks
                    logger.warning("kvpool: loading KV cache %d failed: %s", cache, e)
                    got = [-1] * len(self._ids)
                self._failed.update(b for b, r in zip(self._ids, got) if r != want)
                ready.set()
                done += 1
        finally:
            if done < len(self._ready):  # never leave a layer waiting, nor a block unreported
                self._failed.update(self._ids)
                for ready in self._ready:
                    ready.set()

    def wait(self, cache: Optional[int]) -> None:
        """Until ``cache`` is loaded (every cache when None)."""
        if cache is None or not 0 <= cache < len(self._ready):
            self._thread.join()
        else:
            self._ready[cache].wait()

    def join(self) -> Set[int]:
        """Until every cache is loaded: the blocks that failed."""
        self._thread.join()
        return set(self._failed)

