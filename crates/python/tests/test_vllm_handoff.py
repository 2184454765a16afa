"""kvpool's vLLM connector, the parts the prefill -> decode hand-off rests on, driven as vLLM's
scheduler and workers drive them, against both pools (real Mooncake and kvpool): blocks saved in
the step that completes them, the `kv_transfer_params` a disaggregated prefill returns, and a
decode that answers "ask again" until the handed blocks are in the pool. The same behaviour is
checked once against real vLLM in tests/engines/vllm (docs/testing.md, "Real engines").
"""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

from kvpool.adapters import vllm as vl
from test_adapters import BLOCK, Engine, block_bytes, blocks, closer, clean_env, kv_caches, pool_env  # noqa: F401


def uid() -> str:
    return uuid.uuid4().hex[:12]


class Manager:
    """vLLM's KV cache manager as the scheduler-side connector sees it: block ids by request."""

    def __init__(self):
        self.ids = {}

    def get_block_ids(self, rid):
        return (list(self.ids[rid]),)


def req(rid, hashes, tokens, computed=0, params=None):
    return SimpleNamespace(request_id=rid, block_hashes=list(hashes), num_tokens=tokens,
                           prompt_token_ids=list(range(tokens)), num_computed_tokens=computed,
                           kv_transfer_params=params)


def test_blocks_are_saved_in_the_step_that_completes_them(pool_env, closer, client):
    prefill = Engine("kv_both", kv_caches(11), kvpool_handoff_wait_s=5)
    manager = Manager()
    prefill.scheduler.bind_kv_cache_manager(manager)
    try:
        hashes = [uuid.uuid4().bytes for _ in range(3)]
        r = req(f"p-{uid()}", hashes, tokens=3 * BLOCK + 1,
                params={"do_remote_decode": True})
        manager.ids[r.request_id] = [5, 2, 7, 1]
        assert prefill.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        prefill.scheduler.update_state_after_alloc(r, blocks([5, 2, 7, 1]), 0)
        # A chunked prefill: 2 blocks and a bit this step, the rest the next.
        meta, _ = prefill.step(scheduled={r.request_id: 2 * BLOCK + 2})
        assert [j.block_ids for j in meta.saves] == [[5, 2]]
        keys = [prefill.worker._keys.key(h) for h in hashes]
        assert client.store.batch_is_exist(keys) == [1, 1, 0]
        r.num_computed_tokens = 2 * BLOCK + 2
        meta, _ = prefill.step(scheduled={r.request_id: BLOCK - 1})
        assert [j.block_ids for j in meta.saves] == [[7]]
        assert client.store.batch_is_exist(keys) == [1, 1, 1]
        # Everything was saved while it ran: vLLM may free the blocks at once, and the params
        # name the blocks decode is to wait for.
        r.num_computed_tokens = 3 * BLOCK + 1
        keep, params = prefill.scheduler.request_finished(r, [5, 2, 7, 1])
        assert keep is False
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["kvpool"]["hashes"] == [h.hex() for h in hashes]
        assert params["kvpool"]["namespace"] == prefill.worker._keys.namespace
        # Nothing is reported as a finished save for a request vLLM did not keep.
        _meta, done = prefill.step(finished={r.request_id})
        assert done == (None, None)
        # A plain request (no hand-off) returns no params; its one block was saved above, so
        # nothing is left to save and vLLM may free it at once. A block of unknown fate is
        # kept for its save.
        other = req(f"o-{uid()}", hashes[:1], tokens=BLOCK, computed=BLOCK)
        assert prefill.scheduler.request_finished(other, [3]) == (False, None)
        fresh = req(f"n-{uid()}", [uuid.uuid4().bytes], tokens=BLOCK, computed=BLOCK)
        assert prefill.scheduler.request_finished(fresh, [3]) == (True, None)
    finally:
        prefill.close(closer)


def test_decode_asks_again_until_the_handed_blocks_land(pool_env, closer):
    caches = kv_caches(12)
    prefill = Engine("kv_producer", caches)
    decode = Engine("kv_consumer", kv_caches(13), kvpool_handoff_wait_s=30)
    try:
        hashes = [uuid.uuid4().bytes for _ in range(3)]
        params = {"do_remote_prefill": True,
                  "kvpool": {"namespace": decode.worker._keys.namespace,
                             "hashes": [h.hex() for h in hashes]}}
        d = req(f"d-{uid()}", [uuid.uuid4().bytes for _ in range(3)], tokens=3 * BLOCK + 2,
                params=params)  # decode's own hashes differ: the handed ones are used
        assert decode.scheduler.get_num_new_matched_tokens(d, 0) == (None, False)
        # Prefill saves two blocks: still waiting for the third.
        first = req(f"p-{uid()}", hashes[:2], tokens=2 * BLOCK, computed=2 * BLOCK)
        prefill.finish(first, [0, 1])
        assert decode.scheduler.get_num_new_matched_tokens(d, 0) == (None, False)
        whole = req(f"q-{uid()}", hashes, tokens=3 * BLOCK, computed=3 * BLOCK)
        prefill.finish(whole, [0, 1, 2])
        assert decode.scheduler.get_num_new_matched_tokens(d, 0) == (3 * BLOCK, False)
        decode.scheduler.update_state_after_alloc(d, blocks([4, 6, 7, 3]), 3 * BLOCK)
        decode.step()
        assert decode.worker.get_block_ids_with_load_errors() == set()
        assert [block_bytes(decode.caches, i) for i in (4, 6, 7)] == [
            block_bytes(caches, i) for i in (0, 1, 2)]
        assert decode.scheduler.handoff_stats["kvpool_handoffs"] == 1
        assert decode.scheduler.handoff_stats["kvpool_handoff_timeouts"] == 0
        # Another engine's namespace is not this engine's to read: a plain lookup instead.
        foreign = dict(params, kvpool={"namespace": "x@kvpool-vllm@bfloat16@bs4",
                                       "hashes": params["kvpool"]["hashes"]})
        f = req(f"f-{uid()}", [uuid.uuid4().bytes for _ in range(3)], 3 * BLOCK + 2,
                params=foreign)
        assert decode.scheduler.get_num_new_matched_tokens(f, 0) == (0, False)
    finally:
        prefill.close(closer)
        decode.close(closer)


def test_a_hand_off_that_never_lands_falls_back_to_recompute_and_is_counted(pool_env, closer):
    decode = Engine("kv_consumer", kv_caches(14), kvpool_handoff_wait_s=0.3)
    try:
        params = {"do_remote_prefill": True,
                  "kvpool": {"namespace": decode.worker._keys.namespace,
                             "hashes": [uuid.uuid4().hex for _ in range(2)]}}
        d = req(f"t-{uid()}", [], tokens=2 * BLOCK + 1, params=params)
        assert decode.scheduler.get_num_new_matched_tokens(d, 0) == (None, False)
        time.sleep(0.4)
        assert decode.scheduler.get_num_new_matched_tokens(d, 0) == (0, False)
        assert decode.scheduler.handoff_stats["kvpool_handoff_timeouts"] == 1
    finally:
        decode.close(closer)
