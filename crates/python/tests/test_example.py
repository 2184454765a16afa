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


def wait_for_two_agents(ready: dict) -> None:
    """The example puts with 2 replicas: wait until both agents have mounted their tiers (an
    agent is ready before its first mount reaches the master)."""
    admin = next(c["admin"] for c in ready["children"] if c["role"] == "master")
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"{admin}/metrics", timeout=2) as r:
            if "kvpool_master_nodes_alive 2" in r.read().decode():
                return
        assert time.monotonic() < deadline, "the two agents did not join the pool in 30 s"
        time.sleep(0.1)


def run_example(ready: dict, key_file: str, extra_env: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env.update(extra_env)
    env["KVPOOL_MASTER"] = ready["master"]
    env["KVPOOL_AUTH_KEY_FILE"] = key_file
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "python_put_get.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_example_with_tls_uses_its_own_client_certificate(tmp_path):
    """Issue 38: `kvpool up --tls` runs mutual TLS with a certificate per process; the
    environment its ready line gives a user's process (CA, a client certificate of its own,
    transfer TLS) is what the example needs, with the engine credential; without the client
    certificate the master refuses the connection."""
    with kvpool_up(tmp_path, "--tls") as ready:
        wait_for_two_agents(ready)
        env = ready["client_env"]
        assert set(env) == {"KVPOOL_MASTER_CA_FILE", "KVPOOL_MASTER_CLIENT_CERT_FILE",
                            "KVPOOL_MASTER_CLIENT_KEY_FILE", "KVPOOL_TRANSFER_TLS",
                            "KVPOOL_TRANSFER_CA_FILE"}
        engine_key = ready["role_key_files"]["engine"]
        run = run_example(ready, engine_key, env)
        assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
        assert run.stdout.strip().endswith("ok")
        no_cert = {k: v for k, v in env.items() if "CLIENT" not in k}
        refused = run_example(ready, engine_key, no_cert)
        assert refused.returncode != 0, refused.stdout


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
        env["KVPOOL_MASTER"] = ready["master"]
        env["KVPOOL_AUTH_KEY_FILE"] = ready["auth_key_file"]
        run = subprocess.run(
            [sys.executable, str(REPO / "examples" / "python_put_get.py")],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
        assert run.stdout.strip().endswith("ok")
        assert "2 replicas each" in run.stdout
