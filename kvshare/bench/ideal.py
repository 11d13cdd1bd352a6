"""The fewest prompt tokens a cluster must compute: the yardstick for `computed/ideal`.

Requests form groups (a shared document, a session): each later request of a group begins
with tokens an earlier one sent (`shared_tokens`). An ideal cluster computes a group's first
prompt whole, once, and for every other request only its new tokens plus the part of the
shared prefix that does not fill a whole pool chunk (the pool restores whole chunks only;
at most one partial chunk). A request without a group is computed whole.

Computed is what the replicas say they computed: `usage.kv.computed_tokens` of each
response. Below 1 is possible (the GPU cache reuses 16-token blocks of a partial chunk).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptShare:
    group: str | None  # the document or session; None: shares nothing
    prompt_tokens: int
    shared_tokens: int = 0  # leading tokens an earlier request of the group already sent

    def __post_init__(self) -> None:
        if not 0 <= self.shared_tokens <= self.prompt_tokens:
            raise ValueError(
                f"need 0 <= shared_tokens ({self.shared_tokens}) <= "
                f"prompt_tokens ({self.prompt_tokens})"
            )


def ideal_computed_tokens(requests: Iterable[PromptShare], chunk_tokens: int) -> int:
    """Prompt tokens an ideal cluster computes for `requests`, in the order they were sent."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    seen: set[str] = set()
    total = 0
    for r in requests:
        if r.group is None or r.group not in seen:
            total += r.prompt_tokens
            if r.group is not None:
                seen.add(r.group)
        else:
            total += r.prompt_tokens - r.shared_tokens + r.shared_tokens % chunk_tokens
    return total


def computed_over_ideal(computed_tokens: int, ideal_tokens: int) -> float | None:
    return computed_tokens / ideal_tokens if ideal_tokens else None
