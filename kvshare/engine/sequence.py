"""A request's state inside the engine: its tokens, its blocks and how far its KV reaches."""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field

import numpy as np

from kvshare.engine.block_manager import ROOT_HASH, block_hashes, salted_root
from kvshare.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class KVSources:
    """Where a request's prompt KV came from (reported as usage.kv)."""

    gpu_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    pool_remote_hit_tokens: int = 0  # of pool_hit_tokens: fetched from another host's pool
    computed_tokens: int = 0


@dataclass
class Sequence:
    """Invariant: the KV of token_ids[:num_computed_tokens] is in the blocks of block_table
    (a pool restore counts from its admission on: the compute stream is ordered after its
    copies, and the step that reads them keeps its results only if the restore verifies).

    The prompt comes as a list of ids (`prompt`, which becomes token_ids), or as its int32
    array alone (`prompt`: None, `prompt_array` given; the engine's way): token_ids is then
    built from the array when first read, by the step that computes the prompt. Admission
    reads only the array, so a pool restore's copies are issued before a 100k-token list
    of Python ints exists: it costs ~2 ms to build, and about as much again in every
    young-generation collection that still finds it there.

    block_table only grows while it is the same list: the scheduler extends it in place
    and replaces it whole (admission, release), never rewrites an entry. block_table_array
    relies on that to convert only the blocks added since its last call."""

    request_id: str
    prompt: InitVar[list[int] | None]
    params: SamplingParams
    cache_salt: str | None = None  # seeds the block hashes and pool keys: tenant isolation
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Sliding-window models: the sliding layers' blocks, parallel to block_table, real only
    # for the window (engine.sliding).
    sliding_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv: KVSources = field(default_factory=KVSources)
    first_token_time: float | None = None
    finish_reason: str | None = None
    text: str = ""
    num_preemptions: int = 0
    use_pool: bool = True  # False after a restore failed verification: recompute, never retry
    waited: bool = False  # admission waited for its prefix to be computed by another request
    # Times short work took the last free sequence slot while this (long) sequence waited
    # before it (scheduler.LAST_SLOT_PASSES bounds them).
    slots_lost: int = 0
    # Chained hashes of the full blocks of token_ids (GPU-local prefix cache keys), and
    # how many of this sequence's blocks are registered under them.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Hybrid models: the sequence's recurrent-state slot, and the chunk boundaries (token
    # counts) at which its state is snapshotted; prefill steps end exactly on them.
    state_slot: int | None = None
    snapshot_boundaries: tuple[int, ...] = ()
    # The prompt as int32, converted once (None: from `prompt` at construction): block
    # hashes and pool keys read it instead of converting a 100k-token list each time.
    prompt_array: np.ndarray | None = None
    # The prompt's ids then the generated ones; None until token_ids is first read when
    # the prompt came as prompt_array alone (nothing can be generated before that read).
    _token_ids: list[int] | None = field(default=None, init=False, repr=False)
    # (the block_table list converted, its int32 copy with room to grow, entries converted)
    _table_array: tuple[list[int], np.ndarray, int] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self, prompt: list[int] | None) -> None:
        if prompt is None:
            if self.prompt_array is None:
                raise ValueError("a sequence needs its prompt: a list of ids or prompt_array")
            self.num_prompt_tokens = len(self.prompt_array)
        else:
            self._token_ids = prompt
            self.num_prompt_tokens = len(prompt)
            if self.prompt_array is None:
                self.prompt_array = np.fromiter(prompt, dtype=np.int32, count=len(prompt))
        if (
            self.prompt_array.shape != (self.num_prompt_tokens,)
            or self.prompt_array.dtype != np.int32
        ):
            raise ValueError("prompt_array must be the prompt's token ids as int32")

    @property
    def token_ids(self) -> list[int]:
        """The prompt's ids, then the generated ones: the list that tokens are appended to."""
        if self._token_ids is None:
            assert self.prompt_array is not None
            self._token_ids = self.prompt_array.tolist()
        return self._token_ids

    def block_table_array(self) -> np.ndarray:
        """block_table as int32 (a view, valid until the table next changes). Each step
        reads it, and converting a 128k-token context's table (8k blocks) anew took ~145 us
        a sequence: only the blocks added to the same list since the last call are
        converted; a replaced list is converted whole."""
        table = self.block_table
        cached = self._table_array
        if cached is None or cached[0] is not table:
            array, done = np.empty(max(16, 2 * len(table)), dtype=np.int32), 0
        else:
            _, array, done = cached
            if len(table) > len(array):
                grown = np.empty(2 * len(table), dtype=np.int32)
                grown[:done] = array[:done]
                array = grown
        array[done : len(table)] = table[done:]
        self._table_array = (table, array, len(table))
        return array[: len(table)]

    def token_array(self) -> np.ndarray:
        """token_ids as an int32 array (the prompt's array while nothing was generated)."""
        assert self.prompt_array is not None
        if self.num_tokens == self.num_prompt_tokens:
            return self.prompt_array
        outputs = np.asarray(self.output_token_ids, dtype=np.int32)
        return np.concatenate((self.prompt_array, outputs))

    @property
    def num_tokens(self) -> int:
        if self._token_ids is None:
            return self.num_prompt_tokens
        return len(self._token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        if self._token_ids is None:
            return []
        return self._token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def update_block_hashes(self, block_size: int) -> None:
        full = self.num_tokens // block_size
        if full > len(self.block_hashes):
            parent = (
                self.block_hashes[-1]
                if self.block_hashes
                else salted_root(ROOT_HASH, self.cache_salt)
            )
            # full * block_size is every full block of token_ids; the prompt's array holds
            # them while they lie inside the prompt.
            inside_prompt = full * block_size <= self.num_prompt_tokens
            self.block_hashes += block_hashes(
                self.prompt_array if inside_prompt else self.token_ids,
                block_size,
                start=len(self.block_hashes),
                parent=parent,
            )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
