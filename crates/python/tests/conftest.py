"""Fixtures of the Mooncake conformance suite: every scenario runs against both backends.

`pool` (one per test module) and `fresh_pool` (one per test, for scenarios that fill or empty
the whole pool) are parametrized over BACKENDS:

- "mooncake": real Mooncake (`peers.start_mooncake_pool`: mooncake_master + a holder process);
- "kvpool": kvpool's Mooncake-compatible module (`kvpool_pool.start_kvpool_pool`, written next
  to this file, same signature and same `Pool` shape). If it cannot be imported, every kvpool
  test FAILS (never skips) with the reason.

Select one backend with `-k mooncake` or `-k kvpool`.
"""

from __future__ import annotations

import contextlib
import os
import re

import numpy as np
import pytest

import peers

os.environ.setdefault("MC_TCP_BIND_ADDRESS", peers.HOST)

BACKENDS = ["mooncake", "kvpool"]
# The shared pool: room for every scenario's objects (the largest are 16 MiB) far below
# Mooncake's eviction high watermark (90%), so nothing is ever evicted from it.
POOL_CAPACITY = 256 << 20
# The pool of the scenarios that fill it (full pool) or empty it (remove_all).
FRESH_POOL_CAPACITY = 64 << 20
# Registered arena of the shared client: a 16 MiB source plus a 16 MiB (+ slack) destination.
ARENA_SIZE = 48 << 20


class UnavailablePool:
    """Stands in for a backend that cannot be started: any use fails the test that uses it."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self._reason = reason

    def __getattr__(self, attr):
        pytest.fail(f"{self.name} backend unavailable: {self._reason}", pytrace=False)


def _starter(name: str):
    if name == "mooncake":
        return peers.start_mooncake_pool, None
    try:
        from kvpool_pool import start_kvpool_pool  # written by the kvpool side
    except Exception as e:  # noqa: BLE001 - any failure to import is reported, not skipped
        return None, (
            "cannot import start_kvpool_pool from crates/python/tests/kvpool_pool.py "
            f"({type(e).__name__}: {e}); kvpool.mooncake is built and installed by "
            "scripts/python-env.sh"
        )
    return start_kvpool_pool, None


@contextlib.contextmanager
def _open_pool(name: str, capacity: int, tmp_path):
    """The pool of backend `name`, or an UnavailablePool saying why it could not start (so
    every test using it fails with that reason)."""
    start, reason = _starter(name)
    if start is None:
        yield UnavailablePool(name, reason)
        return
    with contextlib.ExitStack() as stack:
        try:
            pool = stack.enter_context(start(capacity, tmp_path))
        except Exception as e:  # noqa: BLE001 - reported by every test that uses the pool
            yield UnavailablePool(name, f"starting the pool failed: {type(e).__name__}: {e}")
            return
        assert pool.name == name, f"start function for {name} yielded a pool named {pool.name!r}"
        yield pool


@pytest.fixture(scope="module", params=BACKENDS)
def pool(request, tmp_path_factory):
    with _open_pool(request.param, POOL_CAPACITY, tmp_path_factory.mktemp(request.param)) as p:
        yield p


@pytest.fixture(params=BACKENDS)
def fresh_pool(request, tmp_path_factory):
    with _open_pool(request.param, FRESH_POOL_CAPACITY,
                    tmp_path_factory.mktemp(f"{request.param}-fresh")) as p:
        yield p


class Arena:
    """A numpy buffer registered with a store (register_buffer) for put_from/get_into."""

    def __init__(self, store, size: int):
        self.buf = np.zeros(size, dtype=np.uint8)
        self.ptr = self.buf.ctypes.data
        self.size = size
        rc = store.register_buffer(self.ptr, size)
        assert rc == 0, f"register_buffer of a fresh {size}-byte arena returned {rc}"

    def write(self, offset: int, data: np.ndarray) -> int:
        self.buf[offset:offset + len(data)] = data
        return self.ptr + offset

    def fill(self, offset: int, n: int, value: int) -> int:
        self.buf[offset:offset + n] = value
        return self.ptr + offset

    def read(self, offset: int, n: int) -> bytes:
        return self.buf[offset:offset + n].tobytes()


class Client:
    """The shared client of a pool, created in the test body on first use (so a backend that
    cannot start fails the test rather than erroring in a fixture)."""

    def __init__(self, pool):
        self._pool = pool
        self._store = None
        self._arena = None

    @property
    def store(self):
        if self._store is None:
            self._store = self._pool.new_store()
        return self._store

    @property
    def arena(self) -> Arena:
        if self._arena is None:
            self._arena = Arena(self.store, ARENA_SIZE)
        return self._arena


@pytest.fixture(scope="module")
def client(pool):
    return Client(pool)


@pytest.fixture
def key(request):
    """key("x") -> a key unique to this test (and its parameters): TESTNAME_PARAMS/x."""
    prefix = re.sub(r"\W", "_", request.node.name)
    return lambda suffix="": f"{prefix}/{suffix}"
