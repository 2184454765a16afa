"""The one stand-in of the LMCache tests: a GPU connector whose "GPU" KV cache is a CPU tensor.

LMCache's engine moves KV between the serving engine's cache and its own memory objects only
through a `GPUConnectorInterface` (`batched_from_gpu` when storing, `batched_to_gpu` when
retrieving). Its real connectors (vLLM's paged layouts, SGLang's) call LMCache's CUDA
extension, which does not load here, and its `MockGPUConnector` copies nothing. This one copies,
so what a retrieve writes can be compared byte for byte with what a store read.

The cache is one tensor `[2, num_layers, num_tokens, hidden]` (K and V of every layer for every
token position of one request): the layout of LMCache's KV_2LTD memory objects, so a chunk of
tokens `[start, end)` is the slice `kv[:, :, start:end]` and each copy is one `copy_`. The
tensor is passed as the `kv` keyword of `LMCacheEngine.store` / `retrieve`, which LMCache hands
to the connector unchanged. Nothing else of LMCache is replaced.
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface


class CpuKVConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, hidden: int):
        self.num_layers = num_layers
        self.hidden = hidden

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)
