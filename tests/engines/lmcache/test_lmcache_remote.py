"""kvpool's remote storage plugin inside LMCache 0.5.6's own engine (README.md beside this file).

Every engine runs in a process of its own (`lmcache_engine.py`), configured by an LMCache
configuration file as a user writes it, against a real kvpool pool.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peers import free_port

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "lmcache_engine.py"
ENGINE_TIMEOUT_S = 120
CHUNK = 256
TOKENS = 3 * CHUNK + 100  # three full chunks and a partial one


def write_config(path: Path, pool, **options) -> Path:
    """An LMCache configuration file with kvpool as its remote storage plugin. ``options``:
    ``save_chunk_meta`` (LMCache's default when absent), ``save_unfull_chunk``, ``master``
    (the pool's by default) and further ``remote_storage_plugin.kvpool.*`` keys in ``plugin``."""
    plugin = {
        "module_path": "kvpool.adapters.lmcache",
        "class_name": "KvpoolConnectorAdapter",
        "master_server_address": options.get("master", pool.master_addr),
        "local_hostname": "127.0.0.1",
        "key_prefix": f"lmcache-test-{secrets.token_hex(4)}/",
        **options.get("plugin", {}),
    }
    extra = {f"remote_storage_plugin.kvpool.{k}": v for k, v in plugin.items()}
    if "save_chunk_meta" in options:
        extra["save_chunk_meta"] = options["save_chunk_meta"]
    lines = [
        f"chunk_size: {CHUNK}",
        "local_cpu: true",
        "max_local_cpu_size: 0.0625",  # GB
        "remote_serde: naive",
        f"save_unfull_chunk: {str(options.get('save_unfull_chunk', False)).lower()}",
        "lmcache_instance_id: kvpool-test",
        'remote_storage_plugins: ["kvpool"]',
        "extra_config:",
        *(f"  {k}: {json.dumps(v)}" for k, v in extra.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_engine(
    action: str, config: Path, out: Path, env: dict, timeout: float = ENGINE_TIMEOUT_S
) -> subprocess.CompletedProcess:
    log = out.parent / f"{out.name}.log"
    try:
        proc = subprocess.run(
            [sys.executable, str(ENGINE), action, "--out", str(out), "--tokens", str(TOKENS)],
            env={**env, "LMCACHE_CONFIG_FILE": str(config)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
        text = "".join(
            b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            for b in (e.stdout, e.stderr)
        )
        log.write_text(text)
        pytest.fail(
            f"LMCache engine ({action}) still running after {timeout} s; its output ends:\n"
            + "\n".join(text.splitlines()[-30:]),
            pytrace=False,
        )
    log.write_text(proc.stdout + proc.stderr)
    return proc


def engine_result(action: str, config: Path, out: Path, env: dict) -> dict:
    proc = run_engine(action, config, out, env)
    assert proc.returncode == 0, (
        f"LMCache engine ({action}) exited {proc.returncode}; its output ends:\n"
        + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    )
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize(
    "save_chunk_meta, save_unfull_chunk, class_name",
    [
        (True, False, "KvpoolConnectorAdapter"),
        (False, False, "KvpoolConnectorAdapter"),
        (True, True, "KvpoolConnectorAdapter"),
        (False, True, "KvpoolConnectorAdapter"),
        # LMCache wraps a bare RemoteConnector class in its own adapter, without metadata.
        (False, False, "KvpoolConnector"),
    ],
    ids=["chunk-meta", "raw", "chunk-meta-unfull", "raw-unfull", "connector-class"],
)
def test_fresh_engine_retrieves_what_another_engine_stored(
    pool, engine_env, tmp_path, save_chunk_meta, save_unfull_chunk, class_name
):
    options = {"save_unfull_chunk": save_unfull_chunk, "plugin": {"class_name": class_name}}
    if not save_chunk_meta:
        options["save_chunk_meta"] = False  # absent: LMCache's default, true
    config = write_config(tmp_path / "lmcache.yaml", pool, **options)
    expect = TOKENS if save_unfull_chunk else TOKENS // CHUNK * CHUNK

    stored = engine_result("store", config, tmp_path / "store", engine_env)
    # LMCache built its remote backend on kvpool's plugin, with the chunk form asked for.
    assert "RemoteBackend-kvpool" in stored["backends"], stored
    assert stored["connector"] == "kvpool.adapters.lmcache.KvpoolConnector", stored
    assert stored["save_chunk_meta"] is save_chunk_meta
    assert stored["healthy"] is True
    # What LMCache says it wrote to its remote backend, and its own lookup of that backend
    # alone (its store counter counts the tokens it was asked to store: all of them).
    assert stored["interval_stored_tokens"] == TOKENS
    assert stored["remote_lookup_tokens"] == expect
    kv = torch.load(tmp_path / "store" / "stored.pt")
    data = kv[:, :, :expect].numel() * kv.element_size()
    assert stored["interval_remote_write_bytes"] == data
    assert stored["interval_remote_write_requests"] >= 1

    got = engine_result("retrieve", config, tmp_path / "retrieve", engine_env)
    assert got["connector"] == "kvpool.adapters.lmcache.KvpoolConnector", got
    # The new engine's local CPU cache is empty: every hit came from the pool.
    assert got["lookup_tokens"] == expect
    assert got["retrieved_tokens"] == expect and got["mask_prefix"] == expect
    assert got["interval_hit_tokens"] == expect
    assert got["interval_remote_read_bytes"] == data
    assert got["interval_remote_read_requests"] >= 1
    assert got["get_blocking_failed_count"] == 0
    retrieved = torch.load(tmp_path / "retrieve" / "retrieved.pt")
    # Byte for byte what the first engine's KV cache held, and nothing past it.
    bits = torch.int16  # compare bfloat16 values as bit patterns
    assert torch.equal(retrieved[:, :, :expect].view(bits), kv[:, :, :expect].view(bits))
    assert not retrieved[:, :, expect:].view(bits).any()


def _wrong_key(tmp_path: Path, env: dict) -> dict:
    bad = tmp_path / "other.key"
    bad.write_bytes(secrets.token_hex(32).encode())
    bad.chmod(0o600)
    return {**env, "KVPOOL_AUTH_KEY_FILE": str(bad)}


BROKEN = {
    # A master address nobody listens on.
    "wrong-master": (lambda pool, tmp: {"master": f"127.0.0.1:{free_port()}"}, None),
    # The engine's key file holds another pool's key.
    "wrong-key": (lambda pool, tmp: {}, _wrong_key),
    # The key file the engine is told about does not exist.
    "missing-key-file": (
        lambda pool, tmp: {},
        lambda tmp, env: {**env, "KVPOOL_AUTH_KEY_FILE": str(tmp / "absent.key")},
    ),
}


@pytest.mark.parametrize("breakage", list(BROKEN))
def test_broken_plugin_configuration_fails_the_engine_build(
    pool, engine_env, tmp_path, breakage
):
    options, env_change = BROKEN[breakage]
    config = write_config(tmp_path / "lmcache.yaml", pool, **options(pool, tmp_path))
    env = env_change(tmp_path, engine_env) if env_change else engine_env
    # A process that does not end is a failure too (LMCache's non-daemon event-loop thread
    # outlives a failed build unless the plugin lets it end).
    proc = run_engine("start", config, tmp_path / "start", env, timeout=90)
    output = proc.stdout + proc.stderr
    # The process dies of the plugin's error (and exits: no LMCache thread keeps it alive),
    # instead of LMCache logging it and serving without remote storage.
    assert proc.returncode != 0, (
        "the engine was built with a broken kvpool plugin:\n" + output[-3000:]
    )
    assert "kvpool.adapters.lmcache.PluginInitError" in output, output[-3000:]
    assert "kvpool LMCache plugin 'kvpool' (plugin://kvpool) could not start" in output
    assert not (tmp_path / "start" / "result.json").exists()
    assert "degraded mode" not in output  # LMCache's handler did not swallow it either


def test_lmcache_own_handling_when_asked_for(pool, engine_env, tmp_path):
    """``fail_on_init_error: false``: LMCache's own handling, an engine without the pool."""
    config = write_config(tmp_path / "lmcache.yaml", pool, plugin={"fail_on_init_error": False})
    env = _wrong_key(tmp_path, engine_env)
    started = engine_result("start", config, tmp_path / "start", env)
    assert "RemoteBackend-kvpool" in started["backends"]
    assert started["connector"] is None  # LMCache's RemoteBackend runs with no connection
