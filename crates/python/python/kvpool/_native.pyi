"""Types of ``kvpool._native``, the Rust extension module (crates/python/src/lib.rs and
errors.rs). Keep in step with its ``#[pymethods]``: ``mypy.stubtest kvpool._native``
(crates/python/tests/test_typing_and_pickle.py) fails when they drift apart."""

import os
from typing import Any, List, Optional, Sequence, Tuple, Union, final

__all__ = [
    "__version__",
    "device_memory_supported",
    "Client",
    "Placement",
    "PendingGet",
    "P2pEngine",
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

__version__: str

# A key: text (its UTF-8 bytes) or bytes.
_Key = Union[str, bytes]
# Any object with the buffer protocol. Not ``typing_extensions.Buffer``: type checkers count
# a numpy array as one only for Python 3.12 and later.
_BufferLike = Any
_Path = Union[str, "os.PathLike[str]"]

def device_memory_supported() -> bool:
    """Whether ``register_buffer`` accepts a GPU's own memory: a build with feature ``cuda``
    on a host whose CUDA driver reports a GPU."""

@final
class Placement:
    """Where a put's replicas go and how the object is pinned once committed."""

    def __new__(
        cls,
        replicas: int = 1,
        preferred: Optional[str] = None,
        hard_pin: bool = False,
        soft_pin_ttl_ms: int = 0,
    ) -> "Placement": ...

@final
class PendingGet:
    """A batch get running on the store's threads (``Client.start_batch_get_parts``)."""

    def done(self) -> bool: ...
    def wait(self) -> List[int]: ...
    def __len__(self) -> int: ...

@final
class Client:
    """A connection to a kvpool pool. Defaults shown as ``...`` are "127.0.0.1"
    (``local_hostname``), "tcp" (``protocol``), "auto" (``mode``) and 64 MiB
    (``staging_bytes``); no masters and no key file."""

    def __new__(
        cls,
        masters: Sequence[str] = ...,
        auth_key_file: _Path = ...,
        local_hostname: str = ...,
        global_segment_size: int = 0,
        protocol: str = ...,
        request_timeout_ms: int = 10000,
        mode: str = ...,
        agent_socket: Optional[_Path] = None,
        staging_bytes: int = ...,
        numa_node: Optional[int] = None,
        gpu: Optional[str] = None,
    ) -> "Client": ...
    def mode(self) -> str: ...
    def alloc_buffer(self, size: int) -> Tuple[int, int]: ...
    def free_buffer(self, ptr: int) -> bool: ...
    def node(self) -> str: ...
    def put(self, key: _Key, value: _BufferLike, placement: Optional[Placement] = None) -> None: ...
    def put_from(
        self, key: _Key, ptr: int, size: int, placement: Optional[Placement] = None
    ) -> None: ...
    def get(self, key: _Key) -> bytes: ...
    def get_into_buffer(self, key: _Key, buffer: _BufferLike) -> int: ...
    def get_into(self, key: _Key, ptr: int, size: int) -> int: ...
    def batch_put_from(
        self,
        keys: Sequence[_Key],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        placement: Optional[Placement] = None,
    ) -> List[int]: ...
    def batch_get_into(
        self, keys: Sequence[_Key], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> List[int]: ...
    def batch_put_parts(
        self,
        keys: Sequence[_Key],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        placement: Optional[Placement] = None,
    ) -> List[int]: ...
    def batch_get_parts(
        self,
        keys: Sequence[_Key],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        value_offsets: Optional[Sequence[int]] = None,
    ) -> List[int]: ...
    def start_batch_get_parts(
        self,
        keys: Sequence[_Key],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        value_offsets: Optional[Sequence[int]] = None,
    ) -> PendingGet: ...
    def batch_put(
        self,
        keys: Sequence[_Key],
        values: Sequence[_BufferLike],
        placement: Optional[Placement] = None,
    ) -> List[Optional[Error]]: ...
    def batch_get(self, keys: Sequence[_Key]) -> List[Union[bytes, Error]]: ...
    def exists(self, keys: Sequence[_Key]) -> List[bool]: ...
    def size(self, key: _Key) -> int: ...
    def remove(self, key: _Key, force: bool = False) -> None: ...
    def remove_all(self, force: bool = False) -> int: ...
    def register_buffer(self, ptr: int, size: int) -> None: ...
    def register_object(self, obj: _BufferLike) -> Tuple[int, int]: ...
    def unregister_buffer(self, ptr: int) -> bool: ...
    def registered_buffers(self) -> int: ...
    def health(self) -> None: ...
    def metrics(self) -> str: ...
    def is_closed(self) -> bool: ...
    def close(self) -> None: ...

@final
class P2pEngine:
    """A point-to-point transfer engine serving this process's registered memory at
    ``local_hostname`` (``host`` or ``host:port``), for ``kvpool.mooncake_engine``."""

    def __new__(
        cls, local_hostname: str, auth_key_file: Optional[_Path] = None
    ) -> "P2pEngine": ...
    @property
    def rpc_port(self) -> int: ...
    @property
    def authenticated(self) -> bool: ...
    def register(self, ptr: int, size: int) -> None: ...
    def unregister(self, ptr: int) -> bool: ...
    def allocate(self, size: int) -> int: ...
    def free(self, ptr: int) -> bool: ...
    def write_local(self, ptr: int, data: bytes) -> None: ...
    def read_local(self, ptr: int, size: int) -> bytes: ...
    def transfer(
        self,
        session: str,
        write: bool,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[Tuple[str, bytes]] = None,
    ) -> None: ...
    def submit(
        self,
        session: str,
        write: bool,
        buffers: Sequence[int],
        peer_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int: ...
    def status(self, batch_id: int, wait: bool = False) -> int: ...
    def first_buffer(self, session: str) -> int: ...
    def probe(self, session: str) -> None: ...
    def notifications(self) -> List[Tuple[str, bytes]]: ...
    def region_count(self) -> int: ...

class Error(Exception):
    """A kvpool call failed; see ``kind`` (kvpool's error kind) and ``code`` (Mooncake's
    error code). The classes' ``__module__`` is ``kvpool``, where they are exported."""

    kind: str
    code: int

class NotFound(Error): ...
class Exists(Error): ...
class NoSpace(Error): ...
class InvalidArgument(Error): ...
class BufferTooSmall(InvalidArgument): ...
class NotRegistered(InvalidArgument): ...
class Leased(Error): ...
class Unavailable(Error): ...
class AuthFailed(Error): ...
class TransferFailed(Error): ...
class Closed(Error): ...
class NotSupported(Error): ...
