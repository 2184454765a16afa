"""A real SGLang 0.5.23 server (``python -m sglang.launch_server``) on the CPU, for the tests.

``SglangServer`` launches the server in its own process group on 127.0.0.1 with the CPU
engine (``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native``), this
directory's ``cpu_shim`` on PYTHONPATH (the stand-in ``sgl_kernel`` and the HiCache shim,
README.md) and the environment's ``bin`` (ninja) on PATH; ``wait_ready`` waits until
``/health`` answers 200 (after SGLang's own warm-up request); ``stop`` (also the end of its
``with`` block) sends SIGTERM (SGLang's launcher then stops its scheduler and detokenizer),
then SIGKILL to the group if anything of it lingers. Its log is ``log``.

Every server of a test module runs the same model with the same settings, so greedy outputs
are comparable between them: float32 (so that prefilling a prompt in one pass and prefilling
only its last token after loading the rest from storage agree to well below the model's
logit gaps), pages of ``PAGE_SIZE`` tokens, and a small KV cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "cpu_shim"
HOST = "127.0.0.1"
PAGE_SIZE = 32
MAX_TOTAL_TOKENS = 4096
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0

# The dynamic backend flags of docs/engines.md ("SGLang").
BACKEND_CONFIG = {
    "backend_name": "kvpool",
    "module_path": "kvpool.adapters.sglang",
    "class_name": "KvpoolHiCacheStorage",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    keep = [ln for ln in text.splitlines() if "warnings.warn" not in ln]
    return "\n".join(keep[-lines:])


def hicache_flags(interface_v1: bool, extra: Optional[dict] = None) -> List[str]:
    """HiCache with kvpool's storage backend. ``direct`` I/O over the ``page_first_direct``
    host layout is the pair the CPU shim covers; ``wait_complete`` makes a request wait for its
    whole storage prefetch, so the hit a test asserts does not depend on timing."""
    config = dict(BACKEND_CONFIG)
    if interface_v1:
        config["interface_v1"] = 1
    config.update(extra or {})
    return [
        "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "page_first_direct",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(config),
    ]


class SglangServer:
    def __init__(self, model: Path, log: Path, flags: Sequence[str] = (),
                 env: Optional[Dict[str, str]] = None):
        self.model = Path(model)
        self.log = Path(log)
        self.flags = list(flags)
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.launched_at = 0.0

    def command(self) -> List[str]:
        return [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model),
            "--host", HOST, "--port", str(self.port),
            "--device", "cpu", "--attention-backend", "torch_native",
            "--dtype", "float32",
            "--page-size", str(PAGE_SIZE),
            "--max-total-tokens", str(MAX_TOTAL_TOKENS),
            "--enable-metrics",
            # The scheduler polls its queues non-stop by default, a whole core per idle server.
            "--sleep-on-idle",
            *self.flags,
        ]

    def environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p
        )
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env.update({
            "SGLANG_USE_CPU_ENGINE": "1",
            "KVPOOL_SGLANG_CPU_SHIM": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.extra_env)
        return env

    def launch(self) -> "SglangServer":
        """Start the server process; :meth:`wait_ready` waits for it to serve."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.environment(), start_new_session=True,
            )
        self.launched_at = time.monotonic()
        return self

    def wait_ready(self) -> "SglangServer":
        if self.proc is None:
            raise RuntimeError("the server was not launched")
        deadline = self.launched_at + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with {self.proc.returncode} before it was ready; "
                    f"tail of {self.log}:\n{log_tail(self.log)}"
                )
            if self._healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"SGLang server not ready after {START_TIMEOUT_S:.0f}s; tail of {self.log}:\n"
            f"{log_tail(self.log)}"
        )

    def start(self) -> "SglangServer":
        return self.launch().wait_ready()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # The launcher stops its children on SIGTERM; whatever of this server's own process
        # group is still there (it may have died first) goes now.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def __enter__(self) -> "SglangServer":
        """Launches the server (not waiting for it): a ``with`` block stops it at its end."""
        return self.launch()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- requests ---------------------------------------------------------------------------

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> dict:
        """Greedy generation of exactly ``max_new_tokens`` through SGLang's native
        ``/generate`` (token ids in, token ids and their log-probabilities out; ``meta_info``
        carries SGLang's cache accounting)."""
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
            "return_logprob": True,
        }
        req = urllib.request.Request(
            f"{self.url}/generate", data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)

    def metrics(self) -> Dict[str, float]:
        """SGLang's Prometheus counters, summed over their label sets, by metric name."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: Dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 120.0) -> float:
        deadline = time.monotonic() + timeout_s
        value = 0.0
        while time.monotonic() < deadline:
            value = self.metrics().get(name, 0.0)
            if value >= at_least:
                return value
            time.sleep(0.25)
        return value

