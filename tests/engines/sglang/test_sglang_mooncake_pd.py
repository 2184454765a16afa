"""SGLang's PD disaggregation (`--disaggregation-transfer-backend mooncake`) over kvpool's
transfer engine, on real SGLang 0.5.23 (CPU): a prefill and a decode server started with
`python -m kvpool.adapters.sglang_pd` (SGLang's own launcher, with `mooncake.engine` resolving
to `kvpool.mooncake_engine` in every process of the server), so SGLang's unmodified
`MooncakeTransferEngine`, KV manager, sender and receiver move each request's KV with kvpool's
engine. Real Mooncake is not installed in this environment (asserted): without the hook
SGLang's scheduler fails with "No module named 'mooncake'".

Two request paths: SGLang's own convention done by the client (the same `/generate` body, with
the prefill's `bootstrap_host`/`bootstrap_port` and a random `bootstrap_room`, sent to both
servers at once), and kvpool's conductor in front (`kvpool conductor --engine-protocol sglang`,
which does the same for OpenAI requests). Asserted on what the engines report: greedy output
token ids (and the conductor's text) equal those of a plain SGLang server with the same
settings; the prefill's `sglang:kv_transfer_total_mb` counts a transfer per request and its
megabytes; the decode's `decode_transferred` stage counts the requests.

CPU stand-ins: the kit's (tests/engines/sglang/cpu_shim: `sgl_kernel`, HiCache pinning, unused
here) and one for PD (tests/engines/sglang/pd_shim: the prefill's pinned-memory/CUDA-event
branch for host page indices is turned off, docs/engines.md); the prefill runs with
`--disable-overlap-schedule`, since its early send of a cached prefix under overlap scheduling
records a CUDA event (SGLang's `maybe_send_cached_prefix_chunk`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import REPO
from sglang_server import HOST, SglangServer, free_port

PD_SHIM = Path(__file__).resolve().parent / "pd_shim"
PROMPTS = [
    " ".join(f"alpha{i} beta{i * 7 % 13}" for i in range(90)),
    " ".join(f"gamma{i % 17} delta{i}" for i in range(180)),
]
NEW_TOKENS = 8


class PdServer(SglangServer):
    """An SGLang server launched through kvpool's hook, with the PD CPU stand-in."""

    def command(self) -> List[str]:
        cmd = super().command()
        i = cmd.index("sglang.launch_server")
        return cmd[:i] + ["kvpool.adapters.sglang_pd"] + cmd[i + 1:]

    def environment(self) -> Dict[str, str]:
        env = super().environment()
        env["PYTHONPATH"] = os.pathsep.join((str(PD_SHIM), env["PYTHONPATH"]))
        env["KVPOOL_SGLANG_PD_CPU_SHIM"] = "1"
        return env


def post(url: str, body: dict, out: Dict[str, object], key: str) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out[key] = json.load(r)
    except urllib.error.HTTPError as e:
        out[key] = f"HTTP {e.code}: {e.read()[:2000]!r}"
    except OSError as e:
        out[key] = repr(e)


def generate_body(text: str, max_new: int) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                              "ignore_eos": True}}


