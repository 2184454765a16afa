"""Differential suite: kvpool.mooncake_engine against real Mooncake's mooncake.engine.

Each scenario runs on a pair of engines of one backend on loopback (two real Mooncake
TransferEngines, or two of kvpool's: the wire protocols differ, so pairs never mix), and
collects what a caller observes (return codes, the bytes that land, notifications). The two
backends' dicts must be equal, except for the fields listed in KNOWN_DIFFERENCES with their
reasons (docs/python.md, "Mooncake's transfer engine API", lists the same for users).

Calls that crash Mooncake's process (get_rpc_port before initialize, get_batch_transfer_status
or transfer_check_status of an unknown or spent batch id) are not run against it; kvpool's
answers to them are checked on their own below.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import pytest

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import kvpool.mooncake_engine as kv  # noqa: E402
from kvpool import adapters  # noqa: E402

mc = pytest.importorskip("mooncake.engine")

HOST = "127.0.0.1"
REGION = 1 << 20
KiB = 1 << 10

KNOWN_DIFFERENCES: dict[str, dict] = {
    "unregistered_local_memory": {
        "reason": "kvpool refuses a local address outside registered memory (-1) instead of "
                  "copying from wherever it points: a stray pointer from Python must not "
                  "read or crash the process",
        "kvpool": {"write_outside": -1},
    },
    "register_invalid": {
        "reason": "kvpool refuses to register address 0 (-1); Mooncake registers it",
        "kvpool": {"zero": -1},
    },
}


class Pair:
    """Two initialized engines of one backend, each with a registered 1 MiB region."""

    def __init__(self, module):
        self.module = module
        self.a = module.TransferEngine()
        self.b = module.TransferEngine()
        assert self.a.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        assert self.b.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        self.buf_a = ctypes.create_string_buffer(REGION)
        self.buf_b = ctypes.create_string_buffer(REGION)
        self.pa = ctypes.addressof(self.buf_a)
        self.pb = ctypes.addressof(self.buf_b)
        assert self.a.register_memory(self.pa, REGION) == 0
        assert self.b.register_memory(self.pb, REGION) == 0
        self.session_b = f"{HOST}:{self.b.get_rpc_port()}"

    def fill(self, buf, offset: int, data: bytes) -> None:
        ctypes.memmove(ctypes.addressof(buf) + offset, data, len(data))

    def peek(self, buf, offset: int, n: int) -> bytes:
        return bytes(buf.raw[offset:offset + n])

    def clear(self) -> None:
        ctypes.memset(self.pa, 0, REGION)
        ctypes.memset(self.pb, 0, REGION)


_PAIRS: dict[str, Pair] = {}


@pytest.fixture(scope="module", params=["mooncake", "kvpool"])
def pair(request):
    if request.param not in _PAIRS:
        _PAIRS[request.param] = Pair(mc if request.param == "mooncake" else kv)
    p = _PAIRS[request.param]
    p.clear()
    return p


# Scenario name -> {backend -> observed dict}.
_OBSERVED: dict[str, dict[str, dict]] = {}


def observe(request, pair: Pair, name: str, seen: dict) -> None:
    backend = "mooncake" if pair.module is mc else "kvpool"
    _OBSERVED.setdefault(name, {})[backend] = seen
    both = _OBSERVED[name]
    if len(both) < 2:
        return
    expected = dict(both["mooncake"])
    expected.update(KNOWN_DIFFERENCES.get(name, {}).get("kvpool", {}))
    assert both["kvpool"] == expected, f"{name}: kvpool differs from Mooncake"


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


@pytest.mark.parametrize("size", [1, 4 * KiB, 64 * KiB, REGION])
def test_single_sync_write_read(request, pair, size):
    p, data = pair, pattern(size, size)
    p.fill(p.buf_a, 0, data)
    seen = {"write": p.a.transfer_sync_write(p.session_b, p.pa, p.pb, size)}
    seen["written"] = p.peek(p.buf_b, 0, size) == data
    p.fill(p.buf_b, 0, pattern(size, 7))
    seen["read"] = p.a.transfer_sync_read(p.session_b, p.pa, p.pb, size)
    seen["read_back"] = p.peek(p.buf_a, 0, size) == pattern(size, 7)
    seen["sync_write"] = p.a.transfer_sync(
        p.session_b, p.pa, p.pb, size, p.module.TransferOpcode.Write)
    seen["sync_read"] = p.a.transfer_sync(
        p.session_b, p.pa, p.pb, size, p.module.TransferOpcode.Read)
    observe(request, p, f"single_{size}", seen)


def test_batch_sync(request, pair):
    p = pair
    offs = [0, 4096, 70000, 500000]
    lens = [10, 4096, 65536, 3]
    for i, (o, n) in enumerate(zip(offs, lens)):
        p.fill(p.buf_a, o, pattern(n, i))
    src = [p.pa + o for o in offs]
    dst = [p.pb + 600000 + o // 2 for o in offs]
    seen = {"write": p.a.batch_transfer_sync_write(p.session_b, src, dst, lens)}
    seen["landed"] = [p.peek(p.buf_b, 600000 + o // 2, n) == pattern(n, i)
                      for i, (o, n) in enumerate(zip(offs, lens))]
    back = [p.pa + 800000 + i * 70000 for i in range(len(offs))]
    seen["read"] = p.a.batch_transfer_sync_read(p.session_b, back, dst, lens)
    seen["read_back"] = [p.peek(p.buf_a, 800000 + i * 70000, n) == pattern(n, i)
                         for i, n in enumerate(lens)]
    seen["generic_write"] = p.a.batch_transfer_sync(
        p.session_b, src, dst, lens, p.module.TransferOpcode.Write)
    seen["generic_read"] = p.a.batch_transfer_sync(
        p.session_b, back, dst, lens, p.module.TransferOpcode.Read)
    seen["empty"] = p.a.batch_transfer_sync_write(p.session_b, [], [], [])
    seen["mismatch"] = p.a.batch_transfer_sync_write(p.session_b, [p.pa], [p.pb, p.pb], [1])
    seen["zero_length"] = p.a.transfer_sync_write(p.session_b, p.pa, p.pb, 0)
    observe(request, p, "batch_sync", seen)


def test_async_batches(request, pair):
    p = pair
    p.fill(p.buf_a, 0, b"async-bytes")
    m = p.module
    w = p.a.batch_transfer_async_write(p.session_b, [p.pa], [p.pb + 100], [11])
    seen = {"write_id_positive": w > 0, "write_status": p.a.get_batch_transfer_status([w])}
    seen["written"] = p.peek(p.buf_b, 100, 11)
    r = p.a.batch_transfer_async_read(p.session_b, [p.pa + 5000], [p.pb + 100], [11])
    seen["read_status"] = p.a.get_batch_transfer_status([r])
    seen["read_back"] = p.peek(p.buf_a, 5000, 11)
    g1 = p.a.batch_transfer_async(p.session_b, [p.pa], [p.pb + 200], [11], m.TransferOpcode.Write)
    g2 = p.a.batch_transfer_async(p.session_b, [p.pa], [p.pb + 300], [11], m.TransferOpcode.Write)
    seen["two_status"] = p.a.get_batch_transfer_status([g1, g2])
    seen["both"] = [p.peek(p.buf_b, 200, 11), p.peek(p.buf_b, 300, 11)]
    seen["no_ids"] = p.a.get_batch_transfer_status([])
    s = p.a.transfer_submit_write(p.session_b, p.pa, p.pb + 400, 11)
    states = [p.a.transfer_check_status(s)]
    deadline = time.monotonic() + 10
    while states[-1] == 0 and time.monotonic() < deadline:
        states.append(p.a.transfer_check_status(s))
    seen["submit_final"] = states[-1]
    seen["submitted"] = p.peek(p.buf_b, 400, 11)
    bad = p.a.batch_transfer_async_write(p.session_b, [p.pa], [p.pb + 2 * REGION], [5])
    seen["bad_remote_status"] = p.a.get_batch_transfer_status([bad]) if bad else -1
    bad = p.a.transfer_submit_write(p.session_b, p.pa, p.pb + 2 * REGION, 5)
    if bad:
        states = [p.a.transfer_check_status(bad)]
        while states[-1] == 0 and time.monotonic() < deadline:
            states.append(p.a.transfer_check_status(bad))
        seen["bad_submit_final"] = states[-1]
    else:
        seen["bad_submit_final"] = -1
    seen["unreachable_id"] = p.a.batch_transfer_async_write(f"{HOST}:1", [p.pa], [p.pb], [5])
    seen["mismatch_id"] = p.a.batch_transfer_async_write(p.session_b, [p.pa], [p.pb], [1, 2])
    observe(request, p, "async_batches", seen)


def test_transfer_failures(request, pair):
    p = pair
    seen = {
        "remote_outside": p.a.transfer_sync_write(p.session_b, p.pa, p.pb + 2 * REGION, 5),
        "remote_past_end": p.a.transfer_sync_write(p.session_b, p.pa, p.pb + REGION - 2, 5),
        "read_outside": p.a.transfer_sync_read(p.session_b, p.pa, p.pb + 2 * REGION, 5),
        "unreachable": p.a.transfer_sync_write(f"{HOST}:1", p.pa, p.pb, 5),
    }
    observe(request, p, "transfer_failures", seen)


def test_unregistered_local_memory(request, pair):
    p = pair
    other = ctypes.create_string_buffer(64)
    seen = {"write_outside": p.a.transfer_sync_write(
        p.session_b, ctypes.addressof(other), p.pb, 5)}
    observe(request, p, "unregistered_local_memory", seen)


def test_register_and_unregister(request, pair):
    p = pair
    e = p.module.TransferEngine()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    mem = ctypes.create_string_buffer(64 * KiB)
    base = ctypes.addressof(mem)
    seen = {
        "register": e.register_memory(base, 16 * KiB),
        "same_again": e.register_memory(base, 16 * KiB),
        "overlap": e.register_memory(base + 100, 16 * KiB),
        "unregister": e.unregister_memory(base),
        "unregister_again": e.unregister_memory(base),
        "batch_register": e.batch_register_memory(
            [base, base + 16 * KiB, base + 32 * KiB], [16 * KiB] * 3),
        "batch_unregister": e.batch_unregister_memory([base, base + 16 * KiB]),
        "batch_unregister_unknown": e.batch_unregister_memory([base, base + 32 * KiB]),
        "reregister": e.register_memory(base, 64 * KiB),
    }
    # The peer sees the new registration: a write into it lands.
    peer = f"{HOST}:{e.get_rpc_port()}"
    p.fill(p.buf_a, 0, b"to-new-region")
    seen["write_new_region"] = p.a.transfer_sync_write(peer, p.pa, base + 60000, 13)
    seen["landed"] = bytes(mem.raw[60000:60013])
    seen["unregister_last"] = e.unregister_memory(base)
    seen["write_after_unregister"] = p.a.transfer_sync_write(peer, p.pa, base + 60000, 13)
    observe(request, p, "register_and_unregister", seen)


def test_register_invalid(request, pair):
    e = pair.module.TransferEngine()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    seen = {"zero": e.register_memory(0, 10)}
    observe(request, pair, "register_invalid", seen)


def test_peer_queries(request, pair):
    p = pair
    e = p.module.TransferEngine()
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    peer_e = f"{HOST}:{e.get_rpc_port()}"
    seen = {
        "first_of_b": p.a.get_first_buffer_address(p.session_b) == p.pb,
        "first_of_empty": p.a.get_first_buffer_address(peer_e),
        "first_unreachable": p.a.get_first_buffer_address(f"{HOST}:1"),
        "probe": p.a.send_probe(p.session_b),
        "probe_unreachable": p.a.send_probe(f"{HOST}:1"),
        "rpc_port_positive": p.a.get_rpc_port() > 0,
        "topology": json.loads(p.a.get_local_topology()) == json.loads(
            p.a.get_local_topology("")),
        "topology_cpu0": json.loads(p.a.get_local_topology()).get("cpu:0"),
        "init_other_metadata": p.module.TransferEngine().initialize_ext(
            HOST, "P2PHANDSHAKE", "tcp", "", "p2p"),
    }
    observe(request, p, "peer_queries", seen)


def test_managed_buffers(request, pair):
    p = pair
    m = p.a.allocate_managed_buffer(64 * KiB)
    seen = {
        "allocated": m != 0,
        "write_bytes": p.a.write_bytes_to_buffer(m, b"managed\x00bytes", 13),
        "read_bytes": p.a.read_bytes_from_buffer(m, 13),
        # Managed memory is registered: it moves to a peer.
        "send": p.a.transfer_sync_write(p.session_b, m, p.pb + 1000, 13),
        "landed": p.peek(p.buf_b, 1000, 13),
        "free": p.a.free_managed_buffer(m, 64 * KiB),
    }
    observe(request, p, "managed_buffers", seen)


def test_notifications(request, pair):
    p = pair
    m = p.module
    p.fill(p.buf_a, 0, b"noted")
    p.b.get_notifies()  # drop leftovers
    seen = {
        "none": [(n.name, n.msg) for n in p.b.get_notifies()],
        "sync": p.a.transfer_sync(p.session_b, p.pa, p.pb, 5, m.TransferOpcode.Write,
                                  m.TransferNotify("req-1", "done")),
        "batch": p.a.batch_transfer_sync(p.session_b, [p.pa], [p.pb + 10], [5],
                                         m.TransferOpcode.Write, m.TransferNotify("req-2", "ok")),
    }
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += [(n.name, n.msg) for n in p.b.get_notifies()]
    seen["received"] = sorted(got)
    seen["landed"] = [p.peek(p.buf_b, 0, 5), p.peek(p.buf_b, 10, 5)]
    observe(request, p, "notifications", seen)


# --- kvpool only: what Mooncake crashes on, credentials, integrity, the alias -------------


def test_kvpool_answers_where_mooncake_crashes():
    e = kv.TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.register_memory(1 << 20, 10) == -1
    assert e.transfer_check_status(12345) == -1
    assert e.get_batch_transfer_status([12345]) == -1
    assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert e.transfer_check_status(12345) == -1
    assert e.get_batch_transfer_status([12345]) == -1
    assert e.initialize(HOST, "etcd://127.0.0.1:1", "tcp", "") == -1
    assert kv.TransferEngine().initialize(HOST, "etcd://127.0.0.1:1", "tcp", "") == -1
    assert kv.TransferEngine().initialize(HOST, "P2PHANDSHAKE", "nvlink", "") == -1
    stray = ctypes.create_string_buffer(16)
    assert e.write_bytes_to_buffer(ctypes.addressof(stray), b"x", 1) == -1
    assert e.read_bytes_from_buffer(ctypes.addressof(stray), 1) == b""
    assert e.free_managed_buffer(ctypes.addressof(stray), 16) == 0


def _keyed_pair(monkeypatch, tmp_path, key_a: bytes, key_b: bytes):
    engines = []
    for i, key in enumerate((key_a, key_b)):
        path = tmp_path / f"key-{i}"
        path.write_bytes(key)
        monkeypatch.setenv("KVPOOL_AUTH_KEY_FILE", str(path))
        e = kv.TransferEngine()
        assert e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
        engines.append(e)
    return engines


def test_pool_key_authenticates_peers(monkeypatch, tmp_path):
    a, b = _keyed_pair(monkeypatch, tmp_path, b"k" * 32, b"k" * 32)
    assert a._engine is not None and a._engine.authenticated
    src, dst = ctypes.create_string_buffer(b"secret", 64), ctypes.create_string_buffer(64)
    assert a.register_memory(ctypes.addressof(src), 64) == 0
    assert b.register_memory(ctypes.addressof(dst), 64) == 0
    peer = f"{HOST}:{b.get_rpc_port()}"
    assert a.transfer_sync_write(peer, ctypes.addressof(src), ctypes.addressof(dst), 6) == 0
    assert dst.raw[:6] == b"secret"
    # A peer with another key is refused before any byte moves.
    c, d = _keyed_pair(monkeypatch, tmp_path, b"x" * 32, b"y" * 32)
    assert d.register_memory(ctypes.addressof(dst), 64) == 0
    assert c.register_memory(ctypes.addressof(src), 64) == 0
    other = f"{HOST}:{d.get_rpc_port()}"
    assert c.send_probe(other) == -102
    assert c.transfer_sync_write(other, ctypes.addressof(src), ctypes.addressof(dst), 6) == -1


def test_integrity_required_on_both_sides(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPOOL_TRANSFER_INTEGRITY", "require")
    a, b = _keyed_pair(monkeypatch, tmp_path, b"k" * 32, b"k" * 32)
    src, dst = ctypes.create_string_buffer(b"sealed", 64), ctypes.create_string_buffer(64)
    assert a.register_memory(ctypes.addressof(src), 64) == 0
    assert b.register_memory(ctypes.addressof(dst), 64) == 0
    peer = f"{HOST}:{b.get_rpc_port()}"
    assert a.transfer_sync_write(peer, ctypes.addressof(src), ctypes.addressof(dst), 6) == 0
    assert dst.raw[:6] == b"sealed"
    monkeypatch.setenv("KVPOOL_TRANSFER_INTEGRITY", "bogus")
    assert kv.TransferEngine().initialize(HOST, "P2PHANDSHAKE", "tcp", "") == -1


def test_alias_swaps_mooncake_engine_and_restores():
    real = sys.modules.get("mooncake.engine")
    with adapters.mooncake_engine_alias() as mod:
        from mooncake.engine import TransferEngine  # noqa: PLC0415

        assert TransferEngine is kv.TransferEngine
        assert mod is kv
        import mooncake  # noqa: PLC0415

        assert mooncake.engine is kv
    assert sys.modules.get("mooncake.engine") is real
    from mooncake.engine import TransferEngine as after  # noqa: PLC0415

    assert after is mc.TransferEngine


def test_every_offered_method_is_mooncakes():
    ours = {n for n in dir(kv.TransferEngine) if not n.startswith("_")}
    theirs = {n for n in dir(mc.TransferEngine) if not n.startswith("_")}
    not_offered = {"get_engine", "get_engine_ptr", "warmup_efa_segment", "TransferOpcode"}
    assert ours == theirs - not_offered


def test_concurrent_threads_and_late_registrations():
    """Engines call from thread pools: many threads to one peer, while the peer registers
    more memory (the initiator reads its region table again on the first miss)."""
    import threading

    a, b = kv.TransferEngine(), kv.TransferEngine()
    assert a.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize(HOST, "P2PHANDSHAKE", "tcp", "") == 0
    threads_n, rounds, size = 8, 40, 4 * KiB
    src = ctypes.create_string_buffer(threads_n * size)
    assert a.register_memory(ctypes.addressof(src), threads_n * size) == 0
    for t in range(threads_n):
        ctypes.memmove(ctypes.addressof(src) + t * size, pattern(size, t), size)
    regions = [ctypes.create_string_buffer(size) for _ in range(threads_n)]
    assert b.register_memory(ctypes.addressof(regions[0]), size) == 0
    peer = f"{HOST}:{b.get_rpc_port()}"
    assert a.transfer_sync_write(peer, ctypes.addressof(src), ctypes.addressof(regions[0]),
                                 size) == 0  # the initiator now holds a table of one region
    for r in regions[1:]:
        assert b.register_memory(ctypes.addressof(r), size) == 0
    failures: list = []

    def worker(t: int) -> None:
        for _ in range(rounds):
            rc = a.batch_transfer_sync_write(
                peer, [ctypes.addressof(src) + t * size], [ctypes.addressof(regions[t])],
                [size])
            if rc != 0:
                failures.append((t, rc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not failures
    assert all(regions[t].raw == pattern(size, t) for t in range(threads_n))
