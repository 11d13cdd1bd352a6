"""Shared prefix: many users ask questions about a few long documents, concurrently.

Each user asks one question about document (user mod D), in a random order (the same in
every block, over each block's own documents), with at most
`concurrency` requests in flight, and the router places them. With the pool off each replica
must prefill every document it is sent at least once; with it on, a document prefilled anywhere
can be loaded everywhere. Reported: throughput per block and the TTFT distribution.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from kvshare.bench.client import RequestOptions
from kvshare.bench.records import MEASURE, RequestRecord, Tag
from kvshare.bench.runner import BlockContext
from kvshare.bench.synthetic import prompt_rng


@dataclass(frozen=True)
class SharedPrefix:
    name: ClassVar[str] = "shared-prefix"
    x_label: ClassVar[str] = "-"

    documents: int
    users: int  # questions per block, one per user
    concurrency: int
    doc_tokens: int
    question_tokens: int = 32
    output_tokens: int = 16

    def __post_init__(self) -> None:
        values = (
            self.documents,
            self.users,
            self.concurrency,
            self.doc_tokens,
            self.question_tokens,
            self.output_tokens,
        )
        if min(values) < 1:
            raise ValueError("documents, users, concurrency and token counts must be >= 1")

    def params(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "users": self.users,
            "concurrency": self.concurrency,
            "doc_tokens": self.doc_tokens,
            "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens,
        }

    def planned_requests(self) -> int:
        return self.users

    def check(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"{self.name} needs at least one replica")

    def plan(self, seed: int) -> list[int]:
        """Users in the run's random order, the same in every block.

        Which documents the first `concurrency` questions ask about decides how much
        prefill every later question waits behind; with a new order per block that, not
        the condition or time, set the block medians (two ON blocks on the H200: 0.24 and
        1.11 s). Each block still asks about its own documents, so nothing carries over."""
        users = list(range(self.users))
        prompt_rng(seed, self.name, "order").shuffle(users)
        return users

    async def run_block(self, ctx: BlockContext) -> list[RequestRecord]:
        # Every prompt is drawn before the first request: tokenizing while requests are in flight
        # would stall the event loop and delay other requests' chunks (inflating their TTFT).
        block = ctx.block.index
        docs = [
            ctx.model.prompt(self.doc_tokens, prompt_rng(ctx.seed, self.name, block, "doc", d))
            for d in range(self.documents)
        ]
        questions = [
            ctx.model.prompt(
                self.question_tokens, prompt_rng(ctx.seed, self.name, block, "user", u)
            )
            for u in range(self.users)
        ]
        slots = asyncio.Semaphore(self.concurrency)

        async def ask(user: int) -> RequestRecord:
            doc = user % self.documents
            tag = Tag(
                self.name,
                None,
                MEASURE,
                f"user{user}-doc{doc}",
                group=f"doc{doc}",
                shared_tokens=self.doc_tokens,  # the follow-up begins with the document's ids
            )
            async with slots:
                prompt = ctx.model.follow_up(docs[doc], questions[user])
                return await ctx.complete(prompt, RequestOptions(self.output_tokens), tag)

        # Tasks are created in plan order and the semaphore wakes waiters first-in first-out.
        return list(await asyncio.gather(*(ask(user) for user in self.plan(ctx.seed))))
