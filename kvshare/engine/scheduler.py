"""Continuous batching with chunked prefill under a token budget.

Each step the scheduler hands the runner (sequence, number of new tokens) pairs. Running
sequences go first, in arrival order, so decodes are never starved by long prefills;
waiting sequences are admitted while the token budget, the sequence limit and free
blocks allow. Admission reuses the GPU-local prefix cache, then asks the connector for
more (a pool restore puts the sequence in LOADING until the copy is verified). When
blocks run out, the most recently admitted running sequence is preempted: its blocks
are released and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.connector import KVConnector
from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.engine.sequence import Sequence, SequenceStatus


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


class Scheduler:
    """`states` (hybrid models) adds recurrent-state slots: a prefix is reused only up to a
    chunk boundary of `state_chunk_tokens` with a state snapshot, prefill steps end on the
    sequence's snapshot boundaries, and every admitted sequence holds one state slot."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 connector: KVConnector | None = None, states: RecurrentStates | None = None,
                 state_chunk_tokens: int = 256, snapshot_interval: int = 16384) -> None:
        self.config = config
        self.blocks = blocks
        self.connector = connector
        self.states = states
        self.state_chunk = state_chunk_tokens
        self.snapshot_interval = max(state_chunk_tokens, snapshot_interval // state_chunk_tokens * state_chunk_tokens)
        self.waiting: deque[Sequence] = deque()
        self.loading: dict[str, Sequence] = {}
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.loading) + len(self.running)

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
        elif seq.request_id in self.loading:
            del self.loading[seq.request_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        if self.connector is not None:
            self.connector.forget(seq.request_id)

    def _release_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0
        if self.states is not None and seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def collect_loads(self) -> None:
        """Move sequences whose pool restore finished into RUNNING (or back to compute)."""
        if self.connector is None:
            return
        for request_id, ok in self.connector.poll().items():
            seq = self.loading.pop(request_id, None)
            if seq is None:
                continue  # finished (aborted) while loading
            if ok:
                seq.num_computed_tokens += seq.kv.pool_hit_tokens
            else:
                seq.kv.pool_hit_tokens = 0
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted below to make room for an earlier sequence
            n = self._cap_at_snapshot(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self._reserve_blocks(seq, seq.num_computed_tokens + n):
                continue
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and self._num_admitted() < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            if seq.status is SequenceStatus.LOADING:
                continue
            n = self._cap_at_snapshot(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if not self._grow(seq, seq.num_computed_tokens + n):
                break  # cannot happen: _admit reserved the first chunk's blocks
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

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
                return cached[:boundary // bs], slot
            boundary -= self.state_chunk
        return [], None

    def _num_admitted(self) -> int:
        return len(self.running) + len(self.loading)

    def _reserve_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's blocks to num_tokens, preempting later sequences if needed."""
        while not self._grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free_blocks:
            return False
        seq.block_table += self.blocks.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
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

    def _admit(self, seq: Sequence) -> bool:
        """Give seq its cached prefix and the blocks of its first chunk; start a pool load.

        Hits never cover the last token: its logits are needed. Returns False (and leaves
        seq waiting, holding nothing) when the blocks do not fit yet.
        """
        bs = self.blocks.block_size
        usable = (seq.num_tokens - 1) // bs
        cached = self.blocks.match_prefix(seq.block_hashes[:usable])
        snapshot = None
        if self.states is not None:
            cached, snapshot = self._cut_at_snapshot(seq, cached)
        local_tokens = len(cached) * bs
        match = None
        if self.connector is not None:
            match = self.connector.match(seq.request_id, seq.token_ids, local_tokens)
        pool_tokens = match.num_tokens if match else 0
        first_chunk = min(seq.num_tokens - local_tokens - pool_tokens, self.config.max_num_batched_tokens)
        fresh = self.blocks.blocks_needed(local_tokens + pool_tokens + (0 if pool_tokens else first_chunk))
        fresh -= len(cached)
        # Cached blocks that are free still count as free until acquired.
        free_after = self.blocks.num_free_blocks - sum(self.blocks.ref_count[b] == 0 for b in cached)
        if fresh > free_after:
            if pool_tokens and self.connector is not None:
                self.connector.cancel(seq.request_id)
            return False
        self.blocks.acquire(cached)
        seq.block_table = cached + self.blocks.allocate(fresh)
        seq.num_computed_tokens = local_tokens
        if self.states is not None:
            self._take_state_slot(seq, snapshot)
        seq.kv.gpu_hit_tokens = local_tokens
        seq.kv.pool_hit_tokens = pool_tokens
        seq.num_registered_blocks = len(cached)
        if pool_tokens and self.connector is not None:
            self.connector.load(seq.request_id, seq.block_table, seq.state_slot)
            seq.status = SequenceStatus.LOADING
            self.loading[seq.request_id] = seq
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return True
