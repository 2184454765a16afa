"""The engine adapters (kvpool.adapters) driven the way their engines drive them.

Each test calls an adapter with what its engine would pass (vLLM's requests, block ids and KV
cache tensors; SGLang's host pages as pointers and sizes; LMCache's memory objects), built on
numpy host memory (adapter_fakes.py), against the `pool` fixture of conftest.py: real
Mooncake (`-k mooncake`) and kvpool (`-k kvpool`). The engines themselves do not import on
this machine; where an adapter reuses an engine's own Mooncake code, a stand-in module tree at
the engine's import path checks what the adapter changes about it (which store module it
builds, which config it reads).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

import adapter_fakes as fakes
from kvpool import adapters
from kvpool.adapters import lmcache as lmc
from kvpool.adapters import sglang as sgl
from kvpool.adapters import vllm as vl

CONFIG_VARS = (
    "KVPOOL_ENGINE_CONFIG",
    "KVPOOL_CONFIG",
    "MOONCAKE_CONFIG_PATH",
    "KVPOOL_MASTER",
    "KVPOOL_MASTER_ADDR",
    "KVPOOL_STORE_MODULE",
    "KVPOOL_BLOCK_SIZE_TOKENS",
)


@pytest.fixture
def clean_env(monkeypatch):
    for var in CONFIG_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVPOOL_POD_IP", "127.0.0.1")
    return monkeypatch


@pytest.fixture(scope="module")
def closer(pool):
    """Defers closing stores to the end of the module, all at once: a Mooncake client takes
    about a second to close, and closes overlap."""
    pending = []
    yield pending.append
    threads = [threading.Thread(target=f) for f in pending]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@pytest.fixture
def pool_env(pool, clean_env):
    """The environment the operator gives an engine pod, pointing at `pool`."""
    clean_env.setenv("KVPOOL_MASTER", pool.master_addr)
    clean_env.setenv("KVPOOL_STORE_MODULE", pool.module.__name__)
    return pool


def uid() -> str:
    return uuid.uuid4().hex[:12]


def config_file(tmp_path, env, variable, fields, name="engine.json"):
    """Writes `fields` as JSON to `tmp_path/name` and names that file in `variable`."""
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    env.setenv(variable, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Shared configuration
# ---------------------------------------------------------------------------------------------


def test_setup_args_sources_and_precedence(tmp_path, clean_env):
    config_file(
        tmp_path,
        clean_env,
        "KVPOOL_ENGINE_CONFIG",
        {
            "pool": "roce",
            "master_server_address": "file-master:50051",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "rdma",
            "device_name": "mlx5_0,mlx5_1",
            "agent_socket": "/run/kvpool/agent.sock",
            "block_size_tokens": 256,
            "auth_key_file": "/etc/kvpool/auth/key",
        },
    )
    args = adapters.setup_args()
    assert args == (
        "127.0.0.1",
        "P2PHANDSHAKE",
        0,
        64 << 20,
        "rdma",
        "mlx5_0,mlx5_1",
        "file-master:50051",
    )
    settings = adapters.engine_settings()
    assert settings == adapters.EngineSettings(
        "roce", "/run/kvpool/agent.sock", "/etc/kvpool/auth/key", 256
    )
    # The environment beats the file, the engine's own config beats both.
    clean_env.setenv("KVPOOL_MASTER", "m-0:50051, m-1:50051")
    clean_env.setenv("KVPOOL_AGENT_SOCKET", "/other.sock")
    assert adapters.setup_args().master_server_addr == "m-0:50051,m-1:50051"
    assert adapters.engine_settings().agent_socket == "/other.sock"
    over = adapters.setup_args(
        {
            "master_server_address": "x:1",
            "global_segment_size": "1GB",
            "local_buffer_size": "512MiB",
            "protocol": "tcp",
        }
    )
    assert (
        over.master_server_addr,
        over.global_segment_size,
        over.local_buffer_size,
        over.protocol,
    ) == ("x:1", 1 << 30, 512 << 20, "tcp")
    assert over.mooncake_json()["device_name"] == "mlx5_0,mlx5_1"


def test_setup_args_reads_mooncake_and_operator_names(tmp_path, clean_env):
    cfg = config_file(
        tmp_path,
        clean_env,
        "MOONCAKE_CONFIG_PATH",
        {"master_server_address": "mc:50051", "local_hostname": "10.0.0.7"},
        name="mooncake.json",
    )
    assert adapters.setup_args()[::6] == ("10.0.0.7", "mc:50051")
    clean_env.delenv("MOONCAKE_CONFIG_PATH")
    clean_env.setenv("KVPOOL_CONFIG", str(cfg))  # the operator's name for engine.json
    assert adapters.setup_args().master_server_addr == "mc:50051"


def test_setup_args_errors_name_the_field(tmp_path, clean_env):
    with pytest.raises(adapters.ConfigError, match="master_server_address"):
        adapters.setup_args()
    with pytest.raises(adapters.ConfigError, match="local_buffer_size"):
        adapters.setup_args({"master_server_address": "m:1", "local_buffer_size": "lots"})
    with pytest.raises(adapters.ConfigError, match="protocol"):
        adapters.setup_args({"master_server_address": "m:1", "protocol": "carrier-pigeon"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    clean_env.setenv("KVPOOL_ENGINE_CONFIG", str(bad))
    with pytest.raises(adapters.ConfigError):
        adapters.setup_args()
    with pytest.raises(adapters.ConfigError, match="MooncakeDistributedStore"):
        adapters.store_module("json")


def test_mooncake_alias_swaps_and_restores(monkeypatch):
    import mooncake.store as real

    shim = fakes.recording_store_module(real, "kvpool_test_alias_shim")
    monkeypatch.setitem(sys.modules, "kvpool_test_alias_shim", shim)
    before = sys.modules.get("mooncake.store")
    with adapters.mooncake_alias("kvpool_test_alias_shim"):
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        assert MooncakeDistributedStore is shim.MooncakeDistributedStore
        assert ReplicateConfig is real.ReplicateConfig
    assert sys.modules.get("mooncake.store") is before
    from mooncake.store import MooncakeDistributedStore as after

    assert after is real.MooncakeDistributedStore


def test_mooncake_config_file_is_temporary(monkeypatch):
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", "/etc/kvpool/engine.json")
    with adapters.mooncake_config_file({"a": 1}) as path:
        import os

        assert os.environ["MOONCAKE_CONFIG_PATH"] == path
        assert json.load(open(path)) == {"a": 1}
    assert os.environ["MOONCAKE_CONFIG_PATH"] == "/etc/kvpool/engine.json"
    assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------

BLOCK = 4  # tokens per vLLM block in these tests
NUM_BLOCKS = 8


def kv_caches(seed: int, layers: int = 2, layout: str = "flash"):
    """vLLM-shaped KV caches: FlashAttention's (2, blocks, block_size, heads, head_dim)."""
    rng = np.random.default_rng(seed)
    shape = (2, NUM_BLOCKS, BLOCK, 2, 8) if layout == "flash" else (NUM_BLOCKS, 2, BLOCK, 2, 8)
    return {
        f"model.layers.{i}.self_attn": rng.standard_normal(shape).astype(np.float16)
        for i in range(layers)
    }


