"""`kvpool up` serving a Python client end to end: examples/python_put_get.py puts and gets
through the running pool (two agents in pool mode hold the bytes) with both of the package's
APIs, reading the pool from the environment that `kvpool up` prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from kvpool_pool import REPO, kvpool_up


def test_example_runs_against_kvpool_up(tmp_path):
    with kvpool_up(tmp_path) as ready:
        assert ready["ready"] and ready["master"]
        # The example puts with 2 replicas: wait until both agents have mounted their tiers
        # (an agent is ready before its first mount reaches the master).
        admin = next(c["admin"] for c in ready["children"] if c["role"] == "master")
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"{admin}/metrics", timeout=2) as r:
                metrics = r.read().decode()
            if "kvpool_master_nodes_alive 2" in metrics:
                break
            assert time.monotonic() < deadline, "the two agents did not join the pool in 30 s"
            time.sleep(0.1)
        env = dict(os.environ)
        env["KVPOOL_MASTER_ADDR"] = ready["master"]
        env["KVPOOL_AUTH_KEY_FILE"] = ready["auth_key_file"]
        run = subprocess.run(
            [sys.executable, str(REPO / "examples" / "python_put_get.py")],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
        assert run.stdout.strip().endswith("ok")
        assert "2 replicas each" in run.stdout
