"""Routing policies: which replica gets a request. Pure and synchronous (no I/O, no clock),
so they are tested without processes.

The router calls `choose(request, candidates)` with the replicas that may take the request
(healthy, not yet tried for it; never empty) and `record(request, replica)` once a replica
accepted it. Only recorded placements change a policy's state, so a replica that failed
before replying leaves no trace.

- round-robin: candidates in turn.
- session: sticky on the session id by consistent hashing; a session moves to the next
  replica on the ring when its own is down or overloaded (SGLang's balance rule: at least
  `balance_abs` more in flight than the least loaded AND more than `balance_rel` times it).
- alternate: each request of a session goes to the replica after the one it used last -
  the stress case for cross-replica reuse (the previous turn's KV is never local).
- least-load: fewest requests in flight.
- cache-aware: the highest score = tokens of the prompt's prefix in that replica's GPU
  cache or being computed there + `pool_credit` x the further tokens the shared pool holds
  (whole chunks only; 0 for a replica that does not use the pool) - `load_penalty_tokens` x
  requests in flight - `queued_work_weight` x the prompt tokens the replica still has to
  compute for other prefixes before this request's step (those sent before any work it
  shares; at most one step's budget for a request the replica would take as short work).
  The router feeds it what replicas report of their caches and steps (`observe`), so
  resets and evictions leave its view. See docs/serving.md.

The router calls `started(request, replica)` when it sends a request,
`answered(request, replica)` when the replica's answer begins (its prefill is over), and
`ended(request, replica)` when that attempt is over (answered, failed or abandoned), with
the same request object each time; `observe(replica, update)` with each report a replica
gives of its caches.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile
from typing import ClassVar, Protocol

import xxhash

from kvshare.spec import DEFAULT_CHUNK_TOKENS


class ReplicaLoad(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


@dataclass(frozen=True)
class Load:
    """A plain ReplicaLoad (tests, and callers that keep their own replica records)."""

    index: int
    in_flight: int = 0


@dataclass(frozen=True)
class RouteRequest:
    session_id: str | None = None
    prefix: tuple[bytes, ...] = ()  # chained block hashes of the prompt (block_tokens each)
    block_tokens: int = 16


def pool_credit(miss_s_per_token: float, pool_s_per_token: float) -> float:
    """What a pool-hit token saves, as a share of what a GPU-hit token saves: a miss costs
    a prefill, a pool hit a host-to-GPU copy, a GPU hit about nothing."""
    if not 0 <= pool_s_per_token <= miss_s_per_token or miss_s_per_token <= 0:
        raise ValueError(
            f"need 0 <= pool cost ({pool_s_per_token}) <= miss cost ({miss_s_per_token}), "
            "and a positive miss cost"
        )
    return 1.0 - pool_s_per_token / miss_s_per_token


# Measured on one H200 (docs/results/2026-12-02-h200-cross-replica-gemma3-27b.md, run 1):
# shape:gemma3-27b through router and replicas, cold prefill (a miss) against a restore from
# the pool, whole request TTFT over the prompt's tokens. 32,768 tokens: 3.431 s vs 0.100 s
# (credit 0.971); 130,816 tokens: 16.787 s vs 0.291 s (0.983). shape:qwen3.5-27b at
# 131,072 (docs/results/2026-12-02-h200-hybrid-qwen3.5-27b.md): 27.95 s vs 0.294-0.416 s
# (0.985-0.989). The default takes the lowest, where the restore's fixed costs weigh most.
MEASURED_MISS_S_PER_TOKEN = 3.431 / 32_768
MEASURED_POOL_S_PER_TOKEN = 0.100 / 32_768
DEFAULT_POOL_CREDIT = round(pool_credit(MEASURED_MISS_S_PER_TOKEN, MEASURED_POOL_S_PER_TOKEN), 2)


@dataclass(frozen=True)
class PolicyConfig:
    pool_credit: float = DEFAULT_POOL_CREDIT  # a pool hit is worth this much of a GPU hit
    load_penalty_tokens: float = 64.0  # score cost of one request in flight, in prompt tokens
    # Score cost of one prompt token a replica must compute (for other prefixes) before a
    # new request's step: 1.0, as a token waited for costs the time of a token computed.
    queued_work_weight: float = 1.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the pool restores whole chunks only
    replica_index_blocks: int = 1 << 16  # per-replica GPU index bound (LRU)
    pool_index_blocks: int = 1 << 18
    balance_abs: int = 8
    balance_rel: float = 2.0
    virtual_nodes: int = 64  # ring points per replica
    max_sessions: int = 1 << 16  # alternate: sessions remembered (LRU)

    def __post_init__(self) -> None:
        if not 0.0 <= self.pool_credit <= 1.0:
            raise ValueError(f"pool_credit must be in [0, 1], got {self.pool_credit}")
        if self.load_penalty_tokens < 0:
            raise ValueError(f"load_penalty_tokens must be >= 0, got {self.load_penalty_tokens}")
        if self.queued_work_weight < 0:
            raise ValueError(f"queued_work_weight must be >= 0, got {self.queued_work_weight}")
        if (
            min(
                self.chunk_tokens,
                self.replica_index_blocks,
                self.pool_index_blocks,
                self.balance_abs,
                self.virtual_nodes,
                self.max_sessions,
            )
            < 1
        ):
            raise ValueError(f"chunk, index, balance, ring and session sizes must be >= 1: {self}")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")


class Policy(ABC):
    name: ClassVar[str]
    uses_prefix: ClassVar[bool] = False  # whether requests need their prompt's block hashes

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        """The index of one of `candidates` (never empty)."""

    def record(self, request: RouteRequest, replica: int) -> None:  # noqa: B027 - a no-op for stateless policies
        """`replica` accepted `request`."""

    def forget_replica(self, replica: int) -> None:  # noqa: B027 - a no-op for stateless policies
        """The replica's GPU prefix cache was reset (or it restarted)."""

    def forget_pool(self) -> None:  # noqa: B027 - a no-op for stateless policies
        """The shared pool was cleared."""

    def started(self, request: RouteRequest, replica: int) -> None:  # noqa: B027 - a no-op for most policies
        """`request` was sent to `replica`; `ended` follows exactly once."""

    def answered(self, request: RouteRequest, replica: int) -> None:  # noqa: B027 - a no-op for most policies
        """The replica began its answer to `request` (a streamed one: its first token), so
        its prefill is over; at most once per `started`, before `ended`."""

    def ended(self, request: RouteRequest, replica: int) -> None:  # noqa: B027 - a no-op for most policies
        """The attempt `started` announced is over."""

    def observe(self, replica: int, update: CacheUpdate) -> None:  # noqa: B027 - a no-op for most policies
        """`replica` reported its caches."""


