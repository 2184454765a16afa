"""Where a store connects: masters, pool key, agent socket, and which of them it uses.

Explicit arguments win, then the environment the kvpool operator gives engine pods
(``KVPOOL_MASTER``, ``KVPOOL_AUTH_KEY_FILE``, ``KVPOOL_AGENT_SOCKET``,
``KVPOOL_CLIENT_MODE``), then the pool's ``engine.json`` (``KVPOOL_ENGINE_CONFIG``, or
Mooncake's ``MOONCAKE_CONFIG_PATH``). ``KVPOOL_MASTER`` is the master address's one name, as
in the agent and the conductor; ``KVPOOL_MASTER_ADDR``, its old name, is still read when it is
unset, with a ``DeprecationWarning`` (and one logged warning per process).

The mode: "direct" talks to the masters itself (needs their address and the pool key);
"agent" goes through the node agent's engine socket with shared-memory staging (needs only
the socket); "auto" (the default) is agent mode when an agent socket is configured, its file
exists and the store contributes no memory (``global_segment_size`` 0), else direct.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

if TYPE_CHECKING:
    from . import _native

ENV_MASTER = "KVPOOL_MASTER"
# The master address's old name: read when ENV_MASTER is unset, with a deprecation warning.
ENV_MASTER_DEPRECATED = "KVPOOL_MASTER_ADDR"
ENV_AUTH_KEY_FILE = "KVPOOL_AUTH_KEY_FILE"
ENV_AGENT_SOCKET = "KVPOOL_AGENT_SOCKET"
ENV_CLIENT_MODE = "KVPOOL_CLIENT_MODE"
MODES = ("direct", "agent", "auto")
# Staging area an agent-mode store asks the agent for when not told.
DEFAULT_STAGING_BYTES = 64 << 20
ENV_ENGINE_CONFIG = "KVPOOL_ENGINE_CONFIG"
ENV_MOONCAKE_CONFIG = "MOONCAKE_CONFIG_PATH"


class ConfigError(ValueError):
    """The configuration names no pool, or names it in a way kvpool cannot use."""


def choose_mode(mode: Any, agent_socket: str, global_segment_size: int = 0) -> str:
    """``mode`` settled to "direct" or "agent" (the same rule as the native client's)."""
    m = str(mode or "auto").strip().lower()
    if m not in MODES:
        raise ConfigError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if m != "auto":
        return m
    if agent_socket and os.path.exists(agent_socket) and not global_segment_size:
        return "agent"
    return "direct"


def may_lend(auth_key_file: Any) -> bool:
    """Whether the credential file may mount segments (lend the pool memory): the pool key or
    an agent's credential file; an engine's may not (docs/reliability.md, "Credentials"). A
    file that cannot be read counts as allowed here: connecting reports it."""
    try:
        with open(str(auth_key_file), "rb") as f:
            text = f.read()
    except OSError:
        return True
    if not text.lstrip().startswith(b"{"):
        return True  # a raw pool key
    try:
        role = json.loads(text).get("role")
    except (ValueError, AttributeError):
        return True
    return isinstance(role, str) and role == "agent"


_master_alias_logged = False


def master_from_env(env: Mapping[str, str]) -> str:
    """The master addresses the environment names: ``KVPOOL_MASTER``, else the deprecated
    ``KVPOOL_MASTER_ADDR`` (warning that it is deprecated), else ""."""
    value = env.get(ENV_MASTER, "")
    if value.strip():
        return value
    old = env.get(ENV_MASTER_DEPRECATED, "")
    if not old.strip():
        return ""
    message = (
        f"{ENV_MASTER_DEPRECATED} is deprecated and will be removed in a later release; "
        f"set {ENV_MASTER} instead (the name the agent and the conductor read)"
    )
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    global _master_alias_logged
    if not _master_alias_logged:
        # DeprecationWarning is hidden by default outside __main__: say it once in the log.
        _master_alias_logged = True
        logging.getLogger("kvpool").warning("%s", message)
    return old


def engine_config(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The pool's engine.json named by the environment, or {} when none is named."""
    env = os.environ if env is None else env
    path = env.get(ENV_ENGINE_CONFIG) or env.get(ENV_MOONCAKE_CONFIG)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"engine config {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"engine config {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"engine config {path} must hold a JSON object")
    return data


def split_addrs(value: Any) -> List[str]:
    """Master addresses from a comma-separated string or a list."""
    if value is None:
        return []
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"master addresses must be a string or a list, got {type(value).__name__}")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"master address {item!r} is not a string")
        item = item.strip()
        if item:
            out.append(item)
    return out


