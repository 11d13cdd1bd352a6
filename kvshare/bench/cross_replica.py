"""Cross-replica: a context is prefilled on replica A, its follow-up is measured on replica B.

Before each measured follow-up the bench waits until A's pool stores have committed (see
runner.settle) and resets every replica's GPU-local prefix cache, so B has never seen the
context: with the pool off B recomputes it all, with the pool on it can load the chunks A
stored. One pair runs at a time, so each TTFT is taken on an otherwise idle cluster.

`shared_context`: one context per length per block, prefilled on A once (in pool-on
blocks only: with the pool off A's prefill cannot help B), then every follow-up of the
block asks its own question on it. At 128k tokens on a 27B model a prefill takes ~17 s,
so this is what makes 8 follow-ups per block affordable. A and B may be the same replica
(a 27B model at 128k fits one replica per GPU): the reset between them is what makes B
"another replica".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvshare.bench.client import RequestOptions
from kvshare.bench.records import MEASURE, PREFILL, RequestRecord, Tag
from kvshare.bench.runner import BlockContext
from kvshare.bench.synthetic import prompt_rng


@dataclass(frozen=True)
class CrossReplica:
    name: ClassVar[str] = "cross-replica"
    x_label: ClassVar[str] = "context tokens"

    lengths: tuple[int, ...]  # context lengths, tokens
    requests_per_block: int  # follow-ups per length per block
    question_tokens: int = 32
    output_tokens: int = 8
    source: int = 0  # replica A, which prefills
    target: int = 1  # replica B, which is measured
    shared_context: bool = False

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths must be distinct and >= 1, got {self.lengths}")
        if self.requests_per_block < 1 or self.question_tokens < 1 or self.output_tokens < 1:
            raise ValueError("requests_per_block, question_tokens and output_tokens must be >= 1")
        if min(self.source, self.target) < 0:
            raise ValueError(
                f"source and target must be replica indices, got {self.source}, {self.target}"
            )

    def params(self) -> dict[str, Any]:
        return {
            "lengths": list(self.lengths),
            "requests_per_block": self.requests_per_block,
            "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens,
            "source": self.source,
            "target": self.target,
            "shared_context": self.shared_context,
        }

    def planned_requests(self) -> int:
        return 2 * len(self.lengths) * self.requests_per_block

    def check(self, replicas: int) -> None:
        if max(self.source, self.target) >= replicas:
            raise ValueError(
                f"{self.name} needs replicas {self.source} and {self.target}; "
                f"the router has {replicas}"
            )

    def plan(self, seed: int, block: int) -> list[tuple[int, int]]:
        """(length, request) pairs in this block's random order."""
        pairs = [(length, i) for length in self.lengths for i in range(self.requests_per_block)]
        prompt_rng(seed, self.name, "order", block).shuffle(pairs)
        return pairs

    async def run_block(self, ctx: BlockContext) -> list[RequestRecord]:
        records = []
        shared = {}
        if self.shared_context:
            for length in self.lengths:
                rng = prompt_rng(ctx.seed, self.name, ctx.block.index, length, "shared")
                shared[length] = ctx.model.prompt(length, rng)
                if ctx.block.pool_enabled:
                    prefill = Tag(
                        self.name, length, PREFILL, f"L{length}/prefill", group=f"L{length}"
                    )
                    records.append(
                        await ctx.complete(shared[length], RequestOptions(1, self.source), prefill)
                    )
        for length, i in self.plan(ctx.seed, ctx.block.index):
            rng = prompt_rng(ctx.seed, self.name, ctx.block.index, length, i)
            context = shared[length] if self.shared_context else ctx.model.prompt(length, rng)
            question = ctx.model.prompt(self.question_tokens, rng)
            label = f"L{length}-{i}"
            # computed/ideal: a follow-up shares its context with the prefill (or, with a
            # shared context, with every request of that length in the block).
            group = f"L{length}" if self.shared_context else label
            if not self.shared_context:
                prefill = Tag(self.name, length, PREFILL, f"{label}/prefill", group=group)
                records.append(await ctx.complete(context, RequestOptions(1, self.source), prefill))
            settled = await ctx.settle()
            await ctx.reset_prefix_caches()
            follow_up = ctx.model.follow_up(context, question)
            options = RequestOptions(self.output_tokens, self.target)
            tag = Tag(self.name, length, MEASURE, label, group=group, shared_tokens=length)
            records.append(await ctx.complete(follow_up, options, tag, settle_s=settled))
        return records
