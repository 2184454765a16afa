"""The conductor on real vLLM's terms (issue 35): `kvpool up --engine vllm` starts the conductor
with the model directory, and the KV bytes per token it counts in its TTFT estimate equal what
the model's config.json implies, computed here on its own from the file; and a conductor in
front of the real engines of one model and kvpool's synthetic engines of another routes each
request only to engines of its model, as each engine's own /v1/models says."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from conftest import Stack, free_port, http_json, kvpool_bin, metrics, model_dir, stop, wait_http

BLOCK = 32
MODEL = "tiny"
OTHER = "org/other-model"


def kv_bytes_per_token(model: Path, tensor_parallel: int = 1) -> int:
    """2 (K and V) x layers x KV heads per rank x head size x element size, the dtype as vLLM's
    `--dtype auto` resolves it (float32 weights run in bfloat16)."""
    c = json.loads((model / "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    dtype = (c.get("torch_dtype") or c.get("dtype") or "float32").removeprefix("torch.")
    element = {"bfloat16": 2, "float16": 2, "float32": 2}[dtype]
    per_rank = max(1, kv_heads // tensor_parallel)
    return 2 * c["num_hidden_layers"] * per_rank * head_dim * element


def test_the_conductors_kv_bytes_per_token_follow_the_served_models_config(stack: Stack):
    expected = kv_bytes_per_token(model_dir())
    # The conductor's metric, its status, and its start-up log agree with the config.
    m = metrics(stack.children["conductor"]["admin"])
    assert m.get("kvpool_conductor_kv_bytes_per_token") == expected, {
        k: v for k, v in m.items() if "kv_bytes" in k}
    status = http_json(f"{stack.conductor}/v1/kvpool/status")
    assert status["status"] == 200, status
    assert status["json"]["kv_bytes_per_token"] == expected, status["json"]
    log = stack.log("conductor")
    started = next(l for l in log.splitlines() if "starting conductor" in l)
    assert f"kv_bytes_per_token={expected}" in started, started
    assert str(model_dir()) in started, started
    # vLLM sizes its own cache with the same bytes: the tokens it reports fitting in its
    # VLLM_CPU_KVCACHE_SPACE (1 GiB) times the conductor's figure come to that space, less
    # at most one block of every layer's rounding.
    sizes = [int(n.replace(",", "")) for n in
             re.findall(r"KV cache size: ([\d,]+) tokens", stack.log("prefill-0"))]
    assert sizes, "the prefill engine's log has no 'KV cache size: N tokens' line"
    assert abs(sizes[-1] * expected - 2**30) <= expected * 64, (sizes, expected)


def test_two_models_behind_one_conductor_reach_only_their_own_engines(stack: Stack):
    procs = []
    try:
        def start(name, args, ready):
            log = stack.dir / f"{name}.log"
            with open(log, "wb") as out:
                p = subprocess.Popen([str(kvpool_bin())] + args, stdout=out,
                                     stderr=subprocess.STDOUT)
            procs.append(p)
            wait_http(ready, p, log, timeout=60)

        synthetic = []
        for role in ("prefill", "decode"):
            api, admin = free_port(), free_port()
            start(f"synthetic-{role}", ["engine", "--synthetic", "--listen", f"127.0.0.1:{api}",
                                        "--admin-listen", f"127.0.0.1:{admin}", "--model", OTHER,
                                        "--block-size", str(BLOCK), "--time-scale", "0.001"],
                  f"http://127.0.0.1:{admin}/readyz")
            synthetic.append(f"http://127.0.0.1:{api}")
        api, admin = free_port(), free_port()
        # No --model: the names served are the engines' own.
        cmd = ["conductor", "--listen", f"127.0.0.1:{api}", "--admin-listen",
               f"127.0.0.1:{admin}", "--model-dir", str(model_dir()), "--block-size", str(BLOCK),
               "--hash-seed", "0"]
        for url in stack.prefill + synthetic[:1]:
            cmd += ["--prefill", url]
        for url in stack.decode + synthetic[1:]:
            cmd += ["--decode", url]
        start("conductor-two-models", cmd, f"http://127.0.0.1:{admin}/readyz")
        base = f"http://127.0.0.1:{api}"
        listed = http_json(f"{base}/v1/models")
        assert {m["id"] for m in listed["json"]["data"]} == {MODEL, OTHER}, listed
        prompt = "the same prompt for both models, long enough for a block or two " * 4
        for i in range(4):
            for model, prefill, decode in ((MODEL, stack.prefill, stack.decode),
                                           (OTHER, synthetic[:1], synthetic[1:])):
                r = http_json(f"{base}/v1/completions", {
                    "model": model, "prompt": f"{prompt}{i}", "max_tokens": 3,
                    "temperature": 0})
                assert r["status"] == 200, (model, r)
                assert r["headers"]["x-kvpool-prefill-engine"] in prefill, (model, r["headers"])
                assert r["headers"]["x-kvpool-decode-engine"] in decode, (model, r["headers"])
        missing = http_json(f"{base}/v1/completions",
                            {"model": "org/nobody-serves-this", "prompt": "hi", "max_tokens": 1})
        assert missing["status"] == 404, missing
        assert missing["json"]["error"]["code"] == "model_not_found", missing
        assert "org/nobody-serves-this" in missing["json"]["error"]["message"], missing
        status = http_json(f"{base}/v1/kvpool/status")["json"]
        assert status["engine_models"][stack.prefill[0]] == [MODEL], status
    finally:
        for p in reversed(procs):
            stop(p)