@dataclass
class Settings:
    """What a store is set up with."""

    masters: List[str] = field(default_factory=list)
    auth_key_file: str = ""
    agent_socket: str = ""
    # "direct" or "agent" once resolved.
    mode: str = "direct"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    protocol: str = "tcp"
    request_timeout_ms: int = 10_000
    # Agent mode: where this engine runs (NUMA node of its memory, PCI bus id of its GPU);
    # the agent binds the staging area to that node and uses the NICs there.
    numa_node: Optional[int] = None
    gpu: Optional[str] = None

    @classmethod
    def resolve(
        cls,
        masters: Any = None,
        auth_key_file: Optional[str] = None,
        agent_socket: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        mode: Optional[str] = None,
        **rest: Any,
    ) -> "Settings":
        env = os.environ if env is None else env
        file_cfg = engine_config(env)
        resolved = split_addrs(masters)
        if not resolved:
            resolved = split_addrs(master_from_env(env))
        if not resolved:
            resolved = split_addrs(file_cfg.get("master_server_address"))
        key = auth_key_file or env.get(ENV_AUTH_KEY_FILE) or file_cfg.get("auth_key_file") or ""
        socket = agent_socket or env.get(ENV_AGENT_SOCKET) or file_cfg.get("agent_socket") or ""
        asked = mode or env.get(ENV_CLIENT_MODE) or "auto"
        lend = rest.get("global_segment_size", 0)
        if (lend and str(asked).strip().lower() == "auto"
                and choose_mode(asked, str(socket), 0) == "agent" and not may_lend(key)):
            # Engines configured the Mooncake way ask to lend memory; beside a node agent the
            # agent lends the node's memory, and an engine credential may not mount.
            logging.getLogger("kvpool").warning(
                "global_segment_size %d ignored: the credential in %s may not lend memory to "
                "the pool; the node agent at %s lends this node's memory (agent mode)",
                lend, key, socket)
            rest["global_segment_size"] = 0
        chosen = choose_mode(asked, str(socket), rest.get("global_segment_size", 0))
        settings = cls(
            masters=resolved, auth_key_file=str(key), agent_socket=str(socket), mode=chosen, **rest
        )
        settings.check()
        return settings

    def connect(self) -> "_native.Client":
        """A native client set up as these settings say."""
        from . import _native

        return _native.Client(
            self.masters,
            self.auth_key_file,
            local_hostname=self.local_hostname,
            global_segment_size=self.global_segment_size,
            protocol=self.protocol,
            request_timeout_ms=self.request_timeout_ms,
            mode=self.mode,
            agent_socket=self.agent_socket or None,
            staging_bytes=self.staging_bytes,
            numa_node=self.numa_node,
            gpu=self.gpu,
        )

    def check(self) -> None:
        if not isinstance(self.global_segment_size, int) or self.global_segment_size < 0:
            raise ConfigError(
                f"global_segment_size must be a non-negative integer, got {self.global_segment_size!r}"
            )
        if not isinstance(self.staging_bytes, int) or self.staging_bytes <= 0:
            raise ConfigError(f"staging_bytes must be a positive integer, got {self.staging_bytes!r}")
        if self.mode == "agent":
            if not self.agent_socket:
                raise ConfigError(
                    f"agent mode needs the node agent's socket: pass agent_socket, or set "
                    f"{ENV_AGENT_SOCKET} or {ENV_ENGINE_CONFIG}"
                )
            return
        if not self.masters:
            raise ConfigError(
                f"no master address: pass one, or set {ENV_MASTER} or {ENV_ENGINE_CONFIG}"
            )
        if not self.auth_key_file:
            raise ConfigError(
                f"no pool key: pass auth_key_file, or set {ENV_AUTH_KEY_FILE} or {ENV_ENGINE_CONFIG}"
            )
