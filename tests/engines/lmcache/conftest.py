"""Fixtures of the LMCache tests (README.md beside this file).

Run with LMCache's own environment: `scripts/engine-test.sh lmcache` (which installs it with
`scripts/engines.sh lmcache`, builds `kvpool`, and sets KVPOOL_BIN and KVPOOL_TEST_MODELS).
Nothing here skips: a missing LMCache 0.5.6, kvpool package, kvpool binary or test model fails
every test with the reason.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "crates" / "python" / "tests"))  # kvpool_pool.py, peers.py

LMCACHE_VERSION = "0.5.6"
POOL_CAPACITY = 128 << 20
# Variables through which kvpool could find a pool other than the one the test configures.
POOL_ENV = (
    "KVPOOL_MASTER",
    "KVPOOL_MASTER_ADDR",
    "KVPOOL_ENGINE_CONFIG",
    "KVPOOL_CONFIG",
    "MOONCAKE_CONFIG_PATH",
    "KVPOOL_AGENT_SOCKET",
    "KVPOOL_CLIENT_MODE",
    "KVPOOL_STORE_MODULE",
    "LMCACHE_CONFIG_FILE",
)


def _models() -> Path:
    return Path(os.environ.get("KVPOOL_TEST_MODELS") or REPO / ".tools" / "models")


def _missing() -> list:
    why = []
    try:
        version = importlib.metadata.version("lmcache")
        if version != LMCACHE_VERSION:
            why.append(f"LMCache {version} is installed here, the tests are for {LMCACHE_VERSION}")
        import lmcache.v1.cache_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported, never skipped
        why.append(f"LMCache {LMCACHE_VERSION} does not import in {sys.executable}: {e}")
    try:
        import kvpool.adapters.lmcache  # noqa: F401
    except Exception as e:  # noqa: BLE001
        why.append(f"the kvpool package does not import in {sys.executable}: {e}")
    try:
        from kvpool_pool import kvpool_binary

        if not kvpool_binary().exists():
            why.append(f"no kvpool binary at {kvpool_binary()}")
    except Exception as e:  # noqa: BLE001
        why.append(f"no kvpool binary: {e}")
    if not (_models() / "tiny" / "config.json").exists():
        why.append(f"no test model at {_models() / 'tiny'}")
    return why


@pytest.fixture(scope="session", autouse=True)
def engine_installed():
    why = _missing()
    if why:
        pytest.fail(
            "the LMCache engine tests cannot run: " + "; ".join(why)
            + ". Run them with scripts/engine-test.sh lmcache (it installs LMCache "
            f"{LMCACHE_VERSION} with scripts/engines.sh lmcache).",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A real kvpool pool on 127.0.0.1 (master and one holder process); its key file is in
    KVPOOL_AUTH_KEY_FILE while it runs, as the operator gives it to engine pods."""
    from kvpool_pool import start_kvpool_pool

    with start_kvpool_pool(POOL_CAPACITY, tmp_path_factory.mktemp("pool")) as p:
        yield p


@pytest.fixture
def engine_env(pool):
    """The environment of an engine process: the pool's key file, no other way to a pool, and
    the test model."""
    env = {k: v for k, v in os.environ.items() if k not in POOL_ENV}
    env["KVPOOL_TEST_MODELS"] = str(_models())
    env["PYTHONUNBUFFERED"] = "1"
    # LMCache hashes token chunks with Python's hash(): engines that share a cache must agree
    # on the seed (LMCache's own advice for production).
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env
