"""Agent mode: a store that goes through the node agent's engine socket with shared-memory
staging, against a real pool on 127.0.0.1 (`kvpool master` plus one `kvpool agent run` in pool
mode, whose DRAM is the pool's memory). Round trips of every kind of memory, the zero-copy
`alloc_buffer` path, values crossing between agent-mode and direct-mode clients, batches with
missing keys, Mooncake's API with only `KVPOOL_AGENT_SOCKET` set, threads sharing the staging
area, and bad input: an agent killed mid-session, a socket that does not exist."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import kvpool
import kvpool.mooncake as mc
from kvpool import _native
from kvpool_pool import (KvpoolAgent, KvpoolMaster, kvpool_binary, put_get_from_threads,
                         write_key)

MODE_ENV = ("KVPOOL_AGENT_SOCKET", "KVPOOL_MASTER", "KVPOOL_MASTER_ADDR",
            "KVPOOL_AUTH_KEY_FILE", "KVPOOL_CLIENT_MODE", "KVPOOL_ENGINE_CONFIG", "MOONCAKE_CONFIG_PATH")


class Node:
    def __init__(self, master: KvpoolMaster, agent: KvpoolAgent, key: Path, dir: Path):
        self.master, self.agent, self.key, self.dir = master, agent, key, dir

    @property
    def socket(self) -> str:
        return str(self.agent.socket)

    def agent_store(self, **kw) -> kvpool.Store:
        return kvpool.Store(mode="agent", agent_socket=self.socket, **kw)

    def direct_store(self) -> kvpool.Store:
        return kvpool.Store(self.master.addr, str(self.key), mode="direct")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in MODE_ENV:
        monkeypatch.delenv(name, raising=False)


def one_agent_pool(prefix: str, agent_name: str):
    """A master and one agent in a fresh directory, for the life of the generator."""
    # Short, so the socket path fits a Unix socket's 107 bytes.
    dir = Path(tempfile.mkdtemp(prefix=prefix))
    key = write_key(dir / "pool.key")
    master = KvpoolMaster(dir, key)
    agent = None
    try:
        master.start()
        agent = KvpoolAgent(dir / "a0", master.addr, key, name=agent_name).start()
        yield Node(master, agent, key, dir)
    finally:
        if agent is not None:
            agent.stop()
        master.stop()
        shutil.rmtree(dir, ignore_errors=True)


@pytest.fixture(scope="module")
def node():
    yield from one_agent_pool("kvpa-", "py-agent-0")


@pytest.fixture
def store(node):
    with node.agent_store() as s:
        yield s


def key(name: str) -> str:
    return f"agent-test/{name}/{secrets.token_hex(4)}"


def staging_maps(ptr: int) -> bool:
    """Whether address `ptr` lies in a mapping of an agent staging file in this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return len(fields) >= 6 and "kvpool-staging-" in fields[5]
    return False


def view(ptr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))


def test_mode_is_chosen_as_asked(node, tmp_path):
    with node.agent_store() as s:
        assert s.mode == "agent"
    # auto: the socket exists -> agent, though a master is named too.
    with kvpool.Store(node.master.addr, str(node.key), agent_socket=node.socket) as s:
        assert s.mode == "agent"
    # auto: no socket file -> direct.
    missing = str(tmp_path / "none.sock")
    with kvpool.Store(node.master.addr, str(node.key), agent_socket=missing) as s:
        assert s.mode == "direct"
    with kvpool.Store(node.master.addr, str(node.key), agent_socket=node.socket,
                      mode="direct") as s:
        assert s.mode == "direct"
    with pytest.raises(kvpool.ConfigError, match="mode"):
        kvpool.Store(node.master.addr, str(node.key), mode="sideways")
    with pytest.raises(kvpool.ConfigError, match="agent"):
        kvpool.Store(mode="agent")  # no socket named anywhere
    # The native constructor settles "auto" the same way.
    c = _native.Client(agent_socket=node.socket)
    assert c.mode() == "agent"
    c.close()
    # Agent mode contributes no memory: the agent owns the node's.
    with pytest.raises(kvpool.InvalidArgument, match="global_segment_size") as e:
        _native.Client(mode="agent", agent_socket=node.socket, global_segment_size=1 << 20)
    assert e.value.code == -600


