"""The Mooncake side of `kvpool bench store --vs-mooncake`, run with the venv's Python.

Written for kvpool against Mooncake Store's public Python API (`mooncake.store`):
`MooncakeDistributedStore.setup`, `register_buffer`, `put_from`, `get_into`, `close`. No numpy:
buffers are ctypes arrays, registered once.

    python mooncake_store.py driver --master-bin BIN --sizes 65536,1048576 --ops 100,10 \
        --depth 8 --holders 2 --capacity 268435456 --logs DIR
    python mooncake_store.py holder --master HOST:PORT --size BYTES

`driver` starts, for every value size, a fresh `mooncake_master` and `--holders` holder
processes (this script in `holder` mode, each contributing `--capacity` bytes): Mooncake
answers a put of a key it already holds with success without moving bytes, so no size may see
another's keys. Then `--depth` threads put `ops` fresh keys between them from registered
buffers, and get them back into registered buffers; every get's bytes are compared with what
was put after the timed loop. One JSON object on stdout: per size the put and get operations
per second, p50 and p99 latency in microseconds, failures and verified gets.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return preexec


def wait_until(what: str, proc: subprocess.Popen, log: str, ready, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {tail(log)}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s: {tail(log)}")


def tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


def new_store(master: str, global_segment: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", global_segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"setup() returned {rc}")
    return store


def holder(args) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    try:
        store = new_store(args.master, args.size)
    except RuntimeError as e:
        print(f"SETUP_FAILED {e}", flush=True)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("READY", flush=True)
    while not stop.wait(0.2):
        pass
    store.close()
    return 0


class Pool:
    """A fresh mooncake_master and its holders."""

    def __init__(self, args, size: int):
        self.procs = []
        self.port = free_port()
        log = os.path.join(args.logs, f"mooncake-master-{size}.log")
        with open(log, "ab") as out:
            master = subprocess.Popen(
                [args.master_bin, f"--rpc_address={HOST}", f"--port={self.port}",
                 "--enable_http_metadata_server=false", f"--metrics_port={free_port()}",
                 "--logtostderr=true"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(),
            )
        self.procs.append(master)
        wait_until("mooncake_master", master, log, lambda: port_open(self.port))
        self.addr = f"{HOST}:{self.port}"
        for i in range(args.holders):
            hlog = os.path.join(args.logs, f"mooncake-holder-{size}-{i}.log")
            with open(hlog, "ab") as out:
                h = subprocess.Popen(
                    [sys.executable, "-u", os.path.abspath(__file__), "holder",
                     "--master", self.addr, "--size", str(args.capacity)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent(),
                )
            self.procs.append(h)

            def ready(path=hlog):
                text = tail(path, 1 << 16)
                if "SETUP_FAILED" in text:
                    raise RuntimeError(f"holder setup failed: {text}")
                return "READY" in text

            wait_until("mooncake holder", h, hlog, ready)

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=8)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def percentile(sorted_us, q: float) -> int:
    if not sorted_us:
        return 0
    return int(sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))])


def phase(store, bufs, keys_of, size: int, put: bool):
    """Every thread's keys, `put_from` or `get_into`; (seconds, latencies, failures, error,
    gets verified). Every get's bytes are compared with what its thread put, outside the
    call's latency; the longest time one thread spent comparing is taken out of the phase
    time, as kvpool's store bench does with its own checks (`check_us`)."""
    lat = [[] for _ in bufs]
    failures = [0] * len(bufs)
    errors = [None] * len(bufs)
    verified = [0] * len(bufs)
    checking = [0.0] * len(bufs)
    start_gate = threading.Barrier(len(bufs) + 1)

    def run(t: int):
        src, out = bufs[t]
        addr = ctypes.addressof(src if put else out)
        want, got = memoryview(src), memoryview(out)
        start_gate.wait()
        for key in keys_of[t]:
            t0 = time.perf_counter()
            try:
                rc = store.put_from(key, addr, size) if put else store.get_into(key, addr, size)
            except Exception as e:  # noqa: BLE001 - counted and reported
                rc = -1
                errors[t] = errors[t] or repr(e)
            t1 = time.perf_counter()
            lat[t].append((t1 - t0) * 1e6)
            ok = rc == 0 if put else rc == size
            if ok and not put:
                if got == want:
                    verified[t] += 1
                else:
                    ok = False
                    errors[t] = errors[t] or f"get_into of {key} returned other bytes than put"
                checking[t] += time.perf_counter() - t1
            elif not ok:
                errors[t] = errors[t] or f"{'put_from' if put else 'get_into'} returned {rc}"
            if not ok:
                failures[t] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(bufs))]
    for th in threads:
        th.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    seconds = max(time.perf_counter() - t0 - max(checking, default=0.0), 1e-9)
    all_lat = sorted(x for l in lat for x in l)
    return seconds, all_lat, sum(failures), next((e for e in errors if e), None), sum(verified)


def figures(seconds, lat, failures, error, verified, ops):
    done = ops - failures
    return {
        "ops": done,
        "failures": failures,
        "seconds": seconds,
        "ops_per_second": done / max(seconds, 1e-9),
        "p50_us": percentile(lat, 0.5),
        "p99_us": percentile(lat, 0.99),
        "first_error": error,
        "verified": verified,
    }


def driver(args) -> int:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    sizes = [int(s) for s in args.sizes.split(",")]
    ops_per_size = [int(s) for s in args.ops.split(",")]
    results = []
    for size, ops in zip(sizes, ops_per_size):
        pool = Pool(args, size)
        try:
            store = new_store(pool.addr, 0)
            bufs = []
            for t in range(args.depth):
                src = (ctypes.c_ubyte * size).from_buffer_copy(os.urandom(size))
                out = (ctypes.c_ubyte * size)()
                for b in (src, out):
                    rc = store.register_buffer(ctypes.addressof(b), size)
                    if rc != 0:
                        raise RuntimeError(f"register_buffer returned {rc}")
                bufs.append((src, out))
            keys_of = [[f"vs/{size}/{t}/{i}" for i in range(t, ops, args.depth)]
                       for t in range(args.depth)]
            put = figures(*phase(store, bufs, keys_of, size, True), ops)
            get = figures(*phase(store, bufs, keys_of, size, False), ops)
            results.append({"size_bytes": size, "put": put, "get": get})
            store.close()
        finally:
            pool.close()
    from importlib.metadata import version

    print(json.dumps({"mooncake_version": version("mooncake-transfer-engine-non-cuda"),
                      "depth": args.depth, "holders": args.holders,
                      "capacity_per_holder": args.capacity, "values": results}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("driver")
    d.add_argument("--master-bin", required=True)
    d.add_argument("--sizes", required=True)
    d.add_argument("--ops", required=True)
    d.add_argument("--depth", type=int, default=8)
    d.add_argument("--holders", type=int, default=1)
    d.add_argument("--capacity", type=int, required=True)
    d.add_argument("--logs", required=True)
    h = sub.add_parser("holder")
    h.add_argument("--master", required=True)
    h.add_argument("--size", type=int, required=True)
    args = p.parse_args()
    return driver(args) if args.mode == "driver" else holder(args)


if __name__ == "__main__":
    sys.exit(main())