def block_bytes(caches, block_id: int) -> bytes:
    out = b""
    for t in caches.values():
        out += t[0, block_id].tobytes() + t[1, block_id].tobytes()
    return out


def vllm_config(role: str, tp: int = 1, **extra):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=dict(extra)),
        cache_config=SimpleNamespace(
            block_size=BLOCK, num_gpu_blocks=NUM_BLOCKS, cache_dtype="auto"
        ),
        model_config=SimpleNamespace(model="org/tiny-model", dtype="float16"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=0),
    )


def request(rid: str, hashes, tokens: int):
    return SimpleNamespace(
        request_id=rid,
        block_hashes=list(hashes),
        num_tokens=tokens,
        prompt_token_ids=list(range(tokens)),
        num_computed_tokens=tokens,
    )


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


class Engine:
    """One vLLM instance: its scheduler-side and worker-side connectors, stepped as vLLM steps
    them (build metadata, bind it, load, forward, save, report finished)."""

    def __init__(self, role: str, caches, tp: int = 1, tp_rank: int = 0, zeroes: bool = False,
                 **extra):
        cfg = vllm_config(role, tp, kvpool_tp_rank=tp_rank, **extra)
        # vLLM's KVCacheConfig, as far as the connector reads it.
        kv_cfg = SimpleNamespace(num_blocks=NUM_BLOCKS, needs_kv_cache_zeroing=zeroes)
        self.scheduler = vl.KvpoolBlockConnector(cfg, vl.KVConnectorRole.SCHEDULER, kv_cfg)
        self.worker = vl.KvpoolBlockConnector(cfg, vl.KVConnectorRole.WORKER, kv_cfg)
        self.worker.register_kv_caches(caches)
        self.caches = caches

    def step(self, finished=(), scheduled=None):
        """One engine step; `scheduled` is vLLM's `num_scheduled_tokens` (request -> tokens
        computed this step), which the connector saves completed blocks by."""
        out = SimpleNamespace(num_scheduled_tokens=dict(scheduled or {}))
        meta = self.scheduler.build_connector_meta(out)
        # vLLM's worker step: handle_preemptions first, then the step's inputs are prepared,
        # then the connector's forward context (bind, start_load_kv, forward, wait_for_save).
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        done = self.worker.get_finished(set(finished))
        self.worker.clear_connector_metadata()
        return meta, done

    def admit(self, req, block_ids, local_tokens: int = 0):
        """Schedule `req`: the pool lookup, then vLLM's allocation, then one step."""
        n, async_load = self.scheduler.get_num_new_matched_tokens(req, local_tokens)
        assert async_load is False
        self.scheduler.update_state_after_alloc(req, blocks(block_ids), n)
        self.step()
        return n

    def finish(self, req, block_ids):
        """`req` finished: its blocks are saved in the next step, then released."""
        keep, params = self.scheduler.request_finished(req, list(block_ids))
        _meta, done = self.step(finished={req.request_id})
        return keep, done

    def close(self, closer):
        closer(self.worker.shutdown)
        closer(self.scheduler.shutdown)


def test_vllm_layout_finds_blocks_in_each_backend_layout():
    flash = kv_caches(0)
    layout = vl.BlockLayout(flash, NUM_BLOCKS)
    assert len(layout.segments) == 4  # K and V of two layers
    assert layout.bytes_per_block == 4 * BLOCK * 2 * 8 * 2
    ptrs, sizes = layout.parts(3)
    got = b"".join(
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * s).from_address(p)).tobytes()
        for p, s in zip(ptrs, sizes)
    )
    assert got == block_bytes(flash, 3)
    blocks_first = vl.BlockLayout(kv_caches(1, layout="flashinfer"), NUM_BLOCKS)
    assert (
        len(blocks_first.segments) == 2 and blocks_first.bytes_per_block == layout.bytes_per_block
    )
    # A layer that shares another's cache is laid out once.
    shared = dict(flash, **{"model.layers.9.self_attn": flash["model.layers.0.self_attn"]})
    assert len(vl.BlockLayout(shared, NUM_BLOCKS).segments) == 4
    # HND-permuted inner dimensions are still one dense run per block.
    hnd = np.zeros((NUM_BLOCKS, 2, 8, BLOCK, 2), dtype=np.float16).transpose(0, 3, 4, 1, 2)
    assert len(vl.BlockLayout({"l": hnd}, NUM_BLOCKS).segments) == 1
    with pytest.raises(ValueError, match="block dimension"):
        vl.BlockLayout({"l": np.zeros((3, 5), dtype=np.float16)}, NUM_BLOCKS)
    with pytest.raises(IndexError):
        layout.parts(NUM_BLOCKS)


