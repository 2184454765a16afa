"""HiCache-on-CPU shim for the SGLang 0.5.23 servers the real-engine tests start.

Python imports ``sitecustomize`` at start-up in every process whose PYTHONPATH holds this
directory: the server, and its scheduler and detokenizer children. It does nothing unless
``KVPOOL_SGLANG_CPU_SHIM=1`` (the tests set it). Then it patches two SGLang modules right after
they load, and only what a CPU process lacks (tests/engines/sglang/README.md says why each):

- ``sglang.srt.mem_cache.pool_host.base``: HiCache host pools are built with
  ``pin_memory=True`` whatever the device (SGLang's CPU platform says pinned memory is not
  available, but the pool does not ask it). Pinning means CUDA page-locking
  (``cudaHostRegister`` of the pool, ``torch.zeros(pin_memory=True)`` for the page buffers of
  the copying storage path), which needs a CUDA driver and means nothing for the CPU engine,
  whose "device" KV cache is host memory too. ``HostKVCache.pin_memory`` reads False here.
- ``sglang.srt.mem_cache.pool_host.mha``: with ``--hicache-io-backend direct`` and
  ``--hicache-mem-layout page_first_direct`` the MHA host pool calls
  ``transfer_kv_per_layer_direct_pf_lf`` (host pages -> device, one layer) and
  ``transfer_kv_all_layer_direct_lf_pf`` (device -> host pages, all layers), which that module
  imports from ``sgl_kernel.kvcacheio`` only on CUDA/ROCm. They are defined here in torch, as
  indexed copies between the two layouts.

Nothing else in SGLang is changed: its host pool, cache controller, radix tree, storage
threads and the storage backend interface run as released.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENABLE_VAR = "KVPOOL_SGLANG_CPU_SHIM"
BASE = "sglang.srt.mem_cache.pool_host.base"
MHA = "sglang.srt.mem_cache.pool_host.mha"


class _NeverPinned:
    """``HostKVCache.pin_memory``: always False; what a pool sets it to is ignored."""

    def __get__(self, obj, owner=None):
        return False

    def __set__(self, obj, value):
        pass


def _patch_base(module) -> None:
    module.HostKVCache.pin_memory = _NeverPinned()


def _host_token_coords(indices, page_size: int):
    """Host token slots of a page-first-direct pool as (page, offset within page)."""
    import torch  # only once SGLang (which imports torch) loads the module patched

    idx = indices.to(device="cpu", dtype=torch.int64)
    return idx // page_size, idx % page_size


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    """Host (page-first-direct: ``[page, layer, token in page, heads, dim]`` per K and V)
    -> device (``[slot, heads, dim]``, one tensor per layer and K/V), for one layer: device
    slot ``dst_indices[i]`` receives host token slot ``src_indices[i]`` of layer
    ``layer_id``."""
    pages, offsets = _host_token_coords(src_indices, page_size)
    dst_idx = dst_indices.to(device="cpu", dtype=pages.dtype)
    for host, dev in zip(src_ptrs, dst_ptrs):
        dev[dst_idx] = host[pages, layer_id, offsets].to(dev.dtype)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device -> host, every layer: ``src_ptrs`` are the device K tensors of all layers then the
    V tensors, ``dst_ptrs`` the host K and V page-first-direct tensors; host token slot
    ``dst_indices[i]`` of each layer receives device slot ``src_indices[i]``."""
    pages, offsets = _host_token_coords(dst_indices, page_size)
    src_idx = src_indices.to(device="cpu", dtype=pages.dtype)
    layers = len(src_ptrs) // len(dst_ptrs)
    for part, host in enumerate(dst_ptrs):
        for layer in range(layers):
            dev = src_ptrs[part * layers + layer]
            host[pages, layer, offsets] = dev[src_idx].to(host.dtype)


def _patch_mha(module) -> None:
    for fn in (transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
        if not hasattr(module, fn.__name__):  # a GPU build keeps its own kernels
            setattr(module, fn.__name__, fn)


PATCHES = {BASE: _patch_base, MHA: _patch_mha}


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds the modules in PATCHES the normal way and runs their patch after they execute."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(ENABLE_VAR) == "1":
    sys.meta_path.insert(0, _PatchAfterLoad())
