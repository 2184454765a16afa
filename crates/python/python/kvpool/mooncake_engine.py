"""Mooncake's transfer engine API over kvpool: ``TransferEngine``, ``TransferOpcode`` and
``TransferNotify``, as ``mooncake.engine`` (Mooncake 0.3.x) offers them.

Same method names, signatures and return values (0 or a negative code; batch ids; addresses
as ints; session ids ``host:port`` with ``get_rpc_port``), so the engines' own Mooncake code
paths (SGLang's PD disaggregation, vLLM's ``MooncakeConnector``) move KV with kvpool's
transfer engine when they construct this class (see :func:`alias`). Peers are other kvpool
engines: the wire protocol is kvpool's, not Mooncake's. Every difference from Mooncake is
listed in docs/python.md ("Mooncake's transfer engine API").

Credentials and integrity are those of kvpool's TCP lanes: the pool key from
``KVPOOL_AUTH_KEY_FILE`` (or ``KVPOOL_AUTH_KEY``, or ``auth_key_file`` in the engine config
file ``KVPOOL_ENGINE_CONFIG``), per-frame integrity from ``KVPOOL_TRANSFER_INTEGRITY`` and TLS
from the ``KVPOOL_TRANSFER_TLS*`` variables. Without a key peers are not authenticated (as
with Mooncake), and a warning says so.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import sys
import threading
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _native
from ._config import ENV_AUTH_KEY_FILE, ConfigError, engine_config

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "alias"]

_log = logging.getLogger("kvpool.mooncake_engine")

# Mooncake's codes (mooncake-transfer-engine/include/error.h) that this module answers with.
OK = 0
ERR_FAILED = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102

P2P_HANDSHAKE = "P2PHANDSHAKE"


class TransferOpcode(enum.IntEnum):
    """Direction of a transfer, as Mooncake numbers it."""

    Read = 0
    Write = 1


class TransferNotify:
    """A notification sent after a transfer (``name``, ``msg``), as Mooncake's."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _key_file() -> Optional[str]:
    """The pool key file the environment or the engine config names, if any."""
    path = os.environ.get(ENV_AUTH_KEY_FILE)
    if path:
        return path
    try:
        cfg = engine_config()
    except ConfigError as e:
        _log.warning("%s", e)
        return None
    value = cfg.get("auth_key_file")
    return value if isinstance(value, str) and value else None


