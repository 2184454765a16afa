"""vLLM's own ``MooncakeConnector`` (P2P prefill -> decode) over kvpool's transfer engine.

Name this module as vLLM's ``kv_connector_module_path`` and keep vLLM's connector name::

    --kv-transfer-config '{"kv_connector": "MooncakeConnector",
                           "kv_connector_module_path": "kvpool.adapters.vllm_mooncake",
                           "kv_role": "kv_producer", ...}'

vLLM's factory (``KVConnectorFactory.get_connector_class``) imports the module path first and
takes ``getattr(module, kv_connector)``; it does so in every process that builds a connector
(the scheduler's and each worker's). vLLM's connector module
(``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py``) binds
``TransferEngine`` once, when it loads (``from mooncake.engine import TransferEngine``), so
this module imports it inside :func:`kvpool.adapters.mooncake_engine_alias`: the name then
binds :class:`kvpool.mooncake_engine.TransferEngine`, and the connector class exported here is
vLLM's, unmodified. Nothing of vLLM is patched; real Mooncake need not be installed.

If vLLM's module was already imported before (under the real ``mooncake.engine``, or without
it, when vLLM binds ``None``), it is imported again under the alias, so the connector built
from this path always moves KV with kvpool's engine.

I/O boundary: the import of vLLM's module (and ``sys.modules`` while the alias is active).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

from . import attach_engine_logging, mooncake_engine_alias

__all__ = ["MooncakeConnector", "VLLM_MODULE", "connector_module"]

VLLM_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

_log = logging.getLogger("kvpool.adapters.vllm_mooncake")


def connector_module() -> types.ModuleType:
    """vLLM's Mooncake connector module with ``TransferEngine`` bound to kvpool's class."""
    with mooncake_engine_alias() as engine:
        module = sys.modules.get(VLLM_MODULE)
        if module is None:
            module = importlib.import_module(VLLM_MODULE)
        if getattr(module, "TransferEngine", None) is not engine.TransferEngine:
            module = importlib.reload(module)
    if module.TransferEngine is not engine.TransferEngine:
        raise ImportError(
            f"{VLLM_MODULE} did not bind TransferEngine from mooncake.engine; "
            "this vLLM's MooncakeConnector cannot be put over kvpool's transfer engine"
        )
    attach_engine_logging()
    _log.info(
        "vLLM's MooncakeConnector (%s) moves KV with kvpool's transfer engine (%s.%s)",
        VLLM_MODULE,
        engine.TransferEngine.__module__,
        engine.TransferEngine.__qualname__,
    )
    return module


_module = connector_module()

#: vLLM's ``MooncakeConnector`` class itself (its module's ``TransferEngine`` is kvpool's).
MooncakeConnector = _module.MooncakeConnector
