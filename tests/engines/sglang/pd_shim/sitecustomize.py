"""The CPU stand-ins of SGLang's PD disaggregation for tests/engines/sglang/test_sglang_mooncake_pd.py.

Python imports one ``sitecustomize`` at start-up: with this directory first on PYTHONPATH it
is this one, which runs the kit's (``../cpu_shim/sitecustomize.py``: the HiCache-on-CPU shim,
itself inactive unless ``KVPOOL_SGLANG_CPU_SHIM=1``), then, only when
``KVPOOL_SGLANG_PD_CPU_SHIM=1``, adds the one stand-in the PD path needs on a CPU:

SGLang 0.5.23's prefill scheduler (``sglang/srt/disaggregation/prefill.py``,
``_send_kv_chunk``, lines 1746-1761) takes a CUDA-only branch when the KV sender says
``supports_host_tensor_indices`` (``MooncakeKVSender`` does, ``disaggregation/mooncake/
conn.py`` line 3312): it allocates the page indices with ``torch.empty(..., device="cpu",
pin_memory=True)`` (CUDA page-locking: "RuntimeError: Found no NVIDIA driver on your system")
and then records a ``torch.cuda.Event`` on ``torch.cuda.current_stream()``. The attribute
reads False here, so the scheduler takes its other branch (``kv_to_page_indices`` on the
host), the one every sender without that optimisation uses. Nothing else of SGLang changes:
its bootstrap server, the Mooncake KV manager, sender and receiver run as released, and their
transfer calls go to whatever ``mooncake.engine`` is (kvpool's, through
``python -m kvpool.adapters.sglang_pd``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from pathlib import Path

ENABLE_VAR = "KVPOOL_SGLANG_PD_CPU_SHIM"
CONN = "sglang.srt.disaggregation.mooncake.conn"

runpy.run_path(str(Path(__file__).resolve().parent.parent / "cpu_shim" / "sitecustomize.py"),
               run_name="kvpool_sglang_cpu_shim")


def _patch(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds SGLang's Mooncake connection module the normal way and patches it once loaded."""

    def find_spec(self, name, path, target=None):
        if name != CONN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(ENABLE_VAR) == "1":
    sys.meta_path.insert(0, _PatchAfterLoad())