class TransferEngine:
    """Mooncake's ``TransferEngine`` over kvpool's transfer engine (see the module docs)."""

    def __init__(self) -> None:
        self._engine: Optional[_native.P2pEngine] = None
        self._lock = threading.Lock()

    # --- setup ---------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Start serving at ``local_hostname`` (P2P handshake only: ``metadata_server`` must
        be ``"P2PHANDSHAKE"``); 0, or -1 with the reason logged."""
        if metadata_server.strip().upper() != P2P_HANDSHAKE:
            _log.error(
                "metadata server %r: kvpool's engine offers the P2P handshake only "
                "(metadata_server=%r)",
                metadata_server,
                P2P_HANDSHAKE,
            )
            return ERR_FAILED
        proto = (protocol or "tcp").strip().lower()
        if proto not in ("tcp", "rdma", ""):
            _log.error("protocol %r: kvpool's engine moves over tcp", protocol)
            return ERR_FAILED
        if proto == "rdma":
            _log.warning("protocol rdma asked: kvpool's point-to-point engine moves over TCP")
        with self._lock:
            if self._engine is not None:
                return OK
            key = _key_file()
            try:
                self._engine = _native.P2pEngine(local_hostname, key)
            except _native.Error as e:
                _log.error("initialize(%r): %s", local_hostname, e)
                return ERR_FAILED
        if not self._engine.authenticated:
            _log.warning(
                "no pool key (%s): peers of this transfer engine are not authenticated",
                ENV_AUTH_KEY_FILE,
            )
        return OK

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """``initialize``; ``metadata_type`` is not used by the P2P handshake."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self) -> int:
        """The port of this engine's session id (``host:port``); -1 before ``initialize``."""
        return self._engine.rpc_port if self._engine is not None else ERR_FAILED

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """The topology JSON Mooncake reports: no RDMA devices (kvpool's engine moves over
        TCP here), one entry per NUMA node."""
        return json.dumps({f"cpu:{n}": [[], []] for n in _numa_nodes()}, indent="\t")

    # --- memory --------------------------------------------------------------------------

    def _call(self, fn: str, *args: Any) -> Any:
        if self._engine is None:
            raise _native.Closed("the transfer engine is not initialized")
        return getattr(self._engine, fn)(*args)

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            self._call("register", buffer_addr, capacity)
        except _native.Exists as e:
            _log.error("register_memory: %s", e)
            return ERR_ADDRESS_OVERLAPPED
        except _native.Error as e:
            _log.error("register_memory: %s", e)
            return ERR_FAILED
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            return OK if self._call("unregister", buffer_addr) else ERR_ADDRESS_NOT_REGISTERED
        except _native.Error as e:
            _log.error("unregister_memory: %s", e)
            return ERR_FAILED

    def batch_register_memory(
        self, buffer_addresses: List[int], capacities: List[int], location: str = "*"
    ) -> int:
        if len(buffer_addresses) != len(capacities):
            _log.error("batch_register_memory: addresses and capacities differ in length")
            return ERR_FAILED
        for addr, cap in zip(buffer_addresses, capacities):
            rc = self.register_memory(addr, cap, location)
            if rc != OK:
                return rc
        return OK

    def batch_unregister_memory(self, buffer_addresses: List[int]) -> int:
        for addr in buffer_addresses:  # stops at the first failure, as Mooncake does
            rc = self.unregister_memory(addr)
            if rc != OK:
                return rc
        return OK

    def allocate_managed_buffer(self, length: int) -> int:
        """Registered memory of ``length`` bytes owned by the engine; 0 when it fails."""
        try:
            return int(self._call("allocate", length))
        except _native.Error as e:
            _log.error("allocate_managed_buffer(%d): %s", length, e)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        try:
            self._call("free", buffer_addr)
        except _native.Error as e:
            _log.error("free_managed_buffer: %s", e)
        return OK

    def write_bytes_to_buffer(self, dest_address: int, src: Union[bytes, str], length: int) -> int:
        data = src.encode() if isinstance(src, str) else bytes(src)
        try:
            self._call("write_local", dest_address, data[: max(length, 0)])
        except _native.Error as e:
            _log.error("write_bytes_to_buffer: %s", e)
            return ERR_FAILED
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        try:
            return bytes(self._call("read_local", source_address, length))
        except _native.Error as e:
            _log.error("read_bytes_from_buffer: %s", e)
            return b""

    # --- transfers -----------------------------------------------------------------------

    def _transfer(
        self,
        target: str,
        write: bool,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
        notify: Optional[TransferNotify] = None,
    ) -> int:
        note = None if notify is None else (str(notify.name), str(notify.msg).encode())
        try:
            self._call("transfer", target, write, list(buffers), list(peers), list(lengths), note)
        except _native.Error as e:
            _log.error("transfer with %s: %s", target, e)
            return ERR_FAILED
        return OK

    def transfer_sync_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        return self._transfer(target_hostname, True, [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        return self._transfer(target_hostname, False, [buffer], [peer_buffer_address], [length])

    def transfer_sync(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        write = int(opcode) == TransferOpcode.Write
        return self._transfer(
            target_hostname, write, [buffer], [peer_buffer_address], [length], notify
        )

    def batch_transfer_sync_write(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], transport_hint: str = "",
    ) -> int:
        return self._transfer(target_hostname, True, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], transport_hint: str = "",
    ) -> int:
        return self._transfer(target_hostname, False, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
        transport_hint: str = "",
    ) -> int:
        write = int(opcode) == TransferOpcode.Write
        return self._transfer(
            target_hostname, write, buffers, peer_buffer_addresses, lengths, notify
        )

    def _submit(
        self, target: str, write: bool, buffers: Sequence[int], peers: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        try:
            return int(
                self._call("submit", target, write, list(buffers), list(peers), list(lengths))
            )
        except _native.Error as e:
            _log.error("transfer with %s: %s", target, e)
            return 0

    def batch_transfer_async_write(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], transport_hint: str = "",
    ) -> int:
        """A batch id for ``get_batch_transfer_status`` (0 when it could not start)."""
        return self._submit(target_hostname, True, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], transport_hint: str = "",
    ) -> int:
        return self._submit(target_hostname, False, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(
        self, target_hostname: str, buffers: List[int], peer_buffer_addresses: List[int],
        lengths: List[int], opcode: TransferOpcode, transport_hint: str = "",
    ) -> int:
        write = int(opcode) == TransferOpcode.Write
        return self._submit(target_hostname, write, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(
        self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
        transport_hint: str = "",
    ) -> int:
        return self._submit(target_hostname, True, [buffer], [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids: List[int]) -> int:
        """Wait for the batches: 0 when all succeeded, else -1. Their ids are spent."""
        rc = OK
        for bid in batch_ids:
            if self._engine is None or self._engine.status(bid, True) != 1:
                rc = ERR_FAILED
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 still moving, -1 failed (a settled batch's id is spent)."""
        return ERR_FAILED if self._engine is None else int(self._engine.status(batch_id, False))

    # --- peers ---------------------------------------------------------------------------

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The first memory the peer ``segment_name`` registered (0: none, or unreachable)."""
        try:
            return int(self._call("first_buffer", segment_name))
        except _native.Error as e:
            _log.error("get_first_buffer_address(%s): %s", segment_name, e)
            return 0

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers and knows the pool key, else -102."""
        try:
            self._call("probe", peer_server_name)
        except _native.Error as e:
            _log.error("send_probe(%s): %s", peer_server_name, e)
            return ERR_SOCKET
        return OK

    def get_notifies(self) -> List[TransferNotify]:
        """Notifications received since the last call."""
        if self._engine is None:
            return []
        return [
            TransferNotify(name, msg.decode("utf-8", "replace"))
            for name, msg in self._engine.notifications()
        ]


def _numa_nodes() -> List[int]:
    try:
        names = os.listdir("/sys/devices/system/node")
    except OSError:
        return [0]
    nodes = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    return nodes or [0]


_ALIAS_LOCK = threading.RLock()
_MISSING = object()


@contextlib.contextmanager
def alias() -> Iterator[types.ModuleType]:
    """While active, ``from mooncake.engine import TransferEngine`` yields this module's
    class: construct an engine's Mooncake transfer code path under it (SGLang imports the
    class in its constructor; vLLM's ``MooncakeConnector`` module at import) and it moves
    KV with kvpool's engine, unpatched. The previous ``sys.modules`` entries come back on exit.
    """
    me = sys.modules[__name__]
    with _ALIAS_LOCK:
        saved: Dict[str, Any] = {
            n: sys.modules.get(n, _MISSING) for n in ("mooncake", "mooncake.engine")
        }
        parent: Any = saved["mooncake"]
        if parent is _MISSING:
            try:  # the real package when installed, so that its other modules stay importable
                import importlib

                parent = importlib.import_module("mooncake")
                saved["mooncake"] = parent
            except ImportError:
                parent = types.ModuleType("mooncake")
                parent.__path__ = []
                sys.modules["mooncake"] = parent
        saved_attr = getattr(parent, "engine", _MISSING)
        sys.modules["mooncake.engine"] = me
        parent.engine = me
        try:
            yield me
        finally:
            if saved_attr is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(parent, "engine")
            else:
                parent.engine = saved_attr
            for name, old in saved.items():
                if old is _MISSING:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = old