class _DeviceStore:
    """A store that says it takes device memory, around a real one (the caches here are host
    memory standing in for GPU memory, which the kvpool build without feature cuda moves as
    host memory: what is checked is which path BlockIO takes and that bytes round-trip)."""

    def __init__(self, store, takes: bool):
        self._store, self._takes = store, takes

    def device_memory_supported(self):
        return self._takes

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_vllm_device_caches_go_in_place_when_the_store_takes_device_memory(pool_env, closer):
    store = adapters.open_store({}, module=pool_env.module)
    closer(store.close)
    if pool_env.module.__name__ == "kvpool.mooncake":
        import kvpool

        # This build (no feature cuda, or no GPU here) says so, and the adapter believes it.
        assert store.device_memory_supported() is kvpool.device_memory_supported()
    else:
        assert not vl.store_takes_device_memory(store), "real Mooncake is given host memory"
    src, dst = kv_caches(7), kv_caches(8)

    def device_layout(caches):
        layout = vl.BlockLayout(caches, NUM_BLOCKS)
        layout.on_host = False  # as a torch CUDA tensor's layout says
        return layout

    io = vl.BlockIO(_DeviceStore(store, True), device_layout(src))
    assert io.in_place and io._staging is None
    keys = [f"dev-{uid()}-{b}" for b in (1, 5)]
    assert io.save(keys, [1, 5]) == [0, 0]
    into = vl.BlockIO(_DeviceStore(store, True), device_layout(dst), device_memory="direct")
    want = len(block_bytes(src, 1))
    assert into.load(keys, [2, 3]) == [want, want]
    assert block_bytes(dst, 2) == block_bytes(src, 1)
    assert block_bytes(dst, 3) == block_bytes(src, 5)
    io.close()
    into.close()
    # A store that takes host memory only: "direct" is refused by name; "staging" and "auto"
    # would stage through torch, which needs a device.
    with pytest.raises(ValueError, match="does not take GPU memory"):
        vl.BlockIO(_DeviceStore(store, False), device_layout(src), device_memory="direct")
    with pytest.raises(ValueError, match="expected one of"):
        vl.BlockIO(store, device_layout(src), device_memory="gpu")


def test_vllm_keys_hash_forms():
    keys = vl.BlockKeys("ns", tp_size=2)
    assert keys.key(b"\x01\xff", 1) == "ns@tp1of2@pp0of1@01ff"
    assert keys.all_ranks(b"\x02") == ["ns@tp0of2@pp0of1@02", "ns@tp1of2@pp0of1@02"]
    assert vl.hash_hex(-1) == "f" * 32
    assert vl.hash_hex(SimpleNamespace(hash_value=255)) == "ff"
    chain = vl.token_block_hashes(list(range(10)), 4)
    assert len(chain) == 2 and chain == vl.token_block_hashes(list(range(8)), 4)
    assert chain[1] != vl.token_block_hashes([9] + list(range(1, 8)), 4)[1]


def test_vllm_prefill_saves_and_decode_loads(pool_env, closer):
    prefill_caches, decode_caches = kv_caches(1), kv_caches(2)
    for t in decode_caches.values():
        t[...] = 0
    prefill = Engine("kv_producer", prefill_caches)
    decode = Engine("kv_consumer", decode_caches)
    try:
        hashes = [uuid.uuid4().bytes * 2 for _ in range(5)]
        req = request(f"p-{uid()}", hashes, tokens=5 * BLOCK + 2)  # 5 full blocks and 2 tokens
        prefill_ids = [3, 1, 4, 7, 5, 2]
        # A producer does not load: nothing is looked up.
        assert prefill.admit(req, prefill_ids) == 0
        keep, done = prefill.finish(req, prefill_ids)
        assert keep is True and done == ({req.request_id}, None)

        # The decode instance finds all 5 blocks and loads them into its own block ids.
        dreq = request(f"d-{uid()}", hashes, tokens=5 * BLOCK + 2)
        decode_ids = [0, 6, 2, 5, 1, 3]
        assert decode.admit(dreq, decode_ids) == 5 * BLOCK
        assert decode.worker.get_block_ids_with_load_errors() == set()
        for src, dst in zip(prefill_ids[:5], decode_ids[:5]):
            assert block_bytes(decode_caches, dst) == block_bytes(prefill_caches, src)
        assert block_bytes(decode_caches, decode_ids[5]) == bytes(
            len(block_bytes(decode_caches, 0))
        )
        # A consumer does not save.
        assert decode.scheduler.request_finished(dreq, decode_ids) == (False, None)
    finally:
        prefill.close(closer)
        decode.close(closer)


def test_vllm_lookup_counts_the_leading_blocks_only(pool_env, closer):
    caches = kv_caches(3)
    engine = Engine("kv_both", caches)
    try:
        hashes = [uuid.uuid4().bytes for _ in range(4)]
        # Save blocks 0 and 1 and 3 of the chain (a request that ended after 2 blocks, and a
        # block 3 from elsewhere): the prefix stops at the gap.
        first = request(f"a-{uid()}", hashes[:2], tokens=2 * BLOCK)
        assert engine.finish(first, [0, 1])[1] == ({first.request_id}, None)
        other = request(f"b-{uid()}", [hashes[3]], tokens=BLOCK)
        engine.finish(other, [5])
        probe = request(f"c-{uid()}", hashes, tokens=4 * BLOCK + 1)
        assert engine.scheduler.get_num_new_matched_tokens(probe, 0) == (2 * BLOCK, False)
        # Tokens vLLM already has locally are not counted again.
        assert engine.scheduler.get_num_new_matched_tokens(probe, BLOCK) == (BLOCK, False)
        # Unknown hashes: no hit.
        unknown = request(
            f"u-{uid()}", [uuid.uuid4().bytes for _ in range(3)], tokens=3 * BLOCK + 1
        )
        assert engine.scheduler.get_num_new_matched_tokens(unknown, 0) == (0, False)
        # A fully cached prompt still leaves its last token to compute.
        whole = request(f"w-{uid()}", hashes[:2], tokens=2 * BLOCK)
        assert engine.scheduler.get_num_new_matched_tokens(whole, 0) == (BLOCK, False)
        # A save of blocks the pool has writes nothing new and still completes (an engine
        # that has not seen them: its worker finds every key present).
        other_engine = Engine("kv_both", kv_caches(13))
        try:
            again = request(f"r-{uid()}", hashes[:2], tokens=2 * BLOCK)
            assert other_engine.finish(again, [6, 7]) == (True, ({again.request_id}, None))
        finally:
            other_engine.close(closer)
    finally:
        engine.close(closer)


