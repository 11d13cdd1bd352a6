"""A dense test context: per-sequence KV tensors and linear-attention states, no paging.

Implements both AttentionContext and RecurrentStateContext for the sequences of one step, so
a model runs here exactly as the engine would run it, with several sequences packed in one
step, prompts split over steps, and decoding token by token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvshare.models.config import ModelConfig
from kvshare.models.decoder import CausalLM


class DenseContext:
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        carry_state: bool = True,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        # carry_state=False is the broken variant: states are dropped between steps.
        self.carry_state = carry_state
        self.kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.states: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.seq_ids: tuple[str, ...] = ()
        self.seq_lens: tuple[int, ...] = ()

    def begin_step(self, seq_ids: Sequence[str], seq_lens: Sequence[int]) -> None:
        self.seq_ids, self.seq_lens = tuple(seq_ids), tuple(seq_lens)

    def _segments(self) -> list[slice]:
        bounds = itertools.accumulate(self.seq_lens, initial=0)
        return [slice(a, b) for a, b in itertools.pairwise(bounds)]

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
        outs = []
        for seq, segment in zip(self.seq_ids, self._segments()):
            old_k, old_v = self.kv.get((seq, layer), (k[:0], v[:0]))
            keys, values = torch.cat((old_k, k[segment])), torch.cat((old_v, v[segment]))
            self.kv[seq, layer] = keys, values
            outs.append(_causal_attention(q[segment], keys, values, scale, window))
        return torch.cat(outs)

    def load_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv_shape, rec_shape = self.config.conv_state_shape, self.config.recurrent_state_shape
        convs, recs = [], []
        for seq in self.seq_ids:
            conv, rec = self.states.get((seq, layer), (None, None))
            convs.append(
                torch.zeros(conv_shape, dtype=self.dtype, device=self.device)
                if conv is None
                else conv
            )
            recs.append(
                torch.zeros(rec_shape, dtype=torch.float32, device=self.device)
                if rec is None
                else rec
            )
        return torch.stack(convs), torch.stack(recs)

    def prefill_tables(self, conv_width: int) -> None:
        return None  # each kernel call builds its own tables

    def save_state(
        self, layer: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> None:
        assert conv_state.dtype == self.dtype and recurrent_state.dtype == torch.float32
        assert conv_state.shape == (len(self.seq_ids), *self.config.conv_state_shape)
        assert recurrent_state.shape == (len(self.seq_ids), *self.config.recurrent_state_shape)
        if self.carry_state:
            for i, seq in enumerate(self.seq_ids):
                self.states[seq, layer] = conv_state[i], recurrent_state[i]


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """HF eager attention for the last len(q) of len(k) positions: q [Tq, Hq, D], k/v [Tk, Hkv, D]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", weights, v)


@torch.inference_mode()
def forward_step(
    model: CausalLM, ctx: DenseContext, steps: Sequence[tuple[str, Sequence[int], int]]
) -> torch.Tensor:
    """One step over (sequence id, new tokens, position of the first) triples: logits [T, V]."""
    ctx.begin_step([s for s, _, _ in steps], [len(t) for _, t, _ in steps])
    ids = torch.tensor([t for _, tokens, _ in steps for t in tokens], device=ctx.device)
    positions = torch.tensor(
        [p + i for _, tokens, p in steps for i in range(len(tokens))], device=ctx.device
    )
    return model.compute_logits(model(ids, positions, ctx))


def greedy(
    model: CausalLM,
    ctx: DenseContext,
    prompt: list[int],
    n: int,
    *,
    pieces: Sequence[int] = (),
    seq: str = "s",
) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt` in steps of the given piece sizes (the rest in one last step), then
    decode n greedy tokens one per step. Returns (logits of the prompt's last token, tokens)."""
    done = 0
    for size in (*pieces, len(prompt) - sum(pieces)):
        logits = forward_step(model, ctx, [(seq, prompt[done : done + size], done)])
        done += size
    last = logits[-1]
    tokens = [int(last.argmax())]
    while len(tokens) < n:
        logits = forward_step(model, ctx, [(seq, tokens[-1:], len(prompt) + len(tokens) - 1)])
        tokens.append(int(logits[-1].argmax()))
    return last, tokens
