"""Single-call latency of kvpool and Mooncake Store from Python: one thread, one call at a
time, `put_from` / `get_into` with registered buffers and `is_exist`, at 1 KiB and 64 KiB.

Each side gets a fresh pool on 127.0.0.1 (its master and one holder process, as in
`benches/python_store.py`). Prints microseconds per call, the mean over `--calls` calls.

    scripts/python-env.sh --release && cargo build --release
    KVPOOL_BIN=target/release/kvpool .tools/py/bin/python benches/python_latency.py kvpool
    KVPOOL_BIN=target/release/kvpool .tools/py/bin/python benches/python_latency.py mooncake
"""

from __future__ import annotations

import argparse
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
from peers import start_mooncake_pool  # noqa: E402


def measure(store, size: int, calls: int) -> dict:
    src = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
    dst = np.zeros(size, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, size) == 0
    assert store.register_buffer(dst.ctypes.data, size) == 0
    keys = [f"lat-{size}-{i}" for i in range(calls)]
    out = {}
    t = time.perf_counter()
    for k in keys:
        assert store.put_from(k, src.ctypes.data, size) == 0
    out["put_us"] = (time.perf_counter() - t) / calls * 1e6
    t = time.perf_counter()
    for k in keys:
        assert store.get_into(k, dst.ctypes.data, size) == size
    out["get_us"] = (time.perf_counter() - t) / calls * 1e6
    assert np.array_equal(src, dst), "bytes read back differ"
    t = time.perf_counter()
    for k in keys:
        assert store.is_exist(k) == 1
    out["exist_us"] = (time.perf_counter() - t) / calls * 1e6
    store.unregister_buffer(src.ctypes.data)
    store.unregister_buffer(dst.ctypes.data)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pool", choices=["kvpool", "mooncake"])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 64 << 10])
    args = p.parse_args()
    start = start_kvpool_pool if args.pool == "kvpool" else start_mooncake_pool
    with tempfile.TemporaryDirectory() as tmp, start(1 << 30, Path(tmp)) as pool:
        store = pool.new_store()
        for size in args.sizes:
            result = {}
            # From a thread of its own, as an engine's worker thread calls.
            th = threading.Thread(target=lambda: result.update(measure(store, size, args.calls)))
            th.start()
            th.join()
            if not result:
                return 1
            print(f"{args.pool:8} {size:>7} B: put {result['put_us']:6.0f} us  "
                  f"get {result['get_us']:6.0f} us  exist {result['exist_us']:6.0f} us", flush=True)
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
