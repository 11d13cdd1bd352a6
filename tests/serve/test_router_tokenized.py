"""A long text prompt or chat the router tokenized reaches a replica of the same tokenizer with
its ids beside it (kvshare.serve.packed_request): the replica answers as it would have from
the JSON, without tokenizing again; ids from another tokenizer, or from anywhere but a packed
body, are never used."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from aiohttp import web
from tokenizers import Tokenizer as BackendTokenizer

from kvshare import LLM
from kvshare.models.loader import load_tokenizer
from kvshare.models.tokenizer import Tokenizer
from kvshare.serve import router as router_module
from kvshare.serve.errors import APIError
from kvshare.serve.packed_request import (
    CONTENT_TYPE,
    TOKENIZED_KEY,
    TOKENIZER_KEY,
    pack_request,
    unpack_request,
)
from kvshare.serve.prompts import PromptError, request_prompt_ids
from kvshare.serve.router import ROUTER_KEY, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.serve.server import ServeConfig, build_app
from tests.serve.inprocess import BackgroundServer, stand_in_replica, wait_checked

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    loaded = load_tokenizer("smollm2-135m")
    assert loaded is not None
    return loaded


def messages_of(words: int) -> list[dict[str, str]]:
    text = " ".join(f"{uuid.uuid4().hex[:6]} river stone" for _ in range(words // 3))
    return [{"role": "user", "content": f"Summarize: {text}"}]


def test_the_digest_names_what_the_tokenizer_makes_of_a_prompt(tokenizer: Tokenizer) -> None:
    again = load_tokenizer("smollm2-135m")
    assert again is not None and again.digest == tokenizer.digest
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    other_template = Tokenizer(backend, chat_template="{{ messages[0]['content'] }}")
    assert other_template.digest != Tokenizer(backend, chat_template=tokenizer.chat_template).digest
    backend.add_tokens(["<|new|>"])
    assert Tokenizer(backend, chat_template=tokenizer.chat_template).digest != tokenizer.digest


def test_a_replica_uses_ids_beside_a_prompt_only_from_its_own_tokenizer(
    tokenizer: Tokenizer,
) -> None:
    def ids_of(path: str, body: dict[str, Any]) -> list[int]:
        return list(request_prompt_ids(tokenizer, path, body))

    messages = messages_of(30)
    real = tokenizer.encode_chat(messages)
    forged = np.array([5, 6, 7], dtype=np.int32)  # not what the messages make: shows which ids won
    signed = {TOKENIZED_KEY: forged, TOKENIZER_KEY: tokenizer.digest}
    assert ids_of(CHAT, {"messages": messages, **signed}) == [5, 6, 7]
    for digest in ("", "other", tokenizer.digest[:-1] + "x", None):
        assert ids_of(CHAT, {"messages": messages, **signed, TOKENIZER_KEY: digest}) == real
    as_json = {"messages": messages, **signed, TOKENIZED_KEY: [5, 6, 7]}
    assert ids_of(CHAT, as_json) == real  # a JSON list: never
    assert ids_of(COMPLETIONS, {"prompt": "The river crossed.", **signed}) == [5, 6, 7]
    assert ids_of(COMPLETIONS, {"prompt": [9, 10], **signed}) == [9, 10]  # ids are their own
    with pytest.raises(PromptError, match="role"):  # the messages are checked all the same
        ids_of(CHAT, {"messages": [{"role": "x", "content": ""}], **signed})


def test_ids_beside_a_prompt_pack_and_unpack(tokenizer: Tokenizer) -> None:
    body = {"model": "m", "messages": messages_of(12), "max_tokens": 3}
    ids = tokenizer.encode_chat(body["messages"])
    packed = pack_request(body, ids, tokenizer.digest)
    assert packed is not None
    decoded = unpack_request(packed)
    assert decoded.pop(TOKENIZED_KEY).tolist() == ids
    assert decoded == {**body, TOKENIZER_KEY: tokenizer.digest}
    assert pack_request(body, ids, "") is None  # ids without a tokenizer's name
    assert pack_request(body) is None
    with pytest.raises(APIError, match="kvshare_prompt_ids is whole int32"):
        unpack_request(msgpack.packb({**body, TOKENIZED_KEY: b"\x01\x00\x00"}))


def recording_replica(seen: list[tuple[str, bytes]], tokenizer: str) -> BackgroundServer:
    async def chat(request: web.Request) -> web.Response:
        seen.append((request.content_type, await request.read()))
        return web.json_response({"ok": True})

    types = ["application/json", CONTENT_TYPE]
    return stand_in_replica(chat, {"instance": "r", "request_types": types, "tokenizer": tokenizer})


@pytest.mark.parametrize("same_tokenizer", [True, False])
def test_the_router_sends_its_ids_only_to_a_replica_of_its_tokenizer(
    tokenizer: Tokenizer, same_tokenizer: bool
) -> None:
    seen: list[tuple[str, bytes]] = []
    replica = recording_replica(seen, tokenizer.digest if same_tokenizer else "another")
    app = build_router_app(
        RouterConfig((replica.url,), "cache-aware", health_interval=0.1), RoutingKeys(tokenizer, 16)
    )
    router = BackgroundServer(app)
    long_chat = {"model": "m", "messages": messages_of(12000), "max_tokens": 2}
    bodies = [
        (CHAT, long_chat),
        (COMPLETIONS, {"model": "m", "prompt": long_chat["messages"][0]["content"]}),
        (CHAT, {"model": "m", "messages": messages_of(30)}),  # short: as received
    ]
    try:
        wait_checked(app[ROUTER_KEY])
        for path, body in bodies:
            assert httpx.post(router.url + path, json=body, timeout=30).status_code == 200
    finally:
        router.close()
        replica.close()
    assert len(json.dumps(long_chat)) >= router_module.TOKEN_ARRAY_BYTES
    packed = [CONTENT_TYPE] * 2 if same_tokenizer else ["application/json"] * 2
    assert [content_type for content_type, _ in seen] == [*packed, "application/json"]
    for (content_type, raw), (_, body) in zip(seen, bodies):
        if content_type == "application/json":
            assert json.loads(raw) == body
            continue
        decoded = unpack_request(raw)
        made = decoded.pop(TOKENIZED_KEY)
        assert decoded.pop(TOKENIZER_KEY) == tokenizer.digest and decoded == body
        prompt = body.get("prompt")
        expected = tokenizer.encode(prompt) if prompt else tokenizer.encode_chat(body["messages"])
        assert made.tolist() == expected


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[LLM, BackgroundServer]]:
    llm = LLM("smollm2-135m", kv_cache_memory=32 << 20, max_num_batched_tokens=512)
    server = BackgroundServer(build_app(llm.engine, ServeConfig("smol")))
    yield llm, server
    server.close()


def test_a_replica_answers_the_routers_ids_as_its_json_without_tokenizing(
    smollm2: tuple[LLM, BackgroundServer], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm, replica = smollm2
    assert httpx.get(replica.url + "/health").json()["tokenizer"] == tokenizer.digest
    # A 300-token chat stands in for a long one: the router packs every chat of 256 bytes on.
    monkeypatch.setattr(router_module, "TOKEN_ARRAY_BYTES", 256)
    made: list[int] = []
    encode_chat = llm.engine.tokenizer.encode_chat

    def counted(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        made.append(len(messages))
        return encode_chat(messages, *args, **kwargs)

    monkeypatch.setattr(llm.engine.tokenizer, "encode_chat", counted)
    app = build_router_app(
        RouterConfig((replica.url,), "cache-aware", health_interval=0.1), RoutingKeys(tokenizer, 16)
    )
    router = BackgroundServer(app)
    body = {"model": "smol", "messages": messages_of(120), "max_tokens": 6, "temperature": 0}
    try:
        wait_checked(app[ROUTER_KEY])
        direct = httpx.post(replica.url + CHAT, json=body, timeout=60)
        assert made == [1]
        routed = httpx.post(router.url + CHAT, json=body, timeout=60)
    finally:
        router.close()
    assert made == [1]  # the routed request came with the router's ids
    assert direct.status_code == routed.status_code == 200, routed.text
    answers = [r.json() for r in (direct, routed)]
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"] > 200


def test_a_requests_text_is_kept_in_the_scope_of_its_cache_salt(tokenizer: Tokenizer) -> None:
    """Router and replica encode a long chat in its tenant's scope: the next turn of one
    tenant's conversation reuses its ids, the same text from another tenant does not."""
    fresh = Tokenizer(tokenizer.backend, chat_template=tokenizer.chat_template)
    assert fresh.prefixes is not None
    turn1 = messages_of(9000)
    turn2 = [*turn1, {"role": "assistant", "content": "Rivers."}, {"role": "user", "content": "?"}]
    expected = fresh.backend.encode(fresh.apply_chat_template(turn2)).ids
    request_prompt_ids(fresh, CHAT, {"messages": turn1, "cache_salt": "tenant-a"})
    for salt, hits in (("tenant-b", 0), (None, 0), ("tenant-a", 1)):
        body = {"messages": turn2} if salt is None else {"messages": turn2, "cache_salt": salt}
        assert list(request_prompt_ids(fresh, CHAT, body)) == expected
        assert fresh.prefixes.hits == hits, salt


