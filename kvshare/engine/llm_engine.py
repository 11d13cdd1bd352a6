"""The engine loop: admit requests, schedule, run the model, sample, detokenize, stop.

`LLMEngine.step()` is the one loop body: commit finished pool stores, schedule a batch
(admission may start pool restores), run it, register the blocks it completes, verify the
restores (dropping the results of any that failed, and their blocks' registration), hand
newly full chunks to the connector, sample, append tokens, and report what changed.
Callers (the offline `LLM`, the server's engine thread) drive it.

A failure that belongs to one request (its row of logits cannot be sampled, its token
cannot be appended) ends that request alone, with finish reason "error" and `error` set;
the other requests of the batch go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kvshare.engine.block_manager import BlockManager, check_cache_salt, prompt_block_hashes
from kvshare.engine.config import EngineConfig
from kvshare.engine.connector import KVConnector, PagedKVCache
from kvshare.engine.model_runner import ModelRunner
from kvshare.engine.sampler import sample
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from kvshare.engine.sequence import Sequence
from kvshare.engine.sliding import SlidingBlocks
from kvshare.models.loader import LoadedModel
from kvshare.models.tokenizer import IncrementalDetokenizer
from kvshare.spec import DEFAULT_CHUNK_TOKENS

_log = logging.getLogger(__name__)

# (token id, log-probability) of the most likely tokens at one step, most likely first.
TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step. `new_token_ids`/`new_text` are this step's delta."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    gpu_hit_tokens: int
    pool_hit_tokens: int
    computed_tokens: int
    arrival_time: float
    first_token_time: float | None
    logprobs: tuple[float, ...] = ()  # of token_ids, when the request asked for them
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one per token_ids, when asked for
    error: str | None = None  # why the request failed (finish_reason "error")
    pool_remote_hit_tokens: int = 0  # of pool_hit_tokens: fetched from another host's pool

    @property
    def cached_tokens(self) -> int:
        return self.gpu_hit_tokens + self.pool_hit_tokens


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    emitted_text: int = 0  # characters of seq.text already reported
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    error: str | None = None
    # Every output carries the prompt: built once, by the first output (after the step
    # that admitted the request: never before its pool load is issued).
    prompt: tuple[int, ...] | None = None

    def prompt_ids(self) -> tuple[int, ...]:
        if self.prompt is None:
            self.prompt = tuple(self.seq.token_ids[: self.seq.num_prompt_tokens])
        return self.prompt


class _Registered(NamedTuple):
    """Blocks one step made findable for one sequence: ids, their hashes, sliding entries."""

    blocks: list[int]
    hashes: list[bytes]
    sliding: list[int]


# A prompt as add_request takes it: ids, or an integer array of them (the replica server's
# int32 array, checked and converted once per request).
PromptIds = list[int] | tuple[int, ...] | np.ndarray


def prompt_array(token_ids: PromptIds, vocab_size: int) -> np.ndarray | None:
    """The token ids as int32 when every one is in [0, vocab_size), else None (one pass in
    C: min() and max() over a 100k-token list take milliseconds each). The replica server
    checks a request's prompt with it, and the engine again (its callers are not all
    servers)."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            return None
        ids = token_ids
    else:
        try:
            ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        except OverflowError:
            return None
    if ids.min() < 0 or ids.max() >= vocab_size:
        return None
    return ids.astype(np.int32)


class LLMEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        chunk_tokens = connector.chunk_tokens if connector is not None else None
        self.runner = ModelRunner(
            loaded,
            config,
            connector.device_bytes if connector is not None else None,
            chunk_tokens,
        )
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, None, config.enable_prefix_caching
        )
        self.sliding: SlidingBlocks | None = None
        if self.runner.num_sliding_blocks:
            assert loaded.config.sliding_window is not None
            self.sliding = SlidingBlocks(
                self.runner.num_sliding_blocks,
                config.block_size,
                loaded.config.sliding_window,
                chunk_tokens,
                config.enable_prefix_caching,
            )
        self.max_model_len = self.runner.max_model_len
        self.connector = connector
        if connector is not None:
            connector.bind(
                PagedKVCache(
                    self.runner.layout,
                    self.blocks,
                    self.runner.states,
                    self.sliding,
                    self.runner.fences,
                )
            )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len),
            self.blocks,
            connector,
            self.runner.states,
            connector.chunk_tokens if connector is not None else DEFAULT_CHUNK_TOKENS,
            config.snapshot_interval_tokens,
            self.sliding,
        )
        self.generator = torch.Generator(device=self.runner.device).manual_seed(config.seed)
        self.requests: dict[str, _Request] = {}
        self._finished_outputs: list[RequestOutput] = []
        self._eos = frozenset(loaded.config.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: PromptIds,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for an empty, too long or out-of-vocab prompt,
        or a malformed `cache_salt` (see `check_cache_salt`).

        `cache_salt` isolates the request's prefix cache: it shares GPU blocks and pool
        chunks only with requests of the same salt (None: with the other unsalted ones).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cache_salt = check_cache_salt(cache_salt)
        if not len(prompt_token_ids):
            raise ValueError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        prompt = prompt_array(prompt_token_ids, vocab)
        if prompt is None:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(request_id, None, params, cache_salt, prompt_array=prompt)
        self.scheduler.add(seq)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self._eos
        )
        self.requests[request_id] = _Request(seq, detok, generator, stop_ids)

    @property
    def hint_tokens(self) -> int:
        """How many of a prompt's first tokens `hint_prompt_head` needs (0: hints do
        nothing here: no pool, or a transfer that starts no copies ahead)."""
        return self.connector.hint_tokens() if self.connector is not None else 0

    def hint_prompt_head(self, token_ids: PromptIds, cache_salt: str | None = None) -> bool:
        """The first tokens of a prompt whose request is still being read (a server parsing
        a long body): start its restore's first copies now (KVConnector.hint). Only on an
        idle engine (a busy one's copies and staging are its running requests') whose GPU
        cache lacks the prompt's first chunk (else the restore starts past the head). The
        ids and salt are unchecked: wrong ones make no hint, and their request fails when
        it is added. True: copies were started."""
        if self.connector is None or self.has_unfinished() or not len(token_ids):
            return False
        try:
            salt = check_cache_salt(cache_salt)
        except ValueError:
            return False
        ids = prompt_array(token_ids, self.loaded.config.vocab_size)
        if ids is None:
            return False
        chunk, bs = self.connector.chunk_tokens, self.config.block_size
        local = self.blocks.match_prefix(prompt_block_hashes(ids[: max(chunk, bs)], bs, salt))
        if len(local) * bs >= chunk:
            return False
        return self.connector.hint(ids, salt)

    def drop_hint(self) -> None:
        """Let go of a hint no request took (KVConnector.drop_hint)."""
        if self.connector is not None:
            self.connector.drop_hint()

    @property
    def holds_hint(self) -> bool:
        return self.connector is not None and self.connector.holds_hint

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def commit_pool_stores(self) -> None:
        """The engine just went idle (a server with no request left, an offline call about
        to return): finish the pool stores still in flight and commit them.

        Stores are committed by the connector's poll, which runs only inside a step; an
        idle engine takes none, so the last chunks of the last request would stay invisible
        to the other replicas until the next request came. With no request unfinished, no
        pool load can be pending for the scheduler, so polling here loses nothing. A store
        that fails is skipped and logged: the pool never fails a request.
        """
        if self.connector is None:
            return
        try:
            self.connector.wait_idle()
        except Exception:
            _log.exception("finishing pool stores failed")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._finished_outputs)

    def reset_prefix_cache(self) -> int:
        if self.runner.states is not None:
            self.runner.states.reset_snapshots()
        if self.sliding is not None:
            self.sliding.reset_prefix_cache()
        return self.blocks.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        if self.connector is not None:
            self.connector.poll()
        chunks = self.scheduler.schedule()
        outputs, self._finished_outputs = self._finished_outputs, []
        if not chunks:
            return outputs
        prefill_tokens = sum(c.num_new_tokens for c in chunks if not c.seq.prefill_done)
        started = time.perf_counter()
        logits = self.runner.execute(chunks)
        sampling = [c for c in chunks if c.samples]
        # Host work before the restores are waited for, so that their copies (and the step)
        # hide it: registering the blocks of a long restored prefix (9 ms for 16k blocks on
        # an H100's host) and the prompt tuple of a first output.
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_new_tokens
        restoring = {seq.request_id for seq in self.scheduler.restoring}
        registered = self._register(chunks)
        for chunk in sampling:
            self.requests[chunk.seq.request_id].prompt_ids()
        # Nothing computed from a restore counts before the restore is verified, and a failed
        # one draws no sample: a seeded request's tokens must not depend on the pool. Its
        # blocks, registered above, are found by nothing before their hashes go again here
        # (the engine loop is the prefix cache's only reader), and nothing unverified stays
        # findable when verifying itself fails.
        try:
            failed = self.scheduler.finish_restores()
        except BaseException:
            self._forget(registered, restoring)
            raise
        if failed:
            self._forget(registered, failed)
            kept = [i for i, c in enumerate(sampling) if c.seq.request_id not in failed]
            sampling = [sampling[i] for i in kept]
            logits = logits[kept] if logits is not None else None
            chunks = [c for c in chunks if c.seq.request_id not in failed]
        self._store(chunks)
        tokens = []
        if logits is not None:
            tokens = sample(
                logits,
                [c.seq.params for c in sampling],
                [self.requests[c.seq.request_id].generator for c in sampling],
                self.generator,
            )
        if self.connector is not None and prefill_tokens:  # sampling waited for the step
            self.connector.observe_prefill(prefill_tokens, time.perf_counter() - started)
        logprobs = self._logprobs(logits, sampling, tokens)
        now = time.monotonic()
        for chunk, token, logprob in zip(sampling, tokens, logprobs):
            req = self.requests[chunk.seq.request_id]
            if token is None:
                outputs.append(
                    self._fail(
                        req,
                        "the model's next-token distribution for this "
                        "request holds NaN or inf: it cannot be sampled",
                    )
                )
                continue
            if logprob is not None:
                req.logprobs.append(logprob[0])
                req.top_logprobs.append(logprob[1])
            outputs.append(self._append_or_fail(req, token, now))
        return outputs

    def _append_or_fail(self, req: _Request, token: int, now: float) -> RequestOutput:
        try:
            return self._append_token(req, token, now)
        except Exception as exc:  # a bug met by one request's token or text: that request ends
            _log.exception("request %s failed while appending token %d", req.seq.request_id, token)
            return self._fail(req, f"{type(exc).__name__}: {exc}")

    def _fail(self, req: _Request, error: str) -> RequestOutput:
        """End one request with finish reason "error"; its blocks are freed."""
        _log.warning("request %s failed: %s", req.seq.request_id, error)
        req.error = error
        if req.seq.request_id in self.requests:  # not yet finished by the step that failed
            self._finish(req, "error", emit=False)
        req.seq.finish_reason = "error"
        return self._output(req, ())

    @staticmethod
    def _logprobs(
        logits: torch.Tensor | None, sampling: list[ScheduledChunk], tokens: list[int | None]
    ) -> list[tuple[float, TopLogprobs] | None]:
        """Per sampled row that asked: the chosen token's log-probability and the top ones,
        from the raw model distribution (before temperature, top-k and top-p)."""
        wanted = [
            i for i, c in enumerate(sampling) if c.seq.params.logprobs and tokens[i] is not None
        ]
        out: list[tuple[float, TopLogprobs] | None] = [None] * len(sampling)
        if not wanted or logits is None:
            return out
        rows = torch.log_softmax(logits[wanted].float(), dim=-1)
        chosen = torch.tensor([tokens[i] for i in wanted], device=rows.device)
        values = rows.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(sampling[i].seq.params.top_logprobs for i in wanted)
        top_values, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
        for j, (i, value) in enumerate(zip(wanted, values)):
            n = sampling[i].seq.params.top_logprobs
            out[i] = (value, tuple(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())))
        return out

    def _register(self, chunks: list[ScheduledChunk]) -> dict[str, _Registered]:
        """Make the full blocks the chunks' sequences have computed findable by their
        hashes; returns, per request, what this call registered (for `_forget`)."""
        bs = self.config.block_size
        registered = {}
        for chunk in chunks:
            seq = chunk.seq
            full = seq.num_computed_tokens // bs
            if full <= seq.num_registered_blocks:
                continue
            start = seq.num_registered_blocks
            done = _Registered(
                seq.block_table[start:full],
                seq.block_hashes[start:full],
                seq.sliding_table[start:full] if self.sliding is not None else [],
            )
            self.blocks.register(done.blocks, done.hashes)
            if self.sliding is not None:
                self.sliding.register(done.sliding, done.hashes)
            seq.num_registered_blocks = full
            registered[seq.request_id] = done
        return registered

    def _forget(self, registered: dict[str, _Registered], failed: set[str]) -> None:
        """Take back what `_register` made findable for the failed restores' sequences."""
        for request_id in failed & registered.keys():
            done = registered[request_id]
            self.blocks.forget(done.blocks, done.hashes)
            if self.sliding is not None:
                self.sliding.forget(done.sliding, done.hashes)

    def _store(self, chunks: list[ScheduledChunk]) -> None:
        """Hand newly full chunks to the connector and snapshot state at chunk boundaries."""
        for chunk in chunks:
            seq = chunk.seq
            if self.connector is not None:
                self.connector.store(
                    seq.request_id,
                    seq.token_ids,
                    seq.block_table,
                    seq.num_computed_tokens,
                    cache_salt=seq.cache_salt,
                    sliding_table=seq.sliding_table,
                )
            if seq.num_computed_tokens in seq.snapshot_boundaries:
                self._snapshot(seq)

    def _snapshot(self, seq: Sequence) -> None:
        """Keep the state at this chunk boundary (GPU-local reuse) and store it in the pool."""
        states = self.runner.states
        assert states is not None and seq.state_slot is not None
        boundary = seq.num_computed_tokens
        slot = states.snapshot(
            seq.block_hashes[boundary // self.config.block_size - 1], seq.state_slot
        )
        if slot is not None and self.connector is not None:
            self.connector.store_state(
                seq.request_id, seq.token_ids, boundary, slot, cache_salt=seq.cache_salt
            )

    def _append_token(self, req: _Request, token: int, now: float) -> RequestOutput:
        seq = req.seq
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.kv.computed_tokens = (
                seq.num_prompt_tokens - seq.kv.gpu_hit_tokens - seq.kv.pool_hit_tokens
            )
        seq.token_ids.append(token)
        seq.update_block_hashes(self.config.block_size)
        reason = None
        if token in req.stop_ids:
            # A stop token ends the text before itself.
            reason = "stop"
            seq.text += req.detokenizer.flush() if req.detokenizer else ""
        elif req.detokenizer:
            seq.text += req.detokenizer.feed(token)
        if reason is None and seq.params.stop:
            reason = self._check_stop_strings(req)
        if reason is None and (
            seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
            seq.text += req.detokenizer.flush() if req.detokenizer else ""
        if reason is not None:
            self._finish(req, reason, emit=False)
        return self._output(req, (token,))

    def _check_stop_strings(self, req: _Request) -> str | None:
        seq = req.seq
        # Only text near the end can hold a stop string that just completed.
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, req.emitted_text - longest)
        # The earliest match wins (one new piece of text may complete several stop strings).
        found = [
            (at, len(stop))
            for stop in seq.params.stop
            if (at := seq.text.find(stop, search_from)) >= 0
        ]
        if not found:
            return None
        at, length = min(found)
        seq.text = seq.text[: at + length if seq.params.include_stop_str_in_output else at]
        return "stop"

    def _finish(self, req: _Request, reason: str, emit: bool = True) -> None:
        self.scheduler.finish(req.seq, reason)
        del self.requests[req.seq.request_id]
        if emit:
            self._finished_outputs.append(self._output(req, ()))

    def _output(self, req: _Request, new_tokens: tuple[int, ...]) -> RequestOutput:
        seq = req.seq
        # Hold back text that may be the start of a stop string until it is decided.
        visible = len(seq.text)
        if seq.params.stop and not seq.is_finished:
            visible = max(
                req.emitted_text, len(seq.text) - max(len(s) for s in seq.params.stop) + 1
            )
        new_text = seq.text[req.emitted_text : visible]
        req.emitted_text = visible
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=req.prompt_ids(),
            token_ids=tuple(seq.output_token_ids),
            text=seq.text[:visible],
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            gpu_hit_tokens=seq.kv.gpu_hit_tokens,
            pool_hit_tokens=seq.kv.pool_hit_tokens,
            computed_tokens=seq.kv.computed_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            logprobs=tuple(req.logprobs),
            top_logprobs=tuple(req.top_logprobs),
            error=req.error,
            pool_remote_hit_tokens=seq.kv.pool_remote_hit_tokens,
        )
