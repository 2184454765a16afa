"""The driver of `kvpool bench stress`: the shape of Mooncake's stress benchmark, run the same way
against kvpool (`kvpool.mooncake`) and against Mooncake Store (`mooncake.store`).

Written for kvpool against the public Mooncake store API both packages offer
(`MooncakeDistributedStore.setup`, `register_buffer`, `batch_put_from`, `batch_get_into`,
`batch_put_from_multi_buffers`, `batch_get_into_multi_buffers`, `remove_all`, `close`); no
numpy, buffers are ctypes arrays registered once.

    python stress.py cells --store kvpool --master HOST:PORT --cells JSON --logs DIR
    python stress.py cells --store mooncake --master-bin BIN --holders 2 --capacity BYTES \
        --cells JSON --logs DIR
    python stress.py writer|reader --store S --master HOST:PORT --size B --batch N \
        --values N --parts P --prefix KEY

`cells` runs, for every cell (value size, values per batch call, parts per value), a writer
process and then a reader process, one after the other, each a fresh process with one store
and one call in flight, as Mooncake's stress benchmark runs its prefill (writer) and decode
(reader) roles. The writer puts `values` fresh keys in batch calls from one registered region
(`parts` == 1: `batch_put_from`, one range per value) or from `parts` registered regions
(`batch_put_from_multi_buffers`, one range per part, as an engine's K and V caches); the
reader gets them back with the matching call into regions of its own and compares every
value's bytes with what was put (outside the timing). Each side first puts and gets one
warm-up key outside the timing (connections are made on first use by both stores; the warm-up
put is retried for up to 15 s while a fresh pool has no room yet). Against
Mooncake every cell gets a fresh `mooncake_master` and holders (`mooncake_store.Pool`);
against kvpool the caller starts a fresh pool per cell too (and the reader still empties it with
`remove_all(force)`).
One JSON object on stdout: per cell and role the values moved, the time inside the calls,
values per second, bytes per second, p50/p99 latency of one call, failures and gets verified.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import time

HOST = "127.0.0.1"
# Rotation step between values: every value is a different window of the base pattern.
STEP = 7919


def open_store(args):
    if args.store == "kvpool":
        from kvpool.mooncake import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        raise RuntimeError(f"setup() returned {rc}")
    return store


class Layout:
    """`parts` registered regions of `batch` slots each; slot j of region p holds part p of
    the j-th value of a batch call."""

    def __init__(self, store, size: int, batch: int, parts: int):
        if size % parts:
            raise ValueError(f"size {size} is not a multiple of parts {parts}")
        self.size, self.batch, self.parts, self.part = size, batch, parts, size // parts
        self.regions = [(ctypes.c_ubyte * (self.part * batch))() for _ in range(parts)]
        for r in self.regions:
            rc = store.register_buffer(ctypes.addressof(r), len(r))
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        self.views = [memoryview(r).cast("B") for r in self.regions]

    def ptrs(self, j: int):
        return [ctypes.addressof(r) + j * self.part for r in self.regions]

    def slot(self, p: int, j: int):
        return self.views[p][j * self.part:(j + 1) * self.part]


def base_pattern(size: int) -> bytes:
    return random.Random(size).randbytes(2 * size)


def offset_of(i: int, size: int) -> int:
    return (i * STEP) % size


def percentile(sorted_us, q: float) -> int:
    if not sorted_us:
        return 0
    return int(sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))])


def role(args) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    put = args.mode == "writer"
    store = open_store(args)
    lay = Layout(store, args.size, args.batch, args.parts)
    base = base_pattern(args.size)
    base_ptr = ctypes.cast(ctypes.c_char_p(base), ctypes.c_void_p).value
    part = lay.part

    def fill(j: int, i: int):
        r = offset_of(i, args.size)
        for p in range(args.parts):
            ctypes.memmove(lay.ptrs(j)[p], base_ptr + r + p * part, part)

    def check(j: int, i: int) -> bool:
        r = offset_of(i, args.size)
        return all(lay.slot(p, j) == base[r + p * part:r + (p + 1) * part]
                   for p in range(args.parts))

    def call(keys):
        n = len(keys)
        if args.parts == 1:
            ptrs = [lay.ptrs(j)[0] for j in range(n)]
            sizes = [args.size] * n
            if put:
                return store.batch_put_from(keys, ptrs, sizes)
            return store.batch_get_into(keys, ptrs, sizes)
        ptrs = [lay.ptrs(j) for j in range(n)]
        sizes = [[part] * args.parts for _ in range(n)]
        if put:
            return store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        return store.batch_get_into_multi_buffers(keys, ptrs, sizes)

    want = 0 if put else args.size
    # Warm-up: one value of its own, outside the timing.
    # Retried for a while: a pool just started may not have mounted its holders' memory yet
    # (Mooncake answers -200, no space, until it has).
    warm = [f"{args.prefix}/warm"]
    if put:
        fill(0, 0)
    deadline = time.monotonic() + 15
    while list(rc := call(warm)) != [want]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up {'put' if put else 'get'} returned {list(rc)}")
        time.sleep(0.1)

    lat, failures, verified, error = [], 0, 0, None
    inside = 0.0
    for first in range(0, args.values, args.batch):
        idx = list(range(first, min(first + args.batch, args.values)))
        keys = [f"{args.prefix}/{i}" for i in idx]
        if put:
            for j, i in enumerate(idx):
                fill(j, i)
        t0 = time.perf_counter()
        try:
            codes = list(call(keys))
        except Exception as e:  # noqa: BLE001 - counted and reported
            codes = [-1] * len(keys)
            error = error or repr(e)
        dt = time.perf_counter() - t0
        inside += dt
        lat.append(dt * 1e6)
        for j, (i, rc) in enumerate(zip(idx, codes)):
            if rc != want:
                failures += 1
                error = error or f"{keys[j]}: returned {rc}, expected {want}"
            elif not put:
                if check(j, i):
                    verified += 1
                else:
                    failures += 1
                    error = error or f"{keys[j]}: the bytes read are not the bytes put"
    if not put:
        store.remove_all(True)
    store.close()
    lat.sort()
    done = args.values - failures
    print(json.dumps({
        "values": done,
        "calls": len(lat),
        "failures": failures,
        "seconds": inside,
        "values_per_second": done / max(inside, 1e-9),
        "bytes_per_second": done * args.size / max(inside, 1e-9),
        "p50_us": percentile(lat, 0.5),
        "p99_us": percentile(lat, 0.99),
        "verified": verified,
        "first_error": error,
    }), flush=True)
    return 0


def run_role(args, mode: str, cell, master: str, log: str):
    cmd = [sys.executable, "-u", os.path.abspath(__file__), mode, "--store", args.store,
           "--master", master, "--size", str(cell["size"]), "--batch", str(cell["batch"]),
           "--values", str(cell["values"]), "--parts", str(cell["parts"]),
           "--prefix", cell["prefix"]]
    with open(log, "ab") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                             timeout=600)
    lines = [l for l in out.stdout.decode(errors="replace").splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        with open(log, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace")
        raise RuntimeError(f"{mode} of cell {cell} failed ({out.returncode}): {tail}")
    return json.loads(lines[-1])


def cells(args) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    todo = json.loads(args.cells)
    results = []
    for n, cell in enumerate(todo):
        cell = dict(cell, prefix=f"stress/{os.getpid()}/{n}")
        log = os.path.join(args.logs, f"stress-{args.store}-{n}.log")
        pool = None
        master = args.master
        if args.store == "mooncake":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from mooncake_store import Pool

            pool = Pool(args, f"stress-{n}")
            master = pool.addr
        try:
            put = run_role(args, "writer", cell, master, log)
            get = run_role(args, "reader", cell, master, log)
        finally:
            if pool is not None:
                pool.close()
        row = {k: cell[k] for k in ("size", "batch", "parts", "values")} | {"put": put, "get": get}
        if pool is not None:
            row["master_pid"] = pool.procs[0].pid
        results.append(row)
    version = ""
    try:
        from importlib.metadata import version as v

        version = v("kvpool" if args.store == "kvpool" else "mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001 - the version is informative only
        pass
    print(json.dumps({"store": args.store, "version": version, "cells": results}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cells")
    c.add_argument("--store", choices=["kvpool", "mooncake"], required=True)
    c.add_argument("--master", default="")
    c.add_argument("--master-bin", default="")
    c.add_argument("--holders", type=int, default=2)
    c.add_argument("--capacity", type=int, default=256 << 20)
    c.add_argument("--cells", required=True)
    c.add_argument("--logs", required=True)
    for mode in ("writer", "reader"):
        r = sub.add_parser(mode)
        r.add_argument("--store", choices=["kvpool", "mooncake"], required=True)
        r.add_argument("--master", required=True)
        r.add_argument("--size", type=int, required=True)
        r.add_argument("--batch", type=int, required=True)
        r.add_argument("--values", type=int, required=True)
        r.add_argument("--parts", type=int, default=1)
        r.add_argument("--prefix", required=True)
    args = p.parse_args()
    return cells(args) if args.mode == "cells" else role(args)


if __name__ == "__main__":
    sys.exit(main())