class CountingStore:
    """A store wrapper counting the calls a worker makes."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: dict = {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def test_vllm_blocks_known_in_the_pool_are_not_saved_again(pool_env, closer):
    """A prompt whose prefix the engine found in the pool (or saved itself) and then serves
    from its own cache makes no pool call in its steps; a hand-off still saves every block."""
    producer, engine = Engine("kv_both", kv_caches(14)), Engine("kv_both", kv_caches(15))
    try:
        hashes = [uuid.uuid4().bytes for _ in range(3)]
        saved = request(f"s-{uid()}", hashes, tokens=3 * BLOCK)
        assert producer.finish(saved, [0, 1, 2]) == (True, ({saved.request_id}, None))
        # The engine loads the prefix from the pool...
        first = request(f"f-{uid()}", hashes, tokens=3 * BLOCK + 1)
        assert engine.admit(first, [4, 5, 6, 7]) == 3 * BLOCK
        assert engine.finish(first, [4, 5, 6, 7]) == (False, (None, None))
        # ... then serves it from its own cache: the step that completes the blocks and the
        # finish queue nothing, so the worker makes no pool call.
        engine.worker._io.store = counting = CountingStore(engine.worker._io.store)
        hit = request(f"h-{uid()}", hashes, tokens=3 * BLOCK + 1)
        assert engine.scheduler.get_num_new_matched_tokens(hit, 3 * BLOCK) == (0, False)
        engine.scheduler.bind_kv_cache_manager(
            SimpleNamespace(get_block_ids=lambda rid: ([4, 5, 6, 7],))
        )
        engine.scheduler.update_state_after_alloc(hit, blocks([4, 5, 6, 7]), 0)
        hit.num_computed_tokens = 3 * BLOCK
        meta, _ = engine.step(scheduled={hit.request_id: 1})
        assert meta.saves == [] and counting.calls == {}
        hit.num_computed_tokens = 3 * BLOCK + 1
        assert engine.finish(hit, [4, 5, 6, 7]) == (False, (None, None))
        # A request that finishes before any step queued its blocks: nothing to save either.
        short = request(f"q-{uid()}", hashes, tokens=3 * BLOCK)
        assert engine.finish(short, [4, 5, 6]) == (False, (None, None))
        assert counting.calls == {}
        # A prefill handing off to a decode engine saves (checks) every block all the same.
        handoff = request(f"p-{uid()}", hashes, tokens=3 * BLOCK + 1)
        handoff.kv_transfer_params = {"do_remote_decode": True}
        keep, params = engine.scheduler.request_finished(handoff, [4, 5, 6, 7])
        assert keep is True and params is not None
        _meta, done = engine.step(finished={handoff.request_id})
        assert done == ({handoff.request_id}, None)
        assert counting.calls.get("batch_is_exist") == 1
        assert counting.calls.get("batch_put_from_multi_buffers") is None  # all present
    finally:
        producer.close(closer)
        engine.close(closer)


def test_vllm_known_blocks_expire_and_stay_bounded():
    now = [0.0]
    known = vl.KnownBlocks(capacity=3, ttl_s=10.0, clock=lambda: now[0])
    known.add(["a", "b"])
    now[0] = 5.0
    known.add(["c", "d"])  # "a" is the oldest: forgotten at capacity 3
    assert "a" not in known and all(h in known for h in "bcd")
    now[0] = 12.0  # "b" was seen 12 s ago, "c" and "d" 7 s ago
    assert "b" not in known and "c" in known and len(known) == 2
    known.add(["c"])
    now[0] = 20.0
    assert "c" in known and "d" not in known
    with pytest.raises(ValueError):
        vl.KnownBlocks(capacity=0)


def test_vllm_load_failure_reports_the_blocks(pool_env, client, closer):
    caches = kv_caches(4)
    engine = Engine("kv_both", caches)
    store = client.store
    try:
        hashes = [uuid.uuid4().bytes for _ in range(3)]
        saved = request(f"s-{uid()}", hashes, tokens=3 * BLOCK)
        engine.finish(saved, [0, 1, 2])
        probe = request(f"p-{uid()}", hashes, tokens=3 * BLOCK + 1)
        n, _ = engine.scheduler.get_num_new_matched_tokens(probe, 0)
        assert n == 3 * BLOCK
        # The second block disappears between the lookup and the load.
        gone = engine.worker._keys.key(hashes[1])
        assert store.remove(gone, force=True) == 0  # force: the put's lease is still on
        engine.scheduler.update_state_after_alloc(probe, blocks([5, 6, 7]), n)
        engine.step()
        assert engine.worker.get_block_ids_with_load_errors() == {6}
        assert engine.worker.get_block_ids_with_load_errors() == set()
    finally:
        engine.close(closer)


def test_vllm_loads_layer_by_layer_behind_the_forward_pass(pool_env, closer):
    """Asked to (host caches load whole blocks by default), kvpool in direct mode loads in a
    thread, one layer's part of each block at a time: start_load_kv returns with the load in
    flight, and once wait_for_layer_load(layer) returns that layer's blocks are in. Mooncake's
    store reads whole values before the forward pass. The bytes end up the same either way, and
    a block that failed is reported once."""
    src, dst = kv_caches(16, layers=3), kv_caches(17, layers=3)
    for t in dst.values():
        t[...] = 0
    producer = Engine("kv_both", src)
    consumer = Engine("kv_both", dst, kvpool_layerwise_load="true")
    layered = pool_env.name == "kvpool"
    try:
        assert producer.worker._layerwise is False  # "auto": host caches load whole blocks
        assert consumer.worker._layerwise is layered
        hashes = [uuid.uuid4().bytes for _ in range(3)]
        saved = request(f"s-{uid()}", hashes, tokens=3 * BLOCK)
        producer.finish(saved, [0, 1, 2])
        probe = request(f"l-{uid()}", hashes, tokens=3 * BLOCK + 1)
        n, _ = consumer.scheduler.get_num_new_matched_tokens(probe, 0)
        assert n == 3 * BLOCK
        consumer.scheduler.update_state_after_alloc(probe, blocks([5, 6, 7, 4]), n)
        meta = consumer.scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        consumer.worker.bind_connector_metadata(meta)
        consumer.worker.start_load_kv(None)
        assert (consumer.worker._inflight is not None) is layered
        names = list(dst)
        for layer, name in enumerate(names):
            consumer.worker.wait_for_layer_load(name)
            # This layer's blocks are in (K and V), whatever the later layers are doing.
            for s_id, d_id in zip([0, 1, 2], [5, 6, 7]):
                assert dst[name][:, d_id].tobytes() == src[name][:, s_id].tobytes(), (layer, d_id)
        consumer.worker.wait_for_save()
        assert consumer.worker._inflight is None
        assert consumer.worker.get_block_ids_with_load_errors() == set()
        consumer.worker.clear_connector_metadata()
        for s_id, d_id in zip([0, 1, 2], [5, 6, 7]):
            assert block_bytes(dst, d_id) == block_bytes(src, s_id)
        # A block gone before its load: each of its layers fails, it is reported once.
        gone_hashes = [uuid.uuid4().bytes for _ in range(2)]
        producer.finish(request(f"g-{uid()}", gone_hashes, tokens=2 * BLOCK), [0, 1])
        probe = request(f"m-{uid()}", gone_hashes, tokens=2 * BLOCK + 1)
        n, _ = consumer.scheduler.get_num_new_matched_tokens(probe, 0)
        store = producer.worker._io.store
        assert store.remove(producer.worker._keys.key(gone_hashes[0]), force=True) == 0
        consumer.scheduler.update_state_after_alloc(probe, blocks([2, 3, 0]), n)
        consumer.step()
        assert consumer.worker.get_block_ids_with_load_errors() == {2}
        if layered:
            # A part beyond the value's end reads nothing: InvalidArgument (-600).
            io = consumer.worker._io
            key0 = consumer.worker._keys.key(hashes[0])
            ptrs, sizes = io.layout.parts(5, 2)
            assert io.store.batch_get_parts_into_multi_buffers(
                [key0], [io.layout.bytes_per_block - 1], [ptrs], [sizes]
            ) == [-600]
            assert block_bytes(dst, 5) == block_bytes(src, 0)  # untouched
        with pytest.raises(adapters.ConfigError, match="kvpool_layerwise_load"):
            Engine("kv_both", kv_caches(18), kvpool_layerwise_load="sometimes")
    finally:
        producer.close(closer)
        consumer.close(closer)


def test_vllm_loads_start_before_the_step_prepares_its_inputs(pool_env, closer):
    """With kvpool, a step's loads start in handle_preemptions (vLLM's first connector call of
    a worker step, before it prepares the step's inputs) and run on the store's threads;
    start_load_kv waits for them. The bytes and the load errors are what a load in
    start_load_kv gives. Not where vLLM zeroes new blocks in that preparation, nor when told
    not to; Mooncake's store has no such call and loads in start_load_kv."""
    src, dst = kv_caches(21), kv_caches(22)
    for t in dst.values():
        t[...] = 0
    producer = Engine("kv_both", src, kvpool_early_load="false")
    consumer = Engine("kv_both", dst)
    early = pool_env.name == "kvpool"
    try:
        assert producer.worker._early_loads is False
        assert consumer.worker._early_loads is early
        hashes = [uuid.uuid4().bytes for _ in range(4)]
        producer.finish(request(f"s-{uid()}", hashes, tokens=4 * BLOCK), [0, 1, 2, 3])
        # The third block disappears between the lookup and the load.
        probe = request(f"e-{uid()}", hashes, tokens=4 * BLOCK + 1)
        n, _ = consumer.scheduler.get_num_new_matched_tokens(probe, 0)
        assert n == 4 * BLOCK
        store = producer.worker._io.store
        assert store.remove(producer.worker._keys.key(hashes[2]), force=True) == 0
        consumer.scheduler.update_state_after_alloc(probe, blocks([4, 5, 6, 7, 0]), n)
        meta = consumer.scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
        consumer.worker.handle_preemptions(meta)
        assert len(consumer.worker._early) == (1 if early else 0)
        consumer.worker.bind_connector_metadata(meta)
        consumer.worker.start_load_kv(None)
        assert consumer.worker._early == {}  # claimed and waited for
        consumer.worker.wait_for_save()
        assert consumer.worker.get_block_ids_with_load_errors() == {6}
        consumer.worker.clear_connector_metadata()
        for s_id, d_id in zip([0, 1, 3], [4, 5, 7]):
            assert block_bytes(dst, d_id) == block_bytes(src, s_id)
        assert block_bytes(dst, 6) == bytes(len(block_bytes(dst, 6)))
        # A started load no step claims is waited for before the next step's loads start.
        if early:
            job = vl.BlockJob("stray", [1], [vl.hash_hex(hashes[0])])
            consumer.worker.handle_preemptions(vl.KvpoolConnectorMetadata(loads=[job]))
            assert len(consumer.worker._early) == 1
            consumer.worker.bind_connector_metadata(vl.KvpoolConnectorMetadata())
            consumer.worker.start_load_kv(None)
            assert consumer.worker._early == {}
            consumer.worker.clear_connector_metadata()
            assert block_bytes(dst, 1) == block_bytes(src, 0)
    finally:
        producer.close(closer)
        consumer.close(closer)
    # Where vLLM zeroes new blocks while it prepares the step, loads start in start_load_kv.
    zeroed = Engine("kv_both", kv_caches(23), zeroes=True)
    try:
        assert zeroed.worker._early_loads is False
    finally:
        zeroed.close(closer)
    with pytest.raises(adapters.ConfigError, match="kvpool_early_load"):
        Engine("kv_both", kv_caches(24), kvpool_early_load="soon")
    # The decision on its own: GPU caches read in place start early only when told to (the
    # GPU's last step may still be running); never layer by layer, where vLLM zeroes new
    # blocks, where its KV cache config is unknown, or with a store that cannot start a get.
    starts = SimpleNamespace(start_batch_get_into_multi_buffers=lambda *a: None)

    def io(on_host, store=starts, in_place=True):
        return SimpleNamespace(store=store, in_place=in_place,
                               layout=SimpleNamespace(on_host=on_host))

    plain = SimpleNamespace(needs_kv_cache_zeroing=False)
    zeroing = SimpleNamespace(needs_kv_cache_zeroing=True)
    assert vl.early_loads("auto", plain, False, io(True)) is True
    assert vl.early_loads("auto", plain, False, io(False)) is False
    assert vl.early_loads("true", plain, False, io(False)) is True
    assert vl.early_loads("true", plain, True, io(True)) is False
    assert vl.early_loads("true", zeroing, False, io(True)) is False
    assert vl.early_loads("true", None, False, io(True)) is False
    assert vl.early_loads("true", plain, False, io(True, store=object())) is False
    assert vl.early_loads("true", plain, False, io(False, in_place=False)) is False
    assert vl.early_loads("false", plain, False, io(True)) is False


