"""One LMCache engine, in this process: LMCache 0.5.6's own manager and engine, built from the
LMCache configuration file a user writes (`LMCACHE_CONFIG_FILE`), then one action.

    python lmcache_engine.py store    --out DIR   # stores one request's KV, waits for the pool
    python lmcache_engine.py retrieve --out DIR   # looks the same request up and retrieves it
    python lmcache_engine.py start    --out DIR   # only builds the engine

The engine is built as LMCache's standalone mode builds it (`StandaloneLMCacheManager`: the
service factory calls `LMCacheEngineBuilder.get_or_create`, then `post_init` creates the
`StorageManager`, whose `CreateStorageBackends` makes the `LocalCPUBackend` and, for each of
`remote_storage_plugins`, a `RemoteBackend` through the plugin's `ConnectorAdapter`). The KV
layout is the test model's (`$KVPOOL_TEST_MODELS/tiny/config.json`). The only stand-in is the
GPU connector (`cpu_kv_connector.py`).

The request is `--tokens` token ids drawn from `--seed`; its KV cache is random bfloat16 values
from the same seed. `store` saves that KV to `DIR/stored.pt`, `retrieve` saves what LMCache
wrote into a zeroed cache to `DIR/retrieved.pt`; both write what LMCache reported to
`DIR/result.json`. An engine that fails to build raises out of this script (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.observability import LMCStatsMonitor
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.standalone.manager import StandaloneLMCacheManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_kv_connector import CpuKVConnector  # noqa: E402

PLUGIN = "kvpool"
REMOTE = f"RemoteBackend-{PLUGIN}"  # the name LMCache gives a plugin's RemoteBackend


def model_layout() -> dict:
    path = Path(os.environ["KVPOOL_TEST_MODELS"]) / "tiny" / "config.json"
    cfg = json.loads(path.read_text())
    heads = cfg["num_attention_heads"]
    return {
        "layers": cfg["num_hidden_layers"],
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def build():
    config = lmcache_get_or_create_config()
    layout = model_layout()
    metadata = LMCacheMetadata(
        model_name="kvpool-test/tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layout["layers"], 2, config.chunk_size, layout["kv_heads"], layout["head_dim"]),
        role="worker",
        chunk_size=config.chunk_size,
    )
    gpu = CpuKVConnector(layout["layers"], layout["kv_heads"] * layout["head_dim"])
    manager = StandaloneLMCacheManager(
        config, metadata, gpu, broadcast_fn=lambda t, src: None,
        broadcast_object_fn=lambda obj, src: obj,
    )
    manager.post_init()
    engine = manager.lmcache_engine
    # LMCache's stats logger clears the counters every 10 s; this run reads them itself.
    logger = LMCacheEngineBuilder._stat_loggers.get(config.lmcache_instance_id)
    if logger is not None:
        logger.shutdown()
    LMCStatsMonitor.GetOrCreate().get_stats_and_clear()
    return manager, engine, gpu


def request(n: int, seed: int, layers: int, hidden: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 4000, (n,), generator=g, dtype=torch.long)
    kv = torch.randn(2, layers, n, hidden, generator=g).to(torch.bfloat16)
    return tokens, kv


def describe(engine) -> dict:
    sm = engine.storage_manager
    remote = sm.storage_backends.get(REMOTE) if sm is not None else None
    conn = getattr(remote, "connection", None)
    inner = conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn
    return {
        "healthy": engine.is_healthy(),
        "backends": list(sm.storage_backends) if sm is not None else [],
        "connector": type(inner).__module__ + "." + type(inner).__name__ if inner else None,
        "save_chunk_meta": getattr(inner, "save_chunk_meta", None),
        "get_blocking_failed_count": getattr(remote, "get_blocking_failed_count", None),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["store", "retrieve", "start"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=868)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--wait-s", type=float, default=30.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    manager, engine, gpu = build()
    result = {"action": args.action, **describe(engine)}
    tokens, kv = request(args.tokens, args.seed, gpu.num_layers, gpu.hidden)
    monitor = LMCStatsMonitor.GetOrCreate()
    chunk = engine.config.chunk_size
    result["chunk_size"] = chunk
    result["full_chunk_tokens"] = args.tokens // chunk * chunk

    if args.action == "store":
        engine.store(tokens, kv=kv)
        # The remote puts run on LMCache's event loop after store() returns: wait until
        # LMCache's own lookup, asked of the remote backend only, finds every stored token.
        expect = args.tokens if engine.config.save_unfull_chunk else result["full_chunk_tokens"]
        deadline = time.monotonic() + args.wait_s
        while True:
            found = engine.lookup(tokens, search_range=[REMOTE])
            if found >= expect or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        result["remote_lookup_tokens"] = found
        torch.save(kv, args.out / "stored.pt")
    elif args.action == "retrieve":
        result["lookup_tokens"] = engine.lookup(tokens)
        dest = torch.zeros_like(kv)
        mask = engine.retrieve(tokens, kv=dest)
        result["retrieved_tokens"] = int(mask.sum())
        result["mask_prefix"] = int(mask.long().cumprod(0).sum())  # leading run of True
        torch.save(dest, args.out / "retrieved.pt")

    stats = monitor.get_stats_and_clear()
    for name in (
        "interval_stored_tokens", "interval_hit_tokens", "interval_lookup_hits",
        "interval_remote_read_requests", "interval_remote_read_bytes",
        "interval_remote_write_requests", "interval_remote_write_bytes",
    ):
        result[name] = int(getattr(stats, name))
    result.update({k: v for k, v in describe(engine).items() if k == "get_blocking_failed_count"})
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    LMCacheEngineBuilder.destroy(engine.config.lmcache_instance_id)
    manager.stop_services()
    return 0


if __name__ == "__main__":
    sys.exit(main())
