"""Waiting for chunks another replica is producing: the rules (waiting.py), the daemon's
answer, a waiter that loads what the producer committed, and a waiter released at once
when the producer's process is killed."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.llm_engine import LLMEngine, RequestOutput
from kvshare.kvpool.client import PoolClient, PoolError
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.keys import chunk_keys
from kvshare.kvpool.launch import PoolProcess
from kvshare.kvpool.waiting import PrefillSpeed, WaitOptions, wait_budget, worth_waiting
from tests.kvpool.pool_fixture import PoolFactory, child_env

MODEL = "shape:tiny-llama"
CHUNK = 64
_rng = random.Random(11)
DOCUMENT = [_rng.randrange(3, 512) for _ in range(8 * CHUNK)]
PROMPT = DOCUMENT + [_rng.randrange(3, 512) for _ in range(20)]
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
# Claims the keys given in hex for its connection, says so, and lives until killed.
WRITER = """
import sys, time
from kvshare.kvpool.client import PoolClient
client = PoolClient(sys.argv[1])
client.connect()
client.lookup([bytes.fromhex(k) for k in sys.argv[2:]], claim=True)
print("claimed", flush=True)
time.sleep(600)
"""


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=32 << 20, slab_bytes=4 << 20))
    factory.close()


def replica(
    pool: PoolProcess, wait: WaitOptions, batch_tokens: int = 512, model: str = MODEL
) -> LLMEngine:
    llm = LLM(
        model,
        dtype="float32",
        kv_pool=pool.address,
        weights_seed=3,
        chunk_tokens=CHUNK,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=batch_tokens,
    )
    connector = connector_of(llm.engine)
    connector.options = dataclasses.replace(connector.options, wait=wait)
    return llm.engine


def connector_of(engine: LLMEngine) -> PoolConnector:
    assert isinstance(engine.connector, PoolConnector)
    return engine.connector


def test_the_rules() -> None:
    options = WaitOptions(max_wait_s=10.0, stall_s=1.0)
    speed = PrefillSpeed(weight=0.5)
    assert wait_budget(4096, speed, options) == 1.0  # speed unknown: the stall bound alone
    speed.observe(1000, 1.0)
    speed.observe(3000, 1.0)
    assert speed.tokens_per_s == 2000.0
    assert wait_budget(4000, speed, options) == 1.0 + 2 * 2.0
    assert wait_budget(400_000, speed, options) == 10.0  # never past max_wait_s
    assert worth_waiting(64, 0.2, 0.5, 5.0, options)
    assert not worth_waiting(0, 0.2, 0.5, 5.0, options)  # nothing in progress
    assert not worth_waiting(64, 1.0, 0.5, 5.0, options)  # producer stalled
    assert not worth_waiting(64, 0.2, 5.0, 5.0, options)  # budget spent
    assert not worth_waiting(64, 0.2, 0.5, 5.0, dataclasses.replace(options, enabled=False))
    with pytest.raises(ValueError):
        WaitOptions(max_wait_s=-1.0)


def test_the_daemon_answers_what_others_produce_after_the_committed_run(
    pool: PoolProcess,
) -> None:
    producer, asker = PoolClient(pool.address), PoolClient(pool.address)
    try:
        ks = [n.to_bytes(16, "big") for n in range(1, 5)]
        first = producer.lookup(ks, claim=True)
        assert (first.lease, first.in_progress) == (0, 0)
        found = asker.lookup([*ks[:3], bytes(16)], claim=True)
        assert (found.pages, found.in_progress) == ((), 3)
        assert 0.0 <= found.idle_s < 5.0
        assert asker.lookup([bytes(16)]).in_progress == 0  # its own claim
        assert producer.unclaim(ks[:2]) == 2
        assert asker.lookup(ks).in_progress == 0  # ks[0] is nobody's now
        assert asker.lookup(ks[2:]).in_progress == 2
        with pytest.raises(PoolError, match="claim"):
            producer._request({"op": "lookup", "keys": ks, "claim": 1})
        with pytest.raises(PoolError, match="claim_states"):
            producer._request({"op": "lookup", "keys": ks, "claim_states": ks[:1]})
        assert producer.stats()["claims"] == 3  # ks[2:] and the asker's key
    finally:
        producer.close()
        asker.close()


def step_until_finished(
    engines: tuple[LLMEngine, ...], count: int, seconds: float = 60
) -> dict[str, RequestOutput]:
    """Step each engine in turn until `count` requests finished; their outputs by id."""
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + seconds
    while len(done) < count and time.monotonic() < deadline:
        for engine in engines:
            done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def drive(engine: LLMEngine, request_id: str, seconds: float) -> RequestOutput:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out
    raise AssertionError(f"{request_id} did not finish within {seconds} s")


@pytest.mark.parametrize("model", [MODEL, "shape:tiny-qwen3.5"])
def test_a_waiter_loads_the_chunks_another_replica_was_computing(
    pool: PoolProcess, model: str
) -> None:
    """Replica W computes the document 64 tokens a step; replica R, asked meanwhile, waits
    for W's chunks instead of computing them, then restores them from the pool. The hybrid
    model resumes only at a state snapshot: W's lookup also claims the state page of the
    snapshot it will take at the document's end, and R waits for that too."""
    wait = WaitOptions(max_wait_s=30.0, stall_s=30.0)
    writer = replica(pool, wait, batch_tokens=CHUNK, model=model)
    reader = replica(pool, wait, model=model)
    writer.add_request("w", PROMPT, GREEDY)
    writer.step()  # admitted: its lookup claimed every chunk, and it computed the first
    reader.add_request("r", [*DOCUMENT, 7, 8, 9], GREEDY)
    done = step_until_finished((writer, reader), 2)
    assert done["w"].computed_tokens == len(PROMPT)
    assert (done["r"].pool_hit_tokens, done["r"].computed_tokens) == (len(DOCUMENT), 3)
    assert reader.scheduler.counters["pool_waits"] == 1
    stats = connector_of(reader).stats()
    assert stats["wait_requests"] == 1 and stats.get("wait_gave_up", 0) == 0


def test_a_waiter_is_released_when_the_writer_process_is_killed(pool: PoolProcess) -> None:
    """A producer that claimed the document and never commits: the waiter waits (its
    bounds are a minute here), then computes at once when the producer's process dies."""
    engine = replica(pool, WaitOptions(max_wait_s=60.0, stall_s=60.0))
    usable = (len(PROMPT) - 1) // CHUNK
    keys = chunk_keys(connector_of(engine).namespace, PROMPT[: usable * CHUNK])
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, pool.address, *(k.hex() for k in keys)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "claimed\n"
        engine.add_request("r", PROMPT, GREEDY)
        waited_until = time.monotonic() + 1.0
        while time.monotonic() < waited_until:
            assert engine.step() == []  # waiting: not admitted, nothing computed
        assert [s.request_id for s in engine.scheduler.waiting] == ["r"]
        assert engine.scheduler.counters["pool_waits"] == 1
    finally:
        writer.kill()
        writer.wait()
    out = drive(engine, "r", seconds=5.0)
    assert (out.pool_hit_tokens, out.computed_tokens) == (0, len(PROMPT))
    stats = connector_of(engine).stats()
    assert stats["wait_requests"] == 1 and stats.get("wait_gave_up", 0) == 0
