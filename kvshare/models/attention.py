"""The one thing a model asks of whoever runs it: attention over its KV cache.

Models stay ignorant of paging, batching and pools: each attention layer hands its new
queries, keys and values to an `AttentionContext` and gets the attention output back.
The engine implements the context over its paged cache; tests may implement it densely.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionContext(Protocol):
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Store this step's keys/values of `layer` and return causal attention output.

        Shapes: q [T, Hq, D], k and v [T, Hkv, D] for the T tokens of this step, in the
        order the context was built with; returns [T, Hq, D]. `window` (when set) is the
        number of keys a query sees, itself included (HF's sliding window semantics).
        """
        ...
