"""What a bench run produces: one record per request, one result per block, the whole run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.bench.client import StreamResult
from kvshare.bench.design import Block, Design

MEASURE = "measure"  # a request whose timings are the result
PREFILL = "prefill"  # a request that only sets up state (the context on replica A)
ROLES = (MEASURE, PREFILL)
WARMUP = "warmup"  # the series and condition of the warm-up requests before block 0
POOL_BYTE_COUNTERS = ("loaded_bytes", "stored_bytes")


@dataclass(frozen=True)
class Tag:
    """Where a request belongs in the results."""

    series: str  # a curve: "cross-replica", "alternate", "fixed", "shared-prefix"
    x: int | None  # its position on the curve: context length, turn number; None for one point
    role: str
    label: str  # the request's identity, unique within a block
    session: str | None = None  # requests of one multi-turn session share this
    # Requests of one group (a document, a session) begin with tokens an earlier one sent:
    # `shared_tokens` of them, or, when None, the earlier one's whole prompt (kvshare.bench.ideal).
    group: str | None = None
    shared_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class RequestRecord:
    block: int
    condition: str
    tag: Tag
    replica: int | None  # the pinned replica; None when the router chose
    start_s: float  # when it was sent, since its block started
    result: StreamResult
    settle_s: float | None = None  # waited before it for the pool's stores to commit (settle)

    @property
    def measured(self) -> bool:
        return self.tag.role == MEASURE

    @property
    def counts_kv(self) -> bool:
        """Whether the server sent kvshare's usage counters (usage.kv); a vLLM replica does
        not, and its `cached_tokens` do not tell the pool's tokens from its own cache's."""
        return isinstance((self.result.usage or {}).get("kv"), Mapping)

    def usage_int(self, *path: str) -> int:
        """A usage counter (e.g. "kv", "pool_hit_tokens"); 0 where the server did not send it."""
        node: Any = self.result.usage or {}
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        return int(node or 0)


@dataclass(frozen=True)
class BlockResult:
    block: Block
    wall_s: float  # the workload's requests (and resets between them); block setup excluded
    stats_before: tuple[Mapping[str, Any], ...]  # GET /admin/stats of each replica
    stats_after: tuple[Mapping[str, Any], ...]
    records: tuple[RequestRecord, ...]

    def __post_init__(self) -> None:
        if len(self.stats_before) != len(self.stats_after):
            raise ValueError("stats before and after must cover the same replicas")
        if any(r.block != self.block.index for r in self.records):
            raise ValueError("every record must belong to this block")

    def pool_bytes(self, counter: str) -> int | None:
        """Sum over replicas of a kv_pool byte counter's growth; None if a replica has no pool."""
        if counter not in POOL_BYTE_COUNTERS:
            raise ValueError(f"counter must be one of {POOL_BYTE_COUNTERS}, got {counter!r}")
        total = 0
        for before, after in zip(self.stats_before, self.stats_after):
            if before.get("kv_pool") is None or after.get("kv_pool") is None:
                return None
            total += int(after["kv_pool"].get(counter, 0)) - int(before["kv_pool"].get(counter, 0))
        return total


@dataclass(frozen=True)
class RunInfo:
    """Everything about a run except its results: enough to reproduce and to label it."""

    workload: str
    x_label: str  # what a record's tag.x is in this workload ("context tokens", "turn")
    params: Mapping[str, Any]
    design: Design
    seed: int
    settle_timeout_s: float
    target: str
    model: str
    replicas: tuple[str, ...]
    command: str
    started_at: str  # ISO 8601, local time with offset
    machine: Mapping[str, Any]  # the client machine (the target may be elsewhere)


@dataclass(frozen=True)
class BenchRun:
    info: RunInfo
    blocks: tuple[BlockResult, ...]
    warmup: tuple[RequestRecord, ...] = ()  # before block 0 (runner.warm_up); never pooled

    def __post_init__(self) -> None:
        if tuple(b.block for b in self.blocks) != self.info.design.blocks[: len(self.blocks)]:
            raise ValueError("block results must follow the design's order")
        if any(r.condition != WARMUP or r.measured for r in self.warmup):
            raise ValueError("warm-up records must be unmeasured and of the warmup condition")

    def records(self) -> Sequence[RequestRecord]:
        return [r for b in self.blocks for r in b.records]

    def unsettled(self) -> int:
        """Requests sent after a whole settle timeout with pool stores still in flight."""
        timeout = self.info.settle_timeout_s
        return sum(r.settle_s is not None and r.settle_s >= timeout for r in self.records())
