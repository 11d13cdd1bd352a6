"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds.

A seeded request draws from its own generator, so its output does not depend on what
else is batched with it. Unseeded requests share the engine's generator.

The sampler never raises for one row: a row whose distribution cannot be sampled (NaN or
+inf logits, or nothing left with positive probability) comes back as None, which fails
that request alone.
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
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def _unsampleable_rows(logits: torch.Tensor) -> list[bool]:
    """Rows holding NaN or +inf, or only -inf: no distribution to draw from (nor an argmax)."""
    broken = logits.isnan().any(-1) | logits.isposinf().any(-1) | logits.isneginf().all(-1)
    return broken.tolist()


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int | None:
    probs = _filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p).softmax(-1)
    # multinomial raises on NaN, inf or an all-zero row: such a row fails only its request.
    if not bool((torch.isfinite(probs).all() & (probs.sum() > 0)).item()):
        return None
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int | None]:
    """logits [N, V] float32, one row per sequence; returns one token id per row, or None
    for a row that cannot be sampled."""
    greedy = logits.argmax(-1).tolist()
    broken = _unsampleable_rows(logits)
    out: list[int | None] = []
    for i, p in enumerate(params):
        if broken[i]:
            out.append(None)
        elif p.greedy:
            out.append(greedy[i])
        else:
            out.append(_draw(logits[i], p, generators[i] or default_generator))
    return out
