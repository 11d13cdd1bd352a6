"""Waiting for chunks another replica is producing: whether to wait, and for how long.

A lookup answers how many chunks past the committed run another client is producing
(claimed or reserved, not yet committed) and how long that producer has been idle (no
claim, reserve or commit since). The producer runs the same model, so at this replica's
own prefill speed it finishes those chunks no later than this replica would computing
them itself (which would also take this replica's compute from its other requests):
waiting is the cheaper estimate while the producer shows signs of life. The evidence
that it is not, and the bounds:
- a producer idle for `stall_s` or more is presumed stuck: do not wait (or stop);
- a request waits at most `stall_s` plus twice the time it would take to compute the
  pending tokens at this replica's measured speed (a producer slower than half our speed
  loses to computing), and never more than `max_wait_s`;
- a producer whose connection drops loses its claims: the next ask finds nothing in
  progress and the request proceeds at once.
Pure functions and a small speed estimate; the connector applies them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WaitOptions:
    """`recheck_s`: the shortest interval between two asks of the daemon for one waiting
    request (the engine's step loop asks at every step while a request waits)."""

    enabled: bool = True
    # A 27B replica's prefill step over long contexts takes seconds, and a loaded producer
    # commits a document's chunks only every few steps: shorter bounds give up on live
    # producers (measured on the H200 with 1 s: waiters gave up and computed). A producer
    # that dies loses its claims at once, so these bound only a hung, connected producer.
    max_wait_s: float = 30.0
    stall_s: float = 5.0
    recheck_s: float = 0.005

    def __post_init__(self) -> None:
        if not (self.max_wait_s >= 0 and self.stall_s >= 0 and self.recheck_s >= 0):
            raise ValueError(f"wait options must be non-negative: {self}")


class PrefillSpeed:
    """This engine's prefill speed in tokens per second: an exponential average over the
    steps reported to it (None until one was)."""

    def __init__(self, weight: float = 0.25) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.tokens_per_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        sample = num_tokens / seconds
        if self.tokens_per_s is None:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += self.weight * (sample - self.tokens_per_s)

    def seconds_for(self, num_tokens: int) -> float:
        """Time to compute num_tokens here; 0.0 while the speed is unknown."""
        return num_tokens / self.tokens_per_s if self.tokens_per_s else 0.0


def wait_budget(pending_tokens: int, speed: PrefillSpeed, options: WaitOptions) -> float:
    """The longest a request may wait for pending_tokens produced elsewhere."""
    return min(options.max_wait_s, options.stall_s + 2.0 * speed.seconds_for(pending_tokens))


def worth_waiting(
    pending_tokens: int, idle_s: float, waited_s: float, budget_s: float, options: WaitOptions
) -> bool:
    """Wait (again) for pending_tokens whose producer has been idle idle_s, after waiting
    waited_s of a budget_s budget."""
    return (
        options.enabled and pending_tokens > 0 and idle_s < options.stall_s and waited_s < budget_s
    )
