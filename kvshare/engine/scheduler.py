"""Continuous batching with chunked prefill under a token budget.

Each step the scheduler hands the runner (sequence, number of new tokens) pairs. Short
work goes first: running sequences with at most 1/SHORT_WORK_SHARE of the step's token
budget left to compute (decodes, the tail of a prefill), then waiting sequences whose
GPU-cached prefix leaves that little (a question about a document this replica holds).
Each adds a few tokens to the step and gets its first token in it, instead of after
every long prefill ahead of it: with a long prefill running, a cached question would
otherwise wait for all of it (on the H200, with four 16k-token documents queued per
replica, every question's first token came at the end, ~20 s). Then the long work:
running sequences in arrival order, then waiting ones, while the token budget, the
sequence limit and free blocks allow (short work takes the last free sequence slot from a
long sequence that came before it at most LAST_SLOT_PASSES times). When blocks run out,
the most recently admitted running sequence not yet scheduled in this step is preempted:
its blocks are released and it is recomputed later.

Admission reuses the GPU-local prefix cache, then asks the connector for more. A pool
restore is optimistic: the sequence's new tokens are scheduled in the same step, the
compute stream ordered after the copies, so the step does not wait for the host to see
the copy end. Its results count only once `finish_restores` has verified the bytes; a
restore that fails verification is discarded with everything computed from it and the
sequence is recomputed without the pool. Sequences decoding in that step wait for the
copy too (one compute stream): one step as long as the copy, far less than the prefill
the restore replaces. A hybrid model's restored state is copied aside before the step
moves it on, and kept as a snapshot at its boundary once the restore is verified: the
next request with that prefix then resumes on the GPU. Without it the prefix's KV blocks
would be cached but no state to resume from, and that request would load the prefix
again, or recompute it once the pool has evicted the page.

Compute a prefix once. A waiting sequence whose next uncached block a running sequence
is about to compute (same chained block hash, inside that sequence's prompt, not yet
computed) is not admitted: it waits, holding nothing, and the sequences queued behind it
go ahead. Every step it is checked again; the writer's blocks enter the prefix cache as
they are computed, so the waiter finds them there and waits for the next one, until no
running sequence computes its next block (the writer passed the shared prefix, finished,
was preempted or aborted) and it is admitted with everything the writer left. A waiter
is never running, so waits form no cycle, and running sequences always progress. The
same holds across replicas through the connector (`PoolMatch.wait`): it asks the
scheduler to leave the sequence waiting, and is asked again at later steps. No waiting
without prefix caching (nothing to find afterwards). With recurrent state a prefix is
resumable only at a snapshot: the waiter waits for the last chunk boundary inside the
part it shares with the writer, and the writer, not yet there, is told to snapshot at it.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.connector import KVConnector
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.engine.sequence import Sequence, SequenceStatus
from kvshare.engine.sliding import SlidingBlocks
from kvshare.spec import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens: sample the next."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


# Short work: at most this share of the step's token budget left to compute.
SHORT_WORK_SHARE = 16


# How often short work may take the last free sequence slot from a long sequence waiting
# before it: a bound on how long a stream of short requests can keep it out. Holding the
# slot from the first pass kept a document's cached questions behind the next document's
# whole prefill (the H200's 32-user shared-prefix run: median 15.6 s -> 18.1 s); a
# document's questions come in groups, and one pass still held some of them back
# (tests/engine/test_scheduler.py replays one replica's share of that run).
LAST_SLOT_PASSES = 2


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no_room"  # blocks do not fit yet: admission stops here (first come first served)
    WAITS = "waits"  # its prefix is being computed: the sequences behind it may go first
    LONG = "long"  # more than the short work limit to compute: admitted after the long work


class Scheduler:
    """`states` (hybrid models) adds recurrent-state slots: a prefix is reused only up to a
    chunk boundary of `state_chunk_tokens` with a state snapshot, prefill steps end on the
    sequence's snapshot boundaries, and every admitted sequence holds one state slot.
    `sliding` (sliding-window models) gives each sequence the sliding layers' blocks of its
    window: a prefix is reused only as far as its window is cached, and a step that finds
    no free sliding block preempts like one that finds no global block."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        connector: KVConnector | None = None,
        states: RecurrentStates | None = None,
        state_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        snapshot_interval: int = 16384,
        sliding: SlidingBlocks | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.sliding = sliding
        self.connector = connector
        self.states = states
        self.state_chunk = state_chunk_tokens
        self.snapshot_interval = max(
            state_chunk_tokens, snapshot_interval // state_chunk_tokens * state_chunk_tokens
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.restoring: list[Sequence] = []  # admitted this step with an unverified pool restore
        # request id -> (boundary hash, slot) of the copy of its unverified restored state
        self.restored_states: dict[str, tuple[bytes, int]] = {}
        # local_waits: sequences that waited for a running sequence's blocks (each once);
        # pool_waits: sequences the connector had wait for chunks produced elsewhere.
        self.counters: Counter[str] = Counter()

    @property
    def short_work_tokens(self) -> int:
        """Tokens left to compute that make a sequence short work (scheduled first)."""
        return max(1, self.config.max_num_batched_tokens // SHORT_WORK_SHARE)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        if self.blocks.blocks_needed(seq.num_tokens + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens does not fit in the KV cache "
                f"({self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens)"
            )
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens; this model accepts at most "
                f"{self.config.max_model_len - 1}"
            )
        seq.update_block_hashes(self.blocks.block_size)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq wherever it is and release its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.restoring:
            self.restoring.remove(seq)
            self._settle_restored_state(seq, verified=False)
        if self.connector is not None:  # ends a restore in flight before its blocks go
            self.connector.forget(seq.request_id)
        self._release_blocks(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if self.sliding is not None:
            self.sliding.release(seq.sliding_table)
            seq.sliding_table = []
        seq.num_registered_blocks = 0
        if self.states is not None and seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def finish_restores(self) -> set[str]:
        """Verify this step's pool restores (after the step's compute was issued); returns the
        ids of sequences whose restore failed: their step results must be dropped. They go
        back to the queue's front to be recomputed without the pool."""
        failed = set()
        for seq in self.restoring:
            assert self.connector is not None
            verified = self.connector.finish_load(seq.request_id)
            self._settle_restored_state(seq, verified)
            if verified:
                continue
            failed.add(seq.request_id)
            seq.use_pool = False
            self.running.remove(seq)
            self._requeue(seq)
        self.restoring = []
        return failed

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        if self.states is not None and self.blocks.enable_prefix_caching:
            # Before the running sequences' steps are sized: a writer about to pass the
            # snapshot a queued sequence needs must stop there, budget or not.
            for seq in self.waiting:
                self._snapshot_ahead(seq, 0)
        budget = self.config.max_num_batched_tokens
        short = self.short_work_tokens
        budget = self._schedule_running(chunks, budget, max_left=short)
        budget = self._admit_waiting(chunks, budget, max_left=short)
        budget = self._schedule_running(chunks, budget, max_left=None)
        self._admit_waiting(chunks, budget, max_left=None)
        return chunks

    def _schedule_running(
        self, chunks: list[ScheduledChunk], budget: int, max_left: int | None
    ) -> int:
        """Chunks for the running sequences not scheduled yet (with at most `max_left`
        tokens left, when given), in arrival order; returns the budget left."""
        scheduled = {id(c.seq) for c in chunks}
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or id(seq) in scheduled:
                continue  # preempted to make room for an earlier sequence, or in the step already
            left = seq.num_tokens - seq.num_computed_tokens
            if max_left is not None and left > max_left:
                continue
            n = self._cap_at_snapshot(seq, min(left, budget))
            if not self._reserve_blocks(seq, seq.num_computed_tokens + n, scheduled):
                continue
            chunks.append(ScheduledChunk(seq, n))
            scheduled.add(id(seq))
            budget -= n
        return budget

    def _admit_waiting(
        self, chunks: list[ScheduledChunk], budget: int, max_left: int | None
    ) -> int:
        """Admit waiting sequences in order (only those whose GPU-cached prefix leaves at
        most `max_left` tokens, when given) and schedule their first chunks."""
        # Short work may take the last free sequence slot from a long sequence that came
        # before it LAST_SLOT_PASSES times; after that the next free slot is the long
        # one's (a stream of short requests could otherwise keep it out for good).
        passed: Sequence | None = None  # the first long sequence passed over
        for seq in list(self.waiting):
            reserved = 1 if passed is not None and passed.slots_lost >= LAST_SLOT_PASSES else 0
            free = self.config.max_num_seqs - self._num_admitted()
            if budget == 0 or free <= reserved:
                break
            admission = self._admit(seq, max_left)
            if admission is Admission.LONG:
                passed = passed or seq
                continue
            if admission is Admission.WAITS:
                continue
            if admission is Admission.NO_ROOM:
                break
            self.waiting.remove(seq)
            if passed is not None and free == 1:
                passed.slots_lost += 1
            n = self._cap_at_snapshot(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self._grow(seq, seq.num_computed_tokens + n):
                break  # cannot happen: _admit reserved the first chunk's blocks
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return budget

    @staticmethod
    def _cap_at_snapshot(seq: Sequence, n: int) -> int:
        """Shorten a step so that it ends on the next snapshot boundary it would cross."""
        for boundary in seq.snapshot_boundaries:
            if seq.num_computed_tokens < boundary < seq.num_computed_tokens + n:
                return boundary - seq.num_computed_tokens
        return n

    def _snapshot_boundaries(self, seq: Sequence) -> tuple[int, ...]:
        """Every snapshot_interval tokens, and the prompt's last chunk boundary (where a
        follow-up turn that resends this prompt resumes)."""
        last = seq.num_tokens // self.state_chunk * self.state_chunk
        every = range(self.snapshot_interval, last, self.snapshot_interval)
        return tuple(b for b in (*every, last) if b > seq.num_computed_tokens)

    def _cut_at_snapshot(self, seq: Sequence, cached: list[int]) -> tuple[list[int], int | None]:
        """The cached prefix cut back to its last chunk boundary with a state snapshot."""
        assert self.states is not None
        bs = self.blocks.block_size
        boundary = len(cached) * bs // self.state_chunk * self.state_chunk
        while boundary > 0:
            slot = self.states.find(seq.block_hashes[boundary // bs - 1])
            if slot is not None:
                return cached[: boundary // bs], slot
            boundary -= self.state_chunk
        return [], None

    def _num_admitted(self) -> int:
        return len(self.running)

    def _reserve_blocks(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Grow seq's blocks to num_tokens, preempting later sequences if needed (never
        one already in this step: the ids in `scheduled`)."""
        while not self._grow(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for seq's step from num_computed_tokens to num_tokens; False (nothing
        taken) when they are not free."""
        new_len = self.blocks.blocks_needed(num_tokens)
        need = new_len - len(seq.block_table)
        start, sliding = seq.num_computed_tokens, self.sliding
        if sliding is not None:
            sliding.trim(seq.sliding_table, start)
            if sliding.needed(len(seq.sliding_table), new_len, start) > sliding.num_free_blocks:
                return False
        if need > self.blocks.num_free_blocks:
            return False
        if need > 0:
            seq.block_table += self.blocks.allocate(need)
        if sliding is not None:
            sliding.extend(seq.sliding_table, len(seq.block_table), start)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Back to the front of the queue holding nothing: recomputed from its prompt."""
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _take_state_slot(self, seq: Sequence, snapshot: int | None) -> None:
        """A state slot for seq: the snapshot's state when resuming from one, else zeros."""
        assert self.states is not None
        if snapshot is not None:
            self.states.pin(snapshot)  # allocate() may evict unpinned snapshots
        seq.state_slot = self.states.allocate()
        if snapshot is not None:
            self.states.restore(snapshot, seq.state_slot)
            self.states.unpin(snapshot)
        seq.snapshot_boundaries = self._snapshot_boundaries(seq)

    def _copy_restored_state(self, seq: Sequence, boundary: int) -> None:
        """Copy the state seq's load restores (at `boundary`) aside before its step moves
        it on; the load ordered the current stream after the state's copy, so this copy
        reads the restored bytes. It is not found before `_settle_restored_state`."""
        if self.states is None or seq.state_slot is None:
            return
        key = seq.block_hashes[boundary // self.blocks.block_size - 1]
        if self.states.find(key) is not None:
            return
        slot = self.states.copy_aside(seq.state_slot)
        if slot is not None:
            self.restored_states[seq.request_id] = (key, slot)

    def _settle_restored_state(self, seq: Sequence, verified: bool) -> None:
        """Keep the copy of seq's restored state as a snapshot if the restore was verified;
        else free it (a recompute of the prefix must snapshot its own state there)."""
        entry = self.restored_states.pop(seq.request_id, None)
        if entry is None:
            return
        assert self.states is not None
        key, slot = entry
        if verified:
            self.states.keep(key, slot)
        else:
            self.states.drop_aside(slot)

    def _computed_by_another(self, seq: Sequence, block: int) -> bool:
        """A running sequence will compute seq's block `block` (equal chained hash) in its
        prompt. A block it restores from the pool this step does not count: seq restores
        it too, into blocks of its own (a restore is a copy, not a prefill)."""
        if block >= (seq.num_tokens - 1) // self.blocks.block_size:
            return False  # never cached: the last token's logits are needed
        if not self.blocks.enable_prefix_caching:
            return False
        if self.states is not None:
            return self._snapshot_ahead(seq, block)
        wanted = seq.block_hashes[block]
        bs = self.blocks.block_size
        return any(
            other.num_computed_tokens // bs <= block < other.num_prompt_tokens // bs
            and other.block_hashes[block] == wanted
            for other in self.running
        )

    def _snapshot_ahead(self, seq: Sequence, block: int) -> bool:
        """Recurrent state: a running sequence shares seq's prompt past block `block` (where
        seq's cached prefix ends) up to a chunk boundary it has not computed yet. It will
        snapshot there (added to its boundaries), and seq resumes from that snapshot."""
        bs = self.blocks.block_size
        usable = (seq.num_tokens - 1) // bs
        for other in self.running:
            shared = _shared_blocks(
                seq.block_hashes, other.block_hashes, min(usable, other.num_prompt_tokens // bs)
            )
            boundary = shared * bs // self.state_chunk * self.state_chunk
            if boundary <= block * bs or other.num_computed_tokens >= boundary:
                continue
            if boundary not in other.snapshot_boundaries:
                other.snapshot_boundaries = tuple(sorted((*other.snapshot_boundaries, boundary)))
            return True
        return False

    def _wait(self, seq: Sequence, counter: str) -> Admission:
        if not seq.waited:
            seq.waited = True
            self.counters[counter] += 1
        return Admission.WAITS

    def _admit(self, seq: Sequence, max_left: int | None = None) -> Admission:
        """Give seq its cached prefix and the blocks of its first chunk; start a pool load.

        Hits never cover the last token: its logits are needed. Leaves seq waiting,
        holding nothing, when its next blocks are being computed (here, or elsewhere and
        the connector says wait), when the blocks do not fit yet, or when its GPU-cached
        prefix leaves more than `max_left` tokens to compute (the pool is not asked then:
        a lookup claims chunks and counts misses, once per admission).
        """
        bs = self.blocks.block_size
        usable = (seq.num_tokens - 1) // bs
        cached = self.blocks.match_prefix(seq.block_hashes[:usable])
        snapshot = None
        if self.states is not None:
            cached, snapshot = self._cut_at_snapshot(seq, cached)
        sliding_table: list[int] = []
        if self.sliding is not None:
            num_cached, sliding_table = self.sliding.match(seq.block_hashes[: len(cached)])
            cached = cached[:num_cached]
        if max_left is not None and seq.num_tokens - len(cached) * bs > max_left:
            return Admission.LONG
        if self._computed_by_another(seq, len(cached)):
            return self._wait(seq, "local_waits")
        local_tokens = len(cached) * bs
        match = None
        if self.connector is not None and seq.use_pool:
            match = self.connector.match(
                seq.request_id,
                seq.token_array(),
                local_tokens,
                cache_salt=seq.cache_salt,
                snapshot_tokens=self._snapshot_boundaries(seq) if self.states is not None else (),
            )
            if match.wait:
                return self._wait(seq, "pool_waits")
        pool_tokens = match.num_tokens if match else 0
        # The first chunk's blocks too: a restored sequence computes in its admission step.
        first_chunk = min(
            seq.num_tokens - local_tokens - pool_tokens, self.config.max_num_batched_tokens
        )
        resume = local_tokens + pool_tokens
        new_len = self.blocks.blocks_needed(resume + first_chunk)
        fresh = new_len - len(cached)
        # Cached blocks that are free still count as free until acquired.
        free_after = self.blocks.num_free_blocks - sum(
            self.blocks.ref_count[b] == 0 for b in cached
        )
        sliding_short = self.sliding is not None and self.sliding.needed(
            len(sliding_table), new_len, resume
        ) > self.sliding.num_free_blocks - self.sliding.num_free_among(sliding_table)
        if fresh > free_after or sliding_short:
            if pool_tokens and self.connector is not None:
                self.connector.cancel(seq.request_id)
            return Admission.NO_ROOM
        self.blocks.acquire(cached)
        seq.block_table = cached + self.blocks.allocate(fresh)
        if self.sliding is not None:
            # The window before `resume`: cached, or restored by the load (null below it).
            self.sliding.acquire(sliding_table)
            self.sliding.extend(sliding_table, new_len, resume)
            self.sliding.trim(sliding_table, resume)
            seq.sliding_table = sliding_table
        seq.num_computed_tokens = local_tokens
        if self.states is not None:
            self._take_state_slot(seq, snapshot)
        seq.num_registered_blocks = len(cached)
        if pool_tokens and self.connector is not None:
            if self.connector.load(
                seq.request_id, seq.block_table, seq.state_slot, seq.sliding_table
            ):
                self.restoring.append(seq)
                self._copy_restored_state(seq, local_tokens + pool_tokens)
            elif self.sliding is not None:
                # Its sliding table expected the restore (null before the restored window):
                # admit it again, computed without the pool.
                self._release_blocks(seq)
                seq.num_computed_tokens = 0
                seq.use_pool = False
                return Admission.NO_ROOM
            else:
                pool_tokens = 0
        seq.kv.gpu_hit_tokens = local_tokens
        seq.kv.pool_hit_tokens = pool_tokens
        seq.kv.pool_remote_hit_tokens = match.remote_tokens if pool_tokens and match else 0
        seq.num_computed_tokens = local_tokens + pool_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return Admission.ADMITTED


def _shared_blocks(a: list[bytes], b: list[bytes], limit: int) -> int:
    """How many leading blocks two sequences share, up to `limit`. Block hashes are
    chained (each covers every token before it), so equality at i implies it below i."""
    lo, hi = 0, min(limit, len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
