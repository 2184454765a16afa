"""SGLang adapter: ``KvpoolHiCacheStorage``, a HiCache L3 storage backend on the pool.

SGLang loads it through its dynamic storage backend (``StorageBackendFactory``, backend name
``dynamic``; ``interface_v1`` selects the zero-copy page path):

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-mem-layout page_first
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
        '{"backend_name":"kvpool","module_path":"kvpool.adapters.sglang",
          "class_name":"KvpoolHiCacheStorage","interface_v1":1}'

Two implementations behind the one name:

- ``engine``: when SGLang's own Mooncake backend imports
  (``sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStore``), the class is
  a subclass of it whose only changes are where the store comes from (its
  ``_import_mooncake_store`` hook, and ``mooncake.store`` aliased while it constructs) and the
  pool's address filled into ``extra_config`` from the kvpool environment. Key layout, page
  metadata, hybrid pools, warmup and metrics are SGLang's code.
- ``kvpool``: otherwise (SGLang without that module, no SGLang at all, or
  ``KVPOOL_SGLANG_BACKEND=kvpool``), :class:`KvpoolPageStorage`, this module's implementation
  of ``HiCacheStorage``'s page API: ``batch_exists`` (longest prefix of pages present),
  ``batch_get_v1``/``batch_set_v1`` (host pages named by ``host_indices``, moved in place from
  the pointers the host pool gives), and the older ``get``/``set``/``batch_get``/``batch_set``
  with pointers and sizes, or with host page tensors (SGLang's copying path when
  ``interface_v1`` is off: whole pages, copied, under the same page keys as the zero-copy
  path). Its keys are the ones SGLang's Mooncake backend writes
  (``<page hash>_<tp rank>_k``/``_v`` for MHA, ``<page hash>__k`` for MLA, prefixed by
  ``extra_backend_tag`` and the model name), so the two read each other's pages.

I/O boundary: the store calls; host memory is only addressed through the host pool's pointers.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence as _SequenceABC
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import mooncake_alias, open_store, select_impl, setup_args, store_module

logger = logging.getLogger(__name__)

ENV_IMPL = "KVPOOL_SGLANG_BACKEND"
EXTRA_STORE_MODULE = "kvpool_store_module"

try:
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
        HiCacheStorage,
    )

    HAVE_SGLANG = True
except Exception:  # noqa: BLE001 - no usable SGLang here
    HAVE_SGLANG = False

    class HiCacheStorage:  # type: ignore[no-redef]
        """Stand-in for SGLang's abstract ``HiCacheStorage``."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            if not hasattr(self, "registered_pools"):
                self.registered_pools = {}
            self.registered_pools[host_pool_name] = host_pool

        def clear(self) -> None:
            pass

        def get_stats(self) -> Any:
            return None


ENGINE_BACKEND_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"


def find_engine_backend() -> Optional[type]:
    """SGLang's ``MooncakeStore`` class, or None when this SGLang has none."""
    if not HAVE_SGLANG:
        return None
    try:
        import importlib

        found: type = importlib.import_module(ENGINE_BACKEND_MODULE).MooncakeStore
        return found
    except Exception:  # noqa: BLE001
        return None


def _extra_of(storage_config: Any) -> Dict[str, Any]:
    return dict(getattr(storage_config, "extra_config", None) or {})


def pool_extra_config(extra: Mapping[str, Any]) -> Dict[str, Any]:
    """``extra_config`` with the pool's address (and the rest of :func:`setup_args`) filled in
    where SGLang's Mooncake backend looks for them, unless the flags already name a master."""
    if extra.get("master_server_address") or extra.get("client_server_address"):
        return dict(extra)
    args = setup_args(extra)
    filled = dict(extra)
    for key, value in args.mooncake_json().items():
        filled.setdefault(key, value)
    filled["master_server_address"] = args.master_server_addr
    filled.setdefault("check_server", False)
    return filled


