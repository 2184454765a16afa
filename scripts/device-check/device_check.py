"""The GPU device check's measurements (run by scripts/device-check/run.sh).

KV-shaped tensors on the GPU, put into and got back from a running kvpool pool:

* ``api``: one large uint8 tensor on the device, registered with ``register_buffer`` and moved
  as 4 MiB values with ``batch_put_from`` / ``batch_get_into`` (Mooncake's store calls);
* ``connector``: vLLM-shaped KV caches (layers of ``(2, blocks, block_size, heads, head_dim)``
  fp16) saved and loaded block by block through the vLLM connector's worker side
  (``kvpool.adapters.vllm_blocks.BlockIO``): ``device_memory="direct"`` (the caches
  registered, the pool's pinned staging) and ``"staging"`` (the torch copies into a pinned
  buffer the connector used before);

in direct mode, direct mode with per-frame integrity required, and agent mode; every byte
compared with ``torch.equal``. Beside them, in the same run: torch's own device->pinned-host
and pinned-host->device copies of the same bytes, and the ``api`` case on host tensors (the
host-only path). Writes one JSON document; exits 1 when any byte differs.

``--device cpu`` runs all of it on host tensors (no GPU needed: checks the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any, Dict, List

import torch

import kvpool
from kvpool import mooncake
from kvpool.adapters import vllm_blocks as vb

MIB = 1 << 20
VALUE = 4 * MIB


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, f) -> float:
    sync(device)
    t = time.perf_counter()
    f()
    sync(device)
    return time.perf_counter() - t


def gbps(nbytes: int, secs: float) -> float:
    return round(nbytes / secs / 1e9, 3) if secs > 0 else 0.0


def open_store(ready: Dict[str, Any], mode: str) -> Any:
    agent = next(c for c in ready["children"] if c["role"] == "agent")
    cfg = {
        "local_hostname": "127.0.0.1",
        "master_server_addr": ready["master"],
        "auth_key_file": ready["auth_key_file"],
        "protocol": "tcp",
        "mode": "agent" if mode == "agent" else "direct",
        "global_segment_size": 0,
        "local_buffer_size": 256 * MIB,
    }
    if mode == "agent":
        cfg["agent_socket"] = agent["endpoint"]
    if mode == "integrity":
        os.environ["KVPOOL_TRANSFER_INTEGRITY"] = "require"
    else:
        os.environ.pop("KVPOOL_TRANSFER_INTEGRITY", None)
    # "shm": through the agents' shared memory (same node); the other direct modes over TCP.
    os.environ["KVPOOL_SAME_NODE_SHM"] = "on" if mode == "shm" else "off"
    store = mooncake.MooncakeDistributedStore()
    rc = store.setup(cfg)
    if rc != 0:
        raise SystemExit(f"device-check: setup in {mode} mode returned {rc}")
    return store


def api_case(store: Any, device: str, mib: int) -> Dict[str, Any]:
    n = mib * MIB // VALUE
    src = torch.randint(0, 256, (n * VALUE,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    if device == "cpu" and torch.cuda.is_available():
        src, dst = src.pin_memory(), dst.pin_memory()
    for t in (src, dst):
        rc = store.register_buffer(t.data_ptr(), t.numel())
        if rc != 0:
            raise SystemExit(f"device-check: register_buffer returned {rc}")
    keys = [f"dc-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    ptrs = [src.data_ptr() + i * VALUE for i in range(n)]
    back = [dst.data_ptr() + i * VALUE for i in range(n)]
    sizes = [VALUE] * n
    codes: List[int] = []
    put_s = timed(device, lambda: codes.extend(store.batch_put_from(keys, ptrs, sizes)))
    if any(c != 0 for c in codes):
        raise SystemExit(f"device-check: batch_put_from codes {sorted(set(codes))}")
    got: List[int] = []
    get_s = timed(device, lambda: got.extend(store.batch_get_into(keys, back, sizes)))
    if any(g != VALUE for g in got):
        raise SystemExit(f"device-check: batch_get_into results {sorted(set(got))}")
    equal = bool(torch.equal(src, dst))
    for t in (src, dst):
        store.unregister_buffer(t.data_ptr())
    store.remove_all()  # room for the next case
    return {
        "bytes": n * VALUE,
        "bytes_verified": n * VALUE if equal else 0,
        "equal": equal,
        "put_gbps": gbps(n * VALUE, put_s),
        "get_gbps": gbps(n * VALUE, get_s),
    }


def kv_caches(device: str, layers: int, blocks: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (2, blocks, 16, 8, 128)  # K/V, blocks, block_size, KV heads, head_dim
    return {
        f"model.layers.{i}.self_attn": torch.randn(shape, generator=g, dtype=torch.float32)
        .to(torch.float16)
        .to(device)
        for i in range(layers)
    }


def connector_case(store: Any, device: str, how: str, mib: int) -> Dict[str, Any]:
    layers = 8
    per_block = layers * 2 * 16 * 8 * 128 * 2
    blocks = max(2, mib * MIB // per_block)
    src, dst = kv_caches(device, layers, blocks, 1), kv_caches(device, layers, blocks, 2)
    for t in dst.values():
        t.zero_()

    def layout(caches: Dict[str, torch.Tensor]) -> Any:
        lay = vb.BlockLayout(caches, blocks)
        if device == "cpu" and how == "staging":
            lay.on_host = False  # host tensors through the torch staging path (--device cpu)
        return lay

    # On the GPU: "direct" registers the caches, "staging" copies through torch. On the host
    # (--device cpu) "direct" is the in-place host path.
    io_mode = how if device == "cuda" else ("staging" if how == "staging" else "auto")
    save = vb.BlockIO(store, layout(src), device_memory=io_mode)
    load = vb.BlockIO(store, layout(dst), device_memory=io_mode)
    ns = uuid.uuid4().hex[:8]
    keys = [f"dc-{ns}-b{b}" for b in range(blocks)]
    ids = list(range(blocks))
    codes: List[int] = []
    put_s = timed(device, lambda: codes.extend(save.save(keys, ids)))
    if any(c != 0 for c in codes):
        raise SystemExit(f"device-check: connector save codes {sorted(set(codes))}")
    got: List[int] = []
    get_s = timed(device, lambda: got.extend(load.load(keys, ids)))
    if any(g != per_block for g in got):
        raise SystemExit(f"device-check: connector load results {sorted(set(got))}")
    equal = all(torch.equal(src[k], dst[k]) for k in src)
    in_place = save.in_place
    save.close()
    load.close()
    store.remove_all()
    total = blocks * per_block
    return {
        "blocks": blocks,
        "bytes": total,
        "bytes_verified": total if equal else 0,
        "equal": equal,
        "in_place": in_place,
        "save_gbps": gbps(total, put_s),
        "load_gbps": gbps(total, get_s),
    }


def torch_copies(device: str, mib: int) -> Dict[str, Any]:
    if device != "cuda":
        return {"skipped": "no device"}
    src = torch.randint(0, 256, (mib * MIB,), dtype=torch.uint8, device="cuda")
    host = torch.empty(mib * MIB, dtype=torch.uint8).pin_memory()
    d2h = timed(device, lambda: host.copy_(src, non_blocking=True))
    h2d = timed(device, lambda: src.copy_(host, non_blocking=True))
    return {"bytes": mib * MIB, "d2h_gbps": gbps(mib * MIB, d2h), "h2d_gbps": gbps(mib * MIB, h2d)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ready", required=True, help="kvpool up --json's ready line")
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--mib", type=int, default=1024, help="MiB moved per case")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device-check: torch sees no CUDA device (use --device cpu to check the script)")
    ready = json.load(open(a.ready))
    report: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "kvpool_device_memory_supported": kvpool.device_memory_supported(),
        "mib_per_case": a.mib,
        "torch_copies": torch_copies(a.device, a.mib),
        "modes": {},
    }
    if a.device == "cuda" and not report["kvpool_device_memory_supported"]:
        raise SystemExit("device-check: the kvpool wheel does not take GPU memory (built without feature cuda?)")
    for mode in ("direct", "shm", "integrity", "agent"):
        store = open_store(ready, mode)
        try:
            report["modes"][mode] = {
                "api": api_case(store, a.device, a.mib),
                "api_host_only": api_case(store, "cpu", a.mib),
                "connector_direct": connector_case(store, a.device, "direct", a.mib // 4),
                "connector_staging": connector_case(store, a.device, "staging", a.mib // 4),
            }
        finally:
            store.close()
    tc = report["torch_copies"]
    if "d2h_gbps" in tc:
        api = report["modes"]["direct"]["api"]
        report["ratio_put_to_torch_d2h"] = round(api["put_gbps"] / tc["d2h_gbps"], 3)
        report["ratio_get_to_torch_h2d"] = round(api["get_gbps"] / tc["h2d_gbps"], 3)
    cases = [c for m in report["modes"].values() for c in m.values() if "equal" in c]
    report["bytes_verified"] = sum(c["bytes_verified"] for c in cases)
    report["all_equal"] = all(c["equal"] for c in cases)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
