"""The replica server in-process, on a tiny random model (no tokenizer, no pool): the
engine thread, disconnects, engine failures, auth, admin and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

import kvshare
from kvshare import LLM
from kvshare.engine.llm_engine import LLMEngine
from kvshare.engine.sampling_params import SamplingParams
from kvshare.serve import collector
from kvshare.serve.engine_thread import EngineThread
from kvshare.serve.router import ADMIN_CALLS
from kvshare.serve.server import SERVER_KEY, ServeConfig, build_app
from tests.serve.inprocess import BackgroundServer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(3, 51))  # 48 tokens: 3 full blocks


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[BackgroundServer, LLMEngine]]:
    llm = LLM("shape:tiny-llama", kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    app = build_app(llm.engine, ServeConfig("tiny", api_key=KEY))
    server = BackgroundServer(app)
    yield server, app[SERVER_KEY].engine
    server.close()


@pytest.fixture
def client(served: tuple[BackgroundServer, LLMEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0].url, headers=AUTH, timeout=30) as c:
        yield c


@pytest.fixture
def engine(served: tuple[BackgroundServer, LLMEngine]) -> LLMEngine:
    return served[1]


def completion(client: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    return client.post("/v1/completions", json=body)


def sse_chunks(text: str) -> list[Any]:
    return [
        json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict[str, Any]:
    """Until no request holds blocks; the engine stats then."""
    deadline = time.monotonic() + timeout
    while True:
        engine = client.get("/admin/stats").json()["engine"]
        if engine["running"] == engine["waiting"] == 0 and engine["gpu_cache_usage"] == 0.0:
            return engine
        assert time.monotonic() < deadline, f"requests still hold blocks: {engine}"
        time.sleep(0.05)


def wait_running(client: httpx.Client, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/admin/stats").json()["engine"]["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_the_engine_thread_collects_young_objects_when_it_goes_idle(
    client: httpx.Client, engine: LLMEngine
) -> None:
    """With the young threshold raised (as `kvshare serve` runs), the engine thread runs a
    generation-1 collection once its last request has finished, so that the next request
    finds none due."""
    seen: list[tuple[str, int, str]] = []

    def observe(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append((threading.current_thread().name, info["generation"], phase))

    threshold = gc.get_threshold()
    gc.set_threshold(collector.YOUNG_OBJECTS, *threshold[1:])
    gc.callbacks.append(observe)
    try:
        assert completion(client).status_code == 200
        deadline = time.monotonic() + 10
        while not any(name == "kvshare-engine" for name, _, _ in seen):
            assert time.monotonic() < deadline, "the engine thread never collected"
            time.sleep(0.01)
    finally:
        gc.callbacks.remove(observe)
        gc.set_threshold(*threshold)
    assert ("kvshare-engine", 1, "start") in seen and not engine.has_unfinished()


def test_the_idle_work_waits_until_the_last_output_reached_its_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine thread's work on going idle (pool stores, a young collection) holds the
    GIL: it runs after the handler that awaited the last output has it, not beside it."""
    llm = LLM("shape:tiny-llama", kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    thread = EngineThread(llm.engine)
    order: list[str] = []
    monkeypatch.setattr(collector, "collect_idle", lambda: order.append("idle work"))

    async def one_request() -> None:
        thread.start(asyncio.get_running_loop())
        stream = thread.submit_group([("r", PROMPT, SamplingParams(max_tokens=1))])
        assert (await stream.get()).finished
        order.append("handler")
        deadline = time.monotonic() + 10
        while "idle work" not in order:
            assert time.monotonic() < deadline, "the engine thread never did its idle work"
            await asyncio.sleep(0.01)

    try:
        asyncio.run(one_request())
    finally:
        thread.stop()
    assert order == ["handler", "idle work"]


def test_completion_streams_the_same_ids_as_a_whole_answer(client: httpx.Client) -> None:
    whole = completion(client)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert answer["usage"]["prompt_tokens"] == 48 and answer["usage"]["completion_tokens"] == 6
    kv = answer["usage"]["kv"]
    assert kv["gpu_hit_tokens"] + kv["pool_hit_tokens"] + kv["computed_tokens"] == 48
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == kv["gpu_hit_tokens"]

    streamed = completion(client, stream=True, stream_options={"include_usage": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(streamed.text)
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    ids = [t for c in chunks[:-2] for t in c["choices"][0]["token_ids"]]
    assert ids == choice["token_ids"]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    # The repeat found the prompt's 2 full blocks before the last token in the GPU cache.
    assert usage["usage"]["kv"]["gpu_hit_tokens"] == 32


def test_api_key_guards_api_and_admin_but_not_probes(
    served: tuple[BackgroundServer, LLMEngine],
) -> None:
    with httpx.Client(base_url=served[0].url, timeout=10) as anonymous:
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("GET", "/admin/stats"),
            ("POST", "/admin/reset_prefix_cache"),
        ):
            resp = anonymous.request(method, path, json={})
            assert resp.status_code == 401, path
            assert resp.json()["error"]["code"] == "invalid_api_key"
        wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anonymous.get("/health").json()["status"] == "ok"
        assert anonymous.get("/metrics").status_code == 200


def test_the_router_fans_out_exactly_the_replica_admin_calls(engine: LLMEngine) -> None:
    app = build_app(engine, ServeConfig("tiny"))  # never started: only its routes are read
    admin = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
        and route.resource.canonical.startswith("/admin/")
        and route.method != "HEAD"
    }  # aiohttp adds HEAD to each GET
    assert admin == {(method, f"/admin/{call}") for call, method in ADMIN_CALLS.items()}


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(client: httpx.Client) -> None:
    wait_idle(client)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert client.get("/admin/stats").json()["engine"]["running"] == 1
    # Closing the stream dropped the connection; 8000 tokens would take far longer.
    wait_idle(client, timeout=5.0)


def test_client_disconnect_before_the_answer_aborts_and_frees_blocks(
    served: tuple[BackgroundServer, LLMEngine], client: httpx.Client
) -> None:
    wait_idle(client)
    host, port = served[0].url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request.encode())
        wait_running(client)
    wait_idle(client, timeout=5.0)
    assert (
        'kvshare_http_requests_total{endpoint="/v1/completions",status="499"}'
        in client.get("/metrics").text
    )


