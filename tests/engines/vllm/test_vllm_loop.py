"""The Mooncake loop on real vLLM (0.32.0, CPU build): the conductor places requests where the
pool holds their prefix, prefill engines read and fill the pool, decode receives the prefill's KV
through the pool without recomputing it, and the master's pool events name the engine's blocks
as the engine itself does. Every assertion reads what vLLM itself reports: its token ids, its
`prompt_tokens_by_source` metric, its usage, its KV events and its log.

The stack is `kvpool up --engine vllm` (conftest.py): 2 prefill engines (kv_both), 1 decode
engine (kv_consumer), block size 32, the tiny random-weight model of scripts/make-models.py.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from typing import Dict, List, Tuple

import msgspec
import pytest
import zmq
from tokenizers import Tokenizer

from conftest import Stack, by_source, http_json, model_dir

BLOCK = 32
MODEL = "tiny"


def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(model_dir() / "tokenizer.json"))


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["license", "work", "grant", "copyright", "notice", "patent", "source", "object",
             "form", "derivative", "contribution", "terms", "conditions", "file", "use"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(n))


def prefix_of_tokens(seed: int, tokens: int) -> str:
    """A text that tokenizes (with the BOS token vLLM adds) into at least `tokens` tokens."""
    tok, n = tokenizer(), tokens // 2
    while True:
        text = words(seed, n)
        if len(tok.encode(text).ids) >= tokens:
            return text
        n += tokens // 4


def complete(base: str, prompt: str, max_tokens: int = 4, **extra) -> Dict:
    r = http_json(f"{base}/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **extra})
    assert r["status"] == 200, r
    return r


def token_ids(r: Dict) -> List[int]:
    return list(r["json"]["choices"][0]["token_ids"])


def prompt_len(r: Dict) -> int:
    return int(r["json"]["usage"]["prompt_tokens"])


def full_blocks_before_last(n: int) -> int:
    """Blocks a connector may supply for an n-token prompt: the full blocks, less the one
    holding the last token (vLLM computes the last token's logits itself)."""
    return (n - 1) // BLOCK


class Busy:
    """Keeps an engine busy with long decodes sent straight to it (the conductor does not see
    them), for as long as the `with` lasts."""

    def __init__(self, base: str, streams: int = 2):
        self.base, self.streams = base, streams
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []

    def _run(self, seed: int) -> None:
        while not self.stop.is_set():
            http_json(f"{self.base}/v1/completions", {
                "model": MODEL, "prompt": words(seed, 600), "max_tokens": 64,
                "temperature": 0, "ignore_eos": True}, timeout=300)
            seed += 1000

    def __enter__(self) -> "Busy":
        for i in range(self.streams):
            t = threading.Thread(target=self._run, args=(10_000 + 97 * i,), daemon=True)
            t.start()
            self.threads.append(t)
        time.sleep(1.0)  # let the first prompts reach the engine
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def test_adapter_logs_reach_the_engine_log(stack: Stack):
    """kvpool's connector writes its lines into vLLM's own log, from every engine; each says
    its loads start before vLLM prepares a step (kvpool_early_load "auto": these engines'
    vLLM zeroes no new blocks, and the greedy outputs below come through those loads)."""
    for name in ("prefill-0", "prefill-1", "decode-0"):
        log = stack.log(name)
        assert "kvpool: 4 KV segment(s)" in log, f"{name}: no kvpool line in its log"
        assert "loads whole blocks, started before vLLM prepares the step" in log, name


def test_greedy_outputs_through_the_pool_match_vllm_without_a_connector(stack: Stack, baseline):
    """Decode continues from KV it read from the pool; its greedy tokens are the tokens of a
    plain vLLM that computed everything itself."""
    for seed in (1, 2, 3):
        prompt = prefix_of_tokens(seed, 300) + f" question {seed}"
        through = complete(stack.conductor, prompt, max_tokens=12)
        alone = complete(baseline, prompt, max_tokens=12)
        assert token_ids(through) == token_ids(alone), f"prompt {seed}"
        assert prompt_len(through) == prompt_len(alone)


def test_a_prefix_one_engine_stored_is_routed_and_loaded_from_the_pool_by_another(stack: Stack,
                                                                                  baseline):
    """Engine A stores a 512-token prefix. While the conductor keeps A busy with more requests
    of that prefix, it places some of them on B, counting the prefix's blocks as pool blocks,
    and B loads them from the pool (B's own metrics say so); outputs equal a plain vLLM's."""
    prefix = prefix_of_tokens(42, 512 + BLOCK)
    first = complete(stack.conductor, prefix + " first question")
    a = first["headers"]["x-kvpool-prefill-engine"]
    b = next(u for u in stack.prefill if u != a)
    before = by_source(b)
    prompts = [prefix + " " + words(4200 + i, 250) for i in range(6)]
    answers: List[Dict] = [None] * len(prompts)  # type: ignore[list-item]

    def send(i: int) -> None:
        answers[i] = complete(stack.conductor, prompts[i], max_tokens=6)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(600)
    on_b = [(p, r) for p, r in zip(prompts, answers)
            if r["headers"]["x-kvpool-prefill-engine"] == b]
    assert on_b, "the conductor placed every request on the busy engine A"
    heads = [r["headers"] for _, r in on_b]
    pooled = [int(h["x-kvpool-pool-blocks"]) for h in heads]
    local = [int(h["x-kvpool-local-blocks"]) for h in heads]
    # The first request B got fetched the prefix from the pool; later ones may find it in B's
    # own cache by then: the prefix is covered either way.
    assert max(pooled) >= 512 // BLOCK, heads
    assert all(p + l >= 512 // BLOCK for p, l in zip(pooled, local)), heads
    after = by_source(b)
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    reused = loaded + after["local_cache_hit"] - before["local_cache_hit"]
    assert loaded >= 512, (before, after, heads)
    assert reused >= len(on_b) * 512, (before, after, heads)
    prompt, routed = on_b[0]
    assert token_ids(routed) == token_ids(complete(baseline, prompt, max_tokens=6))


def test_decode_recomputes_none_of_the_prefill_blocks_in_20_hand_offs(stack: Stack):
    """The race of the hand-off: with both prefill engines kept busy, 20 requests go prefill
    -> decode through the conductor. vLLM's own count of the tokens decode computed must be the
    prompts' tails (what no full block covers) and nothing more: every prefill block came from
    the pool."""
    decode = stack.decode[0]
    before = by_source(decode)
    tails = 0
    loaded_expected = 0
    with Busy(stack.prefill[0], streams=1), Busy(stack.prefill[1], streams=1):
        for i in range(20):
            # Distinct prompts, so decode's own prefix cache cannot supply anything.
            r = complete(stack.conductor, prefix_of_tokens(500 + i, 200 + 7 * i), max_tokens=2)
            n = prompt_len(r)
            tails += n - full_blocks_before_last(n) * BLOCK
            loaded_expected += full_blocks_before_last(n) * BLOCK
    after = by_source(decode)
    computed = after["local_compute"] - before["local_compute"]
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    hits = after["local_cache_hit"] - before["local_cache_hit"]
    assert hits == 0, (before, after)
    assert computed - tails == 0, f"decode recomputed {computed - tails} prefill tokens"
    assert loaded == loaded_expected, (loaded, loaded_expected)
    assert "recomputing the rest" not in stack.log("decode-0")


def test_usage_reports_the_prefill_engines_cached_tokens(stack: Stack):
    """usage.prompt_tokens_details.cached_tokens of a disaggregated request is what the prefill
    engine did not compute (vLLM carries it in kv_transfer_params): the full blocks of the
    prefix the two prompts share, never the last token's block, and not decode's pool load."""
    prompt = prefix_of_tokens(77, 400)
    cold = complete(stack.conductor, prompt + " one")
    assert cold["json"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = complete(stack.conductor, prompt + " two")
    a = cold["json"]["choices"][0]["prompt_token_ids"]
    b = warm["json"]["choices"][0]["prompt_token_ids"]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    expected = min(common // BLOCK, full_blocks_before_last(len(b))) * BLOCK
    assert expected >= 384
    assert warm["json"]["usage"]["prompt_tokens_details"]["cached_tokens"] == expected, (
        warm["json"]["usage"], common)


def _subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def _stored_hashes(sock: zmq.Socket, seconds: float) -> List[int]:
    """BlockStored hashes of the event batches that arrive within `seconds` (vLLM's format:
    multipart topic, sequence number, msgpack [timestamp, [event...], ...]; an event is a map
    tagged by `type` in vLLM 0.32, a positional array naming its kind first in older releases,
    and the master may send either)."""
    out: List[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        parts = sock.recv_multipart()
        batch = msgspec.msgpack.decode(parts[-1])
        for event in batch[1]:
            if isinstance(event, dict) and event.get("type") == "BlockStored":
                hashes = event["block_hashes"]
            elif isinstance(event, list) and event and event[0] == "BlockStored":
                hashes = event[1]
            else:
                continue
            out.extend(h if isinstance(h, int) else int.from_bytes(h[-8:], "big")
                       for h in hashes)
    return out


def test_master_pool_events_carry_the_engines_own_block_hashes(stack: Stack):
    """The master publishes the blocks a real vLLM stored under the same hashes that engine's
    own KV events publish."""
    ctx = zmq.Context.instance()
    pool = _subscribe(ctx, stack.ready["pool_events"]["endpoint"])
    engines = {c["endpoint"]: _subscribe(ctx, c["kv_events"])
               for c in stack.ready["children"] if c["role"] == "prefill"}
    assert len(engines) == 2
    time.sleep(1.0)  # slow joiners: the subscriptions reach the publishers
    try:
        r = complete(stack.conductor, prefix_of_tokens(9090, 640) + " events")
        engine = r["headers"]["x-kvpool-prefill-engine"]
        engine_hashes = set(_stored_hashes(engines[engine], 3.0))
        pool_hashes = set(_stored_hashes(pool, 2.0))
    finally:
        for s in [pool, *engines.values()]:
            s.close(0)
    n = prompt_len(r)
    # A prompt no engine saw before: the engine stored (and published) each full block once.
    assert len(engine_hashes) == n // BLOCK, (len(engine_hashes), n)
    # Every full block the engine computed and published is in the pool under its hash.
    missing = engine_hashes - pool_hashes
    assert not missing, f"{len(missing)} of {len(engine_hashes)} engine hashes not in pool events"


def second_conductor(stack: Stack, name: str, extra: List[str],
                     kv_events: bool = False) -> Tuple[subprocess.Popen, str, str]:
    """A second `kvpool conductor` in front of the stack's engines and master, with its own
    conductor credential, asking the engines' /tokenize and the master for pooled prefixes
    (plus `extra` flags; with `kv_events`, following the prefill engines' KV events). Returns
    it with its API and admin base URLs once it is ready."""
    from conftest import free_port, kvpool_bin, stop, wait_http

    api, admin = free_port(), free_port()
    cmd = [str(kvpool_bin()), "conductor", "--listen", f"127.0.0.1:{api}",
           "--admin-listen", f"127.0.0.1:{admin}", "--model", MODEL,
           "--master", stack.ready["master"],
           "--auth-key-file", stack.ready["role_key_files"]["conductor"],
           "--tokenizer", "engine", "--block-size", str(BLOCK), "--hash-seed", "0",
           "--pool-lookup-timeout", "2s", *extra]
    for url in stack.prefill:
        cmd += ["--prefill", url]
        if kv_events:
            events = next(c["kv_events"] for c in stack.ready["children"]
                          if c["endpoint"] == url)
            cmd += ["--kv-events", f"{url}={events}"]
    for url in stack.decode:
        cmd += ["--decode", url]
    log = stack.dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{admin}/readyz", proc, log, timeout=60)
    except BaseException:
        stop(proc)
        raise
    return proc, f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"


def test_a_conductor_without_tokenizer_files_keys_blocks_by_the_engines_tokens(stack: Stack):
    """`--tokenizer engine` (what the operator gives a conductor whose pool names no tokenizer
    files): a second conductor, in front of the same engines and pool, asks a prefill engine's
    /tokenize for each prompt and finds the blocks the engines stored under vLLM's keys."""
    from conftest import metrics, stop

    prefix = prefix_of_tokens(8080, 512 + BLOCK)
    complete(stack.conductor, prefix + " stored by the first conductor")
    proc, api, admin = second_conductor(stack, "conductor-engine-tokenizer", [])
    try:
        r = complete(api, prefix + " asked through the second", max_tokens=4)
        found = int(r["headers"]["x-kvpool-pool-blocks"]) + int(
            r["headers"]["x-kvpool-local-blocks"])
        assert found >= 512 // BLOCK, r["headers"]
        m = metrics(admin)
        assert m.get('kvpool_conductor_engine_tokenize_total{outcome="ok"}', 0) >= 1, m
        assert m.get('kvpool_conductor_pool_lookups_total{outcome="hit"}', 0) >= 1, m
    finally:
        stop(proc)


def _labelled(m: Dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include every one of `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def test_a_hot_prefix_gains_copies_in_the_pool_that_another_engine_reads(stack: Stack):
    """Hot-prefix replication in the pool (issue 35): a conductor with `--hot-threshold 2`
    (beside `up`'s own, in front of the same engines and master) sees a prefix the pool holds
    requested twice and asks the master for two copies of its blocks (`ReplicateHot`); the
    master copies every block to the other agent's node (its repair loop, counted by its
    `repair_done` events, and its per-node bytes). Then the prefill engine that did not compute
    the prefix is asked for it directly: vLLM loads it from the pool (its own
    `external_kv_transfer` count) from the copies on its own node: the writer's agent serves
    no bytes to it (its transfer engine's `served_bytes` count), where before the copies every
    byte of the prefix would have come from there."""
    from conftest import metrics, stop

    master = next(c for c in stack.ready["children"] if c["role"] == "master")["admin"]
    prefix = prefix_of_tokens(6060, 512 + BLOCK)
    # Its index follows the engines' own KV events, so it sends the prefix to the engine that
    # holds it and names the other as the one to copy it to.
    proc, api, admin = second_conductor(
        stack, "conductor-hot", ["--hot-threshold", "2", "--hot-fanout", "1",
                                 "--hot-pool-replicas", "2", "--hot-pool-ttl", "10m"],
        kv_events=True)
    try:
        first = complete(stack.conductor, prefix + " stored through up's conductor")
        writer = stack.prefill.index(first["headers"]["x-kvpool-prefill-engine"])
        reader = 1 - writer
        reader_node = f"up-agent-{reader}"
        time.sleep(2)  # the writer's KV events reach the second conductor
        before = metrics(master)
        for i in range(3):
            complete(api, prefix + f" hot question {i}", max_tokens=2)
        m = metrics(admin)
        assert m.get('kvpool_conductor_pool_lookups_total{outcome="hit"}', 0) >= 1, m
        # Copies are asked for the blocks the pool holds (the prefix's full blocks).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = metrics(admin)
            asked = _labelled(m, "kvpool_conductor_hot_pool_replications_total", outcome="ok")
            asked += _labelled(m, "kvpool_conductor_hot_pool_replications_total",
                               outcome="partial")
            if asked >= 1:
                break
            time.sleep(1)
        assert asked >= 1, (m, log.read_text(errors="replace")[-3000:])

        # The master copies each block to the other node (one repair per block).
        blocks = 512 // BLOCK
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = metrics(master)
            done = (_labelled(after, "kvpool_master_events_total", event="repair_done")
                    - _labelled(before, "kvpool_master_events_total", event="repair_done"))
            if done >= blocks:
                break
            time.sleep(1)
        assert done >= blocks, (done, blocks)
        assert _labelled(after, "kvpool_master_events_total", event="hot_request") >= blocks
        grew = (_labelled(after, "kvpool_master_node_used_bytes", node=reader_node)
                - _labelled(before, "kvpool_master_node_used_bytes", node=reader_node))
        assert grew > 0, (before, after)

        # The other prefill engine, asked directly, loads the prefix from the pool, reading the
        # copies on its own node: the writer's agent serves none of those bytes to a peer.
        writer_agent = next(c for c in stack.ready["children"]
                            if c["name"] == f"agent-{writer}")["admin"]
        served = 'kvpool_transfer_served_bytes_total{op="read"}'
        served_before = metrics(writer_agent).get(served, 0)
        loaded_before = by_source(stack.prefill[reader]).get("external_kv_transfer", 0)
        r = complete(stack.prefill[reader], prefix + " read where it is", max_tokens=2)
        loaded = by_source(stack.prefill[reader]).get("external_kv_transfer", 0) - loaded_before
        assert loaded >= 512, (loaded, r["json"].get("usage"))
        served_by_writer = metrics(writer_agent).get(served, 0) - served_before
        assert served_by_writer == 0, served_by_writer
    finally:
        stop(proc)
