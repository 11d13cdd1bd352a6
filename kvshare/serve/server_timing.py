"""The `Server-Timing` response header (W3C Server Timing): where a generate request's
time went before its response headers, hop by hop.

A replica reports, in milliseconds, each phase from the end of the one before it: `read`
(the body received), `parse` (JSON, or the router's packed body), `prompt` (the request's
checks and token ids), `queue` (handed to the engine thread until the engine made its
sequence), `engine` (add_request to the first token: admission, pool load, the step),
`deliver` (that token back on the event loop), for an answer that is not streamed `answer`
(the rest of it), and `total` (the handler's start to its response headers: the phases and
the few lines after the last). The router appends its own: `router-read`, `router-route`
(parsing and hashing the prompt, the policy's pick), `router-upstream` (sending to the
replica until the replica's headers came back: the replica's total plus both transfers),
`router-total`. A streamed response's headers go out with its first output, so for a
streamed request the totals are its time to first token as each hop saw it; the client's
own TTFT less `router-total` is the client's side of the connection.

Timing tells a tenant no more than its own TTFT and its usage's cached-token counts do.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterable, Mapping

HEADER = "Server-Timing"
_ENTRY = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:;(.*))?$")
_DUR = re.compile(r"(?:^|;)\s*dur\s*=\s*([0-9.]+)\s*(?:;|$)")


class PhaseClock:
    """Consecutive phases of one request on one host: each `lap` closes the phase that
    began at the previous lap (or at `start`), so the phases add up to the total."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self._last = self.start
        self._phases: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        self.until(name, time.monotonic())

    def until(self, name: str, when: float) -> None:
        """Close the current phase at `when`, a time.monotonic() taken elsewhere (the
        engine thread); a time before the previous lap gives a phase of 0."""
        self._phases.append((name, max(0.0, when - self._last)))
        self._last = max(self._last, when)

    def header(self, total: str = "total") -> str:
        """The phases so far and `total` (the start until now), as a header value."""
        phases = [*self._phases, (total, time.monotonic() - self.start)]
        return ", ".join(f"{name};dur={1e3 * seconds:.3f}" for name, seconds in phases)


def median_phases(timings: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per phase named in any of `timings` (parsed headers), in first-seen order, the median
    of its durations over the timings that name it."""
    durations: dict[str, list[float]] = {}
    for timing in timings:
        for name, ms in timing.items():
            durations.setdefault(name, []).append(ms)
    return {name: statistics.median(values) for name, values in durations.items()}


def parse_server_timing(values: Iterable[str]) -> dict[str, float]:
    """Milliseconds by name from Server-Timing header values (several headers or entries
    in one, comma-separated); an entry without a `dur` or that does not parse is skipped,
    a repeated name keeps its first value (the spec's rule)."""
    out: dict[str, float] = {}
    for value in values:
        for entry in value.split(","):
            match = _ENTRY.match(entry)
            if match is None:
                continue
            dur = _DUR.search(match.group(2) or "")
            if dur is None:
                continue
            try:
                out.setdefault(match.group(1), float(dur.group(1)))
            except ValueError:
                continue
    return out
