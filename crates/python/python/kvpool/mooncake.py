"""Mooncake's store API over kvpool: ``MooncakeDistributedStore`` and ``ReplicateConfig``.

Same method names, positional and keyword signatures, return values and negative error codes
as ``mooncake.store`` (Mooncake 0.3.x), so code written for Mooncake (vLLM's, SGLang's and
LMCache's Mooncake backends) runs on kvpool by importing this module instead. Every
difference is listed in docs/python.md; calls kvpool does not offer return Mooncake's
"unavailable in current mode" code (-1011). A store never set up, or closed, answers as
Mooncake's does where Mooncake survives the call (-600 for calls that return a code, empty
values for gets) and the same way for the calls that crash Mooncake's process.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _native
from ._config import (
    DEFAULT_STAGING_BYTES,
    ENV_AGENT_SOCKET,
    ENV_CLIENT_MODE,
    MODES,
    ConfigError,
    Settings,
    choose_mode,
    engine_config,
    split_addrs,
)
from ._native import Error, InvalidArgument

# Mooncake's error codes (mooncake-store/include/types.h) that kvpool answers with.
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
UNAVAILABLE_IN_CURRENT_MODE = -1011

# health_check() answers (Mooncake's): healthy, not set up or closed, master unreachable.
HEALTHY, NOT_SET_UP, MASTER_UNREACHABLE = 0, 1, 2

__all__ = ["MooncakeDistributedStore", "ReplicateConfig"]


class ReplicateConfig:
    """Placement of a put, as Mooncake's ``ReplicateConfig``. kvpool uses ``replica_num``,
    ``preferred_segment`` (or the first of ``preferred_segments``), ``with_hard_pin`` and
    ``soft_pin_ttl_ms``; the other fields are accepted and ignored."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.soft_pin_ttl_ms = 0
        self.soft_pin_action = 0
        self.preferred_segment = ""
        self.preferred_segments: List[str] = []
        self.prefer_alloc_in_same_node = False
        self.dfs_replica_num = 0
        self.nof_replica_num = 0
        self.data_type = 0
        self.group_ids: List[int] = []

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"preferred_segment={self.preferred_segment!r})"
        )


def _placement(config: Optional[ReplicateConfig]) -> Optional["_native.Placement"]:
    if config is None:
        return None
    preferred = config.preferred_segment or (
        config.preferred_segments[0] if config.preferred_segments else None
    )
    ttl = int(config.soft_pin_ttl_ms or 0) if config.with_soft_pin else 0
    return _native.Placement(int(config.replica_num), preferred, bool(config.with_hard_pin), ttl)


def _code(e: BaseException) -> int:
    if isinstance(e, Error):
        return int(getattr(e, "code", INTERNAL_ERROR))
    if isinstance(e, (TypeError, ValueError, OverflowError)):
        return INVALID_PARAMS
    return INTERNAL_ERROR


