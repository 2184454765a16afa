"""The driver of `kvpool bench engine`: real vLLM engines (the same model, settings and prompts)
with each store, time to first token of a prefix loaded from the store into a fresh engine,
against vLLM's own prefix-cache hit and against recomputing it, plus a shared-prefix
throughput workload. Run with the vLLM venv's Python.

    python engine.py run --config CONFIG.json      (what `kvpool bench engine` runs)
    python engine.py holder --master HOST:PORT --size BYTES   (a Mooncake Store holder)

Arms (each: a writer engine A and a reader engine B, both with the arm's connector; `none`:
B alone, without a KV connector):

- `kvpool`: kvpool's own connector (`kvpool.adapters.vllm.KvpoolStoreConnector`, the default
  implementation), its store in `client_mode` (direct by default: the engine's client reads the
  node agent's memory over kvpool's transfer engine, as Mooncake's client reads its holder's);
- `kvpool-agent`: the same connector through the node agent's engine socket (agent mode, what
  the operator sets up on a kvpool node);
- `kvpool-engine`: vLLM's own `MooncakeStoreConnector` on the kvpool pool (the same class
  name with `KVPOOL_VLLM_CONNECTOR=engine`);
- `mooncake`: vLLM's own `MooncakeStoreConnector` on real Mooncake Store (a `mooncake_master`
  and one holder process contributing memory, started here with the config's `mooncake_env`,
  e.g. its huge-page settings; `mooncake` importable from the `--mooncake-path` directory);
- `none`: no KV connector.

Every engine gets the same thread settings (`VLLM_CPU_OMP_THREADS_BIND=nobind`,
`OMP_NUM_THREADS`, `VLLM_CPU_NUM_OF_RESERVED_CPU`), KV cache size and allocator setting
(`engine_thp`: PyTorch's `THP_MEM_ALLOC_ENABLE`), so greedy outputs and speed compare. The arms run in groups (`groups` in the config), one group after the other: a
group's engines start at once and stay up while its TTFT rounds interleave its arms (the arm
order rotates each round), so the arms of a group see the machine's load of the same minutes.
Every prompt is drawn once from the seed, so every arm gets the same ones. Per round, one
random-token prefix (a whole number of blocks): A computes prefix + a suffix (its connector
saves the prefix), the driver waits until the store's key count has settled, then B gets
prefix + a fresh suffix (streamed: TTFT of the store-loaded prefix, or of recomputing it for
`none`) and then prefix + another fresh suffix (vLLM's own prefix-cache hit). With
`warm_first` (the default), B first serves a short prompt of its own (under one block: nothing
to load, save or hit), so that the first request finds the engine as steady traffic keeps it,
not after the settle wait's idle second, as the hit right after it does; with
`idle_hit_s` > 0, after that much idle time, prefix + a third suffix (the same hit on KV cache
memory that sat idle: on a virtual machine whose host reclaims idle guest memory, what a
first request's load also pays, `kvpool bench idle-memory`). vLLM's
`vllm:prompt_tokens_by_source_total` on B, read before and after each request, says where the
prompt tokens came from; greedy token ids go into the report. The throughput phase then sends,
per arm in turn, N concurrent requests over a few new shared prefixes (stored beforehand by A)
to B. One JSON object on stdout.

With `"engine": "sglang"` in the config the engines are SGLang servers with HiCache instead
(engine_sglang.py, beside this file); everything else here is the same.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

HOST = "127.0.0.1"
ARMS = ("kvpool", "kvpool-agent", "kvpool-engine", "mooncake", "none")
KVPOOL_ARMS = ("kvpool", "kvpool-agent", "kvpool-engine")
MODEL_NAME = "bench"


def log(msg: str) -> None:
    print(f"[engine.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A free port below the ephemeral range (vLLM's processes bind many port-0 sockets while
    they start; the same rule as the tests' conftest)."""
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
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        os.setpgrp()

    return preexec


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the child's process group (vLLM's engine core and workers too), then
    SIGKILL after `grace`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def scrape(url: str) -> Dict[str, float]:
    """Prometheus samples of `url`, `name{labels}` -> value."""
    with urllib.request.urlopen(url, timeout=30) as r:
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
    out = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for k, v in scrape(f"{base}/metrics").items():
        if k.startswith("vllm:prompt_tokens_by_source_total{") and 'source="' in k:
            src = k.split('source="')[1].split('"')[0]
            out[src] = out.get(src, 0.0) + v
    return out


