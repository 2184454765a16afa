"""`kvpool bench engine --engine sglang` on real SGLang 0.5.23 (CPU, the stand-in kernels of
README.md), at its smallest size: the tiny model, a 256-token prefix (8 pages), two TTFT
rounds and a small throughput workload, with three arms - HiCache on kvpool
(`KvpoolHiCacheStorage`), HiCache on real Mooncake Store through SGLang's own `mooncake`
backend, and SGLang without HiCache - one arm at a time (`--group-size 1`: at most two
servers up at once, as SGLang sizes its host tier against what memory is free).

The bench must complete and every arm must pass its own checks, made from what SGLang reports
per request (`meta_info.cached_tokens_details`): a fresh server's first request of each prefix
took every full page of it from storage (on the arm without HiCache, computed it all), the
next one took it from SGLang's own cache, and greedy token ids are equal across the arms.
Each store arm's reader names the storage backend class SGLang used. The timings are not
asserted here (docs/benchmarks.md has a measured run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PREFIX = 256


def test_bench_engine_on_sglang_completes_with_every_arm_verified(tmp_path, model):
    venv = Path(sys.executable).parent.parent
    binary = os.environ.get("KVPOOL_BIN") or str(REPO / "target" / "debug" / "kvpool")
    cmd = [binary, "bench", "engine", "--engine", "sglang", "--json", "--model", str(model),
           "--sglang-venv", str(venv), "--arms", "kvpool,mooncake,none", "--group-size", "1",
           "--prefix-tokens", str(PREFIX), "--suffix-tokens", "8", "--repeats", "2",
           "--max-tokens", "4", "--throughput-prefixes", "1", "--throughput-per-prefix", "2",
           "--throughput-max-tokens", "4", "--kv-cache", "16MiB",
           "--store-capacity", "256MiB", "--dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=1800)
    err = proc.stderr.decode(errors="replace")[-6000:]
    assert proc.returncode == 0, f"kvpool bench engine --engine sglang failed ({proc.returncode}):\n{err}"
    report = json.loads(proc.stdout)
    assert report["run"]["engine"] == "sglang" and report["run"]["version"] == "0.5.23"
    arms = {a["arm"]: a for a in report["run"]["arms"]}
    assert list(arms) == ["kvpool", "mooncake", "none"], list(arms)
    for check in report["checks"]:
        assert check["loaded_from_store"], check
        assert check["hit_from_cache"], check
        assert check["ids_equal"], check
        if check["arm"] != "none":
            assert check["min_external_tokens"] == PREFIX, check
    assert report["all_verified"], report["checks"]
    # SGLang's own word on which backend served the loads.
    assert arms["kvpool"]["connector_line"] == "SGLang storage_backend=KvpoolPageStorage", arms
    assert arms["mooncake"]["connector_line"] == "SGLang storage_backend=MooncakeStore", arms
    for name, arm in arms.items():
        assert arm["loaded"]["n"] == 2 and arm["hit"]["n"] == 2, arm
        want = 0 if name == "none" else PREFIX
        assert [s["external_kv_transfer"] for s in arm["sources_loaded"]] == [want, want], arm
        assert [s["local_cache_hit"] for s in arm["sources_hit"]] == [PREFIX, PREFIX], arm
        assert all(len(ids) == 4 for ids in arm["ids_loaded"] + arm["ids_hit"]), arm
        assert arm["throughput"]["completed"] == 2, arm["throughput"]
    targets = {t["arm"]: t for t in report["ratios"]["targets"]}
    # One arm per group: the reference hit is the kvpool arm's own engine's.
    assert targets["kvpool"]["reference"] == "kvpool", targets
    assert targets["kvpool"]["over_mooncake"] > 0, targets
