"""kvpool's native Python API (`kvpool.Store`) against a real kvpool pool, and the bad input
every caller can give: wrong types, negative sizes, pointers outside registered memory, a
wrong pool key, a dead master, a master that restarts, a holder that dies."""

from __future__ import annotations

import ctypes
import os
import secrets
import threading

import numpy as np
import pytest

import kvpool
import kvpool.mooncake as mc
from kvpool_pool import put_get_from_threads, start_kvpool_pool, write_key
from peers import free_port


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    with start_kvpool_pool(128 << 20, tmp_path_factory.mktemp("kvpool-store")) as pool:
        yield pool


@pytest.fixture
def store(kv):
    with kvpool.Store(kv.master_addr) as s:  # the key comes from KVPOOL_AUTH_KEY_FILE
        yield s


def key(name: str) -> str:
    return f"store-test/{name}/{secrets.token_hex(4)}"


def test_round_trip_of_every_buffer_kind(store):
    data = os.urandom(100_000)
    values = {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "numpy": np.frombuffer(data, dtype=np.uint8),
        "numpy2d": np.frombuffer(data, dtype=np.uint8).reshape(100, 1000),
    }
    for kind, value in values.items():
        k = key(kind)
        store.put(k, value)
        assert store.get(k) == data, kind
        assert store.size(k) == len(data)
        assert store.exists(k)


def test_get_into_writable_buffers_and_too_small(store):
    k = key("into")
    store.put(k, b"0123456789")
    out = bytearray(16)
    assert store.get_into(k, out) == 10 and out[:10] == b"0123456789"
    arr = np.zeros(10, dtype=np.uint8)
    assert store.get_into(k, arr) == 10 and arr.tobytes() == b"0123456789"
    with pytest.raises(kvpool.BufferTooSmall) as e:
        store.get_into(k, bytearray(4))
    assert e.value.kind == "buffer_too_small" and e.value.code == -600
    with pytest.raises(kvpool.InvalidArgument, match="writable"):
        store.get_into(k, b"read-only bytes")


def test_missing_keys_raise_not_found_with_kind_and_code(store):
    with pytest.raises(kvpool.NotFound) as e:
        store.get(key("missing"))
    assert (e.value.kind, e.value.code) == ("not_found", -704)
    assert isinstance(e.value, kvpool.Error)
    with pytest.raises(kvpool.NotFound):
        store.size(key("missing"))
    with pytest.raises(kvpool.NotFound):
        store.remove(key("missing"))
    assert not store.exists(key("missing"))


def test_batches(store):
    ks = [key(f"b{i}") for i in range(5)]
    store.put_many((k, k.encode()) for k in ks)
    got = store.get_many(ks + [key("absent")])
    assert got[:5] == [k.encode() for k in ks] and got[5] is None
    assert store.exists_many(ks[:2] + [key("absent")]) == [True, True, False]


def test_registered_memory_zero_copy_and_pointers_outside_it(store):
    arr = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8).copy()
    ptr, size = store.register(arr)
    assert (ptr, size) == (arr.ctypes.data, arr.nbytes)
    k = key("zero-copy")
    store.put_from(k, ptr + 4096, 8192)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    dptr, _ = store.register(dst)
    assert store.get_to(k, dptr + 100, 8192) == 8192
    assert dst[100:100 + 8192].tobytes() == arr[4096:4096 + 8192].tobytes()
    # Outside every registered buffer, or running off the end of one: refused, pool unchanged.
    stray = ctypes.create_string_buffer(64)
    with pytest.raises(kvpool.NotRegistered):
        store.put_from(key("stray"), ctypes.addressof(stray), 64)
    with pytest.raises(kvpool.NotRegistered):
        store.put_from(key("overrun"), ptr + size - 10, 20)
    with pytest.raises(kvpool.NotRegistered):
        store.get_to(k, 8, 8192)  # a wild address is never touched
    assert not store.exists(key("stray"))
    assert store.unregister(ptr) and not store.unregister(ptr)
    with pytest.raises(kvpool.NotRegistered):
        store.put_from(key("after-unregister"), ptr, 10)


def test_wrong_types_and_sizes(store):
    with pytest.raises(TypeError):
        store.put(12, b"x")
    with pytest.raises(kvpool.InvalidArgument, match="buffer"):
        store.put(key("t"), 3.5)
    with pytest.raises((OverflowError, TypeError)):
        store.put_from(key("neg"), 4096, -1)
    with pytest.raises((OverflowError, TypeError)):
        store.register_memory(-5, 10)
    with pytest.raises(kvpool.InvalidArgument):
        store.register_memory(0, 10)
    with pytest.raises(kvpool.InvalidArgument):
        store.put(key("empty"), b"")
    with pytest.raises(kvpool.InvalidArgument, match="replica"):
        store.put(key("r"), b"x", replicas=300)
    s = mc.MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", -1, 0, "tcp", "", "127.0.0.1:1") == -600
    assert s.setup("127.0.0.1") == -600  # missing arguments
    assert s.setup({"metadata_server": "x"}) == -600  # no local_hostname