def _ptr_and_size(buf: Any) -> Tuple[int, int]:
    if hasattr(buf, "data_ptr"):
        return int(buf.data_ptr()), int(buf.numel() * buf.element_size())
    if hasattr(buf, "ctypes"):
        return int(buf.ctypes.data), int(buf.nbytes)
    raise TypeError(f"cannot address a buffer of type {type(buf).__name__}")


def _host_bytes(buf: Any, writable: bool) -> memoryview:
    """The bytes of a contiguous host tensor (or numpy array), in place."""
    contiguous = getattr(buf, "is_contiguous", None)
    if callable(contiguous) and not contiguous():
        raise ValueError("a page tensor must be contiguous")
    flags = getattr(buf, "flags", None)
    if flags is not None and not getattr(flags, "c_contiguous", True):
        raise ValueError("a page array must be C-contiguous")
    device = getattr(buf, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"a page tensor must be in host memory, not on {device}")
    ptr, size = _ptr_and_size(buf)
    if size == 0:
        return memoryview(bytearray(0) if writable else b"")
    view = memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")
    return view if writable else view.toreadonly()


class KvpoolPageStorage(HiCacheStorage):  # type: ignore[misc]
    """kvpool's ``HiCacheStorage``: SGLang host-memory pages in the pool.

    ``storage_config`` is SGLang's ``HiCacheStorageConfig`` (tp/pp ranks, MLA or not, model
    name, ``extra_config``); the second argument is what SGLang passes (the host pool for
    built-in backends, a kwargs dict for dynamic ones) and is not used: the host pool arrives
    through :meth:`register_mem_pool_host`. ``store`` or ``module`` (else
    ``extra_config["kvpool_store_module"]``, ``KVPOOL_STORE_MODULE``, ``kvpool.mooncake``)
    choose the store.
    """

    kvpool_impl = "kvpool"

    def __init__(
        self,
        storage_config: Any = None,
        mem_pool: Any = None,
        *,
        store: Any = None,
        module: Any = None,
    ):
        extra = _extra_of(storage_config)
        self.storage_config = storage_config
        self.module = store_module(module or extra.get(EXTRA_STORE_MODULE))
        self.store = store if store is not None else open_store(extra, module=self.module)
        self.mem_pool_host: Any = None
        self._registered: List[int] = []
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.local_rank = tp_rank
        if pp_size > 1:
            self.mha_suffix, self.mla_suffix = f"{tp_rank}_{pp_rank}", f"{pp_rank}"
        else:
            self.mha_suffix, self.mla_suffix = f"{tp_rank}", ""
        parts = []
        if extra.get("extra_backend_tag") is not None:
            parts.append(str(extra["extra_backend_tag"]))
        model = getattr(storage_config, "model_name", None)
        if model:
            parts.append("-".join(str(model).split("/")))
        self.key_prefix = "_".join(parts) if parts else None

    # -- keys ------------------------------------------------------------------------------

    def _tag(self, keys: Sequence[str]) -> List[str]:
        if self.key_prefix is None:
            return list(keys)
        return [f"{self.key_prefix}_{k}" for k in keys]

    def _component_keys(self, tagged: Sequence[str]) -> Tuple[List[str], int]:
        """Store keys of pages: per page ``_k`` (MLA) or ``_k`` and ``_v`` (MHA)."""
        if self.is_mla:
            return [f"{k}_{self.mla_suffix}_k" for k in tagged], 1
        out = []
        for k in tagged:
            out.append(f"{k}_{self.mha_suffix}_k")
            out.append(f"{k}_{self.mha_suffix}_v")
        return out, 2

    # -- host pool -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool's KV buffer for zero-copy transfers."""
        self.mem_pool_host = mem_pool_host
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if buf is None:
            return
        buffers = [buf]
        if hasattr(mem_pool_host, "get_hybrid_pool_buffer"):
            buffers = [
                b for b in mem_pool_host.get_hybrid_pool_buffer() if b is not None
            ] or buffers
        for b in buffers:
            ptr, size = _ptr_and_size(b)
            if size == 0:
                continue
            rc = self.store.register_buffer(ptr, size)
            if rc != 0:
                raise RuntimeError(f"register_buffer of the host KV pool returned {rc}")
            self._registered.append(ptr)

    def _page_meta(
        self, keys: Sequence[str], host_indices: Any
    ) -> Tuple[List[str], List[Any], List[Any], int]:
        if self.mem_pool_host is None:
            raise RuntimeError("register_mem_pool_host was not called")
        page_size = int(getattr(self.mem_pool_host, "page_size", 1) or 1)
        if len(keys) == 0 or len(keys) != len(host_indices) // page_size:
            raise ValueError(
                f"{len(keys)} page keys for {len(host_indices)} host indices "
                f"of page size {page_size}"
            )
        comp, mult = self._component_keys(self._tag(keys))
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        ptrs, sizes = list(ptrs), list(sizes)
        if len(ptrs) != len(comp):
            if len(ptrs) % len(comp) != 0:
                raise ValueError(f"{len(ptrs)} page buffers for {len(comp)} keys")
            n = len(ptrs) // len(comp)
            ptrs = [ptrs[i : i + n] for i in range(0, len(ptrs), n)]
            sizes = [sizes[i : i + n] for i in range(0, len(sizes), n)]
        return comp, ptrs, sizes, mult

    @staticmethod
    def _multi(ptrs: Sequence[Any]) -> bool:
        return bool(ptrs) and isinstance(ptrs[0], _SequenceABC)

    def _put(self, keys: List[str], ptrs: List[Any], sizes: List[Any]) -> List[int]:
        if not keys:
            return []
        if self._multi(ptrs):
            return list(
                self.store.batch_put_from_multi_buffers(
                    keys, ptrs, sizes, self.module.ReplicateConfig()
                )
            )
        return list(self.store.batch_put_from(keys, ptrs, sizes))

    def _get(self, keys: List[str], ptrs: List[Any], sizes: List[Any]) -> List[int]:
        if not keys:
            return []
        if self._multi(ptrs):
            return list(self.store.batch_get_into_multi_buffers(keys, ptrs, sizes))
        return list(self.store.batch_get_into(keys, ptrs, sizes))

    @staticmethod
    def _per_page(
        results: Sequence[int], mult: int, ok: Callable[[int], bool]
    ) -> List[bool]:
        return [all(ok(r) for r in results[i : i + mult]) for i in range(0, len(results), mult)]

    # -- page API (interface_v1) -----------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading pages have all their objects in the pool."""
        if not keys:
            return 0
        comp, mult = self._component_keys(self._tag(keys))
        found = self.store.batch_is_exist(comp)
        for i, e in enumerate(found):
            if e != 1:
                return i // mult
        return len(keys)

    def batch_set_v1(
        self, keys: Sequence[str], host_indices: Any, extra_info: Any = None
    ) -> List[bool]:
        """Write the host pages at ``host_indices`` under ``keys``; pages the pool already
        has are not written again. Per page: True when the pool has it afterwards."""
        comp, ptrs, sizes, mult = self._page_meta(keys, host_indices)
        present = self.store.batch_is_exist(comp)
        results = [0 if e == 1 else -1 for e in present]
        todo = [i for i, e in enumerate(present) if e != 1]
        codes = self._put(
            [comp[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
        )
        for i, code in zip(todo, codes):
            results[i] = int(code)
        return self._per_page(results, mult, lambda r: r == 0)

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: Any, extra_info: Any = None
    ) -> List[bool]:
        """Read ``keys`` into the host pages at ``host_indices``; per page: True when read."""
        comp, ptrs, sizes, mult = self._page_meta(keys, host_indices)
        return self._per_page(self._get(comp, ptrs, sizes), mult, lambda r: r > 0)

    # -- page tensors (SGLang's copying path, without interface_v1) -------------------------

    def _page_parts(self, page: Any, writable: bool) -> List[memoryview]:
        """The objects of one flat host page tensor: MHA pages hold K then V (SGLang's
        ``get_data_page(flat=True)`` and ``get_dummy_flat_data_page``), stored as the same
        ``_k`` and ``_v`` objects the zero-copy path writes; an MLA page is one ``_k``."""
        view = _host_bytes(page, writable)
        if self.is_mla:
            return [view]
        if len(view) % 2:
            raise ValueError(f"an MHA page of {len(view)} bytes does not split into K and V")
        half = len(view) // 2
        return [view[:half], view[half:]]

    def _set_pages(self, keys: Sequence[str], pages: Sequence[Any]) -> List[bool]:
        """Copy whole pages into the pool under their page keys; per page: True when the pool
        has it afterwards. The pages are copies SGLang makes (not the registered host pool),
        so they go through the copying ``put_batch``, not the zero-copy calls."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} page keys for {len(pages)} pages")
        if not keys:
            return []
        comp, mult = self._component_keys(self._tag(keys))
        parts = [part for page in pages for part in self._page_parts(page, False)]
        present = self.store.batch_is_exist(comp)
        results = [0 if e == 1 else -1 for e in present]
        todo = [i for i, e in enumerate(present) if e != 1]
        if todo:
            rc = self.store.put_batch(
                [comp[i] for i in todo], [parts[i] for i in todo], self.module.ReplicateConfig()
            )
            for i in todo:
                results[i] = int(rc)
        return self._per_page(results, mult, lambda r: r == 0)

    def _get_pages(self, keys: Sequence[str], targets: Sequence[Any]) -> List[bool]:
        """Copy the pool's pages into the flat page tensors ``targets``; per page: True when
        every object of it was there with the page's size."""
        if len(keys) != len(targets):
            raise ValueError(f"{len(keys)} page keys for {len(targets)} page buffers")
        if not keys:
            return []
        comp, mult = self._component_keys(self._tag(keys))
        parts = [part for page in targets for part in self._page_parts(page, True)]
        values = self.store.get_batch(comp)
        ok = []
        for dst, value in zip(parts, values):
            good = isinstance(value, (bytes, bytearray, memoryview)) and 0 < len(value) == len(dst)
            if good:
                dst[:] = value
            ok.append(1 if good else 0)
        return self._per_page(ok, mult, lambda r: r == 1)

    # -- object API (the original HiCacheStorage methods) -----------------------------------
    #
    # Pointer form (target_location(s) and target_sizes): objects under the caller's keys, as
    # SGLang's Mooncake backend treats them. Tensor form (value(s), or target(s) without
    # sizes): whole host pages under SGLang's page keys (see _set_pages), which is how
    # SGLang's cache controller uses batch_get/batch_set when interface_v1 is off.

    def exists(self, key: str) -> bool:
        return bool(self.store.batch_is_exist([key])[0] == 1)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store the bytes at ``target_location`` (a pointer, or a list of pointers) of
        ``target_sizes`` under ``key``, or the host page tensor ``value`` as page ``key``."""
        if target_location is None:
            if value is None:
                raise ValueError("set needs a value or a target_location")
            return self._set_pages([key], [value])[0]
        if self.exists(key):
            return True
        return self._put([key], [target_location], [target_sizes])[0] == 0

    def batch_set(
        self,
        keys: Sequence[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store several objects (pointer form) or host pages (tensor form); True when every
        one is in the pool afterwards."""
        if target_locations is None:
            if values is None:
                raise ValueError("batch_set needs values or target_locations")
            return bool(keys) and all(self._set_pages(keys, values))
        if not (len(keys) == len(target_locations) == len(target_sizes)):
            raise ValueError("keys, target_locations and target_sizes differ in length")
        if not keys:
            return False
        present = self.store.batch_is_exist(list(keys))
        todo = [i for i, e in enumerate(present) if e != 1]
        codes = self._put(
            [keys[i] for i in todo],
            [target_locations[i] for i in todo],
            [target_sizes[i] for i in todo],
        )
        return all(c == 0 for c in codes)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read ``key`` into ``target_location``/``target_sizes`` (True/False), or page ``key``
        into the host page tensor ``target_location`` (it, or None when missing)."""
        if target_location is None:
            raise ValueError("get needs a target_location")
        if target_sizes is None:
            return target_location if self._get_pages([key], [target_location])[0] else None
        return self._get([key], [target_location], [target_sizes])[0] >= 0

    def batch_get(
        self, keys: Sequence[str], target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        """Pointer form: the number of leading pages read (objects per page: 2 for MHA, 1 for
        MLA). Tensor form (page tensors, no sizes): the targets, None where a page is
        missing."""
        if target_locations is None:
            raise ValueError("batch_get needs target_locations")
        if target_sizes is None:
            got = self._get_pages(list(keys), list(target_locations))
            return [t if ok else None for t, ok in zip(target_locations, got)]
        if not (len(keys) == len(target_locations) == len(target_sizes)):
            raise ValueError("keys, target_locations and target_sizes differ in length")
        if not keys:
            return 0
        mult = 1 if self.is_mla else 2
        codes = self._get(list(keys), list(target_locations), list(target_sizes))
        for i, r in enumerate(codes):
            if r < 0:
                return i // mult
        return len(keys) // mult

    def clear(self) -> None:
        self.store.remove_all()

    def close(self) -> None:
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()
        self.store.close()

    def get_stats(self) -> Any:
        return None


def _engine_subclass(base: type) -> type:
    class KvpoolHiCacheStorage(base):  # type: ignore[misc]
        """SGLang's ``MooncakeStore`` on the pool's store module."""

        kvpool_impl = "engine"

        def __init__(
            self, storage_config: Any = None, mem_pool: Any = None, *args: Any, **kwargs: Any
        ):
            extra = _extra_of(storage_config)
            self._kvpool_module = store_module(extra.get(EXTRA_STORE_MODULE))
            if storage_config is not None:
                storage_config.extra_config = pool_extra_config(extra)
            with mooncake_alias(self._kvpool_module):
                super().__init__(storage_config, mem_pool, *args, **kwargs)

        def _import_mooncake_store(self) -> Any:  # SGLang's hook (newer releases)
            return self._kvpool_module.MooncakeDistributedStore

        def _import_mooncake_group_semantics(self) -> Tuple[Any, bool]:  # SGLang's hook
            cls = self._kvpool_module.ReplicateConfig
            try:
                return cls, hasattr(cls(), "group_ids")
            except Exception:  # noqa: BLE001
                return cls, False

    KvpoolHiCacheStorage.__qualname__ = "KvpoolHiCacheStorage"
    KvpoolHiCacheStorage.__module__ = __name__
    return KvpoolHiCacheStorage


def select_backend(impl: Optional[str] = None) -> type:
    """The class behind ``KvpoolHiCacheStorage``: ``impl`` (or ``KVPOOL_SGLANG_BACKEND``) is
    ``auto`` (SGLang's own Mooncake backend when it imports), ``engine`` or ``kvpool``."""
    return select_impl(
        impl,
        ENV_IMPL,
        "auto",
        KvpoolPageStorage,
        find_engine_backend,
        _engine_subclass,
        f"{ENGINE_BACKEND_MODULE}.MooncakeStore does not import",
    )


KvpoolHiCacheStorage = select_backend()

__all__ = [
    "KvpoolHiCacheStorage",
    "KvpoolPageStorage",
    "find_engine_backend",
    "pool_extra_config",
    "select_backend",
]
