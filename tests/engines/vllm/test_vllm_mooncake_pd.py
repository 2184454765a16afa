"""vLLM's own `MooncakeConnector` (P2P prefill -> decode) over kvpool's transfer engine, on real
vLLM 0.32.0: a prefill vLLM (`kv_producer`) and a decode vLLM (`kv_consumer`), both with
`kv_connector_module_path: kvpool.adapters.vllm_mooncake`, so vLLM's unmodified connector
constructs `kvpool.mooncake_engine.TransferEngine` where it would construct Mooncake's.

The request flow is vLLM's MooncakeConnector handshake, done here by the client (kvpool's
conductor speaks vLLM's NIXL-style flow, in which prefill returns the decode's
`kv_transfer_params`; MooncakeConnector's prefill returns none, see docs/engines.md): a
`transfer_id` shared by both requests; prefill gets `{do_remote_decode, transfer_id}` and one
token; decode gets `{do_remote_prefill, remote_engine_id, remote_bootstrap_addr, transfer_id}`,
asks the prefill's bootstrap server for its worker, and the prefill worker writes the blocks
into the decode's KV cache with `batch_transfer_sync_write` of kvpool's engine.

What is asserted is what the engines report: the decode's greedy token ids equal a plain vLLM's
(conftest `baseline`, same thread settings); vLLM's decode counts the prompt as
`external_kv_transfer` tokens (its /metrics), not as computed; the prefill's connector stats
(vLLM's "KV Transfer metrics" log line) count successful transfers and no failures; each vLLM
process that built the connector logs that its `TransferEngine` is kvpool's, and kvpool's
engine runs with the pool key (no unauthenticated-peers warning).

One CPU stand-in (tests/engines/vllm/cpu_shim): vLLM's worker asks torch for the accelerator's
device index, which raises on a machine without one (docs/engines.md has the line).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator

import pytest

from conftest import by_source, free_port, model_dir, stop, wait_http
from test_vllm_loop import complete, prefix_of_tokens, prompt_len, token_ids

HERE = Path(__file__).resolve().parent
SHIM = HERE / "cpu_shim"
HOOK = "kvpool.adapters.vllm_mooncake"
TRANSFER_LINE = re.compile(
    r"KV Transfer metrics: Num successful transfers=(\d+), .*?Avg MB per transfer=([\d.]+),"
    r".*?Num failed transfers=(\d+), Num failed recvs=(\d+)")


class Pd:
    def __init__(self, prefill: str, decode: str, engine_id: str, bootstrap: str,
                 logs: Dict[str, Path]):
        self.prefill, self.decode = prefill, decode
        self.engine_id, self.bootstrap, self.logs = engine_id, bootstrap, logs

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")


def _engine(tmp: Path, name: str, role: str, engine_id: str, key: Path,
            bootstrap_port: int) -> tuple:
    port = free_port()
    path = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
               VLLM_HOST_IP="127.0.0.1", VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bootstrap_port),
               KVPOOL_AUTH_KEY_FILE=str(key), KVPOOL_VLLM_CPU_SHIM="1", PYTHONPATH=path)
    config = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": HOOK,
              "kv_role": role, "engine_id": engine_id,
              "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    cmd = [sys.executable, "-m", "kvpool.vllm_serve", str(model_dir()),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--block-size", "32", "--prefix-caching-hash-algo", "sha256_cbor",
           "--max-model-len", "4096", "--enable-prompt-tokens-details",
           "--disable-uvicorn-access-log", "--kv-transfer-config", json.dumps(config)]
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[Pd]:
    tmp = tmp_path_factory.mktemp("mooncake_pd")
    key = tmp / "pool.key"
    key.write_bytes(secrets.token_bytes(32))
    bootstrap_port = free_port()
    engine_id = f"kvpool-prefill-{bootstrap_port}"
    p, p_url, p_log = _engine(tmp, "prefill", "kv_producer", engine_id, key, bootstrap_port)
    d, d_url, d_log = _engine(tmp, "decode", "kv_consumer", "kvpool-decode", key,
                              free_port())
    try:
        wait_http(f"{p_url}/health", p, p_log)
        wait_http(f"{d_url}/health", d, d_log)
        yield Pd(p_url, d_url, engine_id, f"http://127.0.0.1:{bootstrap_port}",
                 {"prefill": p_log, "decode": d_log})
    finally:
        stop(p)
        stop(d)


def disaggregated(pd: Pd, prompt: str, max_tokens: int) -> tuple:
    """vLLM MooncakeConnector's flow: prefill (one token) then decode, paired by transfer_id."""
    transfer_id = str(uuid.uuid4())
    first = complete(pd.prefill, prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_id": transfer_id})
    out = complete(pd.decode, prompt, max_tokens=max_tokens, kv_transfer_params={
        "do_remote_prefill": True, "remote_engine_id": pd.engine_id,
        "remote_bootstrap_addr": pd.bootstrap, "transfer_id": transfer_id})
    return first, out


def transfer_stats(log: str) -> tuple:
    """Sums of vLLM's MooncakeConnector stats lines: (transfers, MB, failed, failed recvs)."""
    n = mb = failed = failed_recv = 0.0
    for m in TRANSFER_LINE.finditer(log):
        n += int(m.group(1))
        mb += int(m.group(1)) * float(m.group(2))
        failed += int(m.group(3))
        failed_recv += int(m.group(4))
    return n, mb, failed, failed_recv


def test_vllms_mooncake_connector_moves_kv_over_kvpools_engine(pd: Pd, baseline):
    before = by_source(pd.decode)
    prompts = [prefix_of_tokens(701, 300) + " first", prefix_of_tokens(702, 640) + " second"]
    total = 0
    for prompt in prompts:
        first, out = disaggregated(pd, prompt, max_tokens=8)
        plain = complete(baseline, prompt, max_tokens=8)
        assert token_ids(out) == token_ids(plain), prompt[:40]
        assert token_ids(first) == token_ids(plain)[:1]
        total += prompt_len(out)
    after = by_source(pd.decode)
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    computed = after["local_compute"] - before["local_compute"]
    # The decode engine computed (at most) each prompt's last token; the rest came from the
    # prefill engine's KV cache.
    assert loaded >= total - len(prompts), (before, after, total)
    assert computed <= len(prompts), (before, after, total)

    # vLLM's prefill worker records each batch_transfer_sync_write that returned 0; its stat
    # logger prints them every 10 s.
    deadline = time.monotonic() + 90
    n = mb = failed = failed_recv = 0.0
    while time.monotonic() < deadline:
        n, mb, failed, failed_recv = transfer_stats(pd.log("prefill"))
        if n >= len(prompts):
            break
        time.sleep(2)
    assert n >= len(prompts) and mb > 0, pd.log("prefill")[-3000:]
    assert failed == 0 and failed_recv == 0

    for name in ("prefill", "decode"):
        log = pd.log(name)
        # The worker process (where the connector moves KV) imported vLLM's connector
        # through the hook, with kvpool's TransferEngine bound.
        assert re.search(r"\(Worker[^)]*\).*moves KV with kvpool's transfer engine "
                         r"\(kvpool\.mooncake_engine\.TransferEngine\)", log), log[-3000:]
        assert "Mooncake Transfer Engine is using tcp" in log
        assert "peers of this transfer engine are not authenticated" not in log
        assert "Traceback" not in log


def test_the_conductor_fronts_vllms_mooncake_connector(pd: Pd, baseline):
    """`kvpool conductor --engine-protocol vllm-mooncake` in front of the same two engines:
    OpenAI requests to the conductor only. The conductor asks the prefill instance's bootstrap
    server for its engine id, pairs the two calls by a transfer id of its own and gives decode
    the prefill's engine id and bootstrap address; the decode engine pulls the prompt's KV
    (vLLM's own counters) and the greedy output equals a plain vLLM's."""
    from conftest import kvpool_bin, metrics, wait_http

    api, admin = free_port(), free_port()
    bootstrap_port = pd.bootstrap.rpartition(":")[2]
    cmd = [str(kvpool_bin()), "conductor", "--listen", f"127.0.0.1:{api}",
           "--admin-listen", f"127.0.0.1:{admin}", "--prefill", pd.prefill,
           "--decode", pd.decode, "--engine-protocol", "vllm-mooncake",
           "--bootstrap-port", bootstrap_port, "--block-size", "32"]
    log = Path(pd.logs["prefill"]).parent / "conductor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{admin}/readyz", proc, log, timeout=60)
        before = by_source(pd.decode)
        n_before = transfer_stats(pd.log("prefill"))[0]
        prompts = [prefix_of_tokens(711, 420) + " via the conductor",
                   prefix_of_tokens(712, 260) + " and again"]
        total = 0
        for prompt in prompts:
            out = complete(f"http://127.0.0.1:{api}", prompt, max_tokens=8)
            plain = complete(baseline, prompt, max_tokens=8)
            assert token_ids(out) == token_ids(plain), (prompt[:40], log.read_text()[-2000:])
            assert out["headers"]["x-kvpool-prefill-engine"] == pd.prefill, out["headers"]
            assert out["headers"]["x-kvpool-decode-engine"] == pd.decode, out["headers"]
            total += prompt_len(out)
        after = by_source(pd.decode)
        loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        assert loaded >= total - len(prompts), (before, after, total)
        assert computed <= len(prompts), (before, after, total)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            n, _, failed, failed_recv = transfer_stats(pd.log("prefill"))
            if n - n_before >= len(prompts):
                break
            time.sleep(2)
        assert n - n_before >= len(prompts), pd.log("prefill")[-3000:]
        assert failed == 0 and failed_recv == 0
        m = metrics(f"http://127.0.0.1:{admin}")
        ok = sum(v for k, v in m.items()
                 if k.startswith("kvpool_conductor_requests_total") and 'outcome="ok"' in k)
        assert ok >= len(prompts), m
    finally:
        stop(proc)
