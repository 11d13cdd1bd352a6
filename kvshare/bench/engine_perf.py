"""Engine timings: cold prefill (time to first token) and decode throughput."""

from __future__ import annotations

import random
import time

import torch

from kvshare.engine.llm import LLM
from kvshare.engine.sampling_params import SamplingParams


def _sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


def prefill_seconds(llm: LLM, num_tokens: int, seed: int = 0) -> float:
    """Cold time to first token of one num_tokens prompt (GPU-local prefix cache reset)."""
    llm.engine.reset_prefix_cache()
    prompt = random_prompt(num_tokens, llm.loaded.config.vocab_size, seed)
    _sync(llm)
    start = time.perf_counter()
    llm.engine.add_request(f"prefill-{seed}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while llm.engine.has_unfinished():
        llm.engine.step()
    _sync(llm)
    return time.perf_counter() - start


def decode_throughput(llm: LLM, batch: int, context: int, steps: int = 32, seed: int = 0) -> dict[str, float]:
    """Tokens/s of pure decode steps for `batch` sequences each at `context` tokens."""
    engine = llm.engine
    engine.reset_prefix_cache()
    vocab = llm.loaded.config.vocab_size
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{seed}-{i}", random_prompt(context, vocab, seed * 1000 + i), params)
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
    return {"batch": batch, "context": context, "steps": steps, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "step_ms": 1e3 * seconds / steps}


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
