"""Multi-turn sessions: each turn resends the whole history plus a new question.

The history holds the previous questions and the model's actual answers, so turn k's prompt
begins with turn k-1's prompt and answer. Between turns the bench waits for the pool's stores
to commit (runner.settle), as a user reading the answer would; session time counts only the
time spent waiting for answers (the sum of the turns' total times), so that wait is not in it. `alternate` sends turn k to replica k mod 2, which
never ran turn k-1: without the pool it recomputes the history, with it it can load it.
`fixed` sends every turn to replica 0, whose own GPU cache already holds the history. A model
with a chat template gets /v1/chat/completions; one without gets token-id prompts, with each
answer's streamed ids appended to the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvshare.bench.client import BenchError, RequestOptions
from kvshare.bench.records import MEASURE, RequestRecord, Tag
from kvshare.bench.runner import BlockContext
from kvshare.bench.synthetic import QUESTION_SEPARATOR, prompt_rng

ALTERNATE = "alternate"
FIXED = "fixed"
PLACEMENTS = (ALTERNATE, FIXED)


def replica_for(placement: str, turn: int) -> int:
    return turn % 2 if placement == ALTERNATE else 0


@dataclass(frozen=True)
class Sessions:
    name: ClassVar[str] = "sessions"
    x_label: ClassVar[str] = "turn"

    sessions: int  # per placement per block
    context_tokens: int  # the document the first question is about
    turns: int = 6
    question_tokens: int = 32
    output_tokens: int = 32
    placements: tuple[str, ...] = (ALTERNATE,)

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.question_tokens, self.output_tokens) < 1:
            raise ValueError("sessions, turns, question_tokens and output_tokens must be >= 1")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}")
        if not self.placements or set(self.placements) - set(PLACEMENTS):
            raise ValueError(f"placements must be among {PLACEMENTS}, got {self.placements}")

    def params(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "context_tokens": self.context_tokens,
            "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens,
            "placements": list(self.placements),
        }

    def planned_requests(self) -> int:
        return self.sessions * self.turns * len(self.placements)

    def check(self, replicas: int) -> None:
        needed = 2 if ALTERNATE in self.placements and self.turns > 1 else 1
        if replicas < needed:
            raise ValueError(f"{self.name} needs {needed} replicas; the router has {replicas}")

    def plan(self, seed: int, block: int) -> list[tuple[str, int]]:
        """(placement, session) pairs in this block's random order; sessions run one at a time."""
        pairs = [(p, s) for p in self.placements for s in range(self.sessions)]
        prompt_rng(seed, self.name, "order", block).shuffle(pairs)
        return pairs

    async def run_block(self, ctx: BlockContext) -> list[RequestRecord]:
        records = []
        for placement, session in self.plan(ctx.seed, ctx.block.index):
            run = self._chat_session if ctx.model.has_chat_template else self._id_session
            records.extend(await run(ctx, placement, session))
        return records

    def _tag(self, placement: str, session: int, turn: int) -> Tag:
        label = f"{placement}-{session}"
        # Each turn resends the last one's prompt: the group shares it.
        return Tag(placement, turn, MEASURE, f"{label}/turn{turn}", session=label, group=label)

    def _options(self, block: int, placement: str, session: int, turn: int) -> RequestOptions:
        return RequestOptions(
            self.output_tokens,
            replica_for(placement, turn),
            session_id=f"block{block}-{placement}-{session}",
        )

    async def _chat_session(
        self, ctx: BlockContext, placement: str, session: int
    ) -> list[RequestRecord]:
        rng = prompt_rng(ctx.seed, self.name, ctx.block.index, placement, session)
        context = ctx.model.prompt(self.context_tokens, rng)
        messages: list[dict[str, str]] = []
        records: list[RequestRecord] = []
        for turn in range(self.turns):
            question = ctx.model.prompt(self.question_tokens, rng)
            assert isinstance(context, str) and isinstance(question, str)  # a chat model has text
            content = context + QUESTION_SEPARATOR + question if turn == 0 else question
            messages.append({"role": "user", "content": content})
            settled = await ctx.settle() if records else None
            options = self._options(ctx.block.index, placement, session, turn)
            record = await ctx.chat(messages, options, self._tag(placement, session, turn), settled)
            messages.append({"role": "assistant", "content": record.result.text})
            records.append(record)
        return records

    async def _id_session(
        self, ctx: BlockContext, placement: str, session: int
    ) -> list[RequestRecord]:
        rng = prompt_rng(ctx.seed, self.name, ctx.block.index, placement, session)
        history = list(ctx.model.prompt(self.context_tokens, rng))
        records: list[RequestRecord] = []
        for turn in range(self.turns):
            history += ctx.model.prompt(self.question_tokens, rng)
            settled = await ctx.settle() if records else None
            options = self._options(ctx.block.index, placement, session, turn)
            record = await ctx.complete(
                list(history), options, self._tag(placement, session, turn), settled
            )
            if not record.result.token_ids:
                raise BenchError(
                    "token-id sessions need the answer's ids; the server streamed none"
                )
            history += record.result.token_ids
            records.append(record)
        return records
