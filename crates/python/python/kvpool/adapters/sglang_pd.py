"""SGLang's PD disaggregation with the mooncake backend over kvpool's transfer engine.

``python -m kvpool.adapters.sglang_pd ARGS...`` runs ``python -m sglang.launch_server ARGS...``
(the same arguments: ``--disaggregation-mode prefill|decode
--disaggregation-transfer-backend mooncake ...``) with ``mooncake.engine`` resolving to
:mod:`kvpool.mooncake_engine` in every process of the server. SGLang imports
``from mooncake.engine import TransferEngine`` inside ``MooncakeTransferEngine.__init__``
(``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``), in its scheduler
processes, which it starts with multiprocessing's ``spawn``: a spawned child imports the
parent's main module again (as ``__mp_main__``), so this module installs the alias whenever
it runs as the main module or as that copy. Nothing of SGLang is patched, and real Mooncake
need not be installed.

:func:`plugin` does the same as a general plugin of SGLang's plugin framework (entry point
group ``sglang.srt.plugins``, loaded by ``load_plugins()`` in the launcher and in each
scheduler process), for deployments that register it instead of using this launcher.

The pool key reaches kvpool's engine as for every kvpool lane (``KVPOOL_AUTH_KEY_FILE`` in the
servers' environment); ``MOONCAKE_PROTOCOL=tcp`` keeps SGLang from asking for RDMA (kvpool's
engine serves ``rdma`` over TCP, with a warning).

I/O boundary: ``sys.modules`` (the alias, for the life of the process) and SGLang's launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, List, Optional

__all__ = ["install", "main", "plugin"]

_log = logging.getLogger("kvpool.adapters.sglang_pd")
_lock = threading.Lock()
_active: Optional[contextlib.AbstractContextManager[Any]] = None


def install() -> bool:
    """Makes ``mooncake.engine`` kvpool's transfer engine module for the rest of this
    process's life; True the first time, False when it already was."""
    global _active
    with _lock:
        if _active is not None:
            return False
        from .. import mooncake_engine

        alias = mooncake_engine.alias()
        alias.__enter__()
        _active = alias
    _log.info(
        "mooncake.engine is kvpool's transfer engine in process %d: SGLang's PD "
        "(MooncakeTransferEngine) moves KV with kvpool.mooncake_engine.TransferEngine",
        os.getpid(),
    )
    return True


def plugin() -> None:
    """SGLang general-plugin entry point (group ``sglang.srt.plugins``): :func:`install`."""
    install()


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m sglang.launch_server ARGV`` with the alias installed (see the module docs)."""
    install()
    from sglang.launch_server import run_server  # type: ignore[import-not-found]
    from sglang.srt.plugins import load_plugins  # type: ignore[import-not-found]
    from sglang.srt.server_args import prepare_server_args  # type: ignore[import-not-found]
    from sglang.srt.utils import kill_process_tree  # type: ignore[import-not-found]

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


# The launcher's process, and each process SGLang spawns from it (they import the main module
# again as ``__mp_main__``).
if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":
    sys.exit(main())
