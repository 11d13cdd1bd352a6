"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds.

A seeded request draws from its own generator, so its output does not depend on what
else is batched with it. Unseeded requests share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshare.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    """logits [N, V] float32, one row per sequence; returns one token id per row."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        gen = generators[i] or default_generator
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