def test_vllm_tensor_parallel_ranks_all_needed(pool_env, closer):
    rank0 = Engine("kv_both", kv_caches(5), tp=2, tp_rank=0)
    rank1 = Engine("kv_both", kv_caches(6), tp=2, tp_rank=1)
    try:
        hashes = [uuid.uuid4().bytes for _ in range(2)]
        req = request(f"t-{uid()}", hashes, tokens=2 * BLOCK + 1)
        rank0.finish(req, [0, 1])
        assert rank0.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        rank1.finish(req, [2, 3])
        assert rank0.scheduler.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)
    finally:
        rank0.close(closer)
        rank1.close(closer)


def test_vllm_requests_without_block_hashes_key_by_tokens(pool_env, closer):
    """vLLM releases before block_hashes on Request: keys come from the token ids."""
    a, b = Engine("kv_both", kv_caches(7)), Engine("kv_both", kv_caches(8))
    try:
        tokens = [int(x) for x in np.random.default_rng(9).integers(0, 50_000, size=3 * BLOCK)]
        req = SimpleNamespace(
            request_id=f"n-{uid()}",
            prompt_token_ids=tokens,
            num_tokens=len(tokens),
            num_computed_tokens=len(tokens),
        )
        a.finish(req, [4, 5, 6])
        other = SimpleNamespace(
            request_id=f"o-{uid()}",
            prompt_token_ids=tokens + [1],
            num_tokens=len(tokens) + 1,
            num_computed_tokens=0,
        )
        assert b.admit(other, [1, 2, 3, 0]) == 3 * BLOCK
        assert [block_bytes(b.caches, i) for i in (1, 2, 3)] == [
            block_bytes(a.caches, i) for i in (4, 5, 6)
        ]
    finally:
        a.close(closer)
        b.close(closer)


