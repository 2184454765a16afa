"""The conductor's cost model taken from the served model, on real vLLM (issue 35): `kvpool up
--engine vllm` starts the conductor with the model directory, and the KV bytes per token it
counts in its TTFT estimate equal what the model's config.json implies, computed here on its
own from the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import Stack, http_json, metrics, model_dir


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
