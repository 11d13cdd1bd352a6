"""The engine on its own thread, fed by a command queue; outputs go back to asyncio.

Thread confinement is the whole synchronization story:
- Only the engine thread touches the engine (and its connector and pool client). The HTTP
  side sends commands: add a request, abort one, or call a function on the engine (admin
  calls, stats snapshots), whose result resolves an asyncio future; and, from the thread
  that parsed them, a long prompt's first ids (a hint: its restore's first copies start
  while the rest of its body is parsed).
- Only the event loop touches the per-request queues: the engine thread hands each step's
  outputs over with one `loop.call_soon_threadsafe`, and the loop fans them out.
- The loop steps while any request is unfinished and blocks on the queue otherwise, so an
  idle server uses no CPU and a busy one never waits for the HTTP side. Going idle, it
  commits the pool stores in flight and runs a young collection (kvshare.serve.collector),
  so that the next request starts with none due; only once the event loop has handed the
  last outputs to their handlers (it queues that work back), because both need the GIL.
  (On an H100 host, with that work done at once, a first token that was also the last
  took 1.3-2.4 ms from the engine to its handler; one with decoding after it, 0.6.)
- A request the engine ends with an error (its logits cannot be sampled, its token cannot
  be appended) fails alone; the others go on.
- An exception out of a step (the batch's forward pass itself) fails every unfinished
  request (which of them the step broke is unknown), frees their blocks, and the thread
  keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvshare.engine.llm_engine import LLMEngine, PromptIds, RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.serve import collector

_log = logging.getLogger(__name__)
T = TypeVar("T")

# After a step that produced no output (a prefill chunk that samples nothing), wait this
# long for commands before stepping again: a busy spin would take the GIL from the copy
# thread and the event loop.
_IDLE_STEP_WAIT_S = 0.001
# A prompt head's hint pins pool pages until a request's match takes or drops it; one whose
# request never came (refused after its body was read) is dropped after the engine has
# been idle this long.
_HINT_LIFE_S = 1.0


class EngineFailure(Exception):
    """The engine raised while this request was unfinished, or refused to add it."""

    def __init__(self, message: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.user_error = user_error  # the request itself was bad (engine ValueError)


@dataclass(frozen=True)
class EngineSnapshot:
    running: int = 0  # admitted: computing or decoding
    waiting: int = 0
    gpu_cache_usage: float = 0.0  # share of KV blocks held by requests
    num_blocks: int = 0
    pool_enabled: bool = False
    kv_pool: dict[str, int] | None = None  # the connector's counters; None without a pool
    waits: dict[str, int] | None = None  # the scheduler's counters: admissions that waited


def snapshot_of(engine: LLMEngine) -> EngineSnapshot:
    scheduler, connector = engine.scheduler, engine.connector
    return EngineSnapshot(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        gpu_cache_usage=engine.blocks.usage,
        num_blocks=engine.blocks.num_blocks,
        pool_enabled=connector is not None and connector.enabled,
        kv_pool=connector.stats() if connector is not None else None,
        waits=dict(scheduler.counters),
    )


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: PromptIds
    params: SamplingParams
    cache_salt: str | None = None


@dataclass(frozen=True)
class _Hint:
    prompt_head: PromptIds
    cache_salt: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _IdleWork:
    pass


_Command = _Add | _Hint | _Abort | _Call | _Stop | _IdleWork
_Item = RequestOutput | EngineFailure


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled meanwhile: nobody wants it
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RequestStream:
    """The outputs of one request, in order; ends with a finished output or a failure."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()

    def put(self, item: _Item) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, EngineFailure):
            raise item
        return item