def test_vllm_engine_config_completes_the_operators_file(tmp_path, clean_env):
    config_file(
        tmp_path,
        clean_env,
        "MOONCAKE_CONFIG_PATH",
        {
            "pool": "tcp",
            "master_server_address": "m:50051",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "device_name": "",
            "agent_socket": "/run/kvpool/agent.sock",
        },
    )
    cfg = vl.engine_mooncake_config({})
    assert cfg["mode"] == "standalone-store" and cfg["global_segment_size"] == 0
    assert cfg["master_server_address"] == "m:50051" and cfg["pool"] == "tcp"
    assert cfg["local_buffer_size"] == 64 << 20
    cfg = vl.engine_mooncake_config({"global_segment_size": "1GB"})
    assert cfg["mode"] == "embedded" and cfg["global_segment_size"] == 1 << 30


def test_vllm_uses_its_own_mooncake_connector_when_asked(pool_env, closer, monkeypatch):
    shim = fakes.recording_store_module(pool_env.module, f"kvpool_test_vllm_shim_{uid()}")
    monkeypatch.setitem(sys.modules, shim.__name__, shim)
    # vLLM's own connector registers device memory: opt-in (the default is kvpool's own).
    monkeypatch.setenv("KVPOOL_VLLM_CONNECTOR", "engine")
    with fakes.engine_installed(fakes.fake_vllm(), "kvpool.adapters.vllm") as mod:
        cls = mod.KvpoolStoreConnector
        assert cls.kvpool_impl == "engine" and cls.__name__ == "KvpoolStoreConnector"
        assert issubclass(cls, mod.find_engine_connector())
        conn = cls(
            vllm_config("kv_both", kvpool_store_module=shim.__name__), mod.KVConnectorRole.WORKER
        )
        assert conn.store is shim.made[-1]  # vLLM's code built the pool's store
        cfg = conn.config_seen
        assert cfg["master_server_address"] == pool_env.master_addr
        assert (cfg["mode"], cfg["global_segment_size"]) == ("standalone-store", 0)
        value = uuid.uuid4().bytes * 64
        assert conn.store.put(f"vllm-engine/{uid()}", value) == 0
        closer(conn.store.close)
        assert "MOONCAKE_CONFIG_PATH" not in __import__("os").environ
        assert sys.modules.get("mooncake.store") is not shim
        assert mod.select_connector("auto").kvpool_impl == "engine"
        monkeypatch.delenv("KVPOOL_VLLM_CONNECTOR")
        assert mod.select_connector() is mod.KvpoolBlockConnector  # the default
    assert vl.select_connector("auto") is vl.KvpoolBlockConnector  # no vLLM again
    with pytest.raises(ImportError, match="MooncakeStoreConnector"):
        vl.select_connector("engine")


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------


def storage_config(mla: bool = False, tp_rank: int = 0, **extra):
    """SGLang's HiCacheStorageConfig, and the extra_config of the dynamic backend flags."""
    flags = {
        "backend_name": "kvpool",
        "module_path": "kvpool.adapters.sglang",
        "class_name": "KvpoolHiCacheStorage",
        "interface_v1": 1,
    }
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="org/tiny-model",
        extra_config={**flags, **extra},
    )


def hicache(mla: bool = False, **extra):
    """The backend as SGLang's StorageBackendFactory builds a dynamic one (config, kwargs),
    then registers the host pool."""
    backend = sgl.KvpoolHiCacheStorage(storage_config(mla, **extra), {})
    host = fakes.HostPool(pages=8, mla=mla, seed=7 if mla else 8)
    backend.register_mem_pool_host(host)
    return backend, host


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sglang_pages_round_trip_with_prefix_exists(pool_env, client, closer, mla):
    backend, host = hicache(mla, extra_backend_tag=f"t{uid()}")
    try:
        keys = [uid() for _ in range(5)]
        originals = [host.page(p) for p in range(8)]
        # Back up pages 0-2 under keys 0-2, and page 4 under key 4 (key 3 missing).
        assert backend.batch_set_v1(keys[:3], host.indices([0, 1, 2])) == [True] * 3
        assert backend.batch_set_v1([keys[4]], host.indices([4])) == [True]
        assert backend.batch_exists(keys) == 3
        assert backend.batch_exists(keys[3:]) == 0
        assert backend.batch_exists([]) == 0
        # Setting pages again is a no-op that succeeds.
        assert backend.batch_set_v1(keys[:2], host.indices([0, 1])) == [True, True]
        # Prefetch keys 0-2 into other host pages.
        host.array[...] = 0
        assert backend.batch_get_v1(keys[:3], host.indices([5, 6, 7])) == [True] * 3
        assert [host.page(p) for p in (5, 6, 7)] == originals[:3]
        # A missing key fails its page only.
        assert backend.batch_get_v1([keys[3], keys[4]], host.indices([0, 1])) == [False, True]
        assert host.page(1) == originals[4]
        # The keys are SGLang's Mooncake backend's.
        probe = client.store
        prefix = f"{backend.key_prefix}_{keys[0]}"
        if mla:
            assert probe.batch_is_exist([f"{prefix}__k"]) == [1]
        else:
            assert probe.batch_is_exist([f"{prefix}_0_k", f"{prefix}_0_v"]) == [1, 1]
        assert backend.key_prefix.endswith("_org-tiny-model")
    finally:
        closer(backend.close)