def test_round_trips_of_bytes(store):
    data = os.urandom(100_000)
    for kind, value in {
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "numpy2d": np.frombuffer(data, dtype=np.uint8).reshape(100, 1000),
    }.items():
        k = key(kind)
        store.put(k, value)
        assert store.get(k) == data, kind
        assert store.size(k) == len(data)
        assert store.exists(k)
    k = key("into")
    store.put(k, b"0123456789")
    out = bytearray(16)
    assert store.get_into(k, out) == 10 and out[:10] == b"0123456789"
    with pytest.raises(kvpool.BufferTooSmall):
        store.get_into(k, bytearray(4))
    # Larger than a get's first guess of room (4 MiB): fetched again with its size.
    big = os.urandom(6 << 20)
    k = key("big")
    store.put(k, big)
    assert store.get(k) == big
    # A re-put keeps the first value, as in direct mode.
    store.put(k, b"short")
    assert store.get(k) == big
    with pytest.raises(kvpool.InvalidArgument):
        store.put(key("empty"), b"")
    with pytest.raises(kvpool.NotFound) as e:
        store.get(key("missing"))
    assert (e.value.kind, e.value.code) == ("not_found", -704)
    with pytest.raises(kvpool.NotFound):
        store.size(key("missing"))


def test_registered_numpy_memory(store):
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr, size = store.register(buf)
    buf[:1000] = np.frombuffer(os.urandom(1000), dtype=np.uint8)
    k = key("np")
    store.put_from(k, ptr, 1000)
    assert store.get(k) == buf[:1000].tobytes()
    assert store.get_to(k, ptr + 4096, 2000) == 1000
    assert buf[4096:5096].tobytes() == buf[:1000].tobytes()
    with pytest.raises(kvpool.NotRegistered) as e:
        store.put_from(key("out"), ptr + size - 10, 100)
    assert e.value.code == -600
    assert store.unregister(ptr) and not store.unregister(ptr)
    with pytest.raises(kvpool.NotRegistered):
        store.get_to(k, ptr, 1000)


def test_alloc_buffer_is_staging_memory_with_no_copy(store):
    n = 256 << 10
    src, size = store.alloc_buffer(n)
    dst, _ = store.alloc_buffer(n)
    assert size == n and src != dst
    # The memory is the agent session's shared staging mapping itself.
    assert staging_maps(src) and staging_maps(dst)
    data = np.frombuffer(os.urandom(n), dtype=np.uint8)
    view(src, n)[:] = data
    k = key("zero-copy")
    store.put_from(k, src, n)
    assert store.get(k) == data.tobytes()
    assert store.get_to(k, dst, n) == n
    assert view(dst, n).tobytes() == data.tobytes()
    # Batches from and into it too.
    keys = [key(f"zc{i}") for i in range(4)]
    c = store._client
    assert c.batch_put_from(keys, [src + i * 1024 for i in range(4)], [1024] * 4) == [0] * 4
    assert c.batch_get_into(keys, [dst + i * 4096 for i in range(4)], [4096] * 4) == [1024] * 4
    for i in range(4):
        assert view(dst + i * 4096, 1024).tobytes() == data[i * 1024:(i + 1) * 1024].tobytes()
    # Staging memory outside alloc_buffer's ranges is refused.
    with pytest.raises(kvpool.NotRegistered, match="alloc_buffer"):
        store.put_from(key("beyond"), src + n + 4096 * 64, 10)
    assert store.free_buffer(src) and not store.free_buffer(src)
    with pytest.raises(kvpool.NotRegistered):
        store.put_from(key("freed"), src, 10)
    assert store.free_buffer(dst)
    with pytest.raises(kvpool.NoSpace):
        store.alloc_buffer(1 << 40)


def shm_and_tcp_bytes(metrics: str) -> tuple:
    """Bytes a client's transfer engine moved through shared memory and over TCP."""
    out = {"shm": 0.0, "tcp": 0.0}
    for line in metrics.splitlines():
        if line.startswith("kvpool_transfer_bytes_total{"):
            for proto in out:
                if f'protocol="{proto}"' in line:
                    out[proto] += float(line.rsplit(" ", 1)[1])
    return out["shm"], out["tcp"]


