"""The blocked design, run: block setup on every replica, then the workload's requests.

At each block start, in this order: the bench waits for stores still in flight (settle), the
pool is switched on or off on every replica, the shared pool is cleared, and every replica's
GPU-local prefix cache is reset. Nothing therefore carries over between blocks except the
model and the process state, and workloads draw fresh contexts per block besides.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvshare.bench.client import BenchClient, BenchError, RequestOptions, StreamResult
from kvshare.bench.design import Block, Design
from kvshare.bench.records import PREFILL, WARMUP, BlockResult, RequestRecord, Tag
from kvshare.bench.synthetic import Prompt, PromptModel, prompt_rng


class Observer(Protocol):
    def block_started(self, block: Block, planned_requests: int) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def block_done(self, result: BlockResult) -> None: ...


@dataclass(frozen=True)
class BlockContext:
    """What a workload needs to run one block: sending tagged requests and resetting caches."""

    client: BenchClient
    block: Block
    seed: int
    model: PromptModel
    replicas: tuple[str, ...]
    observer: Observer
    started: float  # perf_counter at the block's first request
    settle_timeout_s: float

    async def complete(
        self, prompt: Prompt, options: RequestOptions, tag: Tag, settle_s: float | None = None
    ) -> RequestRecord:
        return await self._timed(self.client.complete(prompt, options), options, tag, settle_s)

    async def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        options: RequestOptions,
        tag: Tag,
        settle_s: float | None = None,
    ) -> RequestRecord:
        return await self._timed(self.client.chat(messages, options), options, tag, settle_s)

    async def reset_prefix_caches(self) -> None:
        await self.client.admin_all("reset_prefix_cache")

    async def settle(self) -> float:
        return await settle(self.client, self.settle_timeout_s)

    async def _timed(
        self,
        request: Awaitable[StreamResult],
        options: RequestOptions,
        tag: Tag,
        settle_s: float | None,
    ) -> RequestRecord:
        start = time.perf_counter() - self.started
        result = await request
        if options.replica is not None and result.served_by not in (None, str(options.replica)):
            raise BenchError(
                f"{tag.label} was pinned to replica {options.replica}, "
                f"but replica {result.served_by} served it"
            )
        record = RequestRecord(
            self.block.index, self.block.condition, tag, options.replica, start, result, settle_s
        )
        self.observer.request_done(record)
        return record


class Workload(Protocol):
    name: str
    x_label: str

    def params(self) -> dict[str, Any]: ...
    def planned_requests(self) -> int: ...
    def check(self, replicas: int) -> None: ...  # ValueError if the cluster cannot run it
    async def run_block(self, ctx: BlockContext) -> list[RequestRecord]: ...


async def settle(client: BenchClient, timeout_s: float, poll_s: float = 0.01) -> float:
    """Wait until the pool holds no reservation: every store begun has committed or aborted.

    A replica stores a prompt's chunks after computing them and commits each once its copy
    is done, so a response can end before its chunks are visible. A follow-up sent at once
    would race that commit; the bench waits instead, and measures the state it means to.
    Returns the seconds waited (timeout_s at most; the pool may have none to wait for).
    """
    start = time.perf_counter()
    while (waited := time.perf_counter() - start) < timeout_s:
        pool = (await client.stats())[0].get("pool")  # every replica's pool is the one
        if not pool or not pool.get("reserved"):
            break
        await asyncio.sleep(poll_s)
    return waited


async def prepare_block(client: BenchClient, block: Block, settle_timeout_s: float) -> None:
    # Settle, toggle, clear, reset: the block starts with the pool in its setting and empty
    # (no store of the previous block lands later), and every GPU-local prefix cache cold.
    # (Every replica clears the one pool: idempotent.)
    await settle(client, settle_timeout_s)
    await client.admin_all("kv_pool", {"enabled": block.pool_enabled})
    await client.admin_all("clear_pool")
    await client.admin_all("reset_prefix_cache")


async def warm_up(
    client: BenchClient,
    model: PromptModel,
    replicas: int,
    tokens: int,
    seed: int,
    *,
    restore: bool,
    settle_timeout_s: float,
) -> tuple[RequestRecord, ...]:
    """One request of `tokens` tokens pinned to each replica in turn, before block 0; with
    `restore` (a design that switches the pool on), the pool on for these, and then each
    replica's prompt again on the next replica (one replica: on itself after a cache
    reset), restored from the pool.

    A replica's first request carries one-time costs (kernel compilation and autotuning,
    allocator growth: 46 s against 28.5 s for a 128k prefill on an H200), and so does its
    first restore (an H100's first fp8 hit at 131,072 tokens took 268 ms, the next three
    94-96); inside block 0 or the first ON block they would bias whichever condition comes
    first. The records are reported on their own and never pooled (the block setup that
    follows clears the pool and resets every cache).
    """
    prompts = [model.prompt(tokens, prompt_rng(seed, "warmup", r)) for r in range(replicas)]
    if restore:
        await client.admin_all("kv_pool", {"enabled": True})
    records = [
        await _warm_up_request(client, prompt, replica, f"replica{replica}")
        for replica, prompt in enumerate(prompts)
    ]
    if restore:
        await settle(client, settle_timeout_s)
        await client.admin_all("reset_prefix_cache")
        for source, prompt in enumerate(prompts):
            target = (source + 1) % replicas
            records.append(await _warm_up_request(client, prompt, target, f"restore{source}"))
    return tuple(records)


async def _warm_up_request(
    client: BenchClient, prompt: Prompt, replica: int, label: str
) -> RequestRecord:
    result = await client.complete(prompt, RequestOptions(1, replica=replica))
    return RequestRecord(-1, WARMUP, Tag(WARMUP, None, PREFILL, label), replica, 0.0, result)


async def run_design(
    workload: Workload,
    client: BenchClient,
    design: Design,
    *,
    seed: int,
    model: PromptModel,
    replicas: tuple[str, ...],
    observer: Observer,
    settle_timeout_s: float,
) -> tuple[BlockResult, ...]:
    workload.check(len(replicas))
    results = []
    for block in design.blocks:
        await prepare_block(client, block, settle_timeout_s)
        before = tuple(await client.stats())
        observer.block_started(block, workload.planned_requests())
        started = time.perf_counter()
        ctx = BlockContext(
            client, block, seed, model, replicas, observer, started, settle_timeout_s
        )
        records = await workload.run_block(ctx)
        wall = time.perf_counter() - started
        result = BlockResult(block, wall, before, tuple(await client.stats()), tuple(records))
        observer.block_done(result)
        results.append(result)
    return tuple(results)
