"""A cache-aware router forwards a long token-id prompt packed (msgpack, ids as int32)
to a replica that says it takes that type: the replica decodes exactly what it would have
parsed from the JSON, refuses what JSON could not hold, and answers the same."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare import LLM
from kvshare.serve.errors import APIError
from kvshare.serve.http import TOKEN_ARRAY_BYTES, parse_json_object
from kvshare.serve.packed_request import CONTENT_TYPE, pack_request, unpack_request
from kvshare.serve.router import ROUTER_KEY, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.serve.server import ServeConfig, build_app
from tests.serve.inprocess import BackgroundServer, stand_in_replica, wait_checked

PAD = "x" * TOKEN_ARRAY_BYTES  # a body past TOKEN_ARRAY_BYTES: its prompt is read as an array

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal bodies, array prompts compared as arrays of the same dtype."""
    pa, pb = a.get("prompt"), b.get("prompt")
    if isinstance(pa, np.ndarray) or isinstance(pb, np.ndarray):
        if not (isinstance(pa, np.ndarray) and isinstance(pb, np.ndarray)):
            return False
        if pa.dtype != pb.dtype or not np.array_equal(pa, pb):
            return False
        a, b = {**a, "prompt": None}, {**b, "prompt": None}
    return a == b


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10**9 - 1), min_size=1, max_size=50),
    fields=st.dictionaries(st.text().filter(lambda k: k != "prompt"), JSON_VALUES, max_size=5),
)
def test_a_packed_body_decodes_to_what_the_json_parses_to(
    ids: list[int], fields: dict[str, Any]
) -> None:
    raw = json.dumps({**fields, "prompt": ids, "pad": PAD}).encode()
    parsed = parse_json_object(raw)
    assert isinstance(parsed["prompt"], np.ndarray)
    packed = pack_request(parsed)
    assert packed is not None
    assert same(unpack_request(packed), parsed)


def test_the_wire_format_is_a_msgpack_map_with_little_endian_int32_ids() -> None:
    packed = pack_request({"prompt": np.array([1, 258], dtype=np.int64), "n": 1})
    assert packed is not None
    assert msgpack.unpackb(packed) == {"prompt": b"\x01\x00\x00\x00\x02\x01\x00\x00", "n": 1}


def test_what_is_not_packed() -> None:
    ids = np.arange(5, dtype=np.int64)
    assert pack_request({"prompt": [1, 2, 3]}) is None  # a list: the JSON went its general way
    assert pack_request({"prompt": "text"}) is None
    assert pack_request({"prompt": np.array([2**31], dtype=np.int64)}) is None
    assert pack_request({"prompt": ids, "seed": 2**70}) is None  # past msgpack's integers
    assert pack_request({"prompt": ids, "seed": 1}) is not None


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\xc1", "not valid"),  # a byte msgpack never uses
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({1: 2}), "not valid"),  # a non-string key
        (msgpack.packb({"prompt": b"\x01\x00\x00"}), "whole int32"),
        (msgpack.packb({"prompt": b""}), "whole int32"),
        (msgpack.packb({"prompt": b"\x01\x00\x00\x00", "stop": b"x"}), "bytes"),
        (msgpack.packb({"n": msgpack.ExtType(1, b"x")}), "ExtType"),
        (msgpack.packb({"temperature": float("nan")}), "not valid JSON"),
        (msgpack.packb({"x": [{"y": float("inf")}]}), "not valid JSON"),
        (msgpack.packb({"x": {"y": {2: 1}}}), "not valid"),
    ],
)
def test_a_packed_body_that_json_could_not_hold_is_a_400(raw: bytes, message: str) -> None:
    with pytest.raises(APIError) as err:
        unpack_request(raw)
    assert err.value.status == 400 and message in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def replica() -> Iterator[BackgroundServer]:
    llm = LLM("shape:tiny-llama", kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    server = BackgroundServer(build_app(llm.engine, ServeConfig("tiny")))
    yield server
    server.close()


def test_a_replica_answers_a_packed_request_as_its_json(replica: BackgroundServer) -> None:
    health = httpx.get(replica.url + "/health").json()
    assert CONTENT_TYPE in health["request_types"]
    body = {"model": "tiny", "prompt": list(range(3, 40)), "max_tokens": 4, "temperature": 0}
    as_json = httpx.post(replica.url + "/v1/completions", json=body, timeout=30)
    packed = pack_request({**body, "prompt": np.array(body["prompt"], dtype=np.int32)})
    assert packed is not None
    as_packed = httpx.post(
        replica.url + "/v1/completions",
        content=packed,
        headers={"Content-Type": CONTENT_TYPE},
        timeout=30,
    )
    assert as_json.status_code == as_packed.status_code == 200, as_packed.text
    assert as_packed.json()["choices"][0]["token_ids"] == as_json.json()["choices"][0]["token_ids"]
    # Checked after decoding as JSON is: an id past the vocabulary is the same 400.
    bad = msgpack.packb({**body, "prompt": np.array([10**6], dtype="<i4").tobytes()})
    refused = httpx.post(
        replica.url + "/v1/completions", content=bad, headers={"Content-Type": CONTENT_TYPE}
    )
    assert refused.status_code == 400 and "prompt token ids" in refused.text


def recording_replica(seen: list[tuple[str, bytes]], takes_packed: bool) -> BackgroundServer:
    async def completions(request: web.Request) -> web.Response:
        seen.append((request.content_type, await request.read()))
        return web.json_response({"ok": True})

    types = ["application/json", CONTENT_TYPE] if takes_packed else None
    return stand_in_replica(completions, {"instance": "r", "request_types": types})


@pytest.mark.parametrize("takes_packed", [True, False])
def test_the_router_packs_a_token_id_prompt_only_for_a_replica_that_takes_it(
    takes_packed: bool,
) -> None:
    seen: list[tuple[str, bytes]] = []
    replica = recording_replica(seen, takes_packed)
    app = build_router_app(
        RouterConfig((replica.url,), "cache-aware", health_interval=0.1), RoutingKeys(None, 16)
    )
    router = BackgroundServer(app)
    try:
        wait_checked(app[ROUTER_KEY])
        ids = list(range(20000))  # past TOKEN_ARRAY_BYTES as JSON
        bodies = [
            {"model": "m", "prompt": ids, "max_tokens": 2},
            {"model": "m", "prompt": "text " * 20000, "max_tokens": 2},  # not token ids
            {"model": "m", "prompt": ids, "max_tokens": 2},  # pinned: sent before it is parsed
        ]
        for i, body in enumerate(bodies):
            headers = {"x-kvshare-replica": "0"} if i == 2 else {}
            resp = httpx.post(router.url + "/v1/completions", json=body, headers=headers)
            assert resp.status_code == 200
    finally:
        router.close()
        replica.close()
    types = [content_type for content_type, _ in seen]
    assert (
        types == [CONTENT_TYPE if takes_packed else "application/json"] + ["application/json"] * 2
    )
    for (content_type, raw), body in zip(seen, bodies):
        decoded = unpack_request(raw) if content_type == CONTENT_TYPE else json.loads(raw)
        prompt = decoded["prompt"]
        assert (prompt.tolist() if isinstance(prompt, np.ndarray) else prompt) == body["prompt"]
        assert decoded["max_tokens"] == 2
    if takes_packed:
        assert len(seen[0][1]) < len(json.dumps(bodies[0]))  # 4 bytes an id, not ~7