@pytest.mark.parametrize("setting", ["default", "off"])
def test_direct_mode_copies_through_the_agents_shared_memory(node, monkeypatch, setting):
    """The agent shares its DRAM segment (pool.same_node_shm, on by default): a direct-mode
    client on its node moves every byte of puts and gets (single, batched, into registered
    memory) through the mapping, none over TCP, as its own transfer metrics count;
    KVPOOL_SAME_NODE_SHM=off sends them over TCP."""
    if setting == "off":
        monkeypatch.setenv("KVPOOL_SAME_NODE_SHM", "off")
    values = {key(f"shm-{i}"): os.urandom(n) for i, n in enumerate([1, 4096, 70_000, 1 << 20])}
    with node.direct_store() as direct:
        for k, v in values.items():
            direct.put(k, v)
        for k, v in values.items():
            assert direct.get(k) == v
        assert direct.get_many(list(values)) == list(values.values())
        buf = np.zeros(1 << 21, dtype=np.uint8)
        direct.register_memory(buf.ctypes.data, buf.nbytes)
        for k, v in values.items():
            assert direct.get_to(k, buf.ctypes.data, buf.nbytes) == len(v)
            assert buf[:len(v)].tobytes() == v
        shm, tcp = shm_and_tcp_bytes(direct.metrics())
    total = 4 * sum(len(v) for v in values.values())
    if setting == "off":
        assert (shm, tcp) == (0, total)
    else:
        assert (shm, tcp) == (total, 0)


def test_values_cross_between_agent_and_direct_clients(node, store):
    with node.direct_store() as direct:
        assert direct.mode == "direct"
        a, d = key("from-agent"), key("from-direct")
        va, vd = os.urandom(300_000), os.urandom(200_000)
        store.put(a, va)
        direct.put(d, vd)
        assert direct.get(a) == va and direct.size(a) == len(va)
        assert store.get(d) == vd and store.size(d) == len(vd)
        assert store.exists_many([a, d, key("none")]) == [True, True, False]
        store.remove(d)
        assert not direct.exists(d)


def test_batches_with_missing_keys(node, store):
    keys = [key(f"b{i}") for i in range(20)]
    values = [os.urandom(1000 + i) for i in range(20)]
    store.put_many(zip(keys, values))
    missing = key("missing")
    assert store.get_many(keys[:3] + [missing] + keys[3:]) == values[:3] + [None] + values[3:]
    c = store._client
    got = c.batch_get(keys[:2] + [missing])
    assert got[:2] == values[:2] and isinstance(got[2], kvpool.NotFound)
    errs = c.batch_put([key("ok"), ""], [b"v", b"w"])
    assert errs[0] is None and isinstance(errs[1], kvpool.InvalidArgument)
    buf = np.zeros(64 << 10, dtype=np.uint8)
    ptr, _ = store.register(buf)
    codes = c.batch_get_into([keys[0], missing, keys[1]], [ptr, ptr + 8192, ptr + 16384],
                             [4096] * 3)
    assert codes == [1000, -704, 1001]
    assert buf[:1000].tobytes() == values[0]
    # Multi-buffer puts and gets (Mooncake's): the value spread over ranges.
    buf[:300] = 7
    buf[1000:1200] = 9
    k = key("parts")
    assert c.batch_put_parts([k], [[ptr, ptr + 1000]], [[300, 200]]) == [0]
    assert store.get(k) == b"\x07" * 300 + b"\x09" * 200
    out = ptr + 20000
    assert c.batch_get_parts([k, missing], [[out, out + 5000], [out + 9000]],
                             [[250, 250], [100]]) == [500, -704]
    assert buf[20000:20250].tobytes() + buf[25000:25250].tobytes() == store.get(k)
    assert c.batch_get_parts([k], [[out]], [[400]]) == [-600]  # room must match the value
    # Past one RPC's share of the staging area: several RPCs, same answers.
    many = [key(f"m{i}") for i in range(40)]
    with node.agent_store(staging_bytes=1 << 20) as small:
        small.put_many((k, os.urandom(100 << 10)) for k in many)
        assert all(v is not None and len(v) == 100 << 10 for v in small.get_many(many))
        assert small.exists_many(many) == [True] * 40
        with pytest.raises(kvpool.NoSpace):
            small.put(key("huge"), os.urandom(2 << 20))  # larger than its staging area


