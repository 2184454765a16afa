"""Put and get through a running kvpool pool from Python, with both of the package's APIs.

Start a pool with `target/release/kvpool up`; it prints the line to run this with, which sets
KVPOOL_MASTER and KVPOOL_AUTH_KEY_FILE:

    KVPOOL_MASTER=127.0.0.1:PORT KVPOOL_AUTH_KEY_FILE=DIR/auth.key \
        .tools/py/bin/python examples/python_put_get.py

The bytes land in the node agents' DRAM tiers (`kvpool up` runs two, in pool mode) and come
back over kvpool's transfer engine. Exits 1 if anything read back differs from what was put.
"""

from __future__ import annotations

import os
import sys
import uuid

import numpy as np

import kvpool
from kvpool.mooncake import MooncakeDistributedStore, ReplicateConfig


def main() -> int:
    run = uuid.uuid4().hex[:8]
    # The native API: the pool comes from the environment.
    with kvpool.Store() as store:
        value = os.urandom(256 << 10)
        store.put(f"example/{run}/bytes", value)
        assert store.get(f"example/{run}/bytes") == value
        print(f"native: put and got {len(value)} bytes")

        # Zero-copy: register numpy memory once, then put from and get into it.
        src = np.frombuffer(os.urandom(4 << 20), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        sptr, size = store.register(src)
        dptr, _ = store.register(dst)
        store.put_from(f"example/{run}/block", sptr, size)
        n = store.get_to(f"example/{run}/block", dptr, size)
        assert n == size and np.array_equal(src, dst)
        print(f"native: zero-copy put_from/get_to of {size} bytes")

    # Mooncake's API, as engines call it: an empty master_server_addr takes the environment's.
    mc = MooncakeDistributedStore()
    rc = mc.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "")
    if rc != 0:
        print(f"mooncake API: setup returned {rc}", file=sys.stderr)
        return 1
    cfg = ReplicateConfig()
    cfg.replica_num = 2  # kvpool up runs two agents: one replica in each
    keys = [f"example/{run}/mc/{i}" for i in range(8)]
    values = [os.urandom(64 << 10) for _ in keys]
    codes = [mc.put(k, v, cfg) for k, v in zip(keys, values)]
    got = mc.get_batch(keys)
    exist = mc.batch_is_exist(keys + [f"example/{run}/missing"])
    mc.close()
    if codes != [0] * len(keys) or got != values or exist != [1] * len(keys) + [0]:
        print(f"mooncake API: puts {codes}, exist {exist}, gets equal {got == values}",
              file=sys.stderr)
        return 1
    print(f"mooncake API: {len(keys)} objects with 2 replicas each, batch get and exist checked")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
