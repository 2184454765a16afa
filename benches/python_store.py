"""Mooncake Store against kvpool, driven by the same Python code in one run.

Both pools run on 127.0.0.1 over TCP, built the same way: a master (`mooncake_master` or
`kvpool master`) and one holder process that contributes `--capacity` bytes of its memory
(`crates/python/tests/holder.py`); this process is a client of each in turn that contributes
nothing, registers its buffers and calls `put_from` / `get_into` through
`MooncakeDistributedStore` (Mooncake's own class, or `kvpool.mooncake`'s).

Cells: value sizes 64 KiB, 1 MiB and 4 MiB, with one call in flight and with 8 (8 threads
sharing the store, each with its own registered buffer). Each cell puts fresh keys for about
`--seconds`, then reads them back for about as long; the pool is emptied between cells. Both
pools run side by side and the cells alternate between them (Mooncake first in odd rounds,
kvpool first in even ones), `--rounds` times; each side keeps its best figure per cell, so a
burst of load on this shared machine does not land on one side only. The table gives
operations per second and kvpool's ratio over Mooncake per cell.

    scripts/python-env.sh --release && cargo build --release
    .tools/py/bin/python benches/python_store.py --json docs/bench-python.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "crates" / "python" / "tests"))

from kvpool_pool import start_kvpool_pool  # noqa: E402
from peers import LEASE_TTL_MS, start_mooncake_pool  # noqa: E402

SIZES = [64 << 10, 1 << 20, 4 << 20]
INFLIGHT = [1, 8]


def run_cell(store, size: int, inflight: int, seconds: float, capacity: int, tag: str) -> dict:
    """Put fresh keys for `seconds` (bounded by what the pool holds), then get them back."""
    budget = int(capacity * 0.6) // size // inflight  # per thread, well under eviction
    bufs = []
    for _ in range(inflight):
        b = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
        out = np.zeros(size, dtype=np.uint8)
        assert store.register_buffer(b.ctypes.data, size) == 0
        assert store.register_buffer(out.ctypes.data, size) == 0
        bufs.append((b, out))
    done = [0] * inflight
    errors = []

    def putter(t: int) -> None:
        b, _ = bufs[t]
        deadline = time.perf_counter() + seconds
        n = 0
        while n < budget and time.perf_counter() < deadline:
            rc = store.put_from(f"{tag}-{t}-{n}", b.ctypes.data, size)
            if rc != 0:
                errors.append(f"put_from returned {rc}")
                return
            n += 1
        done[t] = n

    def getter(t: int, counts: list) -> None:
        b, out = bufs[t]
        deadline = time.perf_counter() + seconds
        n, i = 0, 0
        while time.perf_counter() < deadline:
            rc = store.get_into(f"{tag}-{t}-{i}", out.ctypes.data, size)
            if rc != size:
                errors.append(f"get_into returned {rc}")
                return
            n += 1
            i = (i + 1) % max(done[t], 1)
        if not np.array_equal(out, b):
            errors.append("bytes read back differ from the bytes put")
        counts[t] = n

    def timed(target, *args) -> float:
        threads = [threading.Thread(target=target, args=(t, *args)) for t in range(inflight)]
        start = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - start

    put_s = timed(putter)
    puts = sum(done)
    counts = [0] * inflight
    get_s = timed(getter, counts)
    gets = sum(counts)
    for b, out in bufs:
        store.unregister_buffer(b.ctypes.data)
        store.unregister_buffer(out.ctypes.data)
    if errors:
        raise RuntimeError(f"{tag}: {errors[0]}")
    return {
        "put_ops": puts / put_s,
        "get_ops": gets / get_s,
        "put_gbps": puts * size / put_s / 1e9,
        "get_gbps": gets * size / get_s / 1e9,
        "puts": puts,
        "gets": gets,
    }


def empty(store) -> None:
    # Reads took leases that Mooncake keeps for its TTL: wait them out, then empty the pool.
    time.sleep(LEASE_TTL_MS / 1000 + 0.3)
    store.remove_all()


def report(name: str, size: int, inflight: int, r: dict) -> None:
    print(
        f"{name:8} {size >> 10:6} KiB x{inflight}: put {r['put_ops']:8.0f}/s "
        f"{r['put_gbps']:6.2f} GB/s   get {r['get_ops']:8.0f}/s {r['get_gbps']:6.2f} GB/s",
        flush=True,
    )


def best(old: dict, new: dict) -> dict:
    if not old:
        return new
    out = dict(old)
    for op in ("put", "get"):
        if new[f"{op}_ops"] > old[f"{op}_ops"]:
            out[f"{op}_ops"], out[f"{op}_gbps"] = new[f"{op}_ops"], new[f"{op}_gbps"]
    return out


def bench(args, tmp: Path) -> dict:
    results = {"mooncake": {}, "kvpool": {}}
    with contextlib.ExitStack() as stack:
        stores = {
            "mooncake": stack.enter_context(start_mooncake_pool(args.capacity, tmp / "mooncake")),
            "kvpool": stack.enter_context(start_kvpool_pool(args.capacity, tmp / "kvpool")),
        }
        stores = {name: pool.new_store() for name, pool in stores.items()}
        for rnd in range(args.rounds):
            order = ["mooncake", "kvpool"] if rnd % 2 == 0 else ["kvpool", "mooncake"]
            for size in args.sizes:
                for inflight in args.inflight:
                    cell = f"{size}/{inflight}"
                    for name in order:
                        tag = f"{name}-{size}-{inflight}-{time.monotonic_ns()}"
                        r = run_cell(stores[name], size, inflight, args.seconds, args.capacity, tag)
                        report(name, size, inflight, r)
                        results[name][cell] = best(results[name].get(cell, {}), r)
                        empty(stores[name])
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per phase of each cell")
    p.add_argument("--capacity", type=int, default=1 << 30, help="bytes each holder contributes")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--inflight", type=int, nargs="+", default=INFLIGHT)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; best per cell")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-python-") as d:
        results = bench(args, Path(d))
    mooncake, kvpool = results["mooncake"], results["kvpool"]
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    print()
    print("| value | in flight | op | Mooncake ops/s | kvpool ops/s | kvpool / Mooncake |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst = None
    for cell, m in mooncake.items():
        k = kvpool[cell]
        size, inflight = cell.split("/")
        for op in ("put", "get"):
            ratio = k[f"{op}_ops"] / m[f"{op}_ops"]
            worst = ratio if worst is None else min(worst, ratio)
            print(
                f"| {int(size) >> 10} KiB | {inflight} | {op} | {m[op + '_ops']:.0f} | "
                f"{k[op + '_ops']:.0f} | {ratio:.2f}x |"
            )
    print(f"\nlowest ratio: {worst:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"mooncake": mooncake, "kvpool": kvpool}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