def diff(after: Dict[str, float], before: Dict[str, float]) -> Dict[str, int]:
    return {k: int(round(after.get(k, 0.0) - before.get(k, 0.0))) for k in after}


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def sse_chunks(base: str, path: str, body: Dict[str, Any],
               timeout: float = 600) -> Iterator[Dict[str, Any]]:
    """POST `body` as JSON to `base` + `path` and yield each server-sent event's JSON object
    until `[DONE]` or the end of the response. The request is sent when iteration starts."""
    host, port = base.rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body).encode(),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            raise RuntimeError(f"{base}: HTTP {resp.status}: {text[:500]}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            yield json.loads(data)
    finally:
        conn.close()


def stream(base: str, prompt: List[int], max_tokens: int, timeout: float = 600) -> Dict[str, Any]:
    """One streamed greedy completion of a token-id prompt: client-side TTFT (send to the
    first chunk carrying a token), end-to-end time, the token ids and the usage."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    ttft: Optional[float] = None
    ids: List[int] = []
    usage: Dict[str, Any] = {}
    t0 = time.perf_counter()
    for chunk in sse_chunks(base, "/v1/completions", body, timeout):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            got = choice.get("token_ids") or []
            if (got or choice.get("text")) and ttft is None:
                ttft = time.perf_counter() - t0
            ids.extend(int(t) for t in got)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "ids": ids,
            "usage": usage}


class VllmFlavor:
    """How the driver talks to vLLM: the engines, one request with the sources of its prompt
    tokens (vLLM's counters read before and after it), and the version."""

    name = "vllm"
    # What engine B's log says about its connector (the first match is reported).
    connector_needles = ("kvpool: ", "Mooncake mode=", "KV connector")

    @staticmethod
    def engine(cfg: Dict[str, Any], arm: str, role: str,
               mooncake: Optional["MooncakePool"]) -> "Engine":
        return Engine(cfg, arm, role, mooncake)

    @staticmethod
    def request(base: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
        before = by_source(base)
        got = stream(base, prompt, max_tokens)
        got["sources"] = diff(by_source(base), before)
        return got

    @staticmethod
    def concurrent(base: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
        """One request of several in flight (its sources are the phase's, see `phase_sources`)."""
        return stream(base, prompt, max_tokens)

    @staticmethod
    def snapshot(base: str) -> Dict[str, float]:
        return by_source(base)

    @staticmethod
    def phase_sources(base: str, before: Dict[str, float],
                      results: List[Dict[str, Any]]) -> Dict[str, int]:
        return diff(by_source(base), before)

    @staticmethod
    def version() -> str:
        return vllm_version()


# ---------------------------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------------------------


class MooncakePool:
    """A fresh `mooncake_master` and one holder process (this script, `holder` mode)
    contributing `capacity` bytes, as Mooncake Store is deployed beside engines that
    contribute none (`standalone-store`)."""

    def __init__(self, path: str, capacity: int, logs: str,
                 holder_env: Optional[Dict[str, str]] = None):
        self.procs: List[subprocess.Popen] = []
        self.path = path
        self.port = free_port()
        self.metrics_port = free_port()
        master_bin = os.path.join(path, "mooncake", "mooncake_master")
        mlog = os.path.join(logs, "mooncake-master.log")
        with open(mlog, "ab") as out:
            master = subprocess.Popen(
                [master_bin, f"--rpc_address={HOST}", f"--port={self.port}",
                 "--enable_http_metadata_server=false", f"--metrics_port={self.metrics_port}",
                 "--logtostderr=true"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent())
        self.procs.append(master)
        wait_until("mooncake_master", master, mlog, lambda: port_open(self.port))
        self.addr = f"{HOST}:{self.port}"
        hlog = os.path.join(logs, "mooncake-holder.log")
        env = dict(os.environ, PYTHONPATH=path, MC_TCP_BIND_ADDRESS=HOST)
        env.update(holder_env or {})
        with open(hlog, "ab") as out:
            holder = subprocess.Popen(
                [sys.executable, "-u", os.path.abspath(__file__), "holder", "--master",
                 self.addr, "--size", str(capacity)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=die_with_parent())
        self.procs.append(holder)

        def ready() -> bool:
            text = tail(hlog, 1 << 16)
            if "SETUP_FAILED" in text:
                raise RuntimeError(f"Mooncake holder setup failed: {text}")
            return "READY" in text

        wait_until("Mooncake holder", holder, hlog, ready)

    def count(self) -> float:
        return scrape(f"http://{HOST}:{self.metrics_port}/metrics").get("master_key_count", 0.0)

    def version(self) -> str:
        try:
            import importlib.metadata as m

            for d in m.distributions(path=[self.path]):
                if d.metadata["Name"] == "mooncake-transfer-engine-non-cuda":
                    return d.version
        except Exception:  # noqa: BLE001 - the version is informative only
            pass
        return "?"

    def close(self) -> None:
        for p in reversed(self.procs):
            stop(p, 8)


def wait_until(what: str, proc: subprocess.Popen, logpath: str, ready: Callable[[], bool],
               timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {tail(logpath)}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s: {tail(logpath)}")


def holder(args) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", args.size, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        print(f"SETUP_FAILED setup() returned {rc}", flush=True)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("READY", flush=True)
    while not done.wait(0.2):
        pass
    store.close()
    return 0


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def engine_thp(env: Dict[str, str], cfg: Dict[str, Any]) -> None:
    """PyTorch's huge-page allocations (`engine_thp`) on or off, for every engine alike."""
    if cfg.get("engine_thp"):
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    else:
        env.pop("THP_MEM_ALLOC_ENABLE", None)


def kvpool_env(env: Dict[str, str], pool: Dict[str, Any], arm: str) -> None:
    """How a kvpool arm's engine reaches the pool. `kvpool-agent` goes through the node
    agent's socket (the operator's setting on a kvpool node); the others use `client_mode`
    (direct: the engine's client reads the agent's memory over kvpool's transfer engine, as
    Mooncake's reads its holder's)."""
    mode = "agent" if arm == "kvpool-agent" else pool["client_mode"]
    env.update(KVPOOL_MASTER=pool["master"], KVPOOL_AUTH_KEY_FILE=pool["key_file"],
               KVPOOL_CLIENT_MODE=mode)
    if mode == "agent":
        env["KVPOOL_AGENT_SOCKET"] = pool["agent_socket"]


class Served:
    """An engine server process (`proc`, `name`, `log`, `base` set by the subclass)."""

    proc: subprocess.Popen
    name: str
    log: str
    base: str

    def ready(self) -> bool:
        """Whether it answers /health; raises when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.returncode}); "
                               f"log {self.log}:\n{tail(self.log)}")
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False


class Engine(Served):
    """One `vllm serve` (through `kvpool.vllm_serve`) of an arm, role `a` (writer) or `b`."""

    def __init__(self, cfg: Dict[str, Any], arm: str, role: str, mooncake: Optional[MooncakePool]):
        self.arm, self.role = arm, role
        self.name = f"{arm}-{role}"
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        logs = cfg["logs"]
        self.log = os.path.join(logs, f"vllm-{self.name}.log")
        # vLLM's IPC sockets live here: a short path (a socket path holds 107 bytes at most).
        self.rpc_dir = tempfile.mkdtemp(prefix=f"kvb-{self.name}-")
        rpc_dir = self.rpc_dir
        env = dict(os.environ)
        for k in ("KVPOOL_AGENT_SOCKET", "KVPOOL_MASTER", "KVPOOL_AUTH_KEY_FILE",
                  "KVPOOL_VLLM_CONNECTOR", "MOONCAKE_CONFIG_PATH", "KVPOOL_CLIENT_MODE",
                  "VLLM_CPU_KVCACHE_SPACE"):
            env.pop(k, None)
        threads = str(cfg["omp_threads"])
        env.update(PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_TARGET_DEVICE="cpu",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=threads,
                   VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_HOST_IP=HOST,
                   VLLM_RPC_BASE_PATH=rpc_dir, PYTHONUNBUFFERED="1")
        engine_thp(env, cfg)
        path = [p for p in (cfg.get("kvpool_package"),) if p]
        extra: Dict[str, Any] = {}
        ktc: Optional[Dict[str, Any]] = None
        if arm in KVPOOL_ARMS:
            pool = cfg["kvpool"]
            kvpool_env(env, pool, arm)
            env["KVPOOL_VLLM_CONNECTOR"] = "engine" if arm == "kvpool-engine" else "kvpool"
            if arm != "kvpool-engine":
                # Its own key namespace: both arms of kvpool's connector get the same prompts
                # in the same pool.
                extra["cache_prefix"] = arm
                extra["kvpool_layerwise_load"] = pool.get("layerwise_load", "auto")
                extra["kvpool_early_load"] = pool.get("early_load", "auto")
            if arm == "kvpool-engine":
                # vLLM's connector asks for 4 GiB of local buffer by default.
                extra["local_buffer_size"] = cfg["local_buffer"]
            ktc = {"kv_connector": "KvpoolStoreConnector",
                   "kv_connector_module_path": "kvpool.adapters.vllm", "kv_role": "kv_both"}
        elif arm == "mooncake":
            assert mooncake is not None
            conf = os.path.join(logs, f"mooncake-{self.name}.json")
            with open(conf, "w") as f:
                json.dump({"master_server_address": mooncake.addr,
                           "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                           "device_name": "", "mode": "standalone-store",
                           "global_segment_size": 0,
                           "local_buffer_size": cfg["local_buffer"]}, f)
            path.append(mooncake.path)
            env.update(MOONCAKE_CONFIG_PATH=conf, MC_TCP_BIND_ADDRESS=HOST,
                       MOONCAKE_REQUESTER_LOCAL_HOSTNAME=HOST)
            ktc = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        if ktc is not None and arm in ("kvpool-engine", "mooncake"):
            # Its own lookup socket per engine (vLLM names it by host and this number only).
            extra["lookup_rpc_port"] = self.port
        if ktc is not None and extra:
            ktc["kv_connector_extra_config"] = extra
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep)
        cmd = [sys.executable, "-m", "kvpool.vllm_serve", cfg["model"],
               "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(self.port),
               "--block-size", str(cfg["block_size"]),
               "--prefix-caching-hash-algo", "sha256_cbor", "--max-model-len",
               str(cfg["max_model_len"]), "--enable-prompt-tokens-details",
               "--disable-uvicorn-access-log", "--seed", "0",
               "--kv-cache-memory-bytes", str(cfg["kv_cache_bytes"])]
        if ktc is not None:
            cmd += ["--kv-transfer-config", json.dumps(ktc)]
        self.cmd = cmd
        out = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     cwd=logs, preexec_fn=die_with_parent())
        out.close()

    def close(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.rpc_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------------------------


def tokens(rng: random.Random, n: int, vocab: int) -> List[int]:
    # Ids 0-2 are the model's special tokens (scripts/make-models.py); skip a few more.
    return [rng.randrange(8, vocab) for _ in range(n)]


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    i = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[i]


def summary(xs: List[float]) -> Dict[str, Any]:
    ms = [x * 1000.0 for x in xs]
    return {"n": len(ms), "median_ms": statistics.median(ms) if ms else 0.0,
            "p90_ms": pct(ms, 0.9), "min_ms": min(ms) if ms else 0.0,
            "mean_ms": statistics.fmean(ms) if ms else 0.0, "samples_ms": ms}


class Prompts:
    """Every prompt of the run, drawn once from the seed, so that every arm (whichever group
    it runs in) gets the same ones."""

    def __init__(self, cfg: Dict[str, Any]):
        rng = random.Random(cfg["seed"])
        vocab, plen, slen, bs = cfg["vocab"], cfg["prefix_tokens"], cfg["suffix_tokens"], \
            cfg["block_size"]
        self.warm_engine = [tokens(rng, 3 * bs + 5, vocab) for _ in range(2)]
        wp = tokens(rng, plen, vocab)
        self.warm_store = (wp + tokens(rng, slen, vocab), wp + tokens(rng, slen, vocab))
        self.rounds = []
        for _ in range(cfg["repeats"]):
            p = tokens(rng, plen, vocab)
            self.rounds.append(tuple(p + tokens(rng, slen, vocab) for _ in range(3)))
        # The idle hits' suffixes from a generator of their own: every other prompt stays
        # what it was before they existed.
        irng = random.Random(cfg["seed"] + 1)
        self.idle_hits = [r[0][:plen] + tokens(irng, slen, vocab) for r in self.rounds]
        # The warm requests' prompts too (shorter than a block: no block to load or save).
        wrng = random.Random(cfg["seed"] + 2)
        self.warm_first = [tokens(wrng, max(1, bs // 2), vocab) for _ in self.rounds]
        self.tp_prefixes = [tokens(rng, plen, vocab) for _ in range(cfg["tp_prefixes"])]
        self.tp_writes = [p + tokens(rng, slen, vocab) for p in self.tp_prefixes]
        self.tp_prompts = [p + tokens(rng, slen, vocab) for p in self.tp_prefixes
                           for _ in range(cfg["tp_per_prefix"])]
        rng.shuffle(self.tp_prompts)


class Run:
    """The arms of one group: their engines all up at once, the TTFT rounds interleaved."""

    def __init__(self, cfg: Dict[str, Any], arms: List[str], prompts: Prompts,
                 mooncake: Optional[MooncakePool], flavor: Any = VllmFlavor):
        self.cfg = cfg
        self.flavor = flavor
        self.arms = arms
        self.prompts = prompts
        self.mooncake = mooncake
        self.engines: Dict[Tuple[str, str], Engine] = {}
        self.master_metrics = cfg.get("kvpool", {}).get("master_metrics")
        self.startup_s = 0.0
        self.idle_s = float(cfg.get("idle_hit_s", 0.0))

    def store_count(self, arm: str) -> float:
        if arm in KVPOOL_ARMS:
            return scrape(self.master_metrics).get("kvpool_master_objects", 0.0)
        if arm == "mooncake" and self.mooncake is not None:
            return self.mooncake.count()
        return 0.0

    def settle(self, arm: str, before: float) -> Dict[str, Any]:
        """Wait until the arm's store holds more keys than `before` and the count has not
        changed for `settle_s` (vLLM's connector saves on background threads)."""
        if arm == "none":
            return {"keys": 0, "waited_s": 0.0}
        t0 = time.monotonic()
        deadline = t0 + self.cfg["settle_timeout_s"]
        last, since = self.store_count(arm), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.store_count(arm)
            if now != last:
                last, since = now, time.monotonic()
            elif now > before and time.monotonic() - since >= self.cfg["settle_s"]:
                break
        return {"keys": int(last - before), "waited_s": time.monotonic() - t0}

    def start(self) -> None:
        cfg = self.cfg
        for arm in self.arms:
            roles = ("b",) if arm == "none" else ("a", "b")
            for role in roles:
                self.engines[(arm, role)] = self.flavor.engine(cfg, arm, role, self.mooncake)
        t0 = time.monotonic()
        pending = dict(self.engines)
        while pending:
            if time.monotonic() - t0 > cfg["start_timeout_s"]:
                raise RuntimeError(f"engines not ready in {cfg['start_timeout_s']} s: "
                                   f"{sorted(e.name for e in pending.values())}")
            for key, e in list(pending.items()):
                if e.ready():
                    log(f"engine {e.name} ready after {time.monotonic() - t0:.0f} s")
                    del pending[key]
            time.sleep(1)
        self.startup_s = time.monotonic() - t0

    def close(self) -> None:
        for e in self.engines.values():
            e.close()

    def connector_line(self, arm: str) -> str:
        """What the arm's engine B says in its log about its connector, as evidence."""
        describe = getattr(self.flavor, "describe", None)
        said = describe(self.engines[(arm, "b")].base) if describe else ""
        if said:
            return said
        text = tail(self.engines[(arm, "b")].log, 1 << 22)
        for needle in self.flavor.connector_needles:
            hit = [ln for ln in text.splitlines() if needle in ln]
            if hit:
                return hit[0][-300:]
        return ""

    def warm_up(self) -> None:
        """Every engine computes two short prompts, and every store arm moves one prefix
        A -> B once, outside the timing (first calls open connections and compile)."""
        for p in self.prompts.warm_engine:
            for e in self.engines.values():
                self.flavor.request(e.base, p, 2)
        w, x = self.prompts.warm_store
        for arm in self.arms:
            if arm == "none":
                continue
            before = self.store_count(arm)
            self.flavor.request(self.engines[(arm, "a")].base, w, 1)
            self.settle(arm, before)
            self.flavor.request(self.engines[(arm, "b")].base, x, 2)

    def ttft_rounds(self) -> Dict[str, Dict[str, Any]]:
        cfg = self.cfg
        per_arm: Dict[str, Dict[str, Any]] = {
            a: {"loaded_s": [], "hit_s": [], "sources_loaded": [], "sources_hit": [],
                "settle": [], "ids_loaded": [], "ids_hit": [], "idle_hit_s": [],
                "sources_idle_hit": [], "ids_idle_hit": [], "warm_s": [],
                "sources_warm": []} for a in self.arms}
        idle = self.idle_s
        warm_first = bool(cfg.get("warm_first", False))
        for r, (w, x, y) in enumerate(self.prompts.rounds):
            k = r % len(self.arms)
            for arm in self.arms[k:] + self.arms[:k]:
                rec = per_arm[arm]
                if arm != "none":
                    before = self.store_count(arm)
                    self.flavor.request(self.engines[(arm, "a")].base, w, 1)
                    rec["settle"].append(self.settle(arm, before))
                b = self.engines[(arm, "b")].base
                if warm_first:
                    warm = self.flavor.request(b, self.prompts.warm_first[r], 1)
                    rec["warm_s"].append(warm["ttft_s"])
                    rec["sources_warm"].append(warm["sources"])
                got = self.flavor.request(b, x, cfg["max_tokens"])
                hit = self.flavor.request(b, y, cfg["max_tokens"])
                rec["loaded_s"].append(got["ttft_s"])
                rec["hit_s"].append(hit["ttft_s"])
                rec["sources_loaded"].append(got["sources"])
                rec["sources_hit"].append(hit["sources"])
                rec["ids_loaded"].append(got["ids"])
                rec["ids_hit"].append(hit["ids"])
                if idle > 0:
                    time.sleep(idle)
                    late = self.flavor.request(b, self.prompts.idle_hits[r], cfg["max_tokens"])
                    rec["idle_hit_s"].append(late["ttft_s"])
                    rec["sources_idle_hit"].append(late["sources"])
                    rec["ids_idle_hit"].append(late["ids"])
            log(f"round {r + 1}/{len(self.prompts.rounds)} (first/hit TTFT): " + ", ".join(
                f"{a} {per_arm[a]['loaded_s'][-1] * 1000:.0f}/"
                f"{per_arm[a]['hit_s'][-1] * 1000:.0f} ms" for a in self.arms))
        return per_arm

    def throughput(self, arm: str) -> Dict[str, Any]:
        cfg = self.cfg
        prompts = self.prompts.tp_prompts
        if arm != "none":
            a = self.engines[(arm, "a")].base
            before = self.store_count(arm)
            for p in self.prompts.tp_writes:
                self.flavor.request(a, p, 1)
            self.settle(arm, before)
        b = self.engines[(arm, "b")].base
        s0 = self.flavor.snapshot(b)
        results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)
        errors: List[str] = []

        def one(i: int) -> None:
            try:
                results[i] = self.flavor.concurrent(b, prompts[i], cfg["tp_max_tokens"])
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(str(e))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        done = [r for r in results if r is not None]
        out_tokens = sum(len(r["ids"]) for r in done)
        ttfts = [r["ttft_s"] for r in done]
        out = {"requests": len(prompts), "completed": len(done), "errors": errors[:3],
               "wall_s": wall, "output_tokens": out_tokens,
               "output_tok_per_s": out_tokens / wall if wall > 0 else 0.0,
               "mean_ttft_ms": statistics.fmean(ttfts) * 1000 if ttfts else 0.0,
               "sources": self.flavor.phase_sources(b, s0, done)}
        log(f"throughput {arm}: {out['output_tok_per_s']:.1f} tok/s, mean TTFT "
            f"{out['mean_ttft_ms']:.0f} ms")
        return out

    def measure(self) -> List[Dict[str, Any]]:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        self.start()
        try:
            log(f"arms {', '.join(self.arms)}: warm-up")
            self.warm_up()
            log("TTFT rounds")
            rounds = self.ttft_rounds()
            tp = {a: self.throughput(a) for a in self.arms} if self.prompts.tp_prompts else {}
            lines = {a: self.connector_line(a) for a in self.arms}
            thp = {a: anon_huge_mib(self.engines[(a, "b")].proc.pid) for a in self.arms}
        finally:
            self.close()
        load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
        out = []
        for arm in self.arms:
            r = rounds[arm]
            out.append({
                "arm": arm, "group": list(self.arms), "startup_s": self.startup_s,
                "load_average": f"{load} before, {load_after} after",
                "connector_line": lines[arm],
                "loaded": summary(r["loaded_s"]), "hit": summary(r["hit_s"]),
                "idle_hit": summary(r["idle_hit_s"]) if r["idle_hit_s"] else None,
                "idle_hit_after_s": self.idle_s,
                "sources_idle_hit": r["sources_idle_hit"], "ids_idle_hit": r["ids_idle_hit"],
                "warm": summary(r["warm_s"]) if r["warm_s"] else None,
                "sources_warm": r["sources_warm"],
                "sources_loaded": r["sources_loaded"], "sources_hit": r["sources_hit"],
                "settle": r["settle"], "ids_loaded": r["ids_loaded"], "ids_hit": r["ids_hit"],
                "throughput": tp.get(arm), "reader_thp_mib": thp[arm]})
        return out


def anon_huge_mib(pid: int) -> Optional[float]:
    """MiB of transparent huge pages (AnonHugePages) that process `pid` and its descendants
    have mapped, from /proc; None where /proc says nothing of it."""
    total, seen, todo = 0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("AnonHugePages:"):
                        total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
            continue
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            tasks = []
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                pass
    return total / 1024


def vllm_version() -> str:
    """The installed vLLM's version, without importing it (the driver stays small)."""
    import importlib.metadata as m

    for name in ("vllm", "vllm-cpu"):
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            continue
    return "?"


def run(args) -> int:
    with open(args.config) as f:
        cfg = json.load(f)
    groups: List[List[str]] = cfg["groups"]
    unknown = [a for g in groups for a in g if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {ARMS}")
    with open(os.path.join(cfg["model"], "config.json")) as f:
        cfg["vocab"] = int(json.load(f)["vocab_size"])
    prompts = Prompts(cfg)
    flavor: Any = VllmFlavor
    if cfg.get("engine", "vllm") == "sglang":
        # Beside this script (the binary writes both).
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from engine_sglang import SglangFlavor

        flavor = SglangFlavor
    result: Dict[str, Any] = {"engine": flavor.name, "version": flavor.version(), "arms": []}
    mooncake = None
    try:
        if any("mooncake" in g for g in groups):
            mooncake = MooncakePool(cfg["mooncake_path"], cfg["mooncake_capacity"],
                                    cfg["logs"], cfg.get("mooncake_env"))
            result["mooncake"] = mooncake.version()
            log(f"Mooncake master at {mooncake.addr}")
        for group in groups:
            result["arms"].extend(Run(cfg, group, prompts, mooncake, flavor).measure())
    finally:
        if mooncake is not None:
            mooncake.close()
    print(json.dumps(result), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    h = sub.add_parser("holder")
    h.add_argument("--master", required=True)
    h.add_argument("--size", type=int, required=True)
    args = ap.parse_args()
    if args.cmd == "holder":
        return holder(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
