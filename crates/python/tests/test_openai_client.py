"""The official `openai` client against `kvpool up`: completions (a string, a batch, token ids,
`n`), chat (content parts, a tool-call turn), streaming with `stream_options.include_usage`,
`models.list` and `models.retrieve`, and the client's exceptions for a bad role, an unknown
model and a request that no load would let through (docs/openai.md).

Needs the `openai` package (pinned in scripts/python-env.sh) and the kvpool binary; nothing
here needs the kvpool Python package."""

from __future__ import annotations

import openai
import pytest

from kvpool_pool import kvpool_up

MODEL = "org/kvpool-synthetic"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-up")
    flags = ["--agents", "1", "--prefill", "1", "--decode", "1", "--model", MODEL]
    with kvpool_up(tmp, *flags, "--block-size", "16") as ready:
        # No retries: a 429 or 5xx must show, not be retried away.
        yield openai.OpenAI(
            base_url=f"{ready['conductor']}/v1", api_key="unused", max_retries=0, timeout=60
        )


def test_completions_take_strings_batches_token_ids_and_n(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    batch = client.completions.create(
        model=MODEL, prompt=["first prompt", "second prompt"], max_tokens=2, n=2,
        stop=["\n"], echo=False, logprobs=None, seed=1,
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 8
    ids = client.completions.create(model=MODEL, prompt=[[1, 2, 3, 4], [5, 6]], max_tokens=1)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6
    # Response ids are unique.
    assert len({r.id, batch.id, ids.id}) == 3 and r.id.startswith("cmpl-")


def test_chat_takes_content_parts_and_tool_call_turns(client):
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        messages=[
            {"role": "developer", "content": "answer briefly"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ]},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "describe", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        ],
        tools=[{"type": "function", "function": {"name": "describe", "parameters": {}}}],
        response_format={"type": "json_object"},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 3


def test_streams_end_with_the_usage_chunk_when_asked(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=3, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}],
    ))
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    plain = list(client.completions.create(
        model=MODEL, prompt="hello", max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    ))
    assert plain[-1].usage.total_tokens == plain[-1].usage.prompt_tokens + 2


def test_models_are_listed_and_retrieved(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_errors_are_the_clients_exceptions_with_codes(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "x"}], max_tokens=1)
    assert e.value.param == "messages" and "messages[0].role" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    # 200k stand-in tokens: over a minute of prefill on an idle pool against a 30 s objective.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abcd" * 200_000, max_tokens=1)
    assert e.value.code == "slo_unattainable"


def test_api_keys_wrong_key_is_401_right_key_is_served_and_usage_has_cached_tokens(tmp_path):
    """Issue 34: `kvpool up --api-key-file` (the conductor's `--api-key-file`): the official
    client with a wrong key gets `AuthenticationError` (401, OpenAI's `invalid_api_key`), with
    the right key it is served, its request id comes back, and `usage.prompt_tokens_details
    .cached_tokens` is reported (the repeated prompt's prefix is cached)."""
    keys = tmp_path / "api-keys"
    keys.write_text("# clients\nsk-kvpool-right\n")
    flags = ["--agents", "1", "--prefill", "1", "--decode", "1", "--model", MODEL,
             "--block-size", "16", "--api-key-file", str(keys)]
    with kvpool_up(tmp_path, *flags) as ready:
        base = f"{ready['conductor']}/v1"
        wrong = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        right = openai.OpenAI(base_url=base, api_key="sk-kvpool-right", max_retries=0, timeout=60)
        prompt = "a prompt long enough to fill a few sixteen-token blocks of stand-in text " * 3
        right.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        raw = right.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=2,
            extra_headers={"X-Request-Id": "openai-client-1"})
        assert raw.headers.get("x-request-id") == "openai-client-1"
        r = raw.parse()
        details = r.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens > 0, r.usage
        assert details.cached_tokens <= r.usage.prompt_tokens
        assert [m.created > 0 for m in right.models.list()] == [True]