def test_sglang_object_api_with_pointers(pool_env, closer):
    backend, host = hicache()
    try:
        page_ptrs, sizes = host.get_page_buffer_meta(host.indices([0, 1]))
        keys = [f"obj-{uid()}-{i}" for i in range(4)]  # K and V of two pages
        assert backend.batch_set(keys, target_locations=page_ptrs, target_sizes=sizes) is True
        assert all(backend.exists(k) for k in keys)
        assert not backend.exists(f"obj-{uid()}")
        original = host.page(0) + host.page(1)
        host.array[...] = 0
        dst_ptrs, dst_sizes = host.get_page_buffer_meta(host.indices([2, 3]))
        assert backend.batch_get(keys, dst_ptrs, dst_sizes) == 2  # pages read, K+V each
        assert host.page(2) + host.page(3) == original
        missing = keys[:2] + [f"obj-{uid()}", keys[3]]
        assert backend.batch_get(missing, dst_ptrs, dst_sizes) == 1
        one = f"one-{uid()}"
        assert backend.set(one, target_location=dst_ptrs[0], target_sizes=dst_sizes[0]) is True
        assert backend.get(one, dst_ptrs[1], dst_sizes[1]) is True
        assert backend.get(f"none-{uid()}", dst_ptrs[1], dst_sizes[1]) is False
        with pytest.raises(ValueError, match="host indices"):
            backend.batch_set_v1(keys[:1], host.indices([0, 1]))
        with pytest.raises(ValueError):
            backend.batch_set(keys, target_locations=dst_ptrs[:1], target_sizes=dst_sizes)
    finally:
        closer(backend.close)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sglang_page_tensors_use_the_zero_copy_keys(pool_env, closer, mla):
    """Without interface_v1 SGLang hands batch_set flat copies of host pages (K then V) and
    batch_get flat page buffers to fill: those pages land under the same keys the zero-copy
    path uses, so batch_exists finds them and either path reads the other's pages."""
    backend, host = hicache(mla, extra_backend_tag=f"t{uid()}")
    try:
        keys = [uid() for _ in range(5)]
        originals = [host.page(p) for p in range(8)]

        def flat(p):  # what get_data_page(flat=True) gives: a contiguous copy of page p
            return np.frombuffer(originals[p], dtype=np.uint8).copy()

        assert backend.batch_set_v1(keys[:2], host.indices([0, 1])) == [True, True]
        assert backend.batch_set(keys[2:4], [flat(2), flat(3)]) is True
        assert backend.batch_set(keys[2:4], [flat(2), flat(3)]) is True  # present: no-op
        assert backend.batch_exists(keys) == 4
        # Tensor reads of both paths' pages; a missing page reads as None.
        targets = [np.zeros(len(originals[0]), dtype=np.uint8) for _ in range(5)]
        got = backend.batch_get(keys, targets)
        assert [g is not None for g in got] == [True] * 4 + [False]
        assert [t.tobytes() for t in targets[:4]] == originals[:4]
        # Zero-copy reads of the pages written as tensors.
        host.array[...] = 0
        assert backend.batch_get_v1(keys[2:4], host.indices([6, 7])) == [True, True]
        assert [host.page(6), host.page(7)] == originals[2:4]
        one = uid()
        assert backend.set(one, flat(5)) is True
        assert backend.get(one, targets[4]) is targets[4]
        assert targets[4].tobytes() == originals[5]
        with pytest.raises(ValueError, match="contiguous"):
            backend.batch_set([uid()], [np.zeros((4, 64), dtype=np.uint8)[:, ::2]])
    finally:
        closer(backend.close)


def test_sglang_uses_its_own_mooncake_backend_when_present(pool_env, closer, monkeypatch):
    shim = fakes.recording_store_module(pool_env.module, f"kvpool_test_sglang_shim_{uid()}")
    monkeypatch.setitem(sys.modules, shim.__name__, shim)
    with fakes.engine_installed(fakes.fake_sglang(), "kvpool.adapters.sglang") as mod:
        cls = mod.KvpoolHiCacheStorage
        assert cls.kvpool_impl == "engine" and issubclass(cls, mod.find_engine_backend())
        cfg = storage_config(kvpool_store_module=shim.__name__)
        backend = cls(cfg, {})
        assert backend.store is shim.made[-1]  # SGLang's code built the pool's store
        assert backend.replicate_config_cls is pool_env.module.ReplicateConfig
        assert cfg.extra_config["master_server_address"] == pool_env.master_addr
        assert cfg.extra_config["class_name"] == "KvpoolHiCacheStorage"
        closer(backend.store.close)
        assert sys.modules.get("mooncake.store") is not shim
    assert sgl.select_backend() is sgl.KvpoolPageStorage


# ---------------------------------------------------------------------------------------------
# LMCache
# ---------------------------------------------------------------------------------------------

CHUNK = (2, 2, 16, 8)  # LMCache's KV_2LTD chunk: (kv, layers, tokens, hidden)


def lmcache_config(save_chunk_meta=None, **plugin):
    extra = {
        "remote_storage_plugin.kvpool.module_path": "kvpool.adapters.lmcache",
        "remote_storage_plugin.kvpool.class_name": "KvpoolConnectorAdapter",
    }
    if save_chunk_meta is not None:  # absent: LMCache's default, true
        extra["save_chunk_meta"] = save_chunk_meta
    extra.update({f"remote_storage_plugin.kvpool.{k}": v for k, v in plugin.items()})
    return SimpleNamespace(remote_storage_plugins=["kvpool"], extra_config=extra)


def connector(cpu, save_chunk_meta=None, url: str = "plugin://kvpool", **plugin):
    """The connector as LMCache's ConnectorManager creates it from the plugin config."""
    adapter = lmc.KvpoolConnectorAdapter()
    assert adapter.can_parse(url)
    context = SimpleNamespace(
        url=url,
        loop=None,
        local_cpu_backend=cpu,
        metadata=fakes.Metadata(CHUNK, np.float16),
        config=lmcache_config(save_chunk_meta, **plugin),
        plugin_name=url[len("plugin://") :] if url.startswith("plugin://") else None,
    )
    return adapter.create_connector(context)


def test_lmcache_adapter_urls():
    adapter = lmc.KvpoolConnectorAdapter()
    assert adapter.can_parse("plugin://kvpool") and adapter.can_parse("plugin://kvpool.primary")
    assert adapter.can_parse("kvpool://m-0:50051,m-1:50051")
    assert not adapter.can_parse("plugin://fs") and not adapter.can_parse("mooncakestore://h:1")