def sample(server: SglangServer, metric: str, labels: str = "") -> float:
    """One Prometheus sample of SGLang's /metrics, summed over the label sets holding `labels`."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric + "{") and labels in line:
            total += float(line.rpartition(" ")[2])
    return total


def conductor_cmd(prefill: SglangServer, decode: SglangServer, bootstrap: int,
                  port: int) -> List[str]:
    binary = os.environ.get("KVPOOL_BIN") or str(REPO / "target" / "debug" / "kvpool")
    return [binary, "conductor", "--listen", f"{HOST}:{port}",
            "--admin-listen", f"{HOST}:{free_port()}",
            "--prefill", prefill.url, "--decode", decode.url,
            "--engine-protocol", "sglang", "--bootstrap-port", str(bootstrap),
            "--block-size", "32"]


def wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the conductor exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the conductor did not answer in {timeout} s: {log.read_text()[-3000:]}")


def test_sglang_pd_with_the_mooncake_backend_moves_kv_over_kvpools_engine(model, tmp_path):
    assert importlib.util.find_spec("mooncake") is None, (
        "real Mooncake is installed in this environment: this test shows that SGLang's "
        "mooncake backend runs on kvpool's engine by its absence")
    key = tmp_path / "pool.key"
    key.write_bytes(os.urandom(32))
    bootstrap = free_port()
    env = {"KVPOOL_AUTH_KEY_FILE": str(key), "MOONCAKE_PROTOCOL": "tcp"}
    prefill = PdServer(model, tmp_path / "prefill.log", env=env, flags=[
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap), "--disable-overlap-schedule"])
    decode = PdServer(model, tmp_path / "decode.log", env=env, flags=[
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"])
    plain = SglangServer(model, tmp_path / "plain.log")
    conductor: Optional[subprocess.Popen] = None
    with prefill, decode, plain:
        try:
            for s in (prefill, decode, plain):
                s.wait_ready()
            before_mb = sample(prefill, "sglang:kv_transfer_total_mb_count")
            before_rx = sample(decode, "sglang:per_stage_req_latency_seconds_count",
                               'stage="decode_transferred"')

            # SGLang's convention, client side: both servers at once, paired by the room.
            for text in PROMPTS:
                body = dict(generate_body(text, NEW_TOKENS), bootstrap_host=HOST,
                            bootstrap_port=bootstrap,
                            bootstrap_room=random.randrange(1 << 62))
                out: Dict[str, object] = {}
                threads = [threading.Thread(target=post, args=(f"{s.url}/generate", body,
                                                               out, name))
                           for name, s in (("prefill", prefill), ("decode", decode))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert isinstance(out["decode"], dict), out
                assert isinstance(out["prefill"], dict), out
                base: Dict[str, object] = {}
                post(f"{plain.url}/generate", generate_body(text, NEW_TOKENS), base, "plain")
                assert isinstance(base["plain"], dict), base
                assert out["decode"]["output_ids"] == base["plain"]["output_ids"]
                assert out["prefill"]["output_ids"] == base["plain"]["output_ids"][:1]

            # kvpool's conductor in front (SGLang bootstrap style), OpenAI requests.
            port = free_port()
            clog = tmp_path / "conductor.log"
            with open(clog, "wb") as f:
                conductor = subprocess.Popen(conductor_cmd(prefill, decode, bootstrap, port),
                                             stdout=f, stderr=subprocess.STDOUT)
            wait_up(f"http://{HOST}:{port}/v1/models", conductor, clog)
            for text in PROMPTS:
                body = {"model": str(model), "prompt": text + " again",
                        "max_tokens": NEW_TOKENS, "temperature": 0}
                via: Dict[str, object] = {}
                post(f"http://{HOST}:{port}/v1/completions", body, via, "conductor")
                post(f"{plain.url}/v1/completions", body, via, "plain")
                assert isinstance(via["conductor"], dict), (via, clog.read_text()[-3000:])
                assert isinstance(via["plain"], dict), via
                assert (via["conductor"]["choices"][0]["text"]
                        == via["plain"]["choices"][0]["text"])

            n = 2 * len(PROMPTS)
            transfers = sample(prefill, "sglang:kv_transfer_total_mb_count") - before_mb
            mb = sample(prefill, "sglang:kv_transfer_total_mb_sum")
            received = sample(decode, "sglang:per_stage_req_latency_seconds_count",
                              'stage="decode_transferred"') - before_rx
            assert transfers >= n and mb > 0, (transfers, mb)
            assert received >= n, received
            for s in (prefill, decode):
                log = s.log.read_text(errors="replace")
                assert "peers of this transfer engine are not authenticated" not in log
                assert "Traceback" not in log, log[-3000:]
        finally:
            if conductor is not None and conductor.poll() is None:
                conductor.terminate()
                try:
                    conductor.wait(20)
                except subprocess.TimeoutExpired:
                    conductor.kill()
