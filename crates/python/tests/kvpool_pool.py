"""kvpool's side of the differential suites: a real `kvpool master` plus one holder process.

`start_kvpool_pool(capacity_bytes, tmp_path)` starts, on 127.0.0.1 only, `kvpool master`
(the binary in `$KVPOOL_BIN`, else the workspace's `target/debug/kvpool`, else
`target/release/kvpool`) with the same read-lease TTL as the Mooncake pool, then the same
holder script the Mooncake pool uses (`holder.py --module kvpool.mooncake`), which contributes
`capacity_bytes` of its memory to the pool. It yields the `Pool` of `peers.py`, so a test
cannot tell which pool it drives. The pool key is a fresh file in `tmp_path`, handed to every
client through `KVPOOL_AUTH_KEY_FILE` (what the operator gives engine pods).

Also shared by the tests: `kvpool_up` runs `kvpool up --json` for the length of a `with`, and
`put_get_from_threads` drives one store from several threads at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from peers import (
    HOST,
    LEASE_TTL_MS,
    MasterProcess,
    START_TIMEOUT_S,
    Pool,
    PeerStartError,
    free_port,
    pool_with_holder,
    stop_process,
    wait_for,
)

REPO = Path(__file__).resolve().parents[3]


def kvpool_binary() -> Path:
    """The kvpool executable the tests run."""
    explicit = os.environ.get("KVPOOL_BIN")
    if explicit:
        return Path(explicit)
    for profile in ("debug", "release"):
        candidate = REPO / "target" / profile / "kvpool"
        if candidate.exists():
            return candidate
    raise PeerStartError(
        f"no kvpool binary: build it (cargo build) or set KVPOOL_BIN; looked in {REPO / 'target'}"
    )


@contextlib.contextmanager
def kvpool_up(tmp: Path, *flags: str) -> Iterator[dict]:
    """`kvpool up --json` with `flags`, its directory `tmp/up` and its log `tmp/up.log`: yields
    the line it prints once ready (parsed). On exit it is stopped with SIGTERM and must exit 0
    (the assertion quotes the end of its log and names its children's logs)."""
    log_path = tmp / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [str(kvpool_binary()), "up", "--json", "--dir", str(tmp / "up"), *flags],
            stdout=subprocess.PIPE,
            stderr=log,
        )
        try:
            line = up.stdout.readline()
            assert line, f"kvpool up exited ({up.poll()}) before it was ready: {log_path}"
            yield json.loads(line)
        finally:
            up.send_signal(signal.SIGTERM)
            code = up.wait(timeout=60)
    tail = log_path.read_text(errors="replace").splitlines()[-30:]
    logs = tmp / "up" / "logs"
    assert code == 0, f"kvpool up exited {code} after SIGTERM; its log ends:\n" + "\n".join(
        tail) + f"\nchildren's logs: {sorted(p.name for p in logs.glob('*'))} in {logs}"


def put_get_from_threads(store, prefix: str, rounds: int, size: int, threads: int = 8) -> list:
    """Thread `t` of `threads`, all at once on `store`, puts `rounds` values of `size + t`
    random bytes under fresh keys of `prefix` and gets each back, which must equal it. Returns
    the exceptions met (each thread stops at its first): a passing run returns `[]`."""
    errors = []

    def worker(t: int) -> None:
        try:
            for i in range(rounds):
                k = f"{prefix}/{t}/{i}/{secrets.token_hex(2)}"
                v = os.urandom(size + t)
                store.put(k, v)
                assert store.get(k) == v
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    started = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in started:
        th.start()
    for th in started:
        th.join()
    return errors


def _ready(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{admin_port}/readyz", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


class KvpoolMaster(MasterProcess):
    """`kvpool master` on free loopback ports; restartable."""

    name = "kvpool master"

    def __init__(self, tmp_path: Path, key_file: Path, extra: Optional[list] = None):
        super().__init__(tmp_path / "kvpool-master.log")
        self.admin_port = free_port()
        self.key_file = key_file
        self.extra = list(extra or [])

    def command(self) -> list:
        return [
            str(kvpool_binary()),
            "master",
            "--listen",
            self.addr,
            "--admin-addr",
            f"{HOST}:{self.admin_port}",
            "--auth-key-file",
            str(self.key_file),
            "--lease-ttl",
            f"{LEASE_TTL_MS}ms",
            *self.extra,
        ]

    def ready(self) -> bool:
        return _ready(self.admin_port)


# Variables a kvpool role reads as defaults of its flags: a child must not inherit them (as the
# harness's `CLEARED_ENV`).
CLEARED_ENV = (
    "KVPOOL_MASTER",
    "KVPOOL_AUTH_KEY_FILE",
    "KVPOOL_AGENT_SOCKET",
    "KVPOOL_MODEL_CONFIG",
    "KVPOOL_KV_BYTES_PER_TOKEN",
    "POD_IP",
)


class KvpoolAgent:
    """`kvpool agent run` in pool mode behind `master_addr`: a DRAM tier of `dram`, its engine
    socket in `dir/run` (keep `dir` short: a Unix socket path holds 107 bytes), admin on a free
    loopback port, transport on 127.0.0.1. Ready once `/readyz` answers (it has joined the
    pool)."""

    def __init__(self, dir: Path, master_addr: str, key_file: Path, name: str = "py-agent",
                 dram: str = "64MiB"):
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "run" / "agent.sock"
        self.admin_port = free_port()
        self.log = self.dir / "agent.log"
        self.config = self.dir / "agent.yaml"
        self.config.write_text(
            f"node_name: {name}\n"
            f"dram:\n  capacity: {dram}\n  lock: false\n"
            f"engine_api:\n  socket_dir: {self.dir / 'run'}\n"
            f"admin:\n  listen: {HOST}:{self.admin_port}\n"
            f"pool:\n  master: [\"{master_addr}\"]\n  auth_key_file: {key_file}\n"
            f"  transport_listen: {HOST}:0\n  heartbeat_interval: 500ms\n"
        )
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "KvpoolAgent":
        env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
        out = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                [str(kvpool_binary()), "agent", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        finally:
            out.close()
        wait_for("kvpool agent", self.proc, self.log,
                 lambda: self.socket.exists() and _ready(self.admin_port), START_TIMEOUT_S)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc)


def write_key(path: Path) -> Path:
    path.write_bytes(secrets.token_hex(32).encode())
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def start_kvpool_pool(capacity_bytes: int, tmp_path) -> Iterator[Pool]:
    """A kvpool pool of `capacity_bytes` on 127.0.0.1: master plus one holder process."""
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    key = write_key(tmp_path / "pool.key")
    saved = os.environ.get("KVPOOL_AUTH_KEY_FILE")
    os.environ["KVPOOL_AUTH_KEY_FILE"] = str(key)
    env = dict(os.environ)
    try:
        with pool_with_holder("kvpool", "kvpool.mooncake", KvpoolMaster(tmp_path, key),
                              capacity_bytes, tmp_path / "kvpool-holder.log", env) as pool:
            yield pool
    finally:
        if saved is None:
            os.environ.pop("KVPOOL_AUTH_KEY_FILE", None)
        else:
            os.environ["KVPOOL_AUTH_KEY_FILE"] = saved
