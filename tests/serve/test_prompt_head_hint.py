"""A long token-id prompt's first ids reach the engine while the rest of its body is
parsed: the replica's restore starts from them (its first copies, looked up under the
body's cache_salt), and a hint whose request never comes is let go."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvshare import LLM
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import PoolConnector
from kvshare.serve.server import ServeConfig, build_app
from tests.kvpool.pool_fixture import PoolFactory
from tests.kvpool.test_prefetch import GREEDY, PROMPT, _prefetching_replica
from tests.serve.inprocess import BackgroundServer

# Pads a body past the size from which its token array is read in pieces.
PAD = "x" * (70 << 10)


class Replica:
    def __init__(
        self, llm: LLM, connector: PoolConnector, reference: RequestOutput, events: list
    ) -> None:
        self.llm, self.connector, self.reference, self.events = llm, connector, reference, events
        self.server = BackgroundServer(build_app(llm.engine, ServeConfig("tiny")))
        self.pool = PoolClient(connector.client.socket_path)  # the test's own link: stats only
        self.pool.connect()

    def complete(self, **fields: Any) -> httpx.Response:
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": GREEDY.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "user": PAD,
            **fields,
        }
        return httpx.post(self.server.url + "/v1/completions", json=body, timeout=60)

    def leases(self) -> int:
        return int(self.pool.stats()["leases"])

    def close(self) -> None:
        self.server.close()
        self.pool.close()


@pytest.fixture
def replica(pools: PoolFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Replica]:
    """A replica whose pool holds PROMPT (unsalted and under the salt "t1"), its GPU cache
    empty, its transfer prefetching one page (recorded)."""
    llm, connector, reference, events = _prefetching_replica(pools, monkeypatch, 1, salts=("t1",))
    served = Replica(llm, connector, reference, events)
    yield served
    served.close()


def _until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("salt", [None, "t1"])
def test_a_long_prompt_restores_from_the_hint_its_body_sent(
    replica: Replica, salt: str | None
) -> None:
    answer = replica.complete(**({"cache_salt": salt} if salt else {}))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == list(replica.reference.token_ids)
    names = [name for name, _ in replica.events]
    assert names == ["head lookup", "prefetch", "lookup", "load"]
    assert replica.events[3][1][1] is not None  # the load took the hint's prefetch
    counters = replica.connector.counters
    assert (counters["hints"], counters["hints_taken"]) == (1, 1)
    assert replica.leases() == 0


def test_a_salt_the_body_does_not_write_plainly_makes_no_hint(replica: Replica) -> None:
    """An escaped salt is not read from the raw body: no hint, and the request restores
    with its own head lookup."""
    escaped = json.dumps({"cache_salt": "t1"}).replace("t1", "\\u00741")
    assert json.loads(escaped) == {"cache_salt": "t1"}
    body = json.loads(json.dumps({"model": "tiny", "prompt": PROMPT}))
    text = json.dumps(body)[:-1] + ", " + escaped[1:-1] + ', "max_tokens": 4, '
    text += f'"temperature": 0, "ignore_eos": true, "user": "{PAD}"}}'
    answer = httpx.post(
        replica.server.url + "/v1/completions",
        content=text.encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == list(replica.reference.token_ids)
    assert replica.connector.counters["hints"] == 0
    assert [name for name, _ in replica.events] == ["head lookup", "prefetch", "lookup", "load"]


def test_the_hint_of_a_refused_request_is_let_go_once_the_engine_idles(
    replica: Replica,
) -> None:
    refused = replica.complete(temperature=-1)
    assert refused.status_code == 400
    assert _until(lambda: replica.leases() == 1)  # the hint pins its head's pages
    started = time.monotonic()
    assert _until(lambda: replica.leases() == 0)
    assert time.monotonic() - started > 0.5  # kept for _HINT_LIFE_S, 1 s, of idling
    answer = replica.complete()
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["token_ids"] == list(replica.reference.token_ids)
