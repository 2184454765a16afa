"""`kvpool bench engine` on real vLLM 0.32.0 (CPU build), at its smallest size: the tiny model,
a 256-token prefix, two TTFT rounds and a small throughput workload, with all five arms
(kvpool's connector in direct mode, loading layer by layer behind the forward pass
(`--layerwise-load true`), and through the node agent's socket (whole blocks), vLLM's
MooncakeStoreConnector on kvpool, the same connector on real Mooncake Store, no connector) in
one run. The bench must complete and every arm must pass the
bench's own checks: vLLM's `prompt_tokens_by_source` says the first request of each prefix on a
fresh engine took the prefix from the store (none of it from vLLM's cache; on the arm without a
connector, all of it computed), the second took it from vLLM's prefix cache, and greedy token
ids are equal across the arms; the hit measured again after a second idle comes from vLLM's
cache too, and the short warm request before each first request computed every token. The timings are not asserted here (docs/benchmarks.md has a
measured run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, kvpool_bin, model_dir


def test_bench_engine_completes_with_every_arm_verified(tmp_path):
    venv = Path(sys.executable).parent.parent
    cmd = [str(kvpool_bin()), "bench", "engine", "--json", "--model", str(model_dir("tiny")),
           "--vllm-venv", str(venv), "--prefix-tokens", "256", "--suffix-tokens", "8",
           "--repeats", "2", "--max-tokens", "4", "--throughput-prefixes", "1",
           "--throughput-per-prefix", "2", "--throughput-max-tokens", "4",
           "--store-capacity", "256MiB", "--layerwise-load", "true", "--idle-hit-after", "1s",
           "--dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=1800)
    err = proc.stderr.decode(errors="replace")[-6000:]
    assert proc.returncode == 0, f"kvpool bench engine failed ({proc.returncode}):\n{err}"
    report = json.loads(proc.stdout)
    arms = [a["arm"] for a in report["run"]["arms"]]
    assert arms == ["kvpool", "mooncake", "none", "kvpool-agent", "kvpool-engine"], arms
    for check in report["checks"]:
        assert check["loaded_from_store"], check
        assert check["hit_from_cache"], check
        assert check["ids_equal"], check
    for check in report["checks"]:
        if check["arm"] != "none":
            assert check["min_external_tokens"] >= 256, check
    assert report["all_verified"], report["checks"]
    targets = {t["arm"]: t for t in report["ratios"]["targets"]}
    assert set(targets) == {"kvpool", "kvpool-agent"}, targets
    assert targets["kvpool"]["reference"] == "none"
    assert all(t["over_mooncake"] > 0 for t in targets.values()), targets
    for arm in report["run"]["arms"]:
        assert arm["throughput"]["completed"] == 2, arm["throughput"]
        assert arm["loaded"]["n"] == 2 and arm["hit"]["n"] == 2
        # The hit once more after a second idle: from vLLM's cache too (the checks above
        # include it), measured once per round.
        assert arm["idle_hit"]["n"] == 2 and arm["idle_hit_after_s"] == 1.0, arm["idle_hit"]
        assert len(arm["ids_idle_hit"]) == 2 and all(arm["ids_idle_hit"]), arm["ids_idle_hit"]
        # The warm request before each first request (the default `--warm-first`): one per
        # round, every prompt token computed (the checks above fail the arm otherwise).
        assert arm["warm"]["n"] == 2, arm["warm"]
        assert [s["external_kv_transfer"] + s["local_cache_hit"] for s in arm["sources_warm"]] \
            == [0, 0], arm["sources_warm"]
        # The reader engine's transparent huge pages, read from /proc (a number, 0 without
        # --engine-thp where nothing else asks for them).
        assert isinstance(arm["reader_thp_mib"], (int, float)) and arm["reader_thp_mib"] >= 0
    assert report["workload"]["warm_first"] is True
    # The engines say how their connector loads: direct mode layer by layer, the agent's
    # socket (whole values only) whole blocks.
    logs = tmp_path / "run" / "logs"
    assert "loads layer by layer behind the forward pass" in (logs / "vllm-kvpool-b.log").read_text()
    assert "loads whole blocks, started before vLLM prepares the step" in (
        logs / "vllm-kvpool-agent-b.log").read_text()
