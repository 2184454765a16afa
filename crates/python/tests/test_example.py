"""`kvpool up` serving a Python client end to end: examples/python_put_get.py puts and gets
through the running pool (two agents in pool mode hold the bytes) with both of the package's
APIs, reading the pool from the environment that `kvpool up` prints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from kvpool_pool import REPO, kvpool_binary


def test_example_runs_against_kvpool_up(tmp_path):
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [str(kvpool_binary()), "up", "--json", "--dir", str(tmp_path / "up")],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        line = up.stdout.readline()
        assert line, f"kvpool up exited ({up.poll()}) before it was ready: {tmp_path / 'up.log'}"
        ready = json.loads(line)
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
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
        log.close()
    tail = (tmp_path / "up.log").read_text(errors="replace").splitlines()[-30:]
    logs = tmp_path / "up" / "logs"
    assert code == 0, f"kvpool up exited {code} after SIGTERM; its log ends:\n" + "\n".join(
        tail) + f"\nchildren's logs: {sorted(p.name for p in logs.glob('*'))} in {logs}"
