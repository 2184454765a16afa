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
import importlib
import itertools
import logging
import os
import threading
import time
from array import array
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import (
    attach_engine_logging,
    ConfigError,
    mooncake_alias,
    mooncake_config_file,
    open_store,
    read_json_file,
    select_impl,
    setup_args,
    store_module,
)

from .vllm_blocks import (  # noqa: F401 - re-exported: the adapter's pure parts
    DEFAULT_STAGING_BYTES,
    BlockIO,
    BlockKeys,
    BlockLayout,
    KnownBlocks,
    LayeredLoad,
    Segment,
    _Cache,
    _describe,
    _dense,
    _Staging,
    hash_hex,
    prefix_hits,
    segments_of,
    store_takes_device_memory,
    token_block_hashes,
)

logger = logging.getLogger(__name__)

ENV_IMPL = "KVPOOL_VLLM_CONNECTOR"

# Keys of kv_connector_extra_config this adapter reads (besides Mooncake's config keys).
EXTRA_STORE_MODULE = "kvpool_store_module"
EXTRA_TP_RANK = "kvpool_tp_rank"
EXTRA_PP_RANK = "kvpool_pp_rank"
EXTRA_STAGING_BYTES = "kvpool_staging_bytes"
EXTRA_DEVICE_MEMORY = "kvpool_device_memory"
EXTRA_CACHE_PREFIX = "cache_prefix"
EXTRA_HANDOFF_WAIT_S = "kvpool_handoff_wait_s"
EXTRA_LAYERWISE = "kvpool_layerwise_load"
EXTRA_EARLY_LOAD = "kvpool_early_load"
# How long a decode engine waits for the blocks a prefill engine handed over.
DEFAULT_HANDOFF_WAIT_S = 10.0
# get_finished calls a finished request is remembered for, waiting for its finish-time save.
FINISHED_MEMORY = 64
# The key of kvpool's part of vLLM's kv_transfer_params.
HANDOFF_KEY = "kvpool"


try:  # vLLM's own types, when vLLM imports (it does not on a machine without its CUDA stack)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
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
            found: type = importlib.import_module(name).MooncakeStoreConnector
            return found
        except Exception:  # noqa: BLE001 - try the next location
            continue
    return None



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
    # The save of a finished request that vLLM keeps until get_finished reports it (one
    # queued by request_finished); a step's saves are not reported.
    final: bool = False


@dataclasses.dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers each step."""

    loads: List[BlockJob] = dataclasses.field(default_factory=list)
    saves: List[BlockJob] = dataclasses.field(default_factory=list)


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


def kv_dtype_name(vllm_config: Any) -> str:
    """The dtype of the KV cache's elements, as the key contract writes it: vLLM's
    ``--kv-cache-dtype`` when it is set (``fp8_e4m3``...), else the model's resolved dtype
    without torch's prefix (``bfloat16``)."""
    cache_cfg = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cache_cfg, "cache_dtype", "") or "auto")
    if cache_dtype != "auto":
        return cache_dtype
    model_cfg = getattr(vllm_config, "model_config", None)
    dtype = str(getattr(model_cfg, "dtype", "") or "auto")
    return dtype.removeprefix("torch.")


