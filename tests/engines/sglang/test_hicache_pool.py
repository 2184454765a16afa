"""SGLang 0.5.23 with HiCache on a kvpool pool: a fresh server loads the prefixes another one
stored, with either implementation of kvpool's storage backend (README.md).

For each case (implementation, and SGLang's zero-copy ``interface_v1`` page path or its
copying path) server A serves a prompt of ``PROMPT_PAGES`` pages plus one token and writes its
pages through HiCache into the pool; A is stopped; a fresh server B on the same pool serves the
same prompt. Asserted from what SGLang itself reports:

- A computed the whole prompt (no cached tokens) and backed all its full pages up to storage
  (``sglang:backuped_tokens_total``);
- B's request reports every full page of the prompt as loaded from storage
  (``meta_info.cached_tokens_details``: ``storage`` = the pages' tokens, ``device`` and
  ``host`` 0, ``storage_backend`` the class of the implementation under test), and its
  ``sglang:prefetched_tokens_total`` counter says the same;
- A's, B's and a baseline server's (no HiCache) greedy outputs are the same tokens with the
  same log-probabilities (within ``LOGPROB_TOL``).

B also serves the prompts the cases before it stored (other implementation or other path):
the two implementations, and both page paths, read each other's pages.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List

import pytest

from sglang_server import PAGE_SIZE, SglangServer, hicache_flags, log_tail

PROMPT_PAGES = 20
PROMPT_LEN = PROMPT_PAGES * PAGE_SIZE + 1  # SGLang always computes at least the last token
STORED_TOKENS = PROMPT_PAGES * PAGE_SIZE
NEW_TOKENS = 16
# float32 on both sides; the prefill shapes differ (the whole prompt vs its last token after a
# load), which may move log-probabilities by float32 rounding (~1e-6). The random-weight model's
# log-probabilities are nearly flat, so a different prefix moves them by only ~1e-2:
# test_output_depends_on_the_prefix checks that this is well above the tolerance.
LOGPROB_TOL = 1e-4
FIRST_TOKEN, LAST_TOKEN = 6, 4095  # the tiny model's vocabulary past its special tokens


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    impl: str  # KVPOOL_SGLANG_BACKEND
    interface_v1: bool
    seed: int  # of its prompt
    backend_class: str  # what SGLang reports as cached_tokens_details["storage_backend"]


CASES = [
    Case("kvpool", "kvpool", True, 11, "KvpoolPageStorage"),
    Case("engine", "engine", True, 12, "KvpoolHiCacheStorage"),
    Case("kvpool-copying", "kvpool", False, 13, "KvpoolPageStorage"),
]

# Prompts whose pages a case's server A stored (its backup confirmed), for the later cases'
# cross reads.
STORED: Dict[str, List[int]] = {}


def prompt(seed: int, length: int = PROMPT_LEN) -> List[int]:
    rng = random.Random(seed)
    return [rng.randint(FIRST_TOKEN, LAST_TOKEN) for _ in range(length)]


def control_prompt(ids: List[int]) -> List[int]:
    """``ids`` with every token before its last page and a bit replaced."""
    rng = random.Random(99)
    keep = PAGE_SIZE + 1
    return [rng.randint(FIRST_TOKEN, LAST_TOKEN) for _ in ids[:-keep]] + ids[-keep:]


def outputs(result: dict) -> List[int]:
    return list(result["output_ids"])


def logprobs(result: dict) -> List[float]:
    return [float(entry[0]) for entry in result["meta_info"]["output_token_logprobs"]]


def assert_same_generation(got: dict, want: dict, what: str) -> None:
    assert outputs(got) == outputs(want), f"{what}: greedy output differs from the baseline's"
    diffs = [abs(a - b) for a, b in zip(logprobs(got), logprobs(want))]
    assert len(diffs) == NEW_TOKENS and max(diffs) <= LOGPROB_TOL, (
        f"{what}: output log-probabilities differ from the baseline's by up to "
        f"{max(diffs, default=math.nan):.2e}"
    )


def assert_loaded_from_storage(result: dict, case: Case, what: str, log) -> None:
    meta = result["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    want = {"device": 0, "host": 0, "storage": STORED_TOKENS,
            "storage_backend": case.backend_class}
    assert {k: details.get(k) for k in want} == want and meta.get("cached_tokens") == (
        STORED_TOKENS
    ), (
        f"{what}: SGLang reports cached_tokens={meta.get('cached_tokens')}, "
        f"cached_tokens_details={details}; want every full page ({STORED_TOKENS} tokens) from "
        f"storage. Tail of {log}:\n{log_tail(log)}"
    )


class Baseline:
    """A server without HiCache, launched when the module starts (its start-up overlaps the
    first case's servers'); at first use it generates every case's prompt and the control
    prompt, and stops."""

    def __init__(self, server: SglangServer):
        self.server = server
        self._results: Dict[str, dict] = {}

    def __getitem__(self, name: str) -> dict:
        if not self._results:
            server = self.server.wait_ready()
            for case in CASES:
                self._results[case.name] = server.generate(prompt(case.seed), NEW_TOKENS)
            self._results["control"] = server.generate(
                control_prompt(prompt(CASES[0].seed)), NEW_TOKENS
            )
            server.stop()
        return self._results[name]


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    server = SglangServer(model, tmp_path_factory.mktemp("baseline") / "server.log")
    with server:
        yield Baseline(server)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fresh_server_loads_what_another_stored(case, pool, model, baseline, tmp_path):
    env = {"KVPOOL_MASTER": pool.master_addr, "KVPOOL_SGLANG_BACKEND": case.impl}
    flags = hicache_flags(case.interface_v1)
    ids = prompt(case.seed)
    earlier = dict(STORED)

    # B starts alongside A (to overlap their start-up) but serves only once A is gone.
    with SglangServer(model, tmp_path / "b.log", flags, env) as b:
        with SglangServer(model, tmp_path / "a.log", flags, env) as a:
            a.wait_ready()
            first = a.generate(ids, NEW_TOKENS)
            assert first["meta_info"].get("cached_tokens") == 0, (
                f"server A found cached tokens for a new prompt: {first['meta_info']}"
            )
            backed = a.wait_metric("sglang:backuped_tokens_total", STORED_TOKENS)
            assert backed >= STORED_TOKENS, (
                f"server A backed up {backed:.0f} tokens to storage, want {STORED_TOKENS}; "
                f"tail of {a.log}:\n{log_tail(a.log)}"
            )
        STORED[case.name] = ids

        b.wait_ready()
        again = b.generate(ids, NEW_TOKENS)
        assert_loaded_from_storage(again, case, "server B", b.log)
        prefetched = b.metrics().get("sglang:prefetched_tokens_total")
        assert prefetched == STORED_TOKENS, f"sglang:prefetched_tokens_total is {prefetched}"
        # Pages the earlier cases' servers stored, through their implementation and path.
        crossed = {}
        for name, other in earlier.items():
            crossed[name] = b.generate(other, NEW_TOKENS)
            assert_loaded_from_storage(
                crossed[name], case, f"server B reading the pages {name} stored", b.log
            )

    assert_same_generation(first, baseline[case.name], "server A")
    assert_same_generation(again, baseline[case.name], "server B")
    for name, result in crossed.items():
        assert_same_generation(result, baseline[name], f"server B on the pages {name} stored")


def test_output_depends_on_the_prefix(baseline):
    """The comparisons above can catch a wrong page: with the prefix replaced and its last
    page kept, the model's greedy output and its log-probabilities change."""
    first = CASES[0].name
    assert outputs(baseline["control"]) != outputs(baseline[first])
    assert max(abs(a - b) for a, b in zip(logprobs(baseline["control"]),
                                          logprobs(baseline[first]))) > 20 * LOGPROB_TOL
