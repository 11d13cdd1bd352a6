"""The official `openai` client against `kvshare up` (CPU): completions and chat, streamed
and not, usage accounting, and KV reuse across replicas through the shared pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvshare.serve.launcher import Cluster
from tests.serve.conftest import MODEL, unique_text

CHUNK = 256


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0
    ) as c:
        yield c


def pinned(replica: int) -> dict[str, str]:
    return {"x-kvshare-replica": str(replica)}


def kv(usage: Any) -> dict[str, int]:
    return usage.model_extra["kv"]


def check_usage(usage: Any) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    parts = kv(usage)
    assert (
        parts["gpu_hit_tokens"] + parts["pool_hit_tokens"] + parts["computed_tokens"]
        == usage.prompt_tokens
    )
    assert (
        usage.prompt_tokens_details.cached_tokens
        == parts["gpu_hit_tokens"] + parts["pool_hit_tokens"]
    )


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    check_usage(whole.usage)
    assert 0 < whole.usage.completion_tokens <= 12

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    check_usage(whole.usage)
    stream = client.completions.create(
        model=MODEL,
        prompt=[prompt],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    # Without include_usage no usage chunk comes at all.
    plain = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True
        )
    )
    assert all(c.choices and c.usage is None for c in plain)


def test_token_id_prompts_and_stop_strings(client: openai.OpenAI) -> None:
    text = client.completions.create(
        model=MODEL, prompt="Count: one, two, three,", max_tokens=12, temperature=0
    )
    ids = client.completions.create(
        model=MODEL, prompt=[[ord(c) % 1000 + 100 for c in "abcdefgh"]], max_tokens=3, temperature=0
    )
    assert ids.usage.prompt_tokens == 8 and ids.usage.completion_tokens == 3
    stop_at = text.choices[0].text.split(",")[0]
    stopped = client.completions.create(
        model=MODEL, prompt="Count: one, two, three,", max_tokens=12, temperature=0, stop=[","]
    )
    assert stopped.choices[0].text == stop_at and stopped.choices[0].finish_reason == "stop"


def test_max_completion_tokens_and_seeded_sampling(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a word."}]
    short = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert short.usage.completion_tokens <= 2
    # A seed makes sampling reproducible, on either replica.
    answers = {
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a name for a cat."}],
            max_tokens=10,
            temperature=1.0,
            top_p=0.95,
            seed=1234,
            extra_headers=pinned(r),
            extra_body={"top_k": 50},
        )
        .choices[0]
        .message.content
        for r in (0, 1, 0)
    }
    assert len(answers) == 1


def test_completion_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3
    )
    lp = whole.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    assert "".join(lp.tokens) == whole.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0
        assert top[token] == value  # greedy: the chosen token is the most likely one
        assert value == max(top.values())
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chunks = [
        c
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, stream=True
        )
        if c.choices
    ]
    streamed = [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-3)  # cached KV: float noise
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode() == item.token
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [
        item.logprob
        for c in stream
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    # Equal up to float noise: the repeat may reuse cached KV, or run on the other replica.
    assert streamed == pytest.approx([item.logprob for item in content], abs=1e-3)
    only_chosen = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True
    )
    assert all(item.top_logprobs == [] for item in only_chosen.choices[0].logprobs.content)


def test_n_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Invent a name for a dog."}]
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 77,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # each choice is its own sequence
    one = client.chat.completions.create(**{**args, "n": 1})
    assert one.choices[0].message.content == texts[0]  # choice 0 uses the request's seed
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens == 18
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    streamed = [
        "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in range(3)
    ]
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == 18
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2]
    completions = client.completions.create(
        model=MODEL, prompt="A dog named", max_tokens=4, n=2, temperature=1.0, seed=5, logprobs=1
    )
    assert [c.index for c in completions.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == 4 for c in completions.choices)
    streamed_completions = [
        c
        for c in client.completions.create(
            model=MODEL,
            prompt="A dog named",
            max_tokens=4,
            n=2,
            temperature=1.0,
            seed=5,
            stream=True,
        )
        if c.choices
    ]
    for i in range(2):
        assert (
            "".join(c.choices[0].text for c in streamed_completions if c.choices[0].index == i)
            == completions.choices[i].text
        )


def test_long_prompt_moves_to_the_other_replica_through_the_pool(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    prompt = unique_text(520)  # ~600 tokens: 2 whole pool chunks
    first = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_headers=pinned(0)
    )
    answer = first.parse()
    n = answer.usage.prompt_tokens
    assert 512 < n < 768, n
    assert kv(answer.usage) == {
        "gpu_hit_tokens": 0,
        "pool_hit_tokens": 0,
        "pool_remote_hit_tokens": 0,
        "computed_tokens": n,
    }
    assert first.headers["x-kvshare-replica"] == "0"
    assert first.headers["x-kvshare-routing-tokens"] == str(n)  # the router counted as the engine

    second = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_headers=pinned(1)
    )
    moved = second.parse()
    assert second.headers["x-kvshare-replica"] == "1"
    assert kv(moved.usage)["pool_hit_tokens"] == (n - 1) // CHUNK * CHUNK
    assert kv(moved.usage)["gpu_hit_tokens"] == 0
    assert moved.choices[0].text == answer.choices[0].text
    check_usage(moved.usage)
    stats = httpx.get(cluster.replica_urls[1] + "/admin/stats").json()
    assert stats["kv_pool"]["hit_tokens"] >= 512 and stats["kv_pool"]["loaded_bytes"] > 0
    assert stats["pool"]["committed"] >= 2
    metrics = httpx.get(cluster.replica_urls[1] + "/metrics").text
    assert "kvshare_kv_pool_hit_tokens_total" in metrics


def test_multi_turn_chat_hits_the_pool_on_every_turn_after_the_first(client: openai.OpenAI) -> None:
    """Turns alternate between replicas, so each turn's history is only in the pool (or in
    the GPU cache of the replica that had the turn before last)."""
    messages: list[dict[str, str]] = []
    for turn in range(3):
        messages.append({"role": "user", "content": unique_text(300)})
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            extra_headers=pinned(turn % 2),
        )
        check_usage(reply.usage)
        if turn == 0:
            assert kv(reply.usage)["pool_hit_tokens"] == 0
        else:
            assert kv(reply.usage)["pool_hit_tokens"] > 0, (turn, reply.usage)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def test_cache_aware_router_keeps_a_conversation_on_its_replica(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": unique_text(200)}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_headers={"x-session-id": "s1"},
    )
    messages += [
        {"role": "assistant", "content": first.parse().choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_headers={"x-session-id": "s1"},
    )
    assert second.headers["x-kvshare-replica"] == first.headers["x-kvshare-replica"]
    assert kv(second.parse().usage)["gpu_hit_tokens"] >= 192
    assert second.headers["x-kvshare-routing-tokens"] == str(second.parse().usage.prompt_tokens)


def test_admin_through_the_router(client: openai.OpenAI, cluster: Cluster) -> None:
    replicas = httpx.get(cluster.url + "/admin/replicas").json()
    assert [r["url"] for r in replicas] == cluster.replica_urls and all(
        r["healthy"] for r in replicas
    )
    prompt = unique_text(520)
    client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_headers=pinned(0)
    )
    off = httpx.post(cluster.url + "/admin/all/kv_pool", json={"enabled": False}, timeout=30)
    assert [a["body"] for a in off.json()["replicas"]] == [{"enabled": False}] * 2
    try:
        missed = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_headers=pinned(1)
        )
        assert kv(missed.usage)["pool_hit_tokens"] == 0
    finally:
        httpx.post(cluster.url + "/admin/all/kv_pool", json={"enabled": True}, timeout=30)
    cleared = httpx.post(cluster.replica_urls[0] + "/admin/clear_pool", timeout=30).json()[
        "cleared"
    ]
    assert cleared >= 2
    assert httpx.get(cluster.replica_urls[0] + "/admin/stats").json()["pool"]["committed"] == 0
    reset = httpx.post(cluster.url + "/admin/all/reset_prefix_cache", timeout=30).json()
    assert all(a["body"]["reset_blocks"] >= 0 for a in reset["replicas"])
    again = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_headers=pinned(0)
    )
    assert (
        kv(again.usage)["computed_tokens"] == again.usage.prompt_tokens
    )  # nothing cached anywhere