@pytest.mark.parametrize("mode", ["agent", "direct"])
def test_started_gets_answer_what_batch_gets_answer(node, mode):
    """A get started on the store's threads (start_batch_get_parts, what the vLLM connector's
    early loads use) lets the caller go on and answers, when waited for, what
    batch_get_parts would have: per key the length or the code, the bytes in place."""
    with (node.agent_store() if mode == "agent" else node.direct_store()) as store:
        c = store._client
        k, missing = key("started"), key("missing")
        value = os.urandom(500)
        store.put(k, value)
        buf = np.zeros(64 << 10, dtype=np.uint8)
        ptr, _ = store.register(buf)
        pending = c.start_batch_get_parts([k, missing], [[ptr, ptr + 5000], [ptr + 9000]],
                                          [[250, 250], [100]])
        assert len(pending) == 2
        # The caller goes on with the store while the get runs.
        other = key("meanwhile")
        store.put(other, b"x" * 10)
        assert store.get(other) == b"x" * 10
        assert pending.wait() == [500, -704]
        assert pending.done() and pending.wait() == [500, -704]  # the same answer again
        assert buf[:250].tobytes() + buf[5000:5250].tobytes() == value
        # Room that does not match the value: refused per key, as batch_get_parts refuses.
        assert c.start_batch_get_parts([k], [[ptr + 20000]], [[400]]).wait() == [-600]
        with pytest.raises(kvpool.InvalidArgument, match="value_offsets"):
            c.start_batch_get_parts([k], [[ptr]], [[500]], [0, 1])
        with pytest.raises(kvpool.InvalidArgument):
            c.start_batch_get_parts([k, missing], [[ptr]], [[500]])  # lists of two lengths
        store.close()
        with pytest.raises(kvpool.Closed):
            c.start_batch_get_parts([k], [[ptr]], [[500]])


def test_remove_and_unsupported_calls(store):
    k = key("rm")
    store.put(k, b"v")
    store.remove(k)
    assert not store.exists(k)
    with pytest.raises(kvpool.NotFound) as e:
        store.remove(k)
    assert e.value.code == -704
    with pytest.raises(kvpool.NotSupported) as e:
        store._client.remove_all()
    assert e.value.code == -1011
    with pytest.raises(kvpool.NotSupported):
        store.put(key("pin"), b"v", pin=True)
    assert store.healthy()


def test_threads_share_the_staging_area(node):
    with node.agent_store(staging_bytes=1 << 20) as s:
        errors = put_get_from_threads(s, "agent-threads", rounds=15, size=200 << 10)
    assert errors == []


def test_an_engine_credential_lends_no_memory(node, monkeypatch, tmp_path):
    """Issue 38: only agent credentials and the pool key mount segments. An engine that asks
    to lend memory the Mooncake way gets agent mode beside an agent, and a clear refusal at
    setup without one."""
    engine_key = tmp_path / "engine.json"
    subprocess.run([str(kvpool_binary()), "auth", "derive", "--role", "engine",
                    "--auth-key-file", str(node.key), "--out", str(engine_key)], check=True)
    monkeypatch.setenv("KVPOOL_AUTH_KEY_FILE", str(engine_key))
    monkeypatch.setenv("KVPOOL_MASTER", node.master.addr)

    lone = mc.MooncakeDistributedStore()
    rc = lone.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 8 << 20, "tcp", "",
                    node.master.addr)
    assert rc == -1, rc  # Mooncake's setup answers -1 whatever failed
    with pytest.raises(kvpool.AuthFailed, match="may not lend memory") as e:
        kvpool.Store(node.master.addr, str(engine_key), mode="direct",
                     global_segment_size=16 << 20)
    assert str(engine_key) in str(e.value)

    monkeypatch.setenv("KVPOOL_AGENT_SOCKET", node.socket)
    s = mc.MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 8 << 20, "tcp", "",
                   node.master.addr) == 0
    assert s.get_hostname().startswith("agent:"), s.get_hostname()
    k = key("engine-lends")
    assert s.put(k, b"held by the agent") == 0
    assert s.get(k) == b"held by the agent"
    s.close()


