"""Holder process for the conformance suite: contributes a global segment to a pool and keeps it.

In Mooncake the objects live in the memory of the clients that mounted a global segment, so a
pool needs one long-lived process that called `setup` with a non-zero `global_segment_size`.
This script is that process, generic over the module under test, so the Mooncake pool and the
kvpool pool are built the same way:

    python holder.py --module mooncake.store --master 127.0.0.1:50051 --size 67108864
    python holder.py --module kvpool.mooncake --master 127.0.0.1:50051 --size 67108864

It prints `READY <hostname>` on stdout once setup returned 0 (or `SETUP_FAILED <rc>` and exits 1),
then stays alive until SIGTERM/SIGINT or EOF on stdin, and then calls `close()` (prints
`CLOSED <rc>`; exits anyway if close() has not returned after CLOSE_TIMEOUT_S).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

CLOSE_TIMEOUT_S = 8.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", required=True, help="mooncake.store or kvpool.mooncake")
    parser.add_argument("--master", required=True, help="master address, HOST:PORT")
    parser.add_argument("--size", required=True, type=int, help="global_segment_size in bytes")
    parser.add_argument(
        "--local-buffer-size", type=int, default=16 << 20, help="local_buffer_size in bytes"
    )
    parser.add_argument("--hostname", default="127.0.0.1", help="local_hostname")
    parser.add_argument("--metadata", default="P2PHANDSHAKE", help="metadata_server")
    args = parser.parse_args()

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    module = importlib.import_module(args.module)
    store = module.MooncakeDistributedStore()
    rc = store.setup(
        args.hostname,
        args.metadata,
        args.size,
        args.local_buffer_size,
        "tcp",
        "",
        args.master,
    )
    if rc != 0:
        print(f"SETUP_FAILED {rc}", flush=True)
        return 1

    stop = threading.Event()

    def on_signal(_signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    try:
        hostname = store.get_hostname()
    except Exception:  # noqa: BLE001 - only informative
        hostname = args.hostname
    print(f"READY {hostname}", flush=True)

    while not stop.wait(0.2):
        pass
    # close() can block on a master that is gone; never outlive the pool by more than this.
    watchdog = threading.Timer(CLOSE_TIMEOUT_S, lambda: os._exit(0))
    watchdog.daemon = True
    watchdog.start()
    rc = store.close()
    print(f"CLOSED {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
