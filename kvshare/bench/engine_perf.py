"""Engine timings: cold prefill (time to first token) and decode throughput."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from kvshare.engine.llm_engine import RequestOutput
from kvshare.engine.sampling_params import SamplingParams
from kvshare.llm import LLM


def _sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


@dataclass(frozen=True)
class TimedRequest:
    ttft_s: float
    output: RequestOutput  # after the last token
    step_ends_s: tuple[float, ...]  # when each engine step up to the first token returned

    def phases(self) -> dict[str, float]:
        """admit_s: the first step, when more than one led to the token; wait_s: until the
        step before the token; compute_s: the rest. A pool restore computes its new tokens in
        its admission step, so a restored request's whole time is compute_s."""
        admit = self.step_ends_s[0] if len(self.step_ends_s) > 1 else 0.0
        before_token = self.step_ends_s[-2] if len(self.step_ends_s) > 1 else 0.0
        return {
            "admit_s": admit,
            "wait_s": before_token - admit,
            "compute_s": self.ttft_s - before_token,
            "steps": len(self.step_ends_s),
        }


def first_token(
    llm: LLM,
    prompt: list[int],
    *,
    max_tokens: int = 1,
    logprobs: bool = False,
    request_id: str = "timed",
) -> TimedRequest:
    """Seconds from add_request to the first sampled token (synchronized), and the output
    after max_tokens greedy tokens."""
    _sync(llm)
    start = time.perf_counter()
    llm.engine.add_request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs),
    )
    ttft, final, ends = None, None, []
    while llm.engine.has_unfinished():
        outputs = llm.engine.step()
        if ttft is None:
            ends.append(time.perf_counter() - start)
        for out in outputs:
            if ttft is None and out.token_ids:
                _sync(llm)
                ttft = ends[-1] = time.perf_counter() - start
            if out.finished:
                final = out
    assert ttft is not None and final is not None, "the request produced no token"
    return TimedRequest(ttft, final, tuple(ends))


def prefill_seconds(llm: LLM, num_tokens: int, seed: int = 0) -> float:
    """Cold time to first token of one num_tokens prompt (GPU-local prefix cache reset)."""
    llm.engine.reset_prefix_cache()
    prompt = random_prompt(num_tokens, llm.loaded.config.vocab_size, seed)
    return first_token(llm, prompt, request_id=f"prefill-{seed}").ttft_s


def restore_first_token(
    llm: LLM, prompt: list[int], request_id: str, **kwargs: object
) -> dict[str, object]:
    """Time to first token of `prompt` with the GPU-local cache reset, so that its prefix can
    come only from the pool; with the pool's bytes loaded, the tokens hit and the phases."""
    connector = llm.engine.connector
    assert connector is not None, "restore_first_token needs an LLM with a kv_pool"
    llm.engine.reset_prefix_cache()
    loaded_before = connector.stats().get("loaded_bytes", 0)
    timed = first_token(llm, prompt, request_id=request_id, **kwargs)  # type: ignore[arg-type]
    out = timed.output
    return {
        "ttft_s": timed.ttft_s,
        "pool_hit_tokens": out.pool_hit_tokens,
        "computed_tokens": out.computed_tokens,
        "loaded_bytes": connector.stats().get("loaded_bytes", 0) - loaded_before,
        **timed.phases(),
        "output": out,
    }


def decode_throughput(
    llm: LLM, batch: int, context: int, steps: int = 32, seed: int = 0
) -> dict[str, float]:
    """Tokens/s of pure decode steps for `batch` sequences each at `context` tokens."""
    engine = llm.engine
    engine.reset_prefix_cache()
    vocab = llm.loaded.config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"decode-{seed}-{i}", random_prompt(context, vocab, seed * 1000 + i), params
        )
    # Run until every sequence has its first token (prefill done), then time decode steps.
    produced: dict[str, int] = {}
    while len(produced) < batch:
        for out in engine.step():
            produced[out.request_id] = len(out.token_ids)
    _sync(llm)
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync(llm)
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1e3 * seconds / steps,
    }


def decode_bytes_per_step(llm: LLM, batch: int, context: int) -> int:
    """Fewest bytes one decode step must read: every weight once, every visible K/V once."""
    cfg = llm.loaded.config
    weights = sum(p.numel() * p.element_size() for p in llm.loaded.model.parameters())
    item = next(llm.loaded.model.parameters()).element_size()
    per_token_layer = cfg.kv_bytes_per_token_per_layer * item
    kv = 0
    for layer in range(cfg.num_layers):
        window = cfg.window_of(layer)
        kv += min(context, window or context) * per_token_layer
    return weights + batch * kv