@dataclass(frozen=True)
class StepShape:
    """A replica's engine step: its token budget, and the most tokens a request may have
    left to compute past its GPU-cached prefix to be short work, which joins the next step
    ahead of long prefills (kvshare.engine.scheduler)."""

    step_tokens: int
    short_work_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.short_work_tokens <= self.step_tokens:
            raise ValueError(f"need 1 <= short work <= step tokens: {self}")


@dataclass(frozen=True)
class CacheUpdate:
    """One report of a replica's caches (its GET /admin/cache_events), in routing terms."""

    snapshot: bool = False  # `stored` is the whole GPU cache: forget the rest
    stored: tuple[bytes, ...] = ()  # block hashes the GPU cache gained
    removed: tuple[bytes, ...] = ()  # and lost
    uses_pool: bool = True  # the replica reads and writes the shared pool
    pool_blocks: int | None = None  # the pool's capacity in routing blocks; None: unknown
    pool_cleared: bool = False  # the pool was cleared (or restarted) since the last report
    step: StepShape | None = None  # None: a replica that serves first come, first served


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        self._turn += 1
        return candidates[(self._turn - 1) % len(candidates)].index


class LeastLoad(Policy):
    name = "least-load"

    def __init__(self, num_replicas: int) -> None:
        self._n = num_replicas
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        # Ties go round the replicas in turn, not always to the lowest index.
        self._turn += 1
        return min(candidates, key=lambda c: (c.in_flight, (c.index - self._turn) % self._n)).index