def test_mooncake_api_with_only_the_agent_socket(node, monkeypatch):
    monkeypatch.setenv("KVPOOL_AGENT_SOCKET", node.socket)
    s = mc.MooncakeDistributedStore()
    # No master address, no key: auto mode takes the agent.
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 8 << 20, "tcp", "", "") == 0
    assert s.health_check() == 0
    k = key("mc")
    assert s.put(k, b"hello") == 0
    assert s.get(k) == b"hello"
    assert s.get_size(k) == 5
    assert s.is_exist(k) == 1 and s.is_exist(key("no")) == 0
    assert s.get_size(key("no")) == -704
    ptr = s.alloc_from_mem_pool(1 << 20)
    assert ptr != 0 and staging_maps(ptr)
    view(ptr, 4)[:] = np.frombuffer(b"abcd", dtype=np.uint8)
    assert s.put_from(k + "/zc", ptr, 4) == 0
    assert s.get_into(k, ptr + 4096, 100) == 5
    assert view(ptr + 4096, 5).tobytes() == b"hello"
    assert s.batch_get_into([k, key("no")], [ptr + 8192, ptr + 16384], [64, 64]) == [5, -704]
    assert s.batch_is_exist([k, key("no")]) == [1, 0]
    assert s.get_batch([k, k + "/zc"]) == [b"hello", b"abcd"]
    assert s.put_batch([key("pb1"), key("pb2")], [b"x", b"y"]) == 0
    # Parts of values are read in direct mode only: each key answers NotSupported here.
    assert s.reads_value_parts() is False
    assert s.batch_get_parts_into_multi_buffers(
        [k, key("no")], [1, 0], [[ptr + 8192], [ptr + 16384]], [[2], [2]]
    ) == [-1011, -1011]
    started = s.start_batch_get_into_multi_buffers(
        [k, key("no")], [[ptr + 8192], [ptr + 16384]], [[5], [5]])
    assert started.wait() == [5, -704] and started.done()
    assert view(ptr + 8192, 5).tobytes() == b"hello"
    assert s.start_batch_get_into_multi_buffers([], [], []).wait() == []
    assert s.remove(k) == 0 and s.remove(k) == -704
    assert s.remove_all() == -1011
    assert s.alloc_from_mem_pool(1 << 40) == 0
    assert s.close() == 0
    # A dict config names the mode and the socket; agent mode takes no segment.
    s = mc.MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "mode": "agent",
                    "agent_socket": node.socket, "global_segment_size": 1 << 20}) == -600
    assert s.setup({"local_hostname": "127.0.0.1", "mode": "agent",
                    "agent_socket": node.socket}) == 0
    assert s.put(key("dict"), b"v") == 0
    s.close()
    # Mooncake's own "mode" values (its deployment modes) leave kvpool's mode to auto.
    s = mc.MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "mode": "standalone-store",
                    "global_segment_size": 0}) == 0
    assert s.get_hostname().startswith("agent:")
    s.close()
    monkeypatch.setenv("KVPOOL_CLIENT_MODE", "agent")
    s = mc.MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", "") == -600


def test_agent_killed_mid_session_gives_unavailable(node):
    agent = KvpoolAgent(node.dir / "a1", node.master.addr, node.key, name="py-agent-1").start()
    try:
        s = kvpool.Store(mode="agent", agent_socket=str(agent.socket), request_timeout_ms=2000)
        m = mc.MooncakeDistributedStore()
        assert m.setup({"local_hostname": "127.0.0.1", "mode": "agent",
                        "agent_socket": str(agent.socket)}) == 0
        k = key("before")
        s.put(k, b"v")
        ptr, _ = s.alloc_buffer(4096)
        agent.kill()
        for call in (lambda: s.get(k), lambda: s.put(key("after"), b"v"),
                     lambda: s.exists(k), lambda: s.size(k), lambda: s.remove(k),
                     lambda: s.put_from(key("zc"), ptr, 10)):
            with pytest.raises(kvpool.Unavailable) as e:
                call()
            assert (e.value.kind, e.value.code) == ("unavailable", -900)
        assert not s.healthy()
        assert s._client.batch_get_into([k], [ptr], [4096]) == [-900]
        assert m.put(key("mc"), b"v") == -900
        assert m.get(k) == b""
        assert m.get_size(k) == -900
        assert m.health_check() == 2
        s.close()  # the agent is gone: closing still works
        assert m.close() == 0
        # The alloc_buffer memory stays mapped after close: touching it does not crash.
        view(ptr, 16)[:] = 1
    finally:
        agent.stop()


def test_socket_that_does_not_exist(tmp_path):
    missing = tmp_path / "run" / "agent.sock"
    with pytest.raises(kvpool.Unavailable, match=str(missing)) as e:
        kvpool.Store(mode="agent", agent_socket=str(missing))
    assert e.value.code == -900
    s = mc.MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "mode": "agent",
                    "agent_socket": str(missing)}) == -1
    # A path that is no socket at all.
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("x")
    with pytest.raises(kvpool.Unavailable):
        kvpool.Store(mode="agent", agent_socket=str(not_a_socket), request_timeout_ms=2000)