def model_id(vllm_config: Any) -> str:
    """The model's name in keys: the last path component of vLLM's served model name (the
    first one, when several are given), which is what clients, and so the conductor, name in
    requests; by default vLLM serves the model under its path (or hub name)."""
    model_cfg = getattr(vllm_config, "model_config", None)
    served = getattr(model_cfg, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model = str(served or getattr(model_cfg, "model", "") or "model").rstrip("/")
    return model.split("/")[-1] or "model"


def key_namespace(model: str, kv_dtype: str, block_size: int, cache_prefix: str = "") -> str:
    """The pool key contract's namespace (docs/engine-contract.md, "Pool keys"):
    ``[cache_prefix@]<model>@kvpool-vllm@<kv dtype>@bs<block size>``. The conductor builds the
    same string from the engine pool's model and settings."""
    prefix = f"{cache_prefix}@" if cache_prefix else ""
    return f"{prefix}{model}@kvpool-vllm@{kv_dtype}@bs{block_size}"


def _namespace(vllm_config: Any, extra: Mapping[str, Any], block_size: int) -> str:
    return key_namespace(
        model_id(vllm_config),
        kv_dtype_name(vllm_config),
        block_size,
        str(extra.get(EXTRA_CACHE_PREFIX) or ""),
    )


def switch(name: str, value: Any) -> str:
    """An on/off/auto setting of ``kv_connector_extra_config`` as "auto", "true" or "false"
    (true/1/on/yes, false/0/off/no); anything else is a ConfigError naming ``name``."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    if text in ("true", "1", "on", "yes"):
        return "true"
    if text in ("false", "0", "off", "no"):
        return "false"
    raise ConfigError(f"{name} {text!r}: expected auto, true or false")


def layerwise_loads(mode: str, layout: BlockLayout, io: BlockIO) -> bool:
    """Whether loads go layer by layer behind the forward pass. ``mode`` ``"true"``: whenever
    the store reads parts of values (kvpool in direct mode, caches read in place);
    ``"false"``: never; ``"auto"`` (the default): for caches in GPU memory only, whose forward
    pass leaves the host's cores to the load. An engine computing on the CPU shares its cores
    with the load and the node agent's sends: on a 2-core host its forward pass slowed by
    more than the load it hid (docs/benchmarks.md, "Engine-level")."""
    mode = switch(EXTRA_LAYERWISE, mode)
    if mode == "false":
        return False
    if len(layout.caches) < 2 or not io.reads_parts():
        if mode != "auto":
            logger.warning(
                "kvpool: %s is set but this store reads whole values only (agent mode, "
                "staged device caches, or another store): whole blocks are loaded",
                EXTRA_LAYERWISE,
            )
        return False
    return mode != "auto" or not layout.on_host


def early_loads(mode: str, kv_cache_config: Any, layerwise: bool, io: BlockIO) -> bool:
    """Whether a step's whole-block loads start in ``handle_preemptions``, the first connector
    call of the worker's step, and run on the store's threads while vLLM prepares the step's
    inputs (``start_load_kv`` then waits for them). ``mode`` ``"true"``: when the store can
    start a get that way (kvpool, caches read in place), loads are not layer by layer, and vLLM
    does not zero new blocks in that preparation (``needs_kv_cache_zeroing``: Mamba or
    mixed-precision caches; unknown counts as yes); ``"auto"`` (the default): the same, for
    KV caches in host memory only (an engine computing on the CPU has nothing of the last step
    still running then; a GPU's last step may still be writing blocks that the scheduler has
    handed out again, which only loads ordered on its stream may touch); ``"false"``: never."""
    mode = switch(EXTRA_EARLY_LOAD, mode)
    if mode == "false":
        return False
    zeroes = kv_cache_config is None or bool(
        getattr(kv_cache_config, "needs_kv_cache_zeroing", False)
    )
    starts = callable(getattr(io.store, "start_batch_get_into_multi_buffers", None)) and io.in_place
    if mode == "auto" and not io.layout.on_host:
        return False
    if layerwise or zeroes or not starts:
        if mode != "auto":
            logger.warning(
                "kvpool: %s is set but %s: loads start in start_load_kv",
                EXTRA_EARLY_LOAD,
                "loads go layer by layer" if layerwise
                else "vLLM zeroes new KV blocks before it (or its KV cache config is unknown)"
                if zeroes else "this store cannot start a get in the background",
            )
        return False
    return True


def _parallel_ranks(vllm_config: Any, extra: Mapping[str, Any]) -> Tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this process."""
    par = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(par, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    tp_rank = extra.get(EXTRA_TP_RANK)
    pp_rank = extra.get(EXTRA_PP_RANK)
    if tp_rank is None or pp_rank is None:
        try:
            from vllm.distributed.parallel_state import (  # type: ignore[import-not-found]
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
    """kvpool's ``KVConnectorBase_V1``: saves blocks as they are computed, loads pool hits.

    Scheduler side: :meth:`get_num_new_matched_tokens` counts the request's leading full blocks
    whose keys exist for every parallel rank (always leaving the last token to compute), and
    the blocks vLLM then allocates for them are loaded in the next step. Every step,
    :meth:`build_connector_meta` has the workers save the full blocks that step completes, so a
    block is in the pool before the step's output (and so the engine's response) is sent; what a
    step could not cover is saved when the request finishes (:meth:`request_finished` keeps the
    blocks until then). Blocks the engine found in the pool or saved in the last 30 seconds
    (:class:`KnownBlocks`) are not queued again: a prompt served from vLLM's own prefix cache
    costs no pool call before its first token (a prefill handing off to a decode engine still
    saves, and so checks, every block).

    Prefill -> decode hand-off (docs/engines.md, "The hand-off"): a request that came with
    ``kv_transfer_params: {"do_remote_decode": true}`` (what the conductor sends a prefill
    engine) finishes with ``kv_transfer_params`` naming its saved blocks, which the conductor
    passes to the decode engine; there :meth:`get_num_new_matched_tokens` answers "ask again"
    (``None``) until every named block is in the pool, for at most ``kvpool_handoff_wait_s``
    seconds, and then loads them. A wait that expires loads what is there and counts the rest
    as recomputed (``kvpool_handoff_timeouts`` in :meth:`handoff_stats`, and a warning).

    Worker side: :meth:`start_load_kv` loads, :meth:`wait_for_save` saves (skipping keys the
    pool has), :meth:`get_finished` reports the requests whose finish-time saves are done.
    Layer by layer (``kvpool_layerwise_load`` in ``kv_connector_extra_config``; see
    :func:`layerwise_loads`), a step's loads run one KV cache (layer) at a time in a thread
    (:class:`LayeredLoad`): the forward pass starts at once and :meth:`wait_for_layer_load`
    holds each attention layer only until its own cache is in, so the load of a long prefix
    overlaps the compute. Otherwise the whole blocks are loaded before the forward pass.
    ``kv_role``: ``kv_consumer`` only loads, ``kv_producer`` only saves, ``kv_both`` does both.
    """

    kvpool_impl = "kvpool"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # vLLM releases whose base takes (vllm_config, role)
            super().__init__(vllm_config, role)
            self._kv_cache_config = kv_cache_config
        attach_engine_logging()
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
        self._keys = BlockKeys(_namespace(vllm_config, extra, self._block_size), tp_size, pp_size)
        self._module = store_module(extra.get(EXTRA_STORE_MODULE))
        self._handoff_wait_s = float(extra.get(EXTRA_HANDOFF_WAIT_S, DEFAULT_HANDOFF_WAIT_S))
        self._store: Any = None
        self._io: Optional[BlockIO] = None
        # scheduler state
        self._lookups: Dict[str, Tuple[int, int]] = {}  # req -> (local tokens, hit tokens)
        self._pending_loads: List[BlockJob] = []
        self._pending_saves: List[BlockJob] = []
        self._live: Dict[str, Any] = {}  # scheduled requests, for saves as blocks complete
        self._saved_upto: Dict[str, int] = {}  # req -> full blocks already queued for saving
        self._handoff_since: Dict[str, float] = {}  # req -> when its hand-off wait began
        # Blocks found in the pool or saved lately: their saves are not queued again.
        self._known = KnownBlocks()
        self._kv_cache_manager: Any = None
        self.handoff_stats = {"kvpool_handoffs": 0, "kvpool_handoff_timeouts": 0,
                              "kvpool_handoff_wait_s": 0.0}
        # worker state
        self._saved: Set[str] = set()
        # Finished requests told to this worker -> get_finished calls since (forgotten after
        # FINISHED_MEMORY calls: a request whose blocks were all saved while it ran has no
        # finish-time save to wait for).
        self._seen_finished: Dict[str, int] = {}
        self._load_errors: Set[int] = set()
        # Loads cache by cache behind the forward pass: "auto", "true" or "false".
        self._layerwise_mode = str(extra.get(EXTRA_LAYERWISE, "auto")).lower()
        self._layerwise = False
        self._inflight: Optional[LayeredLoad] = None
        # Loads started early (handle_preemptions), by request and block ids.
        self._early_mode = switch(EXTRA_EARLY_LOAD, extra.get(EXTRA_EARLY_LOAD, "auto"))
        self._early_loads = False
        self._early: Dict[Tuple[str, Tuple[int, ...]], Any] = {}

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

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM hands the scheduler-side connector its KV cache manager: the block ids of each
        scheduled request, for the saves of the blocks a step completes."""
        self._kv_cache_manager = kv_cache_manager
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if parent is not None:
            parent(kv_cache_manager)

    def _handoff(self, request: Any) -> Optional[List[str]]:
        """The block hashes a prefill engine handed over with this request, when they are
        under this engine's namespace (an engine of another model, dtype or block size wrote
        keys this one cannot read)."""
        params = getattr(request, "kv_transfer_params", None)
        info = params.get(HANDOFF_KEY) if isinstance(params, dict) else None
        if not isinstance(info, dict) or info.get("namespace") != self._keys.namespace:
            return None
        hashes = info.get("hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            return None
        return hashes

    @staticmethod
    def _hands_off(request: Any) -> bool:
        """Whether ``request`` is a prefill whose blocks a decode engine will wait for: its
        saves are never skipped on what this engine saw in the pool before."""
        params = getattr(request, "kv_transfer_params", None)
        return isinstance(params, dict) and bool(params.get("do_remote_decode"))

    def _unknown(self, request: Any, ids: List[int], hashes: List[str]) -> BlockJob:
        """A save of ``ids``/``hashes`` less the blocks known to be in the pool (all of them
        for a hand-off); the blocks it queues count as known from now on."""
        if not self._hands_off(request):
            keep = [i for i, h in enumerate(hashes) if h not in self._known]
            if len(keep) < len(hashes):
                ids = [ids[i] for i in keep]
                hashes = [hashes[i] for i in keep]
        self._known.add(hashes)
        return BlockJob(request.request_id, ids, hashes)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that the pool can supply (loaded synchronously
        in the next step, hence ``False``); ``None`` while a hand-off's blocks are still on
        their way."""
        if not self._loads_enabled:
            return 0, False
        num_tokens = int(getattr(request, "num_tokens", 0) or len(request.prompt_token_ids))
        handed = self._handoff(request)
        hashes = handed if handed is not None else self._block_hashes(request)
        # Leave at least one token to compute: vLLM needs the last token's logits.
        usable = min(len(hashes), (num_tokens - 1) // self._block_size)
        first = num_computed_tokens // self._block_size
        rid = request.request_id
        if usable <= first:
            self._lookups[rid] = (num_computed_tokens, num_computed_tokens)
            self._handoff_since.pop(rid, None)
            return 0, False
        try:
            store = self._open(contribute=False)
            hits = prefix_hits(store, [self._keys.all_ranks(h) for h in hashes[first:usable]])
            self._known.add(hashes[first : first + hits])
        except Exception as e:  # noqa: BLE001 - a pool outage is a cache miss, not a failure
            logger.warning("kvpool lookup failed for %s: %s", rid, e)
            hits = 0
        if handed is not None:
            now = time.monotonic()
            since = self._handoff_since.setdefault(rid, now)
            if first + hits < usable and now - since < self._handoff_wait_s:
                return None, False  # the prefill engine's save has not landed yet: ask again
            self._handoff_since.pop(rid, None)
            self.handoff_stats["kvpool_handoffs"] += 1
            self.handoff_stats["kvpool_handoff_wait_s"] += now - since
            if first + hits < usable:
                self.handoff_stats["kvpool_handoff_timeouts"] += 1
                logger.warning(
                    "kvpool: hand-off of %s: %d of %d blocks in the pool after %.1f s; "
                    "recomputing the rest",
                    rid, first + hits, usable, now - since,
                )
        hit_tokens = (first + hits) * self._block_size
        self._lookups[rid] = (num_computed_tokens, hit_tokens)
        return max(0, hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._live[request.request_id] = request
        local, _hit = self._lookups.pop(request.request_id, (0, 0))
        if num_external_tokens <= 0:
            return
        first = local // self._block_size
        count = num_external_tokens // self._block_size
        ids = _block_ids(blocks)[first : first + count]
        handed = self._handoff(request)
        hashes = (handed if handed is not None else self._block_hashes(request))[
            first : first + count
        ]
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
        # Blocks that came from the pool need no saving.
        self._saved_upto[request.request_id] = max(
            self._saved_upto.get(request.request_id, 0), first + count
        )

    def _step_saves(self, scheduler_output: Any) -> None:
        """Queue the full blocks this step completes, for the workers to save in this step's
        ``wait_for_save`` (before the step's output leaves the engine)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        manager = self._kv_cache_manager
        if not self._saves_enabled or not isinstance(scheduled, dict) or manager is None:
            return
        for rid, n in scheduled.items():
            request = self._live.get(rid)
            if request is None or not n:
                continue
            computed = int(getattr(request, "num_computed_tokens", 0) or 0) + int(n)
            hashes = self._block_hashes(request)
            full = min(len(hashes), computed // self._block_size)
            done = self._saved_upto.get(rid, 0)
            if full <= done:
                continue
            try:
                ids = _block_ids(manager.get_block_ids(rid))
            except Exception as e:  # noqa: BLE001 - saved at the finish instead
                logger.debug("kvpool: no block ids for %s yet: %s", rid, e)
                continue
            full = min(full, len(ids))
            if full <= done:
                continue
            job = self._unknown(request, ids[done:full], hashes[done:full])
            if job.block_ids:
                self._pending_saves.append(job)
            self._saved_upto[rid] = full

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolConnectorMetadata:
        self._step_saves(scheduler_output)
        meta = KvpoolConnectorMetadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = [], []
        return meta

    def request_finished(
        self, request: Any, block_ids: Any
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Queue the request's full blocks that no step saved yet (True keeps them until they
        are saved); for a prefill of a disaggregated request, the ``kv_transfer_params`` that
        tell the decode engine which blocks to wait for."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._live.pop(rid, None)
        self._handoff_since.pop(rid, None)
        done = self._saved_upto.pop(rid, 0)
        if not self._saves_enabled:
            return False, None
        ids = _block_ids(block_ids)
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        hashes = self._block_hashes(request)
        n = min(len(ids), len(hashes), computed // self._block_size)
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if isinstance(publishable, int):
            n = min(n, publishable // self._hashes_per_block)
        params = None
        incoming = getattr(request, "kv_transfer_params", None)
        if isinstance(incoming, dict) and incoming.get("do_remote_decode") and n > 0:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                HANDOFF_KEY: {"namespace": self._keys.namespace, "hashes": hashes[: max(n, done)]},
            }
        if n <= done:
            return False, params
        job = self._unknown(request, ids[done:n], hashes[done:n])
        if not job.block_ids:
            return False, params
        job.final = True
        self._pending_saves.append(job)
        return True, params

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
            device_memory=str(self._extra.get(EXTRA_DEVICE_MEMORY) or "auto"),
        )
        if layout.on_host:
            how = "in place"
        elif self._io.in_place:
            how = "GPU memory registered with the pool (no torch staging)"
        else:
            how = "through host staging"
        self._layerwise = layerwise_loads(self._layerwise_mode, layout, self._io)
        self._early_loads = early_loads(
            self._early_mode, self._kv_cache_config, self._layerwise, self._io
        )
        logger.info(
            "kvpool: %d KV segment(s), %d bytes per block, %s; loads %s",
            len(layout.segments),
            layout.bytes_per_block,
            how,
            "layer by layer behind the forward pass" if self._layerwise
            else "whole blocks, started before vLLM prepares the step" if self._early_loads
            else "whole blocks",
        )

    def _worker_keys(self, job: BlockJob) -> List[str]:
        return [self._keys.key(h, self._tp_rank, self._pp_rank) for h in job.hashes]

    def _registered(
        self, jobs: List[BlockJob], step: str
    ) -> Iterable[Tuple[BlockJob, BlockIO]]:
        """``jobs``, each with the block I/O of the registered KV caches: a RuntimeError naming
        ``step`` when there are jobs before those are registered."""
        if not jobs:
            return []
        if self._io is None:
            raise RuntimeError(f"{step} before register_kv_caches")
        return [(job, self._io) for job in jobs]

    def _settle_loads(self) -> None:
        """Wait for a layer-by-layer load still running; its failed blocks become load
        errors."""
        if self._inflight is not None:
            load, self._inflight = self._inflight, None
            bad = load.join()
            if bad:
                logger.warning("kvpool: %d blocks not loaded", len(bad))
                self._load_errors.update(bad)

    @staticmethod
    def _early_key(job: BlockJob) -> Tuple[str, Tuple[int, ...]]:
        return job.req_id, tuple(job.block_ids)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM's first connector call of a worker step, before it prepares the step's inputs:
        with early loads (:func:`early_loads`) the step's loads start here, on the store's
        threads, and :meth:`start_load_kv` waits for them."""
        loads = getattr(kv_connector_metadata, "loads", None)
        if not self._early_loads or not loads or self._io is None:
            return
        self._settle_early()  # none should be left; never two loads into one block
        for job in loads:
            try:
                pending = self._io.start_load(self._worker_keys(job), job.block_ids)
            except Exception as e:  # noqa: BLE001 - start_load_kv loads it the usual way
                logger.debug("kvpool: early load of %s not started: %s", job.req_id, e)
                pending = None
            if pending is not None:
                self._early[self._early_key(job)] = pending

    def _settle_early(self) -> None:
        """Wait for early loads no step claimed (none, unless a step ended before its
        ``start_load_kv``), so that nothing writes into blocks vLLM may hand out again."""
        while self._early:
            _key, pending = self._early.popitem()
            pending.wait()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._settle_loads()
        jobs = list(self._registered(meta.loads, "start_load_kv"))
        if jobs and self._layerwise and self._io is not None:
            self._inflight = LayeredLoad(
                self._io, [(self._worker_keys(job), job.block_ids) for job, _io in jobs]
            )
            return
        for job, io in jobs:
            pending = self._early.pop(self._early_key(job), None)
            try:
                if pending is not None:
                    got = pending.wait()
                else:
                    got = io.load(self._worker_keys(job), job.block_ids)
            except Exception as e:  # noqa: BLE001 - report the blocks, vLLM recomputes them
                logger.warning("kvpool load of %s failed: %s", job.req_id, e)
                got = [-1] * len(job.block_ids)
            bad = [b for b, r in zip(job.block_ids, got) if r != io.layout.bytes_per_block]
            if bad:
                logger.warning(
                    "kvpool: %d of %d blocks of %s not loaded", len(bad), len(got), job.req_id
                )
                self._load_errors.update(bad)
        self._settle_early()

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._inflight
        if load is not None and self._io is not None:
            load.wait(self._io.layout.layer_cache.get(layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        self._settle_loads()
        meta = self._get_connector_metadata()
        for job, io in self._registered(meta.saves, "wait_for_save"):
            try:
                codes = io.save(self._worker_keys(job), job.block_ids)
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
            if job.final:
                self._saved.add(job.req_id)

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Requests whose finish-time save is done, once vLLM has told this worker they
        finished."""
        for rid in finished_req_ids:
            self._seen_finished.setdefault(rid, 0)
        done = {r for r in self._saved if r in self._seen_finished}
        self._saved -= done
        for rid in list(self._seen_finished):
            age = self._seen_finished[rid] + 1
            if rid in done or age > FINISHED_MEMORY:
                del self._seen_finished[rid]
            else:
                self._seen_finished[rid] = age
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        self._settle_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._settle_loads()
        self._settle_early()
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._store is not None:
            store, self._store = self._store, None
            store.close()


# ---------------------------------------------------------------------------------------------
# vLLM's own connector on the pool
# ---------------------------------------------------------------------------------------------


def engine_mooncake_config(extra: Mapping[str, Any]) -> Dict[str, Any]:
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
    class KvpoolStoreConnector(base):  # type: ignore[misc]
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
    return select_impl(
        impl,
        ENV_IMPL,
        "kvpool",
        KvpoolBlockConnector,
        find_engine_connector,
        _engine_subclass,
        "this vLLM has no MooncakeStoreConnector "
        f"(looked in {', '.join(ENGINE_CONNECTOR_MODULES)})",
    )


KvpoolStoreConnector = select_connector()

__all__ = [
    "BlockIO",
    "BlockJob",
    "BlockKeys",
    "BlockLayout",
    "KvpoolBlockConnector",
    "KvpoolConnectorMetadata",
    "KvpoolStoreConnector",
    "KnownBlocks",
    "LayeredLoad",
    "Segment",
    "engine_mooncake_config",
    "find_engine_connector",
    "hash_hex",
    "prefix_hits",
    "segments_of",
    "select_connector",
    "token_block_hashes",
]