def test_lmcache_chunk_header():
    header = lmc.encode_header([[2, 3], [1, 3]], [np.float16, np.float32], 1, 24)
    fields, start = lmc.decode_header(header + bytes(24))
    assert fields == {
        "shapes": [[2, 3], [1, 3]], "dtypes": ["float16", "float32"], "fmt": 1, "len": 24,
    } and start == len(header)
    with pytest.raises(ValueError):
        lmc.decode_header(header + bytes(23))
    with pytest.raises(ValueError):
        lmc.decode_header(b"nope" + bytes(20))
    with pytest.raises(ValueError):
        lmc.decode_header(header[:10])
    # A header of one shape and dtype (earlier kvpool releases) reads as one group.
    body = json.dumps({"shape": [2, 3], "dtype": "float16", "fmt": 1, "len": 12}).encode()
    old = b"KVP1" + len(body).to_bytes(4, "little") + body
    fields, _ = lmc.decode_header(old + bytes(12))
    assert fields["shapes"] == [[2, 3]] and fields["dtypes"] == ["float16"]


@pytest.mark.parametrize("meta", [None, True, False], ids=["default", "chunk-meta", "zero-copy"])
def test_lmcache_put_get_exists(pool_env, closer, meta):
    cpu = fakes.CpuBackend()
    conn = connector(cpu, save_chunk_meta=meta, key_prefix=f"lmc-{uid()}/")
    closer(lambda: asyncio.run(conn.close()))
    # LMCache's default (no save_chunk_meta) stores chunk metadata.
    assert conn.save_chunk_meta is (meta is not False)
    assert conn.chunk_shapes == [CHUNK] and conn.chunk_dtypes == [np.dtype(np.float16)]

    async def scenario():
        keys = [f"model@1@0@{uid()}" for _ in range(3)]
        objs = [cpu.filled(CHUNK, np.float16, seed=i) for i in range(3)]
        assert not await conn.exists(keys[0])
        await conn.put(keys[0], objs[0])
        assert await conn.exists(keys[0]) and conn.exists_sync(keys[0])
        got = await conn.get(keys[0])
        assert got is not objs[0] and got.bytes() == objs[0].bytes()
        assert got.get_shape() == CHUNK and got.get_dtype() == np.float16
        await conn.batched_put(keys[1:], objs[1:])
        many = await conn.batched_get(keys + [f"missing-{uid()}"])
        assert [m.bytes() for m in many[:3]] == [o.bytes() for o in objs]
        assert many[3] is None
        assert await conn.get(f"missing-{uid()}") is None
        # Prefix counts, in one call and through LMCache's async lookup.
        gap = [keys[0], keys[1], f"missing-{uid()}", keys[2]]
        assert conn.batched_contains(keys) == 3 and conn.batched_contains(gap) == 2
        assert await conn.batched_async_contains("lookup", gap) == 2
        # A chunk nobody read lately can be removed (a get leases it for a while).
        spare = f"model@1@0@{uid()}"
        await conn.put(spare, objs[0])
        assert conn.remove_sync(spare) is True
        assert not conn.exists_sync(spare) and conn.remove_sync(spare) is False
        assert await conn.ping() == 0 and await conn.list() == []

    asyncio.run(scenario())


def test_lmcache_partial_chunk(pool_env, closer):
    """A chunk of fewer tokens (LMCache's save_unfull_chunk) comes back with its own shape."""
    cpu = fakes.CpuBackend()
    for meta in (True, False):
        conn = connector(cpu, save_chunk_meta=meta, key_prefix=f"lmc-{uid()}/")
        closer(lambda c=conn: asyncio.run(c.close()))
        part = (2, 2, 5, 8)
        obj = cpu.filled(part, np.float16, seed=9)
        key = f"model@1@0@{uid()}"
        asyncio.run(conn.put(key, obj))
        got = asyncio.run(conn.get(key))
        assert got.get_shape() == part and got.bytes() == obj.bytes()


def test_lmcache_rejects_foreign_bytes(pool_env, closer):
    cpu = fakes.CpuBackend()
    conn = connector(cpu)
    closer(lambda: asyncio.run(conn.close()))
    key = f"foreign-{uid()}"
    assert conn.store.put(key, b"not a chunk at all") == 0
    assert asyncio.run(conn.get(key)) is None
    raw = connector(cpu, save_chunk_meta=False)
    closer(lambda: asyncio.run(raw.close()))
    assert asyncio.run(raw.get(key)) is None  # 18 bytes: no whole number of tokens


def test_lmcache_url_names_the_master(pool_env, clean_env, closer):
    clean_env.delenv("KVPOOL_MASTER")
    cpu = fakes.CpuBackend()
    conn = connector(cpu, url=f"kvpool://{pool_env.master_addr}")
    closer(lambda: asyncio.run(conn.close()))
    assert conn.store.health_check() == 0


def test_lmcache_start_failures_are_loud(pool_env, clean_env):
    """LMCache catches every Exception around a remote backend's creation: the plugin's start
    error is a BaseException naming the cause, unless fail_on_init_error is false."""
    clean_env.delenv("KVPOOL_MASTER")
    cpu = fakes.CpuBackend()
    with pytest.raises(lmc.PluginInitError, match="master_server_address") as err:
        connector(cpu, url="plugin://kvpool")
    assert not isinstance(err.value, Exception)
    assert isinstance(err.value.__cause__, adapters.ConfigError)
    with pytest.raises(adapters.ConfigError, match="master_server_address"):
        connector(cpu, url="plugin://kvpool", fail_on_init_error=False)
    with pytest.raises(lmc.PluginInitError, match="no engine metadata"):
        lmc.KvpoolConnector(config=lmcache_config(), local_cpu_backend=cpu)


def test_lmcache_connector_class_without_metadata(pool_env, closer):
    """`class_name: KvpoolConnector` and `external://`: LMCache passes loop, local_cpu_backend
    and config only; the chunk layout comes from the backend's metadata."""
    cpu = fakes.CpuBackend(metadata=fakes.Metadata(CHUNK, np.float16))
    conn = lmc.KvpoolConnector(
        loop=None, local_cpu_backend=cpu, config=lmcache_config(False, key_prefix=f"lmc-{uid()}/")
    )
    closer(lambda: asyncio.run(conn.close()))
    assert conn.save_chunk_meta is False and conn.chunk_shapes == [CHUNK]
    obj = cpu.filled(CHUNK, np.float16, seed=3)
    asyncio.run(conn.put("k", obj))
    assert asyncio.run(conn.get("k")).bytes() == obj.bytes()
