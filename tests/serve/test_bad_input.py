"""Every kind of bad request gets its 4xx with an OpenAI-style error naming the problem,
directly and through the router, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvshare.serve.launcher import Cluster
from tests.serve.conftest import MODEL

OK_CHAT = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    says: str  # a piece of the error message
    body: Any = None  # JSON body, or raw bytes
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    param: str | None = None


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(messages: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}


CHAT = "/v1/chat/completions"
CASES = [
    Case("malformed JSON", 400, "not valid JSON", b'{"model": '),
    Case("NaN is not JSON", 400, "not valid JSON", b'{"model": "m", "temperature": NaN}'),
    Case("invalid UTF-8", 400, "not valid UTF-8", b'{"model": "\xff\xfe"}'),
    Case(
        "wrong content type",
        415,
        "application/json",
        b"model=x",
        headers={"content-type": "text/plain"},
    ),
    Case("oversized body", 413, "too large", b'{"prompt": "' + b"a" * (9 << 20) + b'"}'),
    Case("body not an object", 400, "JSON object", b"[1, 2]"),
    Case("missing model", 400, "model is required", {"prompt": "x"}, param="model"),
    Case("unknown model", 404, "does not exist", completion(model="gpt-9"), param="model"),
    Case("missing prompt", 400, "prompt must be", {"model": MODEL}, param="prompt"),
    Case(
        "batched prompts",
        400,
        "one prompt per request",
        completion(prompt=["a", "b"]),
        param="prompt",
    ),
    Case(
        "prompt of the wrong type",
        400,
        "prompt must be",
        completion(prompt={"text": "x"}),
        param="prompt",
    ),
    Case(
        "token id out of vocabulary",
        400,
        "token ids must be in",
        completion(prompt=[1, 10**7]),
        param="prompt",
    ),
    Case(
        "token id beyond 64 bits",
        400,
        "token ids must be in",
        completion(prompt=[1, 2**70]),
        param="prompt",
    ),
    Case(
        "negative token id",
        400,
        "token ids must be in",
        completion(prompt=[-1, 1]),
        param="prompt",
    ),
    Case(
        "prompt longer than the context",
        400,
        "context",
        completion(prompt=[100] * 9000),
        param="prompt",
    ),
    Case("max_tokens 0", 400, ">= 1", completion(max_tokens=0), param="max_tokens"),
    Case("max_tokens negative", 400, ">= 1", completion(max_tokens=-5), param="max_tokens"),
    Case("max_tokens absurd", 400, "at most", completion(max_tokens=10**9), param="max_tokens"),
    Case("max_tokens a string", 400, "integer", completion(max_tokens="5"), param="max_tokens"),
    Case(
        "max_completion_tokens 0",
        400,
        ">= 1",
        chat(OK_CHAT, max_completion_tokens=0),
        path=CHAT,
        param="max_completion_tokens",
    ),
    Case(
        "temperature negative",
        400,
        "temperature must be in",
        completion(temperature=-0.5),
        param="temperature",
    ),
    Case(
        "temperature too high",
        400,
        "temperature must be in",
        completion(temperature=7),
        param="temperature",
    ),
    Case("temperature a string", 400, "number", completion(temperature="hot"), param="temperature"),
    Case("top_p zero", 400, "top_p must be in", completion(top_p=0), param="top_p"),
    Case("top_p above one", 400, "top_p must be in", completion(top_p=1.5), param="top_p"),
    Case("top_k below -1", 400, "top_k", completion(top_k=-3), param="top_k"),
    Case("n zero", 400, "n must be in [1, 16]", completion(n=0), param="n"),
    Case("n too large", 400, "n must be in [1, 16]", completion(n=17), param="n"),
    Case(
        "temperature underflows",
        400,
        "temperature must be 0 (greedy) or at least",
        completion(temperature=1e-300),
        param="temperature",
    ),
    Case("top_p underflows", 400, "top_p must be at least", completion(top_p=1e-46), param="top_p"),
    Case(
        "logprobs above 20",
        400,
        "logprobs must be in [0, 20]",
        completion(logprobs=21),
        param="logprobs",
    ),
    Case(
        "chat top_logprobs without logprobs",
        400,
        "needs logprobs",
        chat(OK_CHAT, top_logprobs=2),
        path=CHAT,
        param="top_logprobs",
    ),
    Case(
        "chat top_logprobs above 20",
        400,
        "top_logprobs must be in",
        chat(OK_CHAT, logprobs=True, top_logprobs=21),
        path=CHAT,
        param="top_logprobs",
    ),
    Case("deeply nested JSON", 400, "nested too deeply", b"[" * 100_000),
    Case(
        "deeply nested prompt",
        400,
        "nested too deeply",
        b'{"model": "m", "prompt": ' + b"[" * 100_000,
    ),
    Case(
        "lone surrogate in prompt",
        400,
        "lone UTF-16 surrogate",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi \\ud800"}',
    ),
    Case(
        "lone surrogate in messages",
        400,
        "lone UTF-16 surrogate",
        b'{"model": "'
        + MODEL.encode()
        + b'", "messages": [{"role": "user", "content": "\\udc00"}]}',
        path=CHAT,
    ),
    Case(
        "lone surrogate in stop",
        400,
        "lone UTF-16 surrogate",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "stop": ["\\ud800"]}',
    ),
    Case("negative seed", 400, "seed", completion(seed=-1), param="seed"),
    Case("empty stop string", 400, "stop", completion(stop=["", "x"]), param="stop"),
    Case("stop of the wrong type", 400, "stop", completion(stop=5), param="stop"),
    Case("stream not a bool", 400, "true or false", completion(stream="yes"), param="stream"),
    Case("echo unsupported", 400, "not supported", completion(echo=True), param="echo"),
    Case(
        "missing messages", 400, "messages must be", {"model": MODEL}, path=CHAT, param="messages"
    ),
    Case("empty messages", 400, "messages must be", chat([]), path=CHAT, param="messages"),
    Case(
        "message not an object", 400, "must be an object", chat(["hi"]), path=CHAT, param="messages"
    ),
    Case(
        "non-string content",
        400,
        "content must be a string",
        chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
        path=CHAT,
        param="messages",
    ),
    Case(
        "missing content",
        400,
        "content must be a string",
        chat([{"role": "user"}]),
        path=CHAT,
        param="messages",
    ),
    Case(
        "unknown role",
        400,
        "role must be one of",
        chat([{"role": "wizard", "content": "hi"}]),
        path=CHAT,
        param="messages",
    ),
    Case("unknown endpoint", 404, "Not Found", completion(), path="/v1/embeddings"),
    Case("wrong method", 405, "Not Allowed", None, path="/v1/completions", method="GET"),
]


@pytest.fixture(scope="module", params=["replica", "router"])
def http(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[httpx.Client]:
    url = cluster.replica_urls[0] if request.param == "replica" else cluster.url
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_a_clear_4xx(http: httpx.Client, case: Case) -> None:
    headers = {"content-type": "application/json", **case.headers}
    content = (
        case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body)
    )
    resp = http.request(case.method, case.path, content=content, headers=headers)
    assert resp.status_code == case.status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert case.says in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"
    if case.param is not None:
        assert error["param"] == case.param
    assert http.get("/health").status_code == 200


def test_normal_requests_still_succeed(http: httpx.Client) -> None:
    done = http.post("/v1/completions", json=completion(max_tokens=3, temperature=0))
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    talk = http.post(CHAT, json=chat(OK_CHAT, temperature=0))
    assert talk.status_code == 200 and talk.json()["choices"][0]["message"]["content"]
