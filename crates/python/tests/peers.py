"""Real Mooncake as the oracle of the conformance suite: a `mooncake_master` plus one holder.

`start_mooncake_pool(capacity_bytes, tmp_path)` starts, on 127.0.0.1 only, a real
`mooncake_master` (free RPC and metrics ports, log in `tmp_path/mooncake-master.log`) and one
holder process (`holder.py --module mooncake.store`, log in `tmp_path/mooncake-holder.log`)
that mounts `capacity_bytes` of global segment, waits until both are ready and yields a `Pool`.
Every process it started is killed on exit. `kvpool_pool.start_kvpool_pool` yields the same
`Pool` shape for kvpool, so the tests do not know which one they drive.

The master is started with `--default_kv_lease_ttl=LEASE_TTL_MS` so that the lease a get takes
expires quickly (Mooncake's default is 10 s in 0.3.13); the kvpool pool must use the same TTL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Optional

HOST = "127.0.0.1"
# Lease a get takes on an object (ms): remove() is refused with -706 until it expires.
LEASE_TTL_MS = 1000
LOCAL_BUFFER_SIZE = 16 << 20
HOLDER = Path(__file__).with_name("holder.py")
START_TIMEOUT_S = 30.0
# How long a holder gets to close() (hand its segment back) before it is killed.
HOLDER_GRACE_S = 10.0


class PeerStartError(RuntimeError):
    """A process of the pool failed to start; the message carries the tail of its log."""


def _venv_bin(name: str) -> str:
    """The executable `name` next to the running interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise PeerStartError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def peer_env() -> dict:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = HOST
    return env


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `sig` when the process that started it dies, so a
    crashed test run (Mooncake segfaults on some misuse) leaves no orphan behind. Linux only;
    elsewhere a no-op."""

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)

    return preexec


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def stop_process(proc: Optional[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; only ever the process this module started."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def wait_for(
    what: str, proc: subprocess.Popen, log: Path, ready: Callable[[], bool], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerStartError(
                f"{what} exited with {proc.returncode} before it was ready; "
                f"tail of {log}:\n{log_tail(log)}"
            )
        if ready():
            return
        time.sleep(0.05)
    raise PeerStartError(f"{what} not ready after {timeout_s:.0f}s; tail of {log}:\n{log_tail(log)}")


def start_holder(
    module_name: str, master_addr: str, size: int, log: Path, env: dict, timeout_s: float = 60.0
) -> subprocess.Popen:
    """Starts `holder.py --module module_name` and waits for its READY line (in `log`)."""
    start = log.stat().st_size if log.exists() else 0
    out = open(log, "ab")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-u", str(HOLDER), "--module", module_name,
             "--master", master_addr, "--size", str(size)],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    finally:
        out.close()

    def ready() -> bool:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if "SETUP_FAILED" in text:
            raise PeerStartError(f"holder ({module_name}) setup failed; tail of {log}:\n{log_tail(log)}")
        return any(line.startswith("READY") for line in text.splitlines())

    try:
        wait_for(f"holder ({module_name})", proc, log, ready, timeout_s)
    except BaseException:
        stop_process(proc)
        raise
    return proc


@dataclasses.dataclass
class Pool:
    """A running pool as the tests see it; the same shape for Mooncake and kvpool."""

    name: str
    module: ModuleType
    master_addr: str
    capacity: int
    _kill_master: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False)
    _restart_master: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False)
    _stores: list = dataclasses.field(default_factory=list, repr=False)

    def new_store(self):
        """A client set up against this pool that contributes no memory (global segment 0)."""
        store = self.module.MooncakeDistributedStore()
        rc = store.setup(HOST, "P2PHANDSHAKE", 0, LOCAL_BUFFER_SIZE, "tcp", "", self.master_addr)
        assert rc == 0, f"{self.name}: setup() of a client returned {rc}"
        self._stores.append(store)
        return store

    def kill_master(self) -> None:
        if self._kill_master is None:
            raise NotImplementedError(f"{self.name} pool cannot kill its master")
        self._kill_master()

    def restart_master(self) -> None:
        if self._restart_master is None:
            raise NotImplementedError(f"{self.name} pool cannot restart its master")
        self._restart_master()

    def close_stores(self) -> None:
        while self._stores:
            store = self._stores.pop()
            with contextlib.suppress(Exception):
                store.close()


class MasterProcess:
    """A master child process on a free loopback port, logging to `log`, restartable; the
    shared part of the Mooncake and the kvpool masters. Subclasses give `name`, `command()`
    and, when the open port is not enough, `ready()`."""

    name = "master"

    def __init__(self, log: Path, env: Optional[dict] = None):
        self.port = free_port()
        self.log = log
        self.env = env
        self.proc: Optional[subprocess.Popen] = None

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def command(self) -> list:
        raise NotImplementedError

    def ready(self) -> bool:
        return _port_open(self.port)

    def start(self) -> None:
        out = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, preexec_fn=die_with_parent(),
            )
        finally:
            out.close()
        wait_for(self.name, self.proc, self.log, self.ready, START_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        stop_process(self.proc)


class _Master(MasterProcess):
    name = "mooncake_master"

    def __init__(self, tmp_path: Path, env: dict):
        super().__init__(tmp_path / "mooncake-master.log", env)
        self.metrics_port = free_port()

    def command(self) -> list:
        return [
            _venv_bin("mooncake_master"),
            f"--rpc_address={HOST}",
            f"--port={self.port}",
            "--enable_http_metadata_server=false",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={LEASE_TTL_MS}",
            "--logtostderr=true",
        ]


@contextlib.contextmanager
def pool_with_holder(name: str, module_name: str, master, capacity_bytes: int,
                     holder_log: Path, env: dict) -> Iterator[Pool]:
    """Starts `master` (start(), addr, kill(), restart(), stop()) and one holder of
    `capacity_bytes` driving `module_name`; yields the `Pool`; stops both. The shared shape of
    the Mooncake and the kvpool pools."""
    module = importlib.import_module(module_name)
    holder: Optional[subprocess.Popen] = None
    pool: Optional[Pool] = None
    try:
        master.start()
        holder = start_holder(module_name, master.addr, capacity_bytes, holder_log, env)
        pool = Pool(name=name, module=module, master_addr=master.addr, capacity=capacity_bytes,
                    _kill_master=master.kill, _restart_master=master.restart)
        yield pool
    finally:
        if pool is not None:
            pool.close_stores()
        if holder is not None:
            with contextlib.suppress(OSError):
                holder.stdin.close()
            stop_process(holder, grace_s=HOLDER_GRACE_S)
        master.stop()


@contextlib.contextmanager
def start_mooncake_pool(capacity_bytes: int, tmp_path) -> Iterator[Pool]:
    """A real Mooncake pool of `capacity_bytes` on 127.0.0.1: master plus one holder."""
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = peer_env()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    with pool_with_holder("mooncake", "mooncake.store", _Master(tmp_path, env), capacity_bytes,
                          tmp_path / "mooncake-holder.log", env) as pool:
        yield pool
