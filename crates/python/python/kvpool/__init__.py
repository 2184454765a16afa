"""kvpool's Python client.

``kvpool.Store`` is the native API: keys are ``str`` or ``bytes``, values any object with the
buffer protocol, failures raise :class:`kvpool.Error` subclasses that carry kvpool's error
``kind`` and Mooncake's error ``code``. ``kvpool.mooncake`` offers Mooncake's
``MooncakeDistributedStore`` API over the same client, so engines written for Mooncake use
kvpool unchanged.

The package is typed (PEP 561: ``py.typed``, and ``_native.pyi`` for the extension module);
its exceptions pickle (their module is ``kvpool``); ``__version__`` is the Rust crate's.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

from . import _native
from ._config import DEFAULT_STAGING_BYTES, ConfigError, Settings
from ._native import (
    AuthFailed,
    BufferTooSmall,
    Closed,
    Error,
    Exists,
    InvalidArgument,
    Leased,
    NoSpace,
    NotFound,
    NotRegistered,
    NotSupported,
    TransferFailed,
    Unavailable,
)

__all__ = [
    "Store",
    "device_memory_supported",
    "ConfigError",
    "Error",
    "NotFound",
    "Exists",
    "NoSpace",
    "InvalidArgument",
    "BufferTooSmall",
    "NotRegistered",
    "Leased",
    "Unavailable",
    "AuthFailed",
    "TransferFailed",
    "Closed",
    "NotSupported",
]

Key = Union[str, bytes]

# The version of the Rust crate the extension was built from (the wheel's version too).
__version__: str = _native.__version__


def device_memory_supported() -> bool:
    """Whether ``register_buffer`` takes a GPU's own memory (a CUDA tensor's ``data_ptr()``)
    and moves it through pinned staging itself: a build with feature ``cuda`` on a host whose
    CUDA driver reports a GPU. False otherwise; host memory works either way."""
    return bool(_native.device_memory_supported())


def _check_key(key: Any) -> Key:
    if not isinstance(key, (str, bytes)):
        raise TypeError(f"keys are str or bytes, got {type(key).__name__}")
    return key


class Store:
    """A connection to a kvpool pool.

    ``Store()`` reads the pool from the environment (see ``kvpool._config``); pass
    ``masters`` and ``auth_key_file`` to name it. ``mode`` picks the way in: "direct" (to the
    masters), "agent" (through the node agent's socket ``agent_socket``, with a shared-memory
    staging area of ``staging_bytes``), or "auto" (the default: agent mode when the agent's
    socket is configured and exists, and ``global_segment_size`` is 0). ``global_segment_size`` > 0 (direct mode only)
    contributes that much of this process's memory to the pool for as long as the store is
    open. In agent mode, ``numa_node`` (of this process's memory) or ``gpu`` (its GPU's PCI bus
    id, e.g. "0000:18:00.0") tell the agent where the engine runs, so that its staging area
    and NICs are on that NUMA node. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        masters: Union[str, Sequence[str], None] = None,
        auth_key_file: Optional[str] = None,
        *,
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 0,
        protocol: str = "tcp",
        replicas: int = 1,
        request_timeout_ms: int = 10_000,
        mode: Optional[str] = None,
        agent_socket: Optional[str] = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        numa_node: Optional[int] = None,
        gpu: Optional[str] = None,
    ) -> None:
        settings = Settings.resolve(
            masters,
            auth_key_file,
            agent_socket,
            mode=mode,
            staging_bytes=staging_bytes,
            local_hostname=local_hostname,
            global_segment_size=global_segment_size,
            protocol=protocol,
            request_timeout_ms=request_timeout_ms,
            numa_node=numa_node,
            gpu=gpu,
        )
        self._client = settings.connect()
        self.replicas = replicas

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def mode(self) -> str:
        """How this store reaches the pool: "direct" or "agent"."""
        return self._client.mode()

    @property
    def node(self) -> str:
        """This process's node name in the pool."""
        return self._client.node()

    def put(self, key: Key, value: Any, *, replicas: Optional[int] = None, pin: bool = False) -> None:
        """Store ``value`` (bytes, bytearray, memoryview, numpy array...) under ``key``."""
        self._client.put(
            _check_key(key), value, _native.Placement(replicas or self.replicas, hard_pin=pin)
        )

    def get(self, key: Key) -> bytes:
        """The value of ``key``; raises :class:`NotFound` when there is none."""
        return self._client.get(_check_key(key))

    def get_into(self, key: Key, buffer: Any) -> int:
        """Read the value of ``key`` into the writable ``buffer``; returns its length."""
        return self._client.get_into_buffer(_check_key(key), buffer)

    def put_many(self, items: Iterable[Tuple[Key, Any]], *, replicas: Optional[int] = None) -> None:
        """Store several values at once; raises the first failure after all were tried."""
        pairs = list(items)
        results = self._client.batch_put(
            [_check_key(k) for k, _ in pairs],
            [v for _, v in pairs],
            _native.Placement(replicas or self.replicas),
        )
        for err in results:
            if err is not None:
                raise err

    def get_many(self, keys: Iterable[Key]) -> List[Optional[bytes]]:
        """The values of several keys, None where a key is missing."""
        out: List[Optional[bytes]] = []
        for r in self._client.batch_get([_check_key(k) for k in keys]):
            if isinstance(r, NotFound):
                out.append(None)
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append(r)
        return out

    def exists(self, key: Key) -> bool:
        """Whether an object is stored under ``key``."""
        return self._client.exists([_check_key(key)])[0]

    def exists_many(self, keys: Iterable[Key]) -> List[bool]:
        """Per key, in order, whether an object is stored under it: one round trip."""
        return self._client.exists([_check_key(k) for k in keys])

    def size(self, key: Key) -> int:
        """The size in bytes of the value of ``key``."""
        return self._client.size(_check_key(key))

    def remove(self, key: Key) -> None:
        """Remove the object under ``key`` and free its memory in the pool. Raises
        :class:`NotFound` when there is none and :class:`Leased` while a reader holds a lease
        on it (a get in flight): kvpool never frees memory under a reader."""
        self._client.remove(_check_key(key))

    def register(self, buffer: Any) -> Tuple[int, int]:
        """Register a writable buffer (numpy array, bytearray) for zero-copy
        :meth:`put_from` / :meth:`get_to`; returns its address and length."""
        return self._client.register_object(buffer)

    def register_memory(self, ptr: int, size: int) -> None:
        """Register ``size`` bytes at address ``ptr``; they must stay valid until unregistered."""
        self._client.register_buffer(ptr, size)

    def unregister(self, ptr: int) -> bool:
        """Unregister the buffer that starts at ``ptr`` (from :meth:`register` or
        :meth:`register_memory`); False when none does."""
        return self._client.unregister_buffer(ptr)

    def alloc_buffer(self, size: int) -> Tuple[int, int]:
        """``size`` bytes for zero-copy :meth:`put_from` / :meth:`get_to`, until
        :meth:`free_buffer`; returns (address, size). In agent mode the memory is part of the
        shared staging area the agent reads and writes, so puts from it and gets into it copy
        nothing; in direct mode it is fresh registered memory."""
        return self._client.alloc_buffer(size)

    def free_buffer(self, ptr: int) -> bool:
        """Give back memory from :meth:`alloc_buffer`; False when none starts at ``ptr``."""
        return self._client.free_buffer(ptr)

    def put_from(self, key: Key, ptr: int, size: int, *, replicas: Optional[int] = None) -> None:
        """Store ``size`` bytes at ``ptr`` (inside a registered buffer) with no copy."""
        self._client.put_from(
            _check_key(key), ptr, size, _native.Placement(replicas or self.replicas)
        )

    def get_to(self, key: Key, ptr: int, size: int) -> int:
        """Read into ``size`` bytes at ``ptr`` (inside a registered buffer); returns the length."""
        return self._client.get_into(_check_key(key), ptr, size)

    def healthy(self) -> bool:
        """Whether the pool's master answers (through the node agent in agent mode); False
        instead of raising."""
        try:
            self._client.health()
            return True
        except Error:
            return False

    def metrics(self) -> str:
        """This client's Prometheus metrics, in the text format."""
        return self._client.metrics()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called; every other call then raises :class:`Closed`."""
        return self._client.is_closed()

    def close(self) -> None:
        """Withdraw any contributed memory and disconnect; later calls raise :class:`Closed`."""
        self._client.close()
