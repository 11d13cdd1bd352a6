"""The pool daemon dies and comes back while a replica restores a prefix from it.

The restore's lease dies with the daemon, so its release fails. On a sliding-window model
(Gemma 3) the restore brought back only the global layers of the chunks outside the
window: kept, those blocks would be served as GPU prefix hits and stored into the new
pool with sliding layers that were never restored, and every replica restoring them
would answer wrong. The restore must be discarded instead: recomputed, never registered,
never stored, counted, and reported as computed tokens.

Two replicas (two engines with their own pool clients) share one daemon; the daemon is
killed and restarted between the start of one replica's restore and its verification,
with the copy still running (an imposed load delay).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from kvshare import LLM, SamplingParams
from kvshare.engine.llm_engine import RequestOutput
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.faults import FaultInjection
from kvshare.kvpool.launch import PoolProcess
from tests.kvpool.pool_fixture import PoolFactory

CHUNK = 64  # tiny-gemma3's window is 64 tokens: chunks 0-2 of a 4-chunk restore are global-only
_rng = random.Random(5)
PROMPT = [_rng.randrange(3, 512) for _ in range(4 * CHUNK + 20)]
# Shares 150 tokens with PROMPT: a GPU prefix hit on its blocks, window reaching into chunk 1.
BRANCH = PROMPT[:150] + [_rng.randrange(3, 512) for _ in range(40)]
# Shares 3 chunks with PROMPT: restored from the pool, chunk 2 with every layer.
FOLLOW_UP = PROMPT[: 3 * CHUNK] + [_rng.randrange(3, 512) for _ in range(40)]
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, seed=99, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start(factory.config(size_bytes=64 << 20, slab_bytes=8 << 20))
    factory.close()


def replica(pool: PoolProcess, faults: FaultInjection | None = None) -> LLM:
    llm = LLM(
        "shape:tiny-gemma3",
        dtype="float32",
        kv_pool=pool.address,
        weights_seed=3,
        chunk_tokens=CHUNK,
        kv_cache_memory=8 << 20,
        kv_pool_faults=faults,
    )
    connector_of(llm).client.retry_interval = 0.0  # reconnect at the first call after the restart
    return llm


def connector_of(llm: LLM) -> PoolConnector:
    connector = llm.engine.connector
    assert isinstance(connector, PoolConnector)
    return connector


def generate(llm: LLM, prompt: list[int], params: SamplingParams) -> RequestOutput:
    out = llm.generate([prompt], params)[0]
    connector_of(llm).wait_idle()
    return out


def restart_pool_before_first_verification(connector: PoolConnector, pool: PoolProcess) -> None:
    finish: Callable[[str], bool] = connector.finish_load

    def finish_load(request_id: str) -> bool:
        connector.finish_load = finish  # type: ignore[method-assign]
        pool.kill()
        pool.start()
        return finish(request_id)

    connector.finish_load = finish_load  # type: ignore[method-assign]


def test_a_restore_whose_lease_died_with_the_daemon_is_recomputed(pool: PoolProcess) -> None:
    first, second = replica(pool), replica(pool, FaultInjection(load_delay=0.5))
    connector_of(first).set_enabled(False)
    expected = {
        name: generate(first, prompt, params).token_ids
        for name, prompt, params in (
            ("prompt", PROMPT, SEEDED),
            ("branch", BRANCH, GREEDY),
            ("follow_up", FOLLOW_UP, GREEDY),
        )
    }
    first.engine.reset_prefix_cache()
    connector_of(first).set_enabled(True)
    generate(first, PROMPT, GREEDY)  # the prompt's 4 chunks go to the pool

    restorer = connector_of(second)
    restart_pool_before_first_verification(restorer, pool)
    restored = generate(second, PROMPT, SEEDED)
    assert restorer.counters["lost_leases"] == 1 and restorer.counters["load_failures"] == 1
    assert restorer.counters["pool_errors"] >= 1
    # Recomputed, and reported so: no pool hit in usage or in the counters; the seeded
    # request drew its tokens as if the pool had never been there.
    assert (restored.pool_hit_tokens, restored.computed_tokens) == (0, len(PROMPT))
    assert restorer.counters["hit_tokens"] == 0
    assert restored.token_ids == expected["prompt"]
    # Nothing of the discarded restore is a GPU prefix hit on this replica ...
    branch = generate(second, BRANCH, GREEDY)
    assert branch.gpu_hit_tokens > 0 and branch.token_ids == expected["branch"]
    # ... nor reaches another replica through the new pool.
    first.engine.reset_prefix_cache()
    connector_of(first).client.connect()
    follow_up = generate(first, FOLLOW_UP, GREEDY)
    assert follow_up.pool_hit_tokens == 3 * CHUNK
    assert follow_up.token_ids == expected["follow_up"]
    assert connector_of(first).counters["hit_tokens"] == 3 * CHUNK
