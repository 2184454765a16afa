"""`kvpool bench stress --vs-mooncake` once at a tiny size: its driver (written into the binary)
runs the batch calls through this venv's `kvpool.mooncake` and against real Mooncake, every
value read back is verified on both sides, and the report pairs the same cells. No ratio is
asserted: figures are for docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvpool_pool import REPO, kvpool_binary


def _zombie_or_other(pid: int) -> bool:
    """A pid still in /proc that is not a kvpool master any more (reused, or not reaped)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except OSError:
        return True
    return b"master" not in cmd


def test_bench_stress_runs_both_stores_on_the_same_cells():
    out = subprocess.run(
        [str(kvpool_binary()), "bench", "stress", "--vs-mooncake", "--json",
         "--sizes", "64KiB", "--batches", "1,4", "--parts", "1,2",
         "--bytes-per-cell", "512KiB", "--agent-capacity", "64MiB",
         "--python", sys.executable, "--mooncake-venv", str(REPO / ".tools" / "py")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    cells = [(c["size"], c["batch"], c["parts"]) for c in r["kvpool"]["cells"]]
    assert cells == [(65536, 1, 1), (65536, 4, 1), (65536, 1, 2), (65536, 4, 2)]
    assert [(c["size"], c["batch"], c["parts"]) for c in r["mooncake"]["cells"]] == cells
    for side in ("kvpool", "mooncake"):
        for c in r[side]["cells"]:
            assert c["values"] == 8, c
            assert c["put"]["failures"] == 0 and c["get"]["failures"] == 0, (side, c)
            assert c["get"]["verified"] == 8, (side, c)
            assert c["put"]["calls"] == 8 // c["batch"], (side, c)
    assert r["all_values_verified"] is True
    assert r["store_hugepages"] == "none", r["store_hugepages"]
    # Every cell ran on a pool started for it (its own master process, on both sides), and
    # none of kvpool's is left running.
    for side in ("kvpool", "mooncake"):
        pids = [c["master_pid"] for c in r[side]["cells"]]
        assert all(isinstance(p, int) and p > 0 for p in pids), (side, pids)
        assert len(set(pids)) == len(pids), (side, pids)
    for pid in (c["master_pid"] for c in r["kvpool"]["cells"]):
        assert not os.path.exists(f"/proc/{pid}") or _zombie_or_other(pid), pid

    assert len(r["ratios"]) == 4 and all(x["put"] > 0 and x["get"] > 0 for x in r["ratios"])
    # The machine's idle-memory probe, measured before the cells (how to read the figures).
    idle = r["idle_memory"]
    assert idle["idle_s"] == 1.0 and idle["hot_read_us_per_mib"] > 0, idle
    slowdown = idle["idle_read_us_per_mib"] / idle["hot_read_us_per_mib"]
    assert abs(idle["read_slowdown"] - slowdown) < 1e-6, idle