class MooncakeDistributedStore:
    """kvpool behind Mooncake's ``MooncakeDistributedStore``."""

    def __init__(self) -> None:
        self._client: Optional[_native.Client] = None

    # --- setup and lifecycle ---------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, ...)`` or ``setup(config: dict)``.
        ``metadata_server`` is accepted and unused (kvpool's master is its metadata service).
        The mode (config key ``mode``, else ``KVPOOL_CLIENT_MODE``, else "auto") picks the way
        in: direct to the masters, or through the node agent's socket (config key
        ``agent_socket``, ``KVPOOL_AGENT_SOCKET`` or the engine config), which "auto" takes
        when the socket exists and ``global_segment_size`` is 0. Direct mode: an empty
        ``master_server_addr`` falls back to ``KVPOOL_MASTER`` / the engine config; the
        pool key comes from ``auth_key_file`` in the config dict, ``KVPOOL_AUTH_KEY_FILE`` or
        the engine config; ``local_buffer_size`` is unused (staging memory is sized per
        call). Agent mode needs no master or key; ``local_buffer_size`` sizes the session's
        shared staging area, and ``global_segment_size`` must be 0 (-600 otherwise: the agent
        owns the node's memory)."""
        try:
            settings = self._settings(args, kwargs)
        except (ConfigError, TypeError, ValueError):
            return INVALID_PARAMS
        if self._client is not None and not self._client.is_closed():
            return OK
        try:
            client = settings.connect()
            # Like Mooncake's, a set-up store has reached its master.
            client.health()
        except InvalidArgument:
            return INVALID_PARAMS
        except Exception:  # noqa: BLE001 - Mooncake's setup answers -1 whatever failed
            return INTERNAL_ERROR
        self._client = client
        return OK

    @staticmethod
    def _settings(args: Sequence[Any], kwargs: Dict[str, Any]) -> Settings:
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            cfg = dict(args[0])
            if "local_hostname" not in cfg:
                raise ConfigError("setup(config): local_hostname is required")
            size = cfg.get("global_segment_size")
            if size is None:
                # Mooncake's default, for a store that contributes memory (direct mode).
                agent = _auto_mode(_kvpool_mode(cfg), cfg.get("agent_socket")) == "agent"
                size = 0 if agent else 16 << 20
            return Settings.resolve(
                split_addrs(cfg.get("master_server_addr") or cfg.get("master_server_address")),
                cfg.get("auth_key_file"),
                cfg.get("agent_socket"),
                mode=_kvpool_mode(cfg),
                staging_bytes=_staging(cfg.get("local_buffer_size")),
                local_hostname=_host(cfg["local_hostname"]),
                global_segment_size=int(size),
                protocol=str(cfg.get("protocol", "tcp")),
            )
        names = [
            "local_hostname",
            "metadata_server",
            "global_segment_size",
            "local_buffer_size",
            "protocol",
            "rdma_devices",
            "master_server_addr",
            "engine",
            "enable_ssd_offload",
            "ssd_offload_path",
            "tenant_id",
            "enable_client_http_server",
            "client_http_port",
        ]
        if len(args) > len(names):
            raise TypeError(f"setup() takes at most {len(names)} arguments")
        values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names or k in values:
                raise TypeError(f"setup() got an unexpected or repeated argument {k!r}")
            values[k] = v
        missing = [n for n in names[:7] if n not in values]
        if missing:
            raise TypeError(f"setup() missing arguments: {', '.join(missing)}")
        size = values["global_segment_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"global_segment_size must be a non-negative int, got {size!r}")
        return Settings.resolve(
            split_addrs(values["master_server_addr"]),
            staging_bytes=_staging(values["local_buffer_size"]),
            local_hostname=_host(values["local_hostname"]),
            global_segment_size=size,
            protocol=str(values["protocol"] or "tcp"),
        )

    def close(self) -> int:
        """Unmount any contributed memory and disconnect: 0, or a negative code."""
        if self._client is None:
            return OK
        try:
            self._client.close()
        except Error as e:
            return _code(e)
        return OK

    def health_check(self) -> int:
        """0 when the master answers, 1 when the store is not set up or closed, 2 when
        the master cannot be reached."""
        c = self._client
        if c is None or c.is_closed():
            return NOT_SET_UP
        try:
            c.health()
        except Error:
            return MASTER_UNREACHABLE
        return HEALTHY

    def get_hostname(self) -> str:
        """This process's node name in the pool; "" when the store is not set up."""
        c = self._client
        if c is None or c.is_closed():
            return ""
        return c.node()

    # --- registered memory -----------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` for zero-copy ``put_from`` /
        ``get_into``: 0, or a negative code. The memory must stay valid until unregistered."""
        return self._call(lambda c: c.register_buffer(buffer_ptr, size), OK)

    def device_memory_supported(self) -> bool:
        """kvpool's own: whether ``register_buffer`` takes a GPU's own memory (a CUDA tensor's
        ``data_ptr()``) and moves it through pinned staging itself (a build with feature
        ``cuda`` on a host with a CUDA driver and a GPU)."""
        return bool(_native.device_memory_supported())

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Unregister the buffer that starts at ``buffer_ptr``: 0, or -600 when none
        does."""
        return self._call(lambda c: OK if c.unregister_buffer(buffer_ptr) else INVALID_PARAMS, None)

    def alloc_from_mem_pool(self, size: int) -> int:
        """Address of ``size`` bytes for zero-copy ``put_from`` / ``get_into`` (no
        ``register_buffer`` needed), or 0 when there is no room. In agent mode they are part of
        the shared staging area (no copy at all); in direct mode fresh registered memory. They
        stay until the store is closed (``kvpool.Store.free_buffer`` gives them back)."""
        c = self._client
        if c is None or c.is_closed():
            return 0
        try:
            return int(c.alloc_buffer(int(size))[0])
        except (Error, TypeError, ValueError, OverflowError):
            return 0

    # --- single objects --------------------------------------------------------------------

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Store ``value`` (any object with the buffer protocol) under ``key``: 0, or a negative
        code (-705 when the key holds a value of another size)."""
        return self._call(lambda c: c.put(key, value, _placement(config)), OK)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None
    ) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (inside a registered buffer) under
        ``key`` with no copy: 0, or a negative code."""
        return self._call(lambda c: c.put_from(key, buffer_ptr, size, _placement(config)), OK)

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` when there is none or the get failed (as Mooncake)."""
        c = self._client
        if c is None or c.is_closed():
            return b""
        try:
            return c.get(key)
        except Error:
            return b""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the value of ``key`` into ``size`` bytes at ``buffer_ptr`` (inside a
        registered buffer): its length, or a negative code (-704 when there is none)."""
        return self._call(lambda c: c.get_into(key, buffer_ptr, size), None)

    def get_size(self, key: str) -> int:
        """The size in bytes of the value of ``key``, or a negative code (-704 when there
        is none)."""
        return self._call(lambda c: c.size(key), None)

    def is_exist(self, key: str) -> int:
        """1 when an object is stored under ``key``, 0 when none is, or a negative code."""
        return self._call(lambda c: 1 if c.exists([key])[0] else 0, None)

    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``: 0, or a negative code (-704 when there is none). ``force`` waits
        out the reads in flight (their leases) instead of failing with -706; kvpool never frees
        memory under a reader."""
        return self._call(lambda c: c.remove(key, bool(force)), OK)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object no reader holds a lease on (with ``force``, also those
        whose reads were in flight): how many were removed, or a negative code."""
        return self._call(lambda c: c.remove_all(bool(force)), None)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Not offered: kvpool's master keeps key digests, not keys, so it cannot match
        patterns (see docs/python.md)."""
        if self._client is None or self._client.is_closed():
            return INVALID_PARAMS
        return UNAVAILABLE_IN_CURRENT_MODE

    # --- batches ---------------------------------------------------------------------------

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        """Per key, 1 (stored) or 0 (not); -1 for every key when the call failed."""
        c = self._client
        if not keys:
            return []
        if c is None or c.is_closed():
            return [INTERNAL_ERROR] * len(keys)
        try:
            return [1 if p else 0 for p in c.exists(list(keys))]
        except Exception:  # noqa: BLE001 - Mooncake answers -1 per key on any failure
            return [INTERNAL_ERROR] * len(keys)

    def batch_put_from(
        self,
        keys: List[str],
        buffer_ptrs: List[int],
        sizes: List[int],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Puts from registered memory, one address and size per key: per key 0 or a
        negative code; [] when the store is not set up."""
        return self._batch(
            keys, lambda c: c.batch_put_from(list(keys), list(buffer_ptrs), list(sizes), _placement(config))
        )

    def batch_get_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        """Gets into registered memory, one address and size per key: per key the
        length read or a negative code; [] when the store is not set up."""
        return self._batch(keys, lambda c: c.batch_get_into(list(keys), list(buffer_ptrs), list(sizes)))

    def batch_put_from_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Puts of values spread over several registered ranges each
        (a list of addresses and one of sizes per key): per key 0 or a negative code."""
        return self._batch(
            keys,
            lambda c: c.batch_put_parts(
                list(keys), [list(p) for p in all_buffer_ptrs], [list(z) for z in all_sizes],
                _placement(config),
            ),
        )

    def batch_get_into_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        prefer_same_node: bool = True,
    ) -> List[int]:
        """Gets of values into several registered ranges each: per
        key the length read or a negative code. ``prefer_same_node`` is accepted and unused."""
        return self._batch(
            keys,
            lambda c: c.batch_get_parts(
                list(keys), [list(p) for p in all_buffer_ptrs], [list(z) for z in all_sizes]
            ),
        )

    def batch_get_parts_into_multi_buffers(
        self,
        keys: List[str],
        value_offsets: List[int],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
    ) -> List[int]:
        """kvpool's extension (Mooncake has no such call): like
        :meth:`batch_get_into_multi_buffers`, but each key's ranges take only their bytes from
        ``value_offsets[i]`` of its value on (a layer of a KV block whose value holds every
        layer). Per key the bytes read or a negative code; direct mode only (see
        :meth:`reads_value_parts`)."""
        return self._batch(
            keys,
            lambda c: c.batch_get_parts(
                list(keys),
                [list(p) for p in all_buffer_ptrs],
                [list(z) for z in all_sizes],
                [int(o) for o in value_offsets],
            ),
        )

    def start_batch_get_into_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
    ) -> "PendingCodes":
        """kvpool's extension: :meth:`batch_get_into_multi_buffers` started on the store's own
        threads, answered by the returned object's ``wait()`` (per key the length read or a
        negative code). The caller goes on meanwhile, the GIL held or not; the ranges must
        stay registered and untouched until ``wait()`` returns."""
        c = self._client
        if not keys or c is None or c.is_closed():
            return PendingCodes([])  # as batch_get_into_multi_buffers answers then
        try:
            return PendingCodes(
                None,
                c.start_batch_get_parts(
                    list(keys), [list(p) for p in all_buffer_ptrs], [list(z) for z in all_sizes]
                ),
            )
        except Exception as e:  # noqa: BLE001 - the codes batch_get_into_multi_buffers answers
            return PendingCodes([_code(e)] * len(keys))

    def reads_value_parts(self) -> bool:
        """Whether :meth:`batch_get_parts_into_multi_buffers` is served: a set-up store in
        direct mode (the node agent's engine API moves whole values only)."""
        c = self._client
        return c is not None and not c.is_closed() and c.mode() == "direct"

    def put_batch(self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None) -> int:
        """Store ``values[i]`` under ``keys[i]``: 0, or the code of the first failure;
        -600 when the lists differ in length or a value is empty (as Mooncake)."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        if any(len(memoryview(v)) == 0 for v in values):
            return INVALID_PARAMS  # as Mooncake: one empty value fails the whole batch

        def run(c: "_native.Client") -> int:
            for err in c.batch_put(list(keys), list(values), _placement(config)):
                if err is not None:
                    return _code(err)
            return OK

        return self._call(run, None)

    def get_batch(self, keys: List[str]) -> List[bytes]:
        """Per key its value, ``b""`` where a key is missing or its get failed; for no keys
        one ``b""`` (as Mooncake)."""
        c = self._client
        if not keys or c is None or c.is_closed():
            # Mooncake answers one empty value for no keys.
            return [b""] * max(len(keys), 1)
        try:
            return [r if isinstance(r, bytes) else b"" for r in c.batch_get(list(keys))]
        except Exception:  # noqa: BLE001
            return [b""] * len(keys)

    # --- plumbing --------------------------------------------------------------------------

    def _call(self, f: Callable[[_native.Client], Any], ok: Optional[int]) -> int:
        c = self._client
        if c is None or c.is_closed():
            return INVALID_PARAMS
        try:
            r = f(c)
        except Exception as e:  # noqa: BLE001 - Mooncake's API answers with codes
            return _code(e)
        return ok if ok is not None else int(r)

    def _batch(self, keys: Sequence[str], f: Callable[[_native.Client], List[int]]) -> List[int]:
        c = self._client
        if c is None or c.is_closed():
            return []
        try:
            return list(f(c))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)


class PendingCodes:
    """A started batch get (:meth:`MooncakeDistributedStore.start_batch_get_into_multi_buffers`):
    ``wait()`` blocks until it ends and answers its per-key codes, the same on every call."""

    def __init__(self, codes: Optional[List[int]], pending: Any = None):
        self._codes = codes
        self._pending = pending

    def done(self) -> bool:
        return self._pending is None or bool(self._pending.done())

    def wait(self) -> List[int]:
        if self._codes is None:
            self._codes = [int(r) for r in self._pending.wait()]
            self._pending = None
        return list(self._codes)


def _kvpool_mode(cfg: Dict[str, Any]) -> Optional[str]:
    """The config's ``mode`` when it is kvpool's ("direct", "agent", "auto"). Mooncake's
    configs use the key for their own deployment mode ("embedded", "standalone-store"), which
    says nothing about how kvpool connects: those fall back to KVPOOL_CLIENT_MODE / auto."""
    mode = cfg.get("mode")
    if isinstance(mode, str) and mode.strip().lower() in MODES:
        return mode
    return None


def _staging(value: Any) -> int:
    """Mooncake's local_buffer_size, as the agent session's staging area (agent mode)."""
    try:
        n = int(value or 0)
    except (TypeError, ValueError):
        return DEFAULT_STAGING_BYTES
    return n if n > 0 else DEFAULT_STAGING_BYTES


def _auto_mode(mode: Any, agent_socket: Any) -> str:
    """The mode a dict config with no global_segment_size would get."""
    env = os.environ
    socket = agent_socket or env.get(ENV_AGENT_SOCKET) or engine_config(env).get("agent_socket") or ""
    return choose_mode(mode or env.get(ENV_CLIENT_MODE) or "auto", str(socket), 0)


def _host(value: Any) -> str:
    """Mooncake's local_hostname may carry a port (``host:port``); kvpool picks its own."""
    host = str(value or "127.0.0.1").strip()
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host or "127.0.0.1"
