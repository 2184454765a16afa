"""Engine adapters: thin glue that lets vLLM, SGLang and LMCache keep their KV cache in the pool.

Each adapter talks to the pool through a Mooncake-compatible store module: ``kvpool.mooncake``
by default, or any module with ``MooncakeDistributedStore`` and ``ReplicateConfig`` (real
``mooncake.store`` in the tests), chosen by an argument or ``KVPOOL_STORE_MODULE``.

This module holds what the three share, and nothing engine-specific:

- :func:`setup_args`: the one place the pool's address is read (the environment the kvpool
  operator gives engine pods, then the pool's ``engine.json``), as the positional arguments of
  ``MooncakeDistributedStore.setup``;
- :func:`engine_settings`: the rest of that configuration (agent socket, key file, block size);
- :func:`store_module`, :func:`open_store`: pick the store module, open a store;
- :func:`mooncake_alias`, :func:`mooncake_config_file`: make an engine's own Mooncake code path
  build kvpool's store (``from mooncake.store import ...`` resolves to the chosen module, and
  ``MOONCAKE_CONFIG_PATH`` names a file with the pool's settings) while the engine constructs
  its connector; :func:`mooncake_engine_alias` does the same for ``mooncake.engine``
  (kvpool's transfer engine under Mooncake's ``TransferEngine`` API).

I/O boundary: environment and config-file reads, ``sys.modules`` and ``os.environ`` while an
alias is active, the temporary config file, and ``setup()`` of the store.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import types
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    Mapping,
    MutableMapping,
    NamedTuple,
    Optional,
    Tuple,
)

from .._config import ENV_MASTER, ConfigError, engine_config, master_from_env

__all__ = [
    "attach_engine_logging",
    "ConfigError",
    "EngineSettings",
    "SetupArgs",
    "StoreSetupError",
    "engine_settings",
    "mooncake_alias",
    "mooncake_engine_alias",
    "mooncake_config_file",
    "open_store",
    "parse_size",
    "setup_args",
    "store_module",
]

ENV_STORE_MODULE = "KVPOOL_STORE_MODULE"
ENV_AGENT_SOCKET = "KVPOOL_AGENT_SOCKET"
ENV_AUTH_KEY_FILE = "KVPOOL_AUTH_KEY_FILE"
ENV_ENGINE_CONFIG = "KVPOOL_ENGINE_CONFIG"
# The name the operator's engine contract (docs/engine-contract.md) gives the same file.
ENV_OPERATOR_CONFIG = "KVPOOL_CONFIG"
ENV_MOONCAKE_CONFIG = "MOONCAKE_CONFIG_PATH"
ENV_BLOCK_SIZE = "KVPOOL_BLOCK_SIZE_TOKENS"
ENV_POD_IP = "KVPOOL_POD_IP"

DEFAULT_STORE_MODULE = "kvpool.mooncake"
DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
# Engines are clients: in a kvpool pool the node agents hold the memory, so an engine
# contributes none unless its config says otherwise.
DEFAULT_GLOBAL_SEGMENT_SIZE = 0
# Room for the copying calls (put/get of bytes); the zero-copy calls do not use it.
DEFAULT_LOCAL_BUFFER_SIZE = 64 << 20
DEFAULT_PROTOCOL = "tcp"


class StoreSetupError(RuntimeError):
    """``setup()`` of a store returned a non-zero (Mooncake) error code."""

    def __init__(self, module: str, code: int, args: "SetupArgs"):
        super().__init__(
            f"{module}.MooncakeDistributedStore.setup() returned {code} "
            f"(master {args.master_server_addr}, protocol {args.protocol})"
        )
        self.code = code


class SetupArgs(NamedTuple):
    """The positional arguments of ``MooncakeDistributedStore.setup``, in Mooncake's order."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    rdma_devices: str
    master_server_addr: str

    def mooncake_json(self) -> Dict[str, Any]:
        """The same settings as Mooncake's JSON config file spells them (the file vLLM's,
        SGLang's and LMCache's Mooncake connectors read)."""
        return {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
            "protocol": self.protocol,
            "device_name": self.rdma_devices,
            "master_server_address": self.master_server_addr,
        }


