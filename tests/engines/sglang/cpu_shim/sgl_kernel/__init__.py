"""Test stand-in for the ``sgl_kernel`` package on the CPU (tests/engines/sglang/README.md).

SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports its CPU kernels from
``sgl_kernel`` at module load, and no PyPI wheel carries them (``sgl-kernel`` and
``sglang-kernel`` are CUDA builds). The server tests' path imports these names:
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``),
``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``) and six ops of
speculative decoding (``sglang/kernels/ops/speculative/``); it calls none of them.

``assign_req_to_token_pool_cpu`` is written here in torch. Every other name resolves to a
function that raises NotImplementedError naming the op, so a test that reaches an op this
stand-in does not provide fails loudly instead of computing something else.
"""

from __future__ import annotations

import torch

__all__ = ["assign_req_to_token_pool_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write the newly allocated KV slots of a batch into the request-to-token table.

    Request ``i`` of the batch owns row ``req_pool_indices[i]`` of ``req_to_token`` (rows of
    ``pool_len`` entries); its new tokens occupy columns ``start_offset[i]`` up to
    ``end_offset[i]``. ``out_cache_loc`` holds the slots of all requests back to back, in batch
    order, so request ``i``'s slots start after the lengths of requests ``0..i-1``.
    """
    consumed = 0
    for row, lo, hi in zip(req_pool_indices.tolist(), start_offset.tolist(),
                           end_offset.tolist()):
        n = int(hi) - int(lo)
        if n <= 0:
            continue
        if hi > pool_len:
            raise IndexError(f"token column {hi} past the table width {pool_len}")
        req_to_token[int(row), int(lo):int(hi)] = out_cache_loc[consumed:consumed + n].to(
            req_to_token.dtype
        )
        consumed += n


def __getattr__(name: str):
    """Any other op: importable (SGLang's modules import them at load), failing when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def not_provided(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by kvpool's test stand-in "
            "(tests/engines/sglang/cpu_shim/sgl_kernel): the test took a path it does not cover"
        )

    not_provided.__name__ = name
    return not_provided