def test_threads_share_one_store(store):
    assert put_get_from_threads(store, "threads", rounds=20, size=1000) == []


def test_threads_that_come_and_go_each_call_alone(store):
    # One call at a time, each from a thread of its own: every call runs on its thread's own
    # runtime and connection, and forks of ended threads make room for new ones (64 at most).
    for t in range(80):
        out = {}

        def one(t: int = t) -> None:
            k = f"comego/{t}/{secrets.token_hex(2)}"
            store.put(k, b"v%d" % t)
            out["got"] = store.get(k)

        th = threading.Thread(target=one)
        th.start()
        th.join()
        assert out.get("got") == b"v%d" % t, t


def test_close_then_calls_raise_closed(kv):
    s = kvpool.Store(kv.master_addr)
    s.put(key("c"), b"v")
    s.close()
    s.close()  # twice is fine
    assert s.closed
    with pytest.raises(kvpool.Closed) as e:
        s.get(key("c"))
    assert e.value.code == -600


def test_wrong_key_is_refused_and_changes_nothing(kv, tmp_path):
    other = write_key(tmp_path / "other.key")
    with kvpool.Store(kv.master_addr) as good:
        k = key("auth")
        with kvpool.Store(kv.master_addr, str(other)) as bad:
            with pytest.raises(kvpool.AuthFailed) as e:
                bad.put(k, b"intruder")
            assert e.value.kind == "auth_failed"
        assert not good.exists(k)
    s = mc.MooncakeDistributedStore()
    os.environ["KVPOOL_AUTH_KEY_FILE"], saved = str(other), os.environ["KVPOOL_AUTH_KEY_FILE"]
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", kv.master_addr) == -1
    finally:
        os.environ["KVPOOL_AUTH_KEY_FILE"] = saved
    with pytest.raises(kvpool.AuthFailed, match="nope"):
        kvpool.Store(kv.master_addr, str(tmp_path / "nope"))


def test_dead_master_gives_unavailable(tmp_path):
    with pytest.raises(kvpool.ConfigError):
        kvpool.Store(masters="", auth_key_file=str(tmp_path / "k"))
    addr = f"127.0.0.1:{free_port()}"
    with kvpool.Store(addr, request_timeout_ms=500) as s:
        with pytest.raises(kvpool.Unavailable) as e:
            s.get("k")
        assert e.value.code == -900
        assert not s.healthy()


def test_master_restart_and_holder_remount(tmp_path):
    with start_kvpool_pool(64 << 20, tmp_path) as pool:
        with kvpool.Store(pool.master_addr) as s:
            s.put(key("before"), b"lost with the master")
            pool.restart_master()
            # The new master knows no objects; the holder mounts its segment again within
            # a few heartbeats, and the same client reconnects.
            deadline_ok = False
            for _ in range(100):
                try:
                    s.put(k := key("after"), b"stored again")
                    deadline_ok = True
                    break
                except (kvpool.NoSpace, kvpool.Unavailable):
                    threading.Event().wait(0.1)
            assert deadline_ok, "no put succeeded within 10 s of the master's restart"
            assert s.get(k) == b"stored again"


def test_contributing_memory_from_the_store(kv):
    with kvpool.Store(kv.master_addr, global_segment_size=8 << 20) as holder:
        host, port = holder.node.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with kvpool.Store(kv.master_addr) as s:
            k = key("preferred")
            # Mooncake's preferred_segment names the holder: the object lands in its memory,
            # and survives while the holder lives.
            cfg = mc.ReplicateConfig()
            cfg.preferred_segment = holder.node
            m = mc.MooncakeDistributedStore()
            assert m.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", kv.master_addr) == 0
            assert m.put(k, b"in the holder", cfg) == 0
            assert s.get(k) == b"in the holder"
            m.close()
    # The holder closed: its segment is unmounted and what it held is gone.
    with kvpool.Store(kv.master_addr) as s:
        assert not s.exists(k)
    with pytest.raises(kvpool.InvalidArgument, match="IP address"):
        kvpool.Store(kv.master_addr, local_hostname="not-an-ip", global_segment_size=1 << 20)


def test_metrics_text(store):
    store.put(key("m"), b"x" * 10)
    text = store.metrics()
    assert "# TYPE" in text
