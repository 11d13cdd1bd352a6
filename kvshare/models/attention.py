"""What a model asks of whoever runs it: attention over its KV cache, and the recurrent
state of its linear-attention layers.

Models stay ignorant of paging, batching and pools: each attention layer hands its new
queries, keys and values to an `AttentionContext` and gets the attention output back; each
linear-attention (Gated DeltaNet) layer loads its per-sequence state from a
`RecurrentStateContext` at the start of a step and saves it at the end. The engine
implements the contexts over its paged cache and state slots; tests may implement them densely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvshare.models.gdn_triton import PrefillTables


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


class RecurrentStateContext(Protocol):
    """Per-sequence state of linear-attention layers for the tokens of one step."""

    # New tokens of each sequence this step, in order (sum = T); a segment of 1 is a decode step.
    seq_lens: tuple[int, ...]

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_state [B, conv_dim, kernel-1] in the model dtype, recurrent_state [B, Hv, Dk, Dv]
        float32) at the start of this step, one row per sequence (zeros for a sequence starting
        fresh)."""
        ...

    def save_state(
        self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> None:
        """The states at the end of this step, same shapes."""
        ...

    def prefill_tables(self, conv_width: int) -> PrefillTables | None:
        """The step's index tables for the GPU kernels, built once per step and read by
        every linear-attention layer; None where the layers need none (decode steps, the
        torch reference): each kernel call then builds what it needs."""
        ...


class HybridContext(AttentionContext, RecurrentStateContext, Protocol):
    """What a hybrid model (attention and linear-attention layers) runs against."""