# A child process that registers 1 MiB of anonymous memory, stores from it once, unmaps it,
# and then asks the store to read from and write into it: every call must answer an error
# code (Mooncake's -800, as real Mooncake answers over TCP), none may end the process.
UNMAPPED_CHILD = r"""
import ctypes, json, sys
from kvpool import mooncake

cfg, tag = json.loads(sys.argv[1]), sys.argv[2]
store = mooncake.MooncakeDistributedStore()
assert store.setup(cfg) == 0, "setup"
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
size = 1 << 20
addr = libc.mmap(None, size, 3, 0x22, -1, 0)  # read+write, private anonymous
ctypes.memset(addr, 7, size)
out = {"register": store.register_buffer(addr, size)}
out["put_mapped"] = store.put_from(f"ok-{tag}", addr, 4096)
# Take the pages away. Not with munmap: the hole it leaves is free address space, and the
# process's own next allocation of that size (a buffer, a thread's stack) can land in it, making
# the address readable again (a CI run saw put_from succeed that way). A fixed mapping with no
# access replaces the pages in one step and keeps the range; the kernel's check of the caller's
# memory fails on it exactly as on an unmapped page, and a direct read would be the same SIGSEGV.
gone = libc.mmap(addr, size, 0, 0x22 | 0x10, -1, 0)  # PROT_NONE, private anonymous, MAP_FIXED
assert gone == addr, "remap"
out["put_from"] = store.put_from(f"gone-{tag}", addr, size)
out["get_into"] = store.get_into(f"ok-{tag}", addr, 4096)
out["batch_put_from"] = store.batch_put_from([f"gone-b-{tag}"], [addr], [4096])[0]
out["batch_get_into"] = store.batch_get_into([f"ok-{tag}"], [addr], [4096])[0]
# A batch mixing a mapped buffer with the gone one (the shared-memory path asks the kernel
# once for a whole batch, then each copy on its own when that answer is no): the mapped item
# moves, the other fails.
good = libc.mmap(None, 8192, 3, 0x22, -1, 0)
ctypes.memset(good, 9, 8192)
out["register_good"] = store.register_buffer(good, 8192)
out["mixed_put"] = store.batch_put_from([f"good-{tag}", f"gone-m-{tag}"], [good, addr],
                                        [4096, 4096])
out["mixed_get"] = store.batch_get_into([f"good-{tag}", f"ok-{tag}"], [good + 4096, addr],
                                        [4096, 4096])
out["good_bytes"] = ctypes.string_at(good + 4096, 4096) == b"\x09" * 4096
out["stored_anyway"] = (store.is_exist(f"gone-{tag}") + store.is_exist(f"gone-b-{tag}")
                        + store.is_exist(f"gone-m-{tag}"))
out["still_works"] = store.put(f"after-{tag}", b"fine")
print(json.dumps(out))
store.close()
"""


@pytest.fixture(scope="module")
def fresh_node():
    """A pool of its own (the module's `node` has a killed agent and full tiers by now)."""
    yield from one_agent_pool("kvpu-", "py-agent-u")


@pytest.mark.parametrize("mode", ["direct", "integrity", "agent"])
def test_registered_memory_unmapped_later_is_an_error_not_a_signal(fresh_node, mode):
    node = fresh_node
    cfg = {
        "local_hostname": "127.0.0.1",
        "mode": "agent" if mode == "agent" else "direct",
        "global_segment_size": 0,
    }
    env = {k: v for k, v in os.environ.items() if k not in MODE_ENV}
    if mode == "agent":
        cfg["agent_socket"] = node.socket
    else:
        cfg["master_server_addr"] = node.master.addr
        cfg["auth_key_file"] = str(node.key)
    if mode == "integrity":
        env["KVPOOL_TRANSFER_INTEGRITY"] = "require"
    run = subprocess.run(
        [sys.executable, "-c", UNMAPPED_CHILD, json.dumps(cfg), secrets.token_hex(4)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    # A negative return code is the signal that ended the child.
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["register"] == 0 and out["put_mapped"] == 0, out
    for call in ("put_from", "get_into", "batch_put_from", "batch_get_into"):
        assert out[call] < 0, (call, out)
    assert out["register_good"] == 0, out
    assert out["mixed_put"][0] == 0 and out["mixed_put"][1] < 0, out
    assert out["mixed_get"][0] == 4096 and out["mixed_get"][1] < 0, out
    assert out["good_bytes"] is True, out
    assert out["stored_anyway"] == 0, out
    assert out["still_works"] == 0, out