@dataclass(frozen=True)
class EngineSettings:
    """The kvpool-specific part of the engine configuration (not arguments of ``setup``)."""

    pool: str
    agent_socket: str
    auth_key_file: str
    block_size_tokens: Optional[int]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any, field: str) -> int:
    """Bytes from an int or a string such as ``"4GB"``, ``"512MiB"``, ``"1048576"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ConfigError(f"{field}: {value!r} is not a size (e.g. 4GB, 512MiB, 1048576)")
        unit = (m.group(2) or "").lower()[:1]
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{field}: expected a size, got {type(value).__name__}")
    if size < 0:
        raise ConfigError(f"{field}: {size} is negative")
    return size


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    env = dict(os.environ if environ is None else environ)
    if not env.get(ENV_ENGINE_CONFIG) and env.get(ENV_OPERATOR_CONFIG):
        env[ENV_ENGINE_CONFIG] = env[ENV_OPERATOR_CONFIG]
    master = master_from_env(env)  # KVPOOL_MASTER, or its deprecated old name
    if master:
        env[ENV_MASTER] = master
    return env


def _merged(overrides: Optional[Mapping[str, Any]], env: Mapping[str, str]) -> Dict[str, Any]:
    """engine.json, then the environment, then ``overrides``: later wins."""
    cfg = dict(engine_config(env))
    for key, var in (
        ("master_server_address", ENV_MASTER),
        ("agent_socket", ENV_AGENT_SOCKET),
        ("auth_key_file", ENV_AUTH_KEY_FILE),
        ("block_size_tokens", ENV_BLOCK_SIZE),
    ):
        if env.get(var):
            cfg[key] = env[var]
    for key, value in (overrides or {}).items():
        if value is not None:
            cfg[key] = value
    return cfg


def _default_hostname(env: Mapping[str, str]) -> str:
    if env.get(ENV_POD_IP):
        return env[ENV_POD_IP]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def setup_args(
    overrides: Optional[Mapping[str, Any]] = None,
    *,
    environ: Optional[Mapping[str, str]] = None,
) -> SetupArgs:
    """The arguments of ``setup()`` for this engine process.

    Sources, later wins: the pool's ``engine.json`` (``KVPOOL_ENGINE_CONFIG``, the operator's
    ``KVPOOL_CONFIG``, or Mooncake's ``MOONCAKE_CONFIG_PATH``; its keys are Mooncake's:
    ``master_server_address``, ``metadata_server``, ``protocol``, ``device_name``,
    ``local_hostname``, ``global_segment_size``, ``local_buffer_size``), then
    ``KVPOOL_MASTER`` (``host:port``, comma-separated for several masters; the deprecated
    ``KVPOOL_MASTER_ADDR`` when it is unset), then
    ``overrides`` (an engine's own extra config, same keys). Raises :class:`ConfigError`
    naming the missing or bad field.
    """
    env = _environ(environ)
    cfg = _merged(overrides, env)
    master = cfg.get("master_server_address")
    if isinstance(master, (list, tuple)):
        master = ",".join(str(m).strip() for m in master)
    if not master or not str(master).strip():
        raise ConfigError(
            f"master_server_address: not set (set {ENV_MASTER}, or {ENV_ENGINE_CONFIG} "
            f"or {ENV_MOONCAKE_CONFIG} naming the pool's engine.json)"
        )
    protocol = str(cfg.get("protocol") or DEFAULT_PROTOCOL)
    if protocol not in ("tcp", "rdma"):
        raise ConfigError(f"protocol: {protocol!r} is neither tcp nor rdma")
    return SetupArgs(
        local_hostname=str(cfg.get("local_hostname") or _default_hostname(env)),
        metadata_server=str(cfg.get("metadata_server") or DEFAULT_METADATA_SERVER),
        global_segment_size=parse_size(
            cfg.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE), "global_segment_size"
        ),
        local_buffer_size=parse_size(
            cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE), "local_buffer_size"
        ),
        protocol=protocol,
        rdma_devices=str(cfg.get("device_name") or ""),
        master_server_addr=",".join(a.strip() for a in str(master).split(",") if a.strip()),
    )


def engine_settings(
    overrides: Optional[Mapping[str, Any]] = None,
    *,
    environ: Optional[Mapping[str, str]] = None,
) -> EngineSettings:
    """Agent socket, key file, pool name and block size, from the same sources as
    :func:`setup_args`."""
    cfg = _merged(overrides, _environ(environ))
    block = cfg.get("block_size_tokens")
    try:
        block_size = int(block) if block not in (None, "") else None
    except (TypeError, ValueError):
        raise ConfigError(f"block_size_tokens: {block!r} is not an integer") from None
    return EngineSettings(
        pool=str(cfg.get("pool") or ""),
        agent_socket=str(cfg.get("agent_socket") or ""),
        auth_key_file=str(cfg.get("auth_key_file") or ""),
        block_size_tokens=block_size,
    )


def store_module(
    name: Any = None, *, environ: Optional[Mapping[str, str]] = None
) -> types.ModuleType:
    """The store module: ``name`` (a module or its dotted name), else ``KVPOOL_STORE_MODULE``,
    else ``kvpool.mooncake``."""
    if isinstance(name, types.ModuleType):
        return name
    env = os.environ if environ is None else environ
    dotted = name or env.get(ENV_STORE_MODULE) or DEFAULT_STORE_MODULE
    module = importlib.import_module(dotted)
    for attr in ("MooncakeDistributedStore", "ReplicateConfig"):
        if not hasattr(module, attr):
            raise ConfigError(f"store module {dotted} has no {attr}")
    return module


def open_store(
    overrides: Optional[Mapping[str, Any]] = None,
    *,
    module: Any = None,
    args: Optional[SetupArgs] = None,
) -> Any:
    """A ``MooncakeDistributedStore`` of the store module, set up with :func:`setup_args`."""
    mod = store_module(module)
    args = args or setup_args(overrides)
    store = mod.MooncakeDistributedStore()
    rc = store.setup(*args)
    if rc != 0:
        raise StoreSetupError(mod.__name__, rc, args)
    return store


_ALIAS_LOCK = threading.RLock()
_MISSING = object()


def restore_entries(
    mapping: MutableMapping[str, Any], saved: Mapping[str, Any], missing: Any = None
) -> None:
    """Put the ``saved`` entries of ``mapping`` (``os.environ``, ``sys.modules``) back as they
    were before a change: each to its old value, or removed where the old value is ``missing``
    (the entry did not exist)."""
    for name, old in saved.items():
        if old is missing:
            mapping.pop(name, None)
        else:
            mapping[name] = old


def select_impl(
    impl: Optional[str],
    env_var: str,
    default: str,
    ours: type,
    find_engine: Callable[[], Optional[type]],
    engine_class: Callable[[type], type],
    engine_missing: str,
) -> type:
    """The class an adapter's entry point stands for: ``impl`` (or the variable ``env_var``,
    else ``default``) is ``kvpool`` (``ours``), ``engine`` (``engine_class`` of the engine's
    own Mooncake class, which ``find_engine`` looks up; an ImportError naming
    ``engine_missing`` without it) or ``auto`` (``engine`` when there is one, else ``kvpool``)."""
    impl = (impl or os.environ.get(env_var) or default).lower()
    if impl not in ("auto", "engine", "kvpool"):
        raise ConfigError(f"{env_var}: {impl!r} is not auto, engine or kvpool")
    if impl == "kvpool":
        return ours
    engine = find_engine()
    if engine is None:
        if impl == "engine":
            raise ImportError(f"{env_var}=engine, but {engine_missing}")
        return ours
    return engine_class(engine)


@contextlib.contextmanager
def mooncake_alias(module: Any) -> Iterator[types.ModuleType]:
    """While active, ``from mooncake.store import X`` yields ``module``'s ``X``.

    Engines import Mooncake inside the constructors of their Mooncake connectors; running
    that constructor under the alias makes it build ``module``'s store instead, with the rest
    of the engine's code path unchanged. A no-op when ``module`` is ``mooncake.store`` itself.
    The previous ``sys.modules`` entries come back on exit.
    """
    mod = store_module(module)
    if mod.__name__ == "mooncake.store":
        yield mod
        return
    with _ALIAS_LOCK:
        saved = {name: sys.modules.get(name, _MISSING) for name in ("mooncake", "mooncake.store")}
        parent: Any = saved["mooncake"]
        if parent is _MISSING:
            try:  # the real package, when installed, so its other modules stay importable
                parent = importlib.import_module("mooncake")
                saved["mooncake"] = parent
            except ImportError:
                parent = _MISSING
        if parent is _MISSING:
            parent = types.ModuleType("mooncake")
            parent.__path__ = []  # a package, so `import mooncake.store` resolves the child
            sys.modules["mooncake"] = parent
        saved_attr = getattr(parent, "store", _MISSING)
        sys.modules["mooncake.store"] = mod
        try:
            parent.store = mod
        except (AttributeError, TypeError):
            saved_attr = _MISSING
        try:
            yield mod
        finally:
            if saved_attr is _MISSING:
                with contextlib.suppress(AttributeError):
                    if getattr(parent, "store", None) is mod:
                        delattr(parent, "store")
            else:
                parent.store = saved_attr
            restore_entries(sys.modules, saved, _MISSING)


def mooncake_engine_alias() -> ContextManager[types.ModuleType]:
    """While active, ``from mooncake.engine import TransferEngine`` yields kvpool's transfer
    engine (:mod:`kvpool.mooncake_engine`): the transfer-engine counterpart of
    :func:`mooncake_alias`, for SGLang's PD and vLLM's ``MooncakeConnector``."""
    from .. import mooncake_engine

    return mooncake_engine.alias()


@contextlib.contextmanager
def mooncake_config_file(
    settings: Mapping[str, Any], env_vars: Tuple[str, ...] = (ENV_MOONCAKE_CONFIG,)
) -> Iterator[str]:
    """Write ``settings`` as a Mooncake JSON config file and point ``env_vars`` at it while
    active (an engine's Mooncake connector reads the file in its constructor). The variables
    are restored and the file removed on exit."""
    fd, path = tempfile.mkstemp(prefix="kvpool-mooncake-", suffix=".json")
    with _ALIAS_LOCK:
        saved = {var: os.environ.get(var) for var in env_vars}
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(dict(settings), f)
            for var in env_vars:
                os.environ[var] = path
            yield path
        finally:
            restore_entries(os.environ, saved)
            with contextlib.suppress(OSError):
                os.unlink(path)


def read_json_file(path: Optional[str]) -> Dict[str, Any]:
    """A JSON object file, or {} for no path; :class:`ConfigError` when unreadable."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def attach_engine_logging(engine_logger: str = "vllm") -> bool:
    """Sends the adapters' log records (logger ``kvpool``) to the engine's own log handlers,
    at the engine's level, when the ``kvpool`` logger has no handler of its own. Engines
    configure only their own logger (vLLM: ``vllm``) in the processes that construct the
    adapters, so without this the adapters' lines are lost below WARNING and unformatted above.
    Returns whether handlers were attached; a process that configured ``kvpool`` logging
    itself (or the root logger) keeps its configuration."""
    ours = logging.getLogger("kvpool")
    if ours.handlers or logging.getLogger().handlers:
        return False
    theirs = logging.getLogger(engine_logger)
    if not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False
    return True
