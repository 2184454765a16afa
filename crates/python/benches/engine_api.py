"""Mooncake's transfer engine against kvpool's, through the same Python API in one run.

Each side is a pair of engines on 127.0.0.1 over TCP, built the same way: a target process
that initializes `TransferEngine` (P2P handshake), registers `--region` bytes and waits, and
this process, the initiator, which registers as much and calls `batch_transfer_sync_write` /
`batch_transfer_sync_read` with `--batch` requests of one size per call, as SGLang's PD and
vLLM's MooncakeConnector do. The class is `mooncake.engine.TransferEngine` (Mooncake
0.3.13.post1) or `kvpool.mooncake_engine.TransferEngine`; the wire protocols differ, so each
initiator talks to a target of its own kind.

Cells: request sizes 64 KiB, 1 MiB and 4 MiB, write and read. Each cell runs for about
`--seconds`; the cells alternate between the two sides (Mooncake first in odd rounds, kvpool
first in even ones), `--rounds` times, and each side keeps its best figure per cell, so a burst
of load on this shared machine does not land on one side only. Printed: GB/s per side and
kvpool's ratio over Mooncake per cell.

    scripts/python-env.sh --release
    .tools/py/bin/python crates/python/benches/engine_api.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import time
from typing import Any, Dict, List, Tuple

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

HOST = "127.0.0.1"
SIZES = [64 << 10, 1 << 20, 4 << 20]


def _module(side: str) -> Any:
    if side == "mooncake":
        import mooncake.engine as m
    else:
        import kvpool.mooncake_engine as m
    return m


def _target(side: str, region: int, conn: Any) -> None:
    """The target process: serve `region` registered bytes until told to stop."""
    m = _module(side)
    e = m.TransferEngine()
    if e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        conn.send(("error", "initialize failed"))
        return
    buf = ctypes.create_string_buffer(region)
    addr = ctypes.addressof(buf)
    if e.register_memory(addr, region) != 0:
        conn.send(("error", "register_memory failed"))
        return
    conn.send(("ok", (f"{HOST}:{e.get_rpc_port()}", addr)))
    conn.recv()  # stop


class Side:
    def __init__(self, side: str, region: int) -> None:
        self.name = side
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(side, region, child), daemon=True)
        self.proc.start()
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{side} target: {value}")
        self.session, self.remote = value
        m = _module(side)
        self.engine = m.TransferEngine()
        if self.engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"{side}: initialize failed")
        self.buf = ctypes.create_string_buffer(region)
        self.local = ctypes.addressof(self.buf)
        if self.engine.register_memory(self.local, region) != 0:
            raise RuntimeError(f"{side}: register_memory failed")
        self.check()

    def check(self) -> None:
        """Write a pattern to the target and read it back elsewhere: the bytes really move."""
        n = 1 << 20
        pattern = bytes((i * 7 + 3) & 0xFF for i in range(n))
        ctypes.memmove(self.local, pattern, n)
        e, s = self.engine, self.session
        ok = e.batch_transfer_sync_write(s, [self.local], [self.remote + 12345], [n]) == 0
        ok = ok and e.batch_transfer_sync_read(s, [self.local + n], [self.remote + 12345], [n]) == 0
        if not ok or ctypes.string_at(self.local + n, n) != pattern:
            raise RuntimeError(f"{self.name}: the bytes read back differ from those written")

    def run(self, op: str, size: int, batch: int, seconds: float) -> float:
        """GB/s of `op` with `batch` requests of `size` bytes per call, for `seconds`."""
        locals_ = [self.local + i * size for i in range(batch)]
        remotes = [self.remote + i * size for i in range(batch)]
        lens = [size] * batch
        call = (self.engine.batch_transfer_sync_write if op == "write"
                else self.engine.batch_transfer_sync_read)
        if call(self.session, locals_, remotes, lens) != 0:  # warm-up, and a check
            raise RuntimeError(f"{self.name} {op} {size}: transfer failed")
        moved, start = 0, time.perf_counter()
        while True:
            if call(self.session, locals_, remotes, lens) != 0:
                raise RuntimeError(f"{self.name} {op} {size}: transfer failed")
            moved += size * batch
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return moved / elapsed / 1e9

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="requests per call")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    region = max(max(SIZES) * args.batch, 4 << 20)
    sides = {s: Side(s, region) for s in ("mooncake", "kvpool")}
    best: Dict[Tuple[str, int, str], float] = {}
    try:
        for rnd in range(args.rounds):
            order = ["mooncake", "kvpool"] if rnd % 2 == 0 else ["kvpool", "mooncake"]
            for size in SIZES:
                for op in ("write", "read"):
                    for s in order:
                        gbps = sides[s].run(op, size, args.batch, args.seconds)
                        key = (s, size, op)
                        best[key] = max(best.get(key, 0.0), gbps)
    finally:
        for s in sides.values():
            s.close()
    rows: List[Dict[str, Any]] = []
    print(f"batch of {args.batch} requests per call, best of {args.rounds} rounds "
          f"of {args.seconds:g} s per cell")
    print(f"{'op':6} {'size':>8} {'mooncake GB/s':>14} {'kvpool GB/s':>12} {'ratio':>6}")
    for size in SIZES:
        for op in ("write", "read"):
            mc, kv = best[("mooncake", size, op)], best[("kvpool", size, op)]
            rows.append({"op": op, "size": size, "mooncake_gbps": mc, "kvpool_gbps": kv,
                         "ratio": kv / mc if mc else None})
            label = f"{size >> 10} KiB" if size < (1 << 20) else f"{size >> 20} MiB"
            print(f"{op:6} {label:>8} {mc:14.2f} {kv:12.2f} {kv / mc:6.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"batch": args.batch, "seconds": args.seconds, "rounds": args.rounds,
                       "cells": rows}, f, indent=2)


if __name__ == "__main__":
    main()