def _hash64(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())  # stable across processes, unlike hash()


class HashRing:
    """Consistent hashing: replica i owns `virtual_nodes` points on a 64-bit ring, and a key
    belongs to the first point clockwise from its hash. Taking a replica out moves only
    the keys it owned; bringing it back moves exactly those keys back."""

    def __init__(self, num_replicas: int, virtual_nodes: int) -> None:
        points = sorted(
            (_hash64(f"replica-{i}#{v}"), i)
            for i in range(num_replicas)
            for v in range(virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [i for _, i in points]
        self._n = num_replicas

    def walk(self, key: str) -> Iterator[int]:
        """Every replica once, in ring order from the key's position."""
        start = bisect.bisect_left(self._points, _hash64(key))
        seen: set[int] = set()
        for k in range(len(self._owners)):
            owner = self._owners[(start + k) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == self._n:
                    return


def overloaded(in_flight: int, least: int, config: PolicyConfig) -> bool:
    return in_flight - least >= config.balance_abs and in_flight > config.balance_rel * least


class Session(Policy):
    name = "session"

    def __init__(self, num_replicas: int, config: PolicyConfig) -> None:
        self._ring = HashRing(num_replicas, config.virtual_nodes)
        self._config = config
        self._no_session = LeastLoad(num_replicas)

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        if request.session_id is None:
            return self._no_session.choose(request, candidates)
        loads = {c.index: c.in_flight for c in candidates}
        least = min(loads.values())
        # The least loaded candidate is never overloaded, so the walk always ends here.
        return next(
            i
            for i in self._ring.walk(request.session_id)
            if i in loads and not overloaded(loads[i], least, self._config)
        )


class Alternate(Policy):
    name = "alternate"

    def __init__(self, num_replicas: int, config: PolicyConfig) -> None:
        self._ring = HashRing(num_replicas, config.virtual_nodes)
        self._max_sessions = config.max_sessions
        self._last: OrderedDict[str, int] = OrderedDict()  # session -> replica used last
        self._no_session = RoundRobin()

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        if request.session_id is None:
            return self._no_session.choose(request, candidates)
        indexes = sorted(c.index for c in candidates)
        last = self._last.get(request.session_id)
        if last is None:  # a new session starts where consistent hashing puts it
            return next(i for i in self._ring.walk(request.session_id) if i in indexes)
        return next((i for i in indexes if i > last), indexes[0])

    def record(self, request: RouteRequest, replica: int) -> None:
        if request.session_id is not None:
            self._last[request.session_id] = replica
            self._last.move_to_end(request.session_id)
            if len(self._last) > self._max_sessions:
                self._last.popitem(last=False)


class PrefixIndex:
    """An LRU-bounded set of chained block hashes: the prompt prefixes sent somewhere.

    A chained hash stands for its whole prefix, so a match is the run of leading hashes
    present. Inserting touches a chain from its end back to its start, so a chain's head
    is always more recent than its tail and eviction trims prefixes from the end.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """The end of the run of hashes present from `start` on (how many leading hashes
        are present, from 0; read-only: no LRU touch). The walk runs in C: 8k hashes (a
        130k-token prompt) take ~0.3 ms, a Python loop took twice that."""
        run = takewhile(self._lru.__contains__, islice(hashes, start, None))
        return start + sum(1 for _ in run)

    def insert(self, hashes: Sequence[bytes]) -> None:
        lru, move_to_end = self._lru, self._lru.move_to_end  # 8k hashes per 130k-token prompt
        for h in reversed(hashes):
            lru[h] = None
            move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def discard(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._lru.pop(h, None)

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while len(self._lru) > capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


def common_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading blocks two prefixes of chained hashes share. A chained hash names
    its whole prefix, so two prefixes agree on block i exactly when they agree on every
    block up to i: the first disagreement is found by bisection."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # a[:low] == b[:low]; a[high] != b[high] or high is the shorter's end
        mid = (low + high) // 2
        if a[mid] == b[mid]:
            low = mid + 1
        else:
            high = mid
    return low


class InFlightPrefixes:
    """The prefixes of the requests in flight on one replica (a multiset: one prompt may be
    in flight twice). Adding and removing one is O(1) in its length (a 130k-token prompt
    has 8k hashes: a counter of hashes took ~10 ms of the router's event loop per
    request), and the blocks a prompt shares with any of them are a bisection each."""

    def __init__(self) -> None:
        self._prefixes: list[Sequence[bytes]] = []

    def add(self, prefix: Sequence[bytes]) -> None:
        if prefix:
            self._prefixes.append(prefix)

    def remove(self, prefix: Sequence[bytes]) -> None:
        """One occurrence of `prefix` (an equal one; the same object is found first)."""
        if prefix:
            self._prefixes.remove(prefix)

    def shared_blocks(self, prefix: Sequence[bytes]) -> int:
        """The most leading blocks `prefix` shares with a prefix in flight."""
        return max((common_blocks(prefix, p) for p in self._prefixes), default=0)


class CacheAware(Policy):
    """Five views per replica: its GPU cache as reported (and, until the next report,
    predicted from the prompts it answered), the prefixes of the requests it is computing,
    the prompt tokens those requests still have to compute (estimated when sent), whether
    it uses the pool, and its step's shape. One view of the pool: what replicas using it
    answered, bounded by its reported capacity and forgotten when it is cleared."""

    name = "cache-aware"
    uses_prefix = True

    def __init__(self, num_replicas: int, config: PolicyConfig) -> None:
        self._config = config
        self._n = num_replicas
        self._gpu = [PrefixIndex(config.replica_index_blocks) for _ in range(num_replicas)]
        # Prefixes of requests sent and not yet over: they are in the GPU cache by the time a
        # request behind them is admitted (or are being computed, which it can wait for).
        self._computing = [InFlightPrefixes() for _ in range(num_replicas)]
        self._uses_pool = [True] * num_replicas
        self._steps: list[StepShape | None] = [None] * num_replicas
        self._pool = PrefixIndex(config.pool_index_blocks)
        self._turn = 0
        # Prompt tokens to compute for requests sent and not yet answered, per replica, by
        # the (index, hash) of the first block each computes, in the order that work was
        # first sent (a replica prefills first come, first served). A request whose prefix
        # holds that block shares everything that work computes up to it (chained hashes)
        # and waits for it wherever it goes (in the replica, or through the pool): to it,
        # that work is its own, and only the work sent before its own is a queue.
        self._queued: list[OrderedDict[tuple[int, bytes], int]] = [
            OrderedDict() for _ in range(num_replicas)
        ]
        # Each started attempt's (first computed block, tokens), until answered or ended.
        # Keyed by the request object, which the router passes to started, answered, ended.
        self._work: dict[tuple[int, int], list[tuple[tuple[int, bytes], int]]] = {}

    def gpu_tokens(self, request: RouteRequest, replica: int) -> int:
        """Tokens of the leading blocks each in the replica's GPU cache or being computed
        there: past the blocks computing covers, those the cache holds."""
        prefix = request.prefix
        blocks = self._gpu[replica].match(prefix, self._computing[replica].shared_blocks(prefix))
        return blocks * request.block_tokens

    def pool_tokens(self, request: RouteRequest) -> int:
        tokens = self._pool.match(request.prefix) * request.block_tokens
        return tokens // self._config.chunk_tokens * self._config.chunk_tokens

    def queued_tokens(self, request: RouteRequest, replica: int) -> int:
        """Prompt tokens `replica` computes for other prefixes before `request`'s step: all
        its queued work, or, when the queue holds work this request shares, the work sent
        before that; at most one step's budget when the request would be short work there
        (it joins the next step, ahead of the long prefills)."""
        return self._queued_ahead(request, replica, self.gpu_tokens(request, replica))

    def _queued_ahead(self, request: RouteRequest, replica: int, gpu_tokens: int) -> int:
        """queued_tokens, given the request's `gpu_tokens` on that replica."""
        prefix = request.prefix
        ahead = 0
        for (index, block), work in self._queued[replica].items():
            if index < len(prefix) and prefix[index] == block:
                break
            ahead += work
        step = self._steps[replica]
        left = len(prefix) * request.block_tokens - gpu_tokens
        if step is not None and left <= step.short_work_tokens:
            return min(ahead, step.step_tokens)
        return ahead

    def score(self, request: RouteRequest, replica: ReplicaLoad, pool_tokens: int) -> float:
        gpu = self.gpu_tokens(request, replica.index)
        c = self._config
        pool = pool_tokens if self._uses_pool[replica.index] else 0
        return (
            gpu
            + c.pool_credit * max(0, pool - gpu)
            - c.load_penalty_tokens * replica.in_flight
            - c.queued_work_weight * self._queued_ahead(request, replica.index, gpu)
        )

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> int:
        pool = self.pool_tokens(request)
        self._turn += 1

        def rank(c: ReplicaLoad) -> tuple[float, int, int]:
            # Best score, then fewer in flight, then replicas in turn.
            return (self.score(request, c, pool), -c.in_flight, -((c.index - self._turn) % self._n))

        return max(candidates, key=rank).index

    def record(self, request: RouteRequest, replica: int) -> None:
        self._gpu[replica].insert(request.prefix)
        if self._uses_pool[replica]:
            self._pool.insert(request.prefix)

    def started(self, request: RouteRequest, replica: int) -> None:
        pool = self.pool_tokens(request) if self._uses_pool[replica] else 0
        first = max(self.gpu_tokens(request, replica), pool) // request.block_tokens
        if first < len(request.prefix):
            work = (len(request.prefix) - first) * request.block_tokens
            key = (first, request.prefix[first])
            self._work.setdefault((id(request), replica), []).append((key, work))
            queued = self._queued[replica]
            queued[key] = queued.get(key, 0) + work
        self._computing[replica].add(request.prefix)

    def answered(self, request: RouteRequest, replica: int) -> None:
        self._computed(request, replica)

    def _computed(self, request: RouteRequest, replica: int) -> None:
        """One started attempt's work is no longer queued (answered, or over)."""
        key = (id(request), replica)
        attempts = self._work.get(key)
        if not attempts:
            return
        block, work = attempts.pop()
        if not attempts:
            del self._work[key]
        queued = self._queued[replica]
        queued[block] -= work
        if queued[block] <= 0:
            del queued[block]

    def ended(self, request: RouteRequest, replica: int) -> None:
        self._computed(request, replica)
        self._computing[replica].remove(request.prefix)

    def observe(self, replica: int, update: CacheUpdate) -> None:
        gpu = self._gpu[replica]
        if update.snapshot:
            gpu.clear()
        gpu.discard(update.removed)
        gpu.insert(update.stored)
        self._uses_pool[replica] = update.uses_pool
        self._steps[replica] = update.step
        if update.pool_cleared:
            self._pool.clear()
        if update.pool_blocks is not None:
            self._pool.resize(min(update.pool_blocks, self._config.pool_index_blocks))

    def forget_replica(self, replica: int) -> None:
        self._gpu[replica].clear()

    def forget_pool(self) -> None:
        self._pool.clear()


POLICIES: tuple[str, ...] = ("round-robin", "session", "alternate", "least-load", "cache-aware")


def make_policy(name: str, num_replicas: int, config: PolicyConfig) -> Policy:
    if num_replicas < 1:
        raise ValueError("a router needs at least one replica")
    if name == RoundRobin.name:
        return RoundRobin()
    if name == LeastLoad.name:
        return LeastLoad(num_replicas)
    if name == Session.name:
        return Session(num_replicas, config)
    if name == Alternate.name:
        return Alternate(num_replicas, config)
    if name == CacheAware.name:
        return CacheAware(num_replicas, config)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
