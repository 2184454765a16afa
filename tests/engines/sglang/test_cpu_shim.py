"""The CPU stand-ins themselves (README.md), against the layouts SGLang 0.5.23 defines.

The server tests exercise the HiCache transfer functions only as a round trip (device ->
host pages -> pool -> host pages -> device), which would hide a layout mistake made the same
way in both directions; here each direction is checked against SGLang's page-first-direct host
layout (``MHATokenToKVPoolHost.init_kv_buffer``: ``[K/V, page, layer, token in page, heads,
head dim]``). ``assign_req_to_token_pool_cpu`` is reached in SGLang 0.5.23 only by speculative
decoding, which the server tests do not run, so it is checked here alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent / "cpu_shim"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shim():
    return load("kvpool_test_sglang_cpu_shim", SHIM / "sitecustomize.py")


@pytest.fixture(scope="module")
def kernel():
    return load("kvpool_test_sgl_kernel_standin", SHIM / "sgl_kernel" / "__init__.py")


PAGES, LAYERS, PAGE_SIZE, HEADS, DIM = 4, 3, 2, 2, 5


def host_pool():
    import torch

    return torch.zeros(2, PAGES, LAYERS, PAGE_SIZE, HEADS, DIM)


def device_layers(slots: int):
    """Per layer a K and a V tensor ``[slot, heads, dim]`` whose values name (K/V, layer,
    slot)."""
    import torch

    def layer(kv: int, i: int):
        base = torch.arange(slots, dtype=torch.float32).view(slots, 1, 1) + 1000 * i + 100000 * kv
        return base.expand(slots, HEADS, DIM).clone()

    return [layer(0, i) for i in range(LAYERS)], [layer(1, i) for i in range(LAYERS)]


def test_device_to_host_pages_lands_in_page_first_direct_layout(shim):
    import torch

    host = host_pool()
    ks, vs = device_layers(16)
    device_slots = torch.tensor([9, 10, 3, 4])  # two pages' worth of device slots
    host_slots = torch.tensor([4, 5, 0, 1])  # host pages 2 and 0
    shim.transfer_kv_all_layer_direct_lf_pf(
        ks + vs, [host[0], host[1]], device_slots, host_slots, PAGE_SIZE
    )
    for kv, layers in enumerate((ks, vs)):
        for layer in range(LAYERS):
            for d, h in zip(device_slots.tolist(), host_slots.tolist()):
                page, offset = divmod(h, PAGE_SIZE)
                assert torch.equal(host[kv, page, layer, offset], layers[layer][d])
    assert host[:, 1].abs().sum() == 0 and host[:, 3].abs().sum() == 0  # untouched pages


def test_host_pages_to_device_fills_one_layer(shim):
    import torch

    host = torch.randn(2, PAGES, LAYERS, PAGE_SIZE, HEADS, DIM)
    dev_k, dev_v = torch.zeros(16, HEADS, DIM), torch.zeros(16, HEADS, DIM)
    host_slots = torch.tensor([6, 7, 2, 3])  # host pages 3 and 1
    device_slots = torch.tensor([0, 1, 12, 13])
    shim.transfer_kv_per_layer_direct_pf_lf(
        [host[0], host[1]], [dev_k, dev_v], host_slots, device_slots, 1, PAGE_SIZE
    )
    for kv, dev in enumerate((dev_k, dev_v)):
        for h, d in zip(host_slots.tolist(), device_slots.tolist()):
            page, offset = divmod(h, PAGE_SIZE)
            assert torch.equal(dev[d], host[kv, page, 1, offset])
        untouched = [s for s in range(16) if s not in device_slots.tolist()]
        assert dev[untouched].abs().sum() == 0


def test_assign_req_to_token_pool(kernel):
    import torch

    table = torch.full((4, 8), -1, dtype=torch.int32)
    # Request rows 2 and 0 get tokens [1, 4) and [0, 2); their slots come back to back.
    kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([4, 2]),
        torch.tensor([50, 51, 52, 60, 61]), table.shape[1],
    )
    assert table[2].tolist() == [-1, 50, 51, 52, -1, -1, -1, -1]
    assert table[0].tolist() == [60, 61, -1, -1, -1, -1, -1, -1]
    assert (table[[1, 3]] == -1).all()


def test_other_sgl_kernel_ops_fail_loudly(kernel):
    op = kernel.verify_tree_greedy_cpu  # imported by SGLang's speculative decoding
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        op()
