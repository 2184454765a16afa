"""The mechanics of the engine hooks over kvpool's transfer engine: `kvpool.adapters.sglang_pd`
(SGLang's launcher with the alias in every process; last test) and
`kvpool.adapters.vllm_mooncake`, vLLM's `kv_connector_module_path` hook for its own
`MooncakeConnector`: the connector module it imports binds kvpool's
`TransferEngine`, whether or not that module was imported before, and `mooncake.engine` is
what it was once the import is done. vLLM is not installed in this environment, so vLLM's
module is stood in for by one with the same import (`from mooncake.engine import
TransferEngine` at load, `None` when that fails) and the same dotted name; the real engine run
is tests/engines/vllm/test_vllm_mooncake_pd.py.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import kvpool.mooncake_engine as kv_engine

HOOK = "kvpool.adapters.vllm_mooncake"
PARTS = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector".split(".")
SOURCE = '''
try:
    from mooncake.engine import TransferEngine
except ImportError:
    TransferEngine = None


class MooncakeConnector:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self.engine = TransferEngine()
'''


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch):
    d = tmp_path
    for part in PARTS[:-1]:
        d = d / part
        d.mkdir()
        (d / "__init__.py").write_text("")
    (d / f"{PARTS[-1]}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {k: v for k, v in sys.modules.items()
             if k == "vllm" or k.startswith("vllm.") or k == HOOK
             or k in ("mooncake", "mooncake.engine")}
    for k in saved:
        sys.modules.pop(k)
    importlib.invalidate_caches()
    yield ".".join(PARTS)
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.") or k == HOOK
              or k in ("mooncake", "mooncake.engine")]:
        sys.modules.pop(k)
    sys.modules.update(saved)


def test_the_hook_gives_vllms_connector_kvpools_engine(stand_in):
    hook = importlib.import_module(HOOK)
    module = sys.modules[stand_in]
    assert hook.MooncakeConnector is module.MooncakeConnector
    assert module.TransferEngine is kv_engine.TransferEngine
    assert isinstance(hook.MooncakeConnector(None, None).engine, kv_engine.TransferEngine)
    # The alias is gone again: whatever `mooncake.engine` was (real Mooncake in this
    # environment, or nothing), it is not kvpool's module.
    assert sys.modules.get("mooncake.engine") is not kv_engine


def test_a_connector_module_imported_before_is_imported_again_under_the_alias(stand_in):
    sys.modules.pop("mooncake.engine", None)
    sys.modules.pop("mooncake", None)
    early = importlib.import_module(stand_in)
    assert early.TransferEngine is not kv_engine.TransferEngine
    hook = importlib.import_module(HOOK)
    assert sys.modules[stand_in].TransferEngine is kv_engine.TransferEngine
    assert hook.MooncakeConnector is sys.modules[stand_in].MooncakeConnector


def test_the_sglang_launcher_installs_the_alias_for_the_whole_process(tmp_path):
    """`kvpool.adapters.sglang_pd`: as the main module, or as the copy a spawned SGLang
    process imports (`__mp_main__`), it makes `mooncake.engine` kvpool's module for good; a
    plain import does nothing; `plugin()` (SGLang's general-plugin entry point) installs it."""
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text(
        "import runpy, sys, importlib\n"
        "import kvpool.adapters.sglang_pd as pd\n"
        "import kvpool.mooncake_engine as kv\n"
        "assert sys.modules.get('mooncake.engine') is not kv\n"
        "runpy.run_module('kvpool.adapters.sglang_pd', run_name='__mp_main__')\n"
        "from mooncake.engine import TransferEngine\n"
        "assert TransferEngine is kv.TransferEngine, TransferEngine\n"
        "assert pd.install() in (True, False)\n"
        "pd.plugin()\n"
        "from mooncake.engine import TransferEngine as again\n"
        "assert again is kv.TransferEngine\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
