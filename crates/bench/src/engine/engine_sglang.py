"""SGLang for `kvpool bench engine --engine sglang` (imported by engine.py, written beside it):
real SGLang servers (`python -m sglang.launch_server` on the CPU, with the stand-in kernels of
tests/engines/sglang/cpu_shim) with HiCache on each store, and what SGLang itself says about
where each request's prompt tokens came from.

Arms (the same names as vLLM's):

- `kvpool`: HiCache's storage tier is kvpool's backend (`KvpoolHiCacheStorage`, dynamic
  backend, zero-copy page path `interface_v1`), kvpool's own implementation, its store in the
  run's `client_mode`;
- `kvpool-agent`: the same through the node agent's socket;
- `kvpool-engine`: SGLang's own Mooncake backend code on kvpool's store module
  (`KVPOOL_SGLANG_BACKEND=engine`);
- `mooncake`: SGLang's own `mooncake` backend on real Mooncake Store (the run's master and
  holder);
- `none`: no HiCache (SGLang's radix cache only).

Every server gets the same model, float32 (greedy outputs equal across arms), page size (the
run's block size), KV cache size, thread count and `--sleep-on-idle` (an idle scheduler would
otherwise poll a whole core). Store arms use HiCache with `direct` I/O over the
`page_first_direct` host layout and the `wait_complete` prefetch policy: a request whose
prefix is in storage waits until its pages are loaded, so the loaded TTFT includes the whole
load, as vLLM's does.

A request's sources come from its own `meta_info`: `cached_tokens_details.storage` is what the
storage tier supplied (reported as `external_kv_transfer`), `device` + `host` what SGLang's own
caches held (`local_cache_hit`; without HiCache, `cached_tokens`), the rest was computed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from engine import (HOST, KVPOOL_ARMS, Served, die_with_parent, engine_thp, free_port,
                    kvpool_env, sse_chunks, stop)

BACKEND_CONFIG = {
    "backend_name": "kvpool",
    "module_path": "kvpool.adapters.sglang",
    "class_name": "KvpoolHiCacheStorage",
    "interface_v1": 1,
}


def hicache_flags(backend: str, extra: Dict[str, Any]) -> List[str]:
    # The host tier twice the device pool (SGLang sizes it from free memory otherwise, and
    # refuses when less than its reserve is free).
    return ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "page_first_direct",
            "--hicache-storage-backend", backend,
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(extra)]


def kv_tokens(cfg: Dict[str, Any]) -> int:
    """The KV cache's size in tokens (`--max-total-tokens`) for `kv_cache_bytes` of float32
    keys and values."""
    with open(os.path.join(cfg["model"], "config.json")) as f:
        m = json.load(f)
    heads = int(m.get("num_key_value_heads") or m["num_attention_heads"])
    head_dim = int(m.get("head_dim") or int(m["hidden_size"]) // int(m["num_attention_heads"]))
    per_token = 2 * int(m["num_hidden_layers"]) * heads * head_dim * 4
    return max(int(cfg["block_size"]) * 8, int(cfg["kv_cache_bytes"]) // per_token)


class SglangEngine(Served):
    """One SGLang server of an arm, role `a` (writer) or `b` (reader)."""

    def __init__(self, cfg: Dict[str, Any], arm: str, role: str, mooncake: Any):
        self.arm, self.role = arm, role
        self.name = f"{arm}-{role}"
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        logs = cfg["logs"]
        self.log = os.path.join(logs, f"sglang-{self.name}.log")
        self.tmp = tempfile.mkdtemp(prefix=f"kvb-{self.name}-")
        env = dict(os.environ)
        for k in ("KVPOOL_AGENT_SOCKET", "KVPOOL_MASTER", "KVPOOL_AUTH_KEY_FILE",
                  "KVPOOL_SGLANG_BACKEND", "KVPOOL_CLIENT_MODE", "MOONCAKE_MASTER",
                  "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
            env.pop(k, None)
        threads = str(cfg["omp_threads"])
        env.update(SGLANG_USE_CPU_ENGINE="1", KVPOOL_SGLANG_CPU_SHIM="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
                   OMP_NUM_THREADS=threads,
                   TMPDIR=self.tmp)
        engine_thp(env, cfg)
        # SGLang compiles its page hasher with ninja from the venv at run time.
        env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
        path = [p for p in (cfg.get("kvpool_package"), cfg["sglang_cpu_shim"]) if p]
        flags: List[str] = []
        if arm in KVPOOL_ARMS:
            kvpool_env(env, cfg["kvpool"], arm)
            env["KVPOOL_SGLANG_BACKEND"] = "engine" if arm == "kvpool-engine" else "kvpool"
            extra = dict(BACKEND_CONFIG)
            if arm != "kvpool":
                # Its own key namespace (a prefix of every key): the kvpool arms get the same
                # prompts in one pool, and a page one arm stored would be a hit for another.
                extra["extra_backend_tag"] = arm
            flags = hicache_flags("dynamic", extra)
        elif arm == "mooncake":
            assert mooncake is not None
            path.append(mooncake.path)
            env.update(MC_TCP_BIND_ADDRESS=HOST, MOONCAKE_LOCAL_HOSTNAME=HOST)
            # The engine contributes no memory: the holder does (as for vLLM's arm).
            flags = hicache_flags("mooncake", {
                "master_server_address": mooncake.addr, "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp", "device_name": "", "global_segment_size": 0,
                "local_hostname": HOST})
        env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg["model"],
               "--host", HOST, "--port", str(self.port), "--device", "cpu",
               "--attention-backend", "torch_native", "--dtype", "float32",
               "--page-size", str(cfg["block_size"]),
               "--max-total-tokens", str(kv_tokens(cfg)),
               "--context-length", str(cfg["max_model_len"]),
               "--enable-metrics", "--sleep-on-idle", "--random-seed", "0", *flags]
        self.cmd = cmd
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=logs,
                                         preexec_fn=die_with_parent())

    def close(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


def sources_of(meta: Dict[str, Any], prompt_len: int) -> Dict[str, int]:
    """A request's prompt tokens by source, from SGLang's own accounting (`meta_info`)."""
    cached = int(meta.get("cached_tokens") or 0)
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict):
        storage = int(details.get("storage") or 0)
        local = int(details.get("device") or 0) + int(details.get("host") or 0)
    else:
        storage, local = 0, cached
    return {"local_compute": prompt_len - cached, "local_cache_hit": local,
            "external_kv_transfer": storage}


# The storage backend each server reported (`cached_tokens_details.storage_backend`).
BACKENDS: Dict[str, str] = {}


def stream(base: str, prompt: List[int], max_tokens: int, timeout: float = 600) -> Dict[str, Any]:
    """One streamed greedy generation through SGLang's native `/generate` (token ids in):
    client-side TTFT (send to the first chunk carrying a token), the output ids and the
    request's sources."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens,
                                "ignore_eos": True}}
    ttft: Optional[float] = None
    ids: List[int] = []
    meta: Dict[str, Any] = {}
    t0 = time.perf_counter()
    for chunk in sse_chunks(base, "/generate", body, timeout):
        got = chunk.get("output_ids") or []
        if got and ttft is None:
            ttft = time.perf_counter() - t0
        # Each chunk carries every id generated so far (the servers run without
        # `--incremental-streaming-output`).
        if got:
            ids = [int(t) for t in got]
        meta = chunk.get("meta_info") or meta
    total = time.perf_counter() - t0
    details = meta.get("cached_tokens_details")
    if isinstance(details, dict) and details.get("storage_backend"):
        BACKENDS[base] = str(details["storage_backend"])
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "ids": ids,
            "sources": sources_of(meta, len(prompt))}


class SglangFlavor:
    name = "sglang"
    connector_needles = ("KvpoolHiCacheStorage", "Mooncake Configuration", "storage backend")

    @staticmethod
    def engine(cfg: Dict[str, Any], arm: str, role: str, mooncake: Any) -> SglangEngine:
        return SglangEngine(cfg, arm, role, mooncake)

    @staticmethod
    def request(base: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
        return stream(base, prompt, max_tokens)

    @staticmethod
    def concurrent(base: str, prompt: List[int], max_tokens: int) -> Dict[str, Any]:
        return stream(base, prompt, max_tokens)

    @staticmethod
    def snapshot(base: str) -> Dict[str, float]:
        return {}

    @staticmethod
    def phase_sources(base: str, before: Dict[str, float],
                      results: List[Dict[str, Any]]) -> Dict[str, int]:
        out = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        for r in results:
            for k, v in r["sources"].items():
                out[k] += v
        return out

    @staticmethod
    def describe(base: str) -> str:
        backend = BACKENDS.get(base)
        return f"SGLang storage_backend={backend}" if backend else ""

    @staticmethod
    def version() -> str:
        import importlib.metadata as m

        try:
            return m.version("sglang")
        except m.PackageNotFoundError:
            return "?"