class EngineThread:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
        self.snapshot = snapshot_of(engine)  # replaced (never mutated) after each loop turn

    # ------------------------------------------------------------ asyncio side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the engine; outputs are delivered on `loop`, where every other method is called."""
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit_group(
        self,
        requests: list[tuple[str, PromptIds, SamplingParams]],
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Several requests whose outputs share one stream (the choices of one API request);
        each output names its request. The stream's first failure is the group's.
        `cache_salt` isolates their prefix cache (kvshare.engine.block_manager)."""
        stream = RequestStream()
        for request_id, prompt_token_ids, params in requests:
            self._streams[request_id] = stream
            self._commands.put(_Add(request_id, prompt_token_ids, params, cache_salt))
        return stream

    def hint(self, prompt_head: PromptIds, cache_salt: str | None = None) -> None:
        """The first ids of a prompt still being read (LLMEngine.hint_prompt_head); callable
        from any thread, so that the thread that parsed them sends them at once."""
        self._commands.put(_Hint(prompt_head, cache_salt))

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone) and free its blocks; later outputs are dropped."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; its exception propagates."""
        if self._loop is None or not self.alive:
            raise RuntimeError("the engine thread is not running")
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def _fail_all(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.put(EngineFailure(reason))
        self._streams.clear()

    def _deliver(
        self, outputs: list[RequestOutput], failures: list[tuple[str, EngineFailure]]
    ) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(
                    out if out.error is None else EngineFailure(f"engine error: {out.error}")
                )
                if out.finished:
                    del self._streams[out.request_id]
        for request_id, failure in failures:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(failure)

    # ------------------------------------------------------------ engine thread

    def _send(
        self, outputs: list[RequestOutput], failures: list[tuple[str, EngineFailure]]
    ) -> None:
        if outputs or failures:
            self._post(lambda: self._deliver(outputs, failures))

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # stopped, or a bug ended the thread: no request can finish any more
            self._post(functools.partial(self._fail_all, "the engine thread stopped"))

    def _serve(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # a new thread starts on GPU 0, whatever the engine's GPU
            torch.cuda.set_device(device)
        wait: float | None = None  # None: block until a command comes
        while True:
            try:
                commands = [self._commands.get(timeout=wait)]
            except queue.Empty:
                commands = []
                if not self.engine.has_unfinished():  # a hint held that long: no request came
                    self.engine.drop_hint()
            with contextlib.suppress(queue.Empty):
                while True:
                    commands.append(self._commands.get_nowait())
            for command in commands:
                if isinstance(command, _Stop):
                    return
                self._apply(command)
            produced = False
            if self.engine.has_unfinished():
                produced = self._step()
                if not self.engine.has_unfinished():
                    self._post(self._queue_idle_work)
            self.snapshot = snapshot_of(self.engine)
            if not self.engine.has_unfinished():
                wait = _HINT_LIFE_S if self.engine.holds_hint else None
            else:
                wait = 0.0 if produced else _IDLE_STEP_WAIT_S

    def _queue_idle_work(self) -> None:
        """On the loop, right after the last outputs were delivered: queue the idle work
        behind the handlers those outputs woke, so that they write first."""
        assert self._loop is not None
        self._loop.call_soon(self._commands.put, _IdleWork())

    def _apply(self, command: _Add | _Hint | _Abort | _Call | _IdleWork) -> None:
        if isinstance(command, _Hint):
            try:
                self.engine.hint_prompt_head(command.prompt_head, command.cache_salt)
            except Exception:  # a hint is an optimization: it never stops the engine
                _log.exception("a prompt head's hint failed")
        elif isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params, command.cache_salt
                )
            except ValueError as exc:
                self._send([], [(command.request_id, EngineFailure(str(exc), user_error=True))])
            except Exception as exc:
                _log.exception("engine refused request %s", command.request_id)
                self._send([], [(command.request_id, EngineFailure(f"engine error: {exc}"))])
        elif isinstance(command, _Abort):
            try:
                self.engine.abort(command.request_id)
            except Exception:
                _log.exception("abort of %s failed", command.request_id)
        elif isinstance(command, _IdleWork):
            if not self.engine.has_unfinished():  # else: queued again when it goes idle
                self.engine.commit_pool_stores()
                collector.collect_idle()
        else:
            self._call(command)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            self._post(functools.partial(_settle, command.future, None, exc))
        else:
            self._post(functools.partial(_settle, command.future, result, None))

    def _post(self, fn: Callable[[], object]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            self._loop.call_soon_threadsafe(fn)

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            _log.exception("engine step failed; failing every unfinished request")
            failed = list(self.engine.requests)
            for request_id in failed:
                try:
                    self.engine.abort(request_id)
                except Exception:
                    _log.exception("abort of %s after a failed step failed too", request_id)
            failure = EngineFailure(f"engine error: {type(exc).__name__}: {exc}")
            self._send([], [(request_id, failure) for request_id in failed])
            return False
        self._send(outputs, [])
        return bool(outputs)