def test_the_routers_metrics_count_bodies_by_kind_and_kept_prefix_hits(
    tokenizer: Tokenizer,
) -> None:
    fresh = Tokenizer(tokenizer.backend, chat_template=tokenizer.chat_template)
    seen: list[tuple[str, bytes]] = []
    replica = recording_replica(seen, fresh.digest)
    app = build_router_app(
        RouterConfig((replica.url,), "cache-aware", health_interval=0.1), RoutingKeys(fresh, 16)
    )
    router = BackgroundServer(app)
    turn1 = messages_of(12000)
    turn2 = [*turn1, {"role": "assistant", "content": "Rivers."}, {"role": "user", "content": "?"}]
    try:
        wait_checked(app[ROUTER_KEY])
        for messages in (turn1, turn2, messages_of(30)):
            body = {"model": "m", "messages": messages}
            assert httpx.post(router.url + CHAT, json=body, timeout=30).status_code == 200
        metrics = httpx.get(router.url + "/metrics").text
    finally:
        router.close()
        replica.close()
    assert 'kvshare_router_bodies_total{body="packed with the router\'s ids"} 2.0' in metrics
    assert 'kvshare_router_bodies_total{body="as received"} 1.0' in metrics
    assert "kvshare_router_kept_prefix_hits 1.0" in metrics  # turn 2 extended turn 1
