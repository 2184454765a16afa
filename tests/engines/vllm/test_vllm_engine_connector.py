"""vLLM's own `MooncakeStoreConnector` on the kvpool pool (`KVPOOL_VLLM_CONNECTOR=engine`: the
class behind `KvpoolStoreConnector` is vLLM's, built over `kvpool.mooncake`), on real vLLM
0.32.0: a fresh engine loads from the pool the prefix another engine stored, and its greedy
tokens equal a plain vLLM's. The pool is `kvpool up` (its master and agents; its synthetic
engines are not used); the engines reach it through the node agent's socket with the engine
credential, as the operator sets them up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from conftest import (REPO, by_source, free_port, kvpool_bin, metrics, model_dir, stop,
                      wait_http)
from test_vllm_loop import complete, prefix_of_tokens, prompt_len, token_ids

BLOCK = 32


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[Dict]:
    tmp = tmp_path_factory.mktemp("pool")
    cmd = [str(kvpool_bin()), "up", "--prefill", "1", "--decode", "1", "--agents", "1",
           "--agent-dram", "256MiB", "--json", "--dir", str(tmp / "run")]
    log = tmp / "up.out"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=REPO)
    lines: List[bytes] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")),
                     daemon=True).start()
    deadline = time.monotonic() + 180
    ready = None
    while ready is None and time.monotonic() < deadline and proc.poll() is None:
        ready = next((json.loads(l) for l in lines if l.startswith(b"{")), None)
        time.sleep(0.2)
    if ready is None:
        stop(proc)
        pytest.fail(f"kvpool up did not start; see {log}", pytrace=False)
    try:
        yield ready
    finally:
        stop(proc)


def engine(pool: Dict, tmp: Path, name: str) -> tuple:
    port = free_port()
    agent = next(c for c in pool["children"] if c["role"] == "agent")
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
               KVPOOL_VLLM_CONNECTOR="engine", KVPOOL_MASTER=pool["master"],
               KVPOOL_AUTH_KEY_FILE=pool["role_key_files"]["engine"],
               KVPOOL_AGENT_SOCKET=agent["endpoint"], VLLM_HOST_IP="127.0.0.1")
    config = {"kv_connector": "KvpoolStoreConnector",
              "kv_connector_module_path": "kvpool.adapters.vllm", "kv_role": "kv_both",
              # vLLM's connector asks for 4 GiB of local buffer by default.
              "kv_connector_extra_config": {"local_buffer_size": "64MiB"}}
    cmd = [sys.executable, "-m", "kvpool.vllm_serve", str(model_dir()),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "32", "--prefix-caching-hash-algo", "sha256_cbor",
           "--max-model-len", "4096", "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log", "--kv-transfer-config", json.dumps(config)]
    log = tmp / f"{name}.log"
    out = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return proc, f"http://127.0.0.1:{port}", log


def test_vllms_own_mooncake_store_connector_shares_prefixes_through_the_pool(
        pool, baseline, tmp_path):
    a, url_a, log_a = engine(pool, tmp_path, "a")
    b, url_b, log_b = engine(pool, tmp_path, "b")
    try:
        wait_http(f"{url_a}/health", a, log_a)
        wait_http(f"{url_b}/health", b, log_b)
        prefix = prefix_of_tokens(313, 512 + BLOCK)
        first = complete(url_a, prefix + " first", max_tokens=6)
        assert token_ids(first) == token_ids(complete(baseline, prefix + " first", max_tokens=6))
        # vLLM's connector saves on background threads: wait until the pool's object count
        # has settled before B asks for the prefix.
        master = next(c["admin"] for c in pool["children"] if c["role"] == "master")
        objects, settled, deadline = -1.0, 0, time.monotonic() + 60
        while settled < 4 and time.monotonic() < deadline:
            now = metrics(master).get("kvpool_master_objects", 0.0)
            settled = settled + 1 if now == objects and now > 0 else 0
            objects = now
            time.sleep(0.5)
        assert objects > 0, "vLLM's connector stored nothing in the pool"
        before = by_source(url_b)
        prompt = prefix + " second"
        second = complete(url_b, prompt, max_tokens=6)
        after = by_source(url_b)
        loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
        assert loaded >= 512, (objects, before, after)
        assert token_ids(second) == token_ids(complete(baseline, prompt, max_tokens=6))
        assert prompt_len(second) > loaded
    finally:
        stop(a)
        stop(b)