def fail_execute(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, should_fail: Callable[[int], bool]
) -> None:
    """Make the model runner raise on the calls `should_fail` picks (by call number)."""
    real = engine.runner.execute
    calls = iter(range(1 << 30))

    def execute(*args: Any, **kwargs: Any) -> Any:
        if should_fail(next(calls)):
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)


def test_engine_failure_is_a_500_and_the_server_keeps_serving(
    client: httpx.Client, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_execute(engine, monkeypatch, lambda call: call == 0)
    failed = completion(client, prompt=list(range(100, 140)))
    assert failed.status_code == 500
    assert "injected fault" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    wait_idle(client)
    assert completion(client).status_code == 200
    assert client.get("/health").json()["status"] == "ok"


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(
    client: httpx.Client, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_execute(engine, monkeypatch, lambda call: call == 3)
    resp = completion(client, prompt=list(range(200, 230)), max_tokens=20, stream=True)
    assert resp.status_code == 200  # headers were sent with the first token
    chunks = sse_chunks(resp.text)
    assert "injected fault" in chunks[-1]["error"]["message"]
    assert "[DONE]" not in chunks
    wait_idle(client)
    assert completion(client).status_code == 200


def test_engine_rejecting_a_request_is_a_400(client: httpx.Client) -> None:
    resp = completion(client, prompt=[1, 2, 512])  # the tiny model's vocabulary is 512
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt"


def test_chat_on_a_model_without_template_is_refused(client: httpx.Client) -> None:
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 400
    assert "no chat template" in resp.json()["error"]["message"]


def test_admin_calls_without_a_pool(client: httpx.Client) -> None:
    assert completion(client, prompt=list(range(300, 348))).status_code == 200
    wait_idle(client)
    assert client.post("/admin/reset_prefix_cache").json()["reset_blocks"] >= 3
    assert client.post("/admin/reset_prefix_cache", json={}).json() == {"reset_blocks": 0}
    assert client.post("/admin/kv_pool", json={"enabled": False}).json() == {"enabled": False}
    refused = client.post("/admin/kv_pool", json={"enabled": True})
    assert refused.status_code == 409 and "without a KV pool" in refused.json()["error"]["message"]
    assert client.post("/admin/kv_pool", json={"enabled": "yes"}).status_code == 400
    assert client.post("/admin/clear_pool").json() == {"cleared": 0}
    stats = client.get("/admin/stats").json()
    assert stats["kv_pool"] is None and stats["pool"] is None
    assert set(stats["engine"]) >= {"running", "waiting", "gpu_cache_usage", "num_blocks"}


def test_metrics_expose_latencies_gauges_and_finish_reasons(client: httpx.Client) -> None:
    assert completion(client, max_tokens=3).status_code == 200
    text = client.get("/metrics").text
    for series in (
        "kvshare_time_to_first_token_seconds_count",
        "kvshare_inter_token_latency_seconds_count",
        "kvshare_requests_running",
        "kvshare_requests_waiting",
        "kvshare_gpu_cache_usage_ratio",
        'kvshare_requests_finished_total{finish_reason="length"}',
        'kvshare_prompt_tokens_total{source="computed"}',
        'kvshare_http_requests_total{endpoint="/v1/completions",status="200"}',
    ):
        assert series in text, series
    ttft_count = next(
        line
        for line in text.splitlines()
        if line.startswith("kvshare_time_to_first_token_seconds_count")
    )
    assert float(ttft_count.split()[-1]) >= 1
    assert "kvshare_kv_pool_hit_tokens" not in text  # no pool, no pool series


def test_unsampleable_temperature_and_top_p_are_400_and_a_concurrent_request_completes(
    client: httpx.Client, served: tuple[BackgroundServer, LLMEngine]
) -> None:
    wait_idle(client)
    results: dict[str, httpx.Response] = {}

    def long_request() -> None:
        with httpx.Client(base_url=served[0].url, headers=AUTH, timeout=30) as other:
            results["other"] = completion(
                other,
                prompt=list(range(60, 100)),
                max_tokens=60,
                ignore_eos=True,
                temperature=0.8,
                seed=3,
            )

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_running(client)
    for field, value, says in (
        ("temperature", 1e-300, "temperature must be 0 (greedy) or at least"),
        ("temperature", 1e-39, "temperature must be 0 (greedy) or at least"),
        ("top_p", 1e-46, "top_p must be at least"),
    ):
        resp = completion(client, **{"temperature": 1.0, field: value})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == field and says in resp.json()["error"]["message"]
    thread.join(30)
    other = results["other"]
    assert other.status_code == 200, other.text
    assert other.json()["choices"][0]["finish_reason"] == "length"
    assert len(other.json()["choices"][0]["token_ids"]) == 60


def test_a_request_whose_sampling_fails_ends_alone(
    client: httpx.Client, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN logits for one request's row (what an extreme temperature used to give): that
    request gets a 500, the one batched with it finishes."""
    wait_idle(client)
    victim_prompt = list(range(400, 430))
    real = engine.runner.execute

    def execute(chunks: list[Any]) -> Any:
        logits = real(chunks).clone()
        for row, chunk in enumerate(c for c in chunks if c.samples):
            if chunk.seq.token_ids[:30] == victim_prompt and chunk.seq.num_output_tokens >= 3:
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", execute)
    results: dict[str, httpx.Response] = {}

    def other() -> None:
        with httpx.Client(base_url=served_url(client), headers=AUTH, timeout=30) as c:
            results["other"] = completion(
                c, prompt=list(range(60, 100)), max_tokens=40, ignore_eos=True
            )

    thread = threading.Thread(target=other)
    thread.start()
    wait_running(client)
    victim = completion(client, prompt=victim_prompt, max_tokens=20, ignore_eos=True, stream=True)
    thread.join(30)
    assert "cannot be sampled" in sse_chunks(victim.text)[-1]["error"]["message"]
    assert results["other"].status_code == 200
    assert len(results["other"].json()["choices"][0]["token_ids"]) == 40
    assert 'kvshare_requests_finished_total{finish_reason="error"}' in client.get("/metrics").text


def served_url(client: httpx.Client) -> str:
    return str(client.base_url).rstrip("/")


def test_version_and_vllm_metric_names(client: httpx.Client) -> None:
    assert client.get("/version").json() == {"version": kvshare.__version__}
    assert completion(client, max_tokens=3).status_code == 200
    text = client.get("/metrics").text
    for series in (
        'vllm:time_to_first_token_seconds_count{model_name="tiny"}',
        'vllm:e2e_request_latency_seconds_count{model_name="tiny"}',
        'vllm:prompt_tokens_total{model_name="tiny"}',
        'vllm:generation_tokens_total{model_name="tiny"}',
        'vllm:num_requests_running{model_name="tiny"}',
        'vllm:num_requests_waiting{model_name="tiny"}',
        'vllm:gpu_cache_usage_perc{model_name="tiny"}',
        'vllm:prefix_cache_queries_total{model_name="tiny"}',
        'vllm:prefix_cache_hits_total{model_name="tiny"}',
    ):
        assert series in text, series
    generated = next(
        line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )
    assert float(generated.split()[-1]) >= 3


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"model": "tiny", "prompt": ' + b"[" * 100_000,
        b'{"model": "tiny", "prompt": "a\\ud800b"}',
        b'{"model": "tiny", "prompt": [1], "stop": ["\\udfff"]}',
    ],
    ids=["nested", "nested prompt", "surrogate prompt", "surrogate stop"],
)
def test_nested_json_and_lone_surrogates_are_400(client: httpx.Client, body: bytes) -> None:
    resp = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"
    # A surrogate pair is one valid character.
    pair = b'{"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2, "stop": ["\\ud83d\\ude00"]}'
    ok = client.post("/v1/completions", content=pair, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


class SlowTokenizer:
    """Stands in for a tokenizer that takes seconds over a huge prompt (it sleeps)."""

    chat_template = None
    eos_token_ids: frozenset[int] = frozenset()

    def encode(
        self, text: str, add_special_tokens: bool = False, scope: str | None = None
    ) -> list[int]:
        time.sleep(TOKENIZE_S)
        return [5, 6, 7]


TOKENIZE_S = 3.0


def test_health_answers_while_a_huge_prompt_is_tokenized(
    client: httpx.Client,
    served: tuple[BackgroundServer, LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = served[0]._app[SERVER_KEY]
    monkeypatch.setattr(
        server, "model", dataclasses.replace(server.model, tokenizer=SlowTokenizer())
    )
    results: dict[str, httpx.Response] = {}

    def tokenized() -> None:
        with httpx.Client(base_url=served[0].url, headers=AUTH, timeout=30) as c:
            results["slow"] = c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "x" * (1 << 20), "max_tokens": 1},
            )

    thread = threading.Thread(target=tokenized)
    thread.start()
    time.sleep(0.5)  # the body is read and the tokenizer is asleep
    started = time.monotonic()
    assert client.get("/health").status_code == 200
    assert time.monotonic() - started < TOKENIZE_S / 2
    thread.join(30)
    assert results["slow"].status_code == 200, results["slow"].text
