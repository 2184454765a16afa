"""Fixtures of the SGLang real-engine tests (README.md): the engine check, the model, a kvpool
pool.

Run by ``scripts/engine-test.sh sglang`` with the SGLang environment's Python
(``.tools/sglang/bin/python``), ``KVPOOL_BIN`` (the kvpool binary) and ``KVPOOL_TEST_MODELS``
(the test models) set. Without SGLang 0.5.23, the kvpool package, the binary or the model the
tests fail, saying what to run; they never skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "crates" / "python" / "tests"))  # kvpool_pool, peers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sglang_server

SGLANG_VERSION = "0.5.23"
SETUP_HINT = "install it with scripts/engines.sh sglang, or run scripts/engine-test.sh sglang"
POOL_BYTES = 256 << 20


def _engine_problem() -> str:
    """Why the tests cannot run here, or "" (cheap: nothing of SGLang is imported)."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    if found is None or find_spec("sglang") is None:
        return f"SGLang is not installed for {sys.executable}: {SETUP_HINT}"
    if found != SGLANG_VERSION:
        return f"these tests are written for SGLang {SGLANG_VERSION}, {sys.executable} has {found}"
    try:
        import kvpool.mooncake  # noqa: F401 - the native extension loads
    except Exception as e:  # noqa: BLE001 - reported as the failure
        return f"the kvpool package is not importable with {sys.executable} ({e!r}): {SETUP_HINT}"
    binary = os.environ.get("KVPOOL_BIN") or str(REPO / "target" / "debug" / "kvpool")
    if not Path(binary).is_file():
        return f"no kvpool binary at {binary}: cargo build --bin kvpool, or set KVPOOL_BIN"
    return ""


@pytest.fixture(scope="session", autouse=True)
def sglang_engine() -> None:
    problem = _engine_problem()
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def model() -> Path:
    root = Path(os.environ.get("KVPOOL_TEST_MODELS") or REPO / ".tools" / "models")
    tiny = root / "tiny"
    if not (tiny / "config.json").is_file():
        pytest.fail(f"no test model at {tiny} (set KVPOOL_TEST_MODELS): {SETUP_HINT}",
                    pytrace=False)
    return tiny


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A real kvpool pool on 127.0.0.1 (``kvpool master`` and one holder process contributing
    ``POOL_BYTES``), shared by every server of a module; its address and key reach the servers
    through ``KVPOOL_MASTER`` and ``KVPOOL_AUTH_KEY_FILE``."""
    from kvpool_pool import start_kvpool_pool

    with start_kvpool_pool(POOL_BYTES, tmp_path_factory.mktemp("pool")) as p:
        yield p
