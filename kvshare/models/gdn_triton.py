"""Triton kernels of the gated delta rule (the GPU path of `gated_deltanet.gated_delta_rule`).

Same contract as `gated_delta_rule_reference`: packed sequences, q/k [T, Hk, Dk] and
v [T, Hv, Dv] in the model dtype, g/beta [T, Hv] and the states [B, Hv, Dk, Dv] float32;
returns float32 outputs and new final states. q/k normalization, the query scale and the
key-head sharing (value head h reads key head h // (Hv / Hk)) happen inside the kernels.

Prefill runs the chunked form in two kernels:
1. `_chunk_prepare` (parallel over chunks x value heads): the cumulative log decay gamma
   and the corrections' two parts w_k = (I + A)^-1 (beta e^gamma K), w_v = (I + A)^-1 (beta V)
   (see `chunk_gated_delta_rule`); the unit lower-triangular inverse by forward substitution.
2. `_chunk_scan` (parallel over sequences x value heads x value blocks, sequential over a
   sequence's chunks): the state lives in registers, u = w_v - w_k S, outputs and state update.
Decode (one token per sequence) is one recurrent step, `_decode_step`. The causal conv of a
prefill step is `_causal_conv` (decode steps keep the torch path, a handful of tiny ops).

Matmuls run in full float32 for float32 inputs and in TF32 for 16-bit inputs, whose own
rounding is coarser. No software pipelining (num_stages=1): the chunk tiles are float32 and
multi-buffering them overflows shared memory at Qwen3.5-27B's head dims (128).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvshare.uploads import copy_into, host_to_device

CHUNK = 64


@triton.jit
def _l2_normalize(x):
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit
def _chunk_prepare(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    gamma_ptr,
    wk_ptr,
    wv_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)  # offsets pass 2**31 at long contexts
    rows = tl.arange(0, C)
    valid = rows < tl.load(chunk_len_ptr + chunk)
    tok = start + rows
    cols_k = tl.arange(0, BK)
    k = tl.load(
        k_ptr + tok[:, None] * stride_kt + (head // GROUP) * stride_kh + cols_k[None, :],
        mask=valid[:, None] & (cols_k < DK)[None, :],
        other=0.0,
    ).to(tl.float32)
    k = _l2_normalize(k)
    # Padding rows: g = 0 and beta = 0, so they change neither gamma nor anything else.
    g = tl.load(g_ptr + tok * HV + head, mask=valid, other=0.0)
    beta = tl.load(beta_ptr + tok * HV + head, mask=valid, other=0.0)
    gamma = tl.cumsum(g, 0)
    tl.store(gamma_ptr + tok * HV + head, gamma, mask=valid)

    # A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s for s < t (exponent <= 0 there).
    lower = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.minimum(gamma[:, None] - gamma[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    a = tl.where(lower, kk * decay * beta[:, None], 0.0)
    # (I + A)^-1 by forward substitution: row i = e_i - sum_{j<i} A[i, j] row j.
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
        update = tl.sum(a_row[:, None] * inv, 0)
        inv = tl.where(rows[:, None] == i, inv - update[None, :], inv)

    out_rows = tok[:, None] * HV + head
    w_k = tl.dot(inv, k * (beta * tl.exp(gamma))[:, None], input_precision=PRECISION)
    tl.store(
        wk_ptr + out_rows * DK + cols_k[None, :], w_k, mask=valid[:, None] & (cols_k < DK)[None, :]
    )
    cols_v = tl.arange(0, BV)
    v = tl.load(
        v_ptr + tok[:, None] * stride_vt + head * stride_vh + cols_v[None, :],
        mask=valid[:, None] & (cols_v < DV)[None, :],
        other=0.0,
    ).to(tl.float32)
    w_v = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
    tl.store(
        wv_ptr + out_rows * DV + cols_v[None, :], w_v, mask=valid[:, None] & (cols_v < DV)[None, :]
    )


@triton.jit
def _chunk_scan(
    q_ptr,
    k_ptr,
    gamma_ptr,
    wk_ptr,
    wv_ptr,
    state_ptr,
    out_ptr,
    final_ptr,
    cu_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scale,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1) - bos
    rows = tl.arange(0, C)
    cols_k = tl.arange(0, BK)
    cols_v = vblock * BV + tl.arange(0, BV)
    kmask, vmask = cols_k < DK, cols_v < DV
    state_offsets = ((seq * HV + head) * DK + cols_k[:, None]) * DV + cols_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(state_ptr + state_offsets, mask=smask, other=0.0)
    causal = rows[:, None] >= rows[None, :]
    for c in range(0, tl.cdiv(length, C)):
        n = tl.minimum(length - c * C, C)
        valid = rows < n
        tok = bos + c * C + rows
        qk_mask = valid[:, None] & kmask[None, :]
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + (head // GROUP) * stride_qh + cols_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        q = _l2_normalize(q) * scale
        k = tl.load(
            k_ptr + tok[:, None] * stride_kt + (head // GROUP) * stride_kh + cols_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        k = _l2_normalize(k)
        gamma = tl.load(gamma_ptr + tok * HV + head, mask=valid, other=0.0)
        w_k = tl.load(
            wk_ptr + (tok[:, None] * HV + head) * DK + cols_k[None, :], mask=qk_mask, other=0.0
        )
        w_v = tl.load(
            wv_ptr + (tok[:, None] * HV + head) * DV + cols_v[None, :],
            mask=valid[:, None] & vmask[None, :],
            other=0.0,
        )
        # The corrections of this chunk given the state entering it.
        u = w_v - tl.dot(w_k, state, input_precision=PRECISION)
        decay = tl.exp(tl.minimum(gamma[:, None] - gamma[None, :], 0.0))
        scores = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        out = tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION) + tl.dot(
            scores, u, input_precision=PRECISION
        )
        tl.store(
            out_ptr + (tok[:, None] * HV + head) * DV + cols_v[None, :],
            out,
            mask=valid[:, None] & vmask[None, :],
        )
        last = tl.sum(tl.where(rows == n - 1, gamma, 0.0), 0)
        k_to_end = tl.where(valid[:, None], k * tl.exp(last - gamma)[:, None], 0.0)
        state = state * tl.exp(last) + tl.dot(tl.trans(k_to_end), u, input_precision=PRECISION)
    tl.store(final_ptr + state_offsets, state, mask=smask)


@triton.jit
def _decode_step(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    final_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    scale,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    seq, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols_k = tl.arange(0, BK)
    cols_v = vblock * BV + tl.arange(0, BV)
    kmask, vmask = cols_k < DK, cols_v < DV
    key_head = head // GROUP
    q = tl.load(q_ptr + seq * stride_qt + key_head * stride_qh + cols_k, mask=kmask, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + seq * stride_kt + key_head * stride_kh + cols_k, mask=kmask, other=0.0).to(
        tl.float32
    )
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + seq * stride_vt + head * stride_vh + cols_v, mask=vmask, other=0.0).to(
        tl.float32
    )
    g = tl.load(g_ptr + seq * HV + head)
    beta = tl.load(beta_ptr + seq * HV + head)
    state_offsets = ((seq * HV + head) * DK + cols_k[:, None]) * DV + cols_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(state_ptr + state_offsets, mask=smask, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], 0)) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(out_ptr + (seq * HV + head) * DV + cols_v, tl.sum(state * q[:, None], 0), mask=vmask)
    tl.store(final_ptr + state_offsets, state, mask=smask)


@triton.jit
def _causal_conv(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    seq_ptr,
    pos_ptr,
    tokens,
    channels,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask, cmask = rows < tokens, cols < channels
    seq = tl.load(seq_ptr + rows, mask=rmask, other=0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        # Input K-1-j steps back: this step's x, or column pos+j of the sequence's state.
        back = K - 1 - j
        in_x = (pos >= back)[:, None]
        mask = rmask[:, None] & cmask[None, :]
        from_x = tl.load(
            x_ptr + (rows - back)[:, None] * channels + cols[None, :], mask=mask & in_x, other=0.0
        )
        from_state = tl.load(
            state_ptr + (seq[:, None] * channels + cols[None, :]) * (K - 1) + pos[:, None] + j,
            mask=mask & ~in_x,
            other=0.0,
        )
        weight = tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.where(in_x, from_x, from_state).to(tl.float32) * weight[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + rows[:, None] * channels + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


def conv_indices(seq_lens: tuple[int, ...], width: int) -> tuple[np.ndarray, ...]:
    """Host index arrays of the causal conv over packed sequences (state width K-1):
    per token its sequence and its position in it; per sequence (rows [B, width]) the
    position of each of its last `width` inputs (negative: it lies in the old state), the
    row of x holding it, and the old state's column holding it."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    pos = np.arange(len(seq), dtype=np.int64) - starts[seq]
    back = lens[:, None] - width + np.arange(width, dtype=np.int64)
    x_rows = np.maximum(starts[:, None] + back, 0)
    state_cols = np.minimum(back + width, width - 1)
    return seq, pos, back, x_rows, state_cols


def chunk_table(seq_lens: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """(first token, length) of every CHUNK-token chunk of the packed sequences, in order,
    and the sequences' bounds (cu_seqlens)."""
    starts, lens, bounds = [], [], [0]
    for n in seq_lens:
        starts += range(bounds[-1], bounds[-1] + n, CHUNK)
        lens += (min(CHUNK, n - i) for i in range(0, n, CHUNK))
        bounds.append(bounds[-1] + n)
    return starts, lens, bounds


class PrefillTables:
    """The index tables of a prefill step's packed sequences on the device: the conv's
    (`conv_indices`) and the chunked rule's (`chunk_table`), uploaded once per step and
    shared by every linear-attention layer (built in each layer, they cost two uploads and
    a dozen launches per layer).

    `rows` (a captured graph's tables): the step's rows, fixed; a captured graph keeps one
    object and `upload`s each step's lengths into it (the same sequence count, each
    sequence at most CHUNK tokens: one chunk each, so every shape stays), and rows past
    the step's tokens are padding. Padding rows belong to no sequence and no chunk: the
    conv computes them from the rows before them (sequence 0's state where those run out),
    the rule writes zeros for them, and no state reads them."""

    def __init__(
        self,
        seq_lens: tuple[int, ...],
        width: int,
        device: torch.device,
        rows: int | None = None,
    ) -> None:
        self.width = width
        self.num_seqs = len(seq_lens)
        self.tokens = sum(seq_lens) if rows is None else rows
        self.num_chunks = len(chunk_table(seq_lens)[0])
        self.may_pad = rows is not None
        small, wide = self._host(seq_lens)
        self.small, self.wide = host_to_device(small, device), host_to_device(wide, device)

    def _host(self, seq_lens: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(int32: seq, pos, chunk starts, chunk lengths, cu_seqlens; int64: back, x_rows,
        state_cols), each packed into one array."""
        assert len(seq_lens) == self.num_seqs and sum(seq_lens) <= self.tokens
        seq, pos, back, x_rows, state_cols = conv_indices(seq_lens, self.width)
        pad = self.tokens - len(seq)
        seq = np.pad(seq, (0, pad))  # padding: "sequence 0", at its own row's position
        pos = np.concatenate((pos, np.arange(len(pos), self.tokens, dtype=np.int64)))
        starts, lens, bounds = chunk_table(seq_lens)
        assert len(starts) == self.num_chunks, "a captured step's sequences: one chunk each"
        small = np.concatenate((seq, pos, starts, lens, bounds)).astype(np.int32)
        return small, np.concatenate((back.ravel(), x_rows.ravel(), state_cols.ravel()))

    def upload(self, seq_lens: tuple[int, ...]) -> None:
        """A new step's lengths into the same device tensors (a captured graph reads them)."""
        for dest, host in zip((self.small, self.wide), self._host(seq_lens), strict=True):
            copy_into(dest, host)

    @property
    def conv(self) -> tuple[torch.Tensor, ...]:
        """(seq, pos, back, x_rows, state_cols) as in `conv_indices`."""
        t, b, w = self.tokens, self.num_seqs, self.width
        back, x_rows, state_cols = (x.view(b, w) for x in self.wide.split(b * w))
        return self.small[:t], self.small[t : 2 * t], back, x_rows, state_cols

    @property
    def chunks(self) -> tuple[torch.Tensor, ...]:
        """(chunk starts, chunk lengths, cu_seqlens), int32."""
        c = self.num_chunks
        return tuple(self.small[2 * self.tokens :].split((c, c, self.num_seqs + 1)))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    seq_lens: tuple[int, ...],
    tables: PrefillTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gated_deltanet.causal_conv1d_reference` (prefill steps); `tables`:
    the step's (built here when None)."""
    tokens, channels = x.shape
    width = weight.shape[1] - 1
    if tables is None:
        tables = PrefillTables(seq_lens, width, x.device)
    assert tables.tokens == tokens and tables.width == width
    x, weight, conv_state = x.contiguous(), weight.contiguous(), conv_state.contiguous()
    seq, pos, back, x_rows, state_cols = tables.conv
    out = torch.empty_like(x)
    grid = (triton.cdiv(tokens, 64), triton.cdiv(channels, 128))
    _causal_conv[grid](
        x, weight, conv_state, out, seq, pos, tokens, channels, K=width + 1, BT=64, BC=128
    )
    # New state: the last K-1 inputs, reaching back into the old state for short segments.
    from_x = x[x_rows].transpose(1, 2)
    old = conv_state.gather(2, state_cols[:, None, :].expand(-1, channels, -1))
    return out, torch.where((back >= 0)[:, None, :], from_x, old)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_lens: tuple[int, ...],
    tables: PrefillTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences; see the module docstring. Decode steps take the recurrent kernel;
    prefill steps read `tables` (built here when None)."""
    _check(q, k, v, g, beta, state, seq_lens, tables)
    if all(n == 1 for n in seq_lens) and tables is None:
        return decode_step(q, k, v, g, beta, state)
    if tables is None:
        tables = PrefillTables(seq_lens, 1, v.device)
    return chunk_prefill(q, k, v, g, beta, state, tables)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seq_lens: tuple[int, ...],
    tables: PrefillTables | None,
) -> None:
    tokens, key_heads, key_dim = k.shape
    _, value_heads, value_dim = v.shape
    rows = sum(seq_lens) if tables is None else tables.tokens
    assert q.shape == k.shape and v.shape[0] == tokens == rows, "token counts differ"
    assert value_heads % key_heads == 0 and min(key_dim, value_dim) >= 16, "unsupported head shape"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dims must be contiguous"
    assert g.dtype == beta.dtype == state.dtype == torch.float32
    assert g.is_contiguous() and beta.is_contiguous() and state.is_contiguous()
    assert state.shape == (len(seq_lens), value_heads, key_dim, value_dim)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _value_block(value_dim: int) -> int:
    return min(32, triton.next_power_of_2(value_dim))


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (token b belongs to sequence b)."""
    batch, value_heads, value_dim = v.shape
    key_dim = k.shape[2]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    final = torch.empty_like(state)
    block_v = _value_block(value_dim)
    grid = (batch, value_heads, triton.cdiv(value_dim, block_v))
    _decode_step[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        final,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_dim**-0.5,
        HV=value_heads,
        GROUP=value_heads // k.shape[1],
        DK=key_dim,
        DV=value_dim,
        BK=triton.next_power_of_2(key_dim),
        BV=block_v,
    )
    return out, final


def chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tables: PrefillTables,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any segment lengths, each sequence continuing from its state."""
    tokens, value_heads, value_dim = v.shape
    key_dim = k.shape[2]
    chunks = tables.num_chunks
    chunk_starts, chunk_lens, cu_seqlens = tables.chunks
    f32 = {"dtype": torch.float32, "device": v.device}
    gamma = torch.empty((tokens, value_heads), **f32)
    w_k = torch.empty((tokens, value_heads, key_dim), **f32)
    w_v = torch.empty((tokens, value_heads, value_dim), **f32)
    # Padding rows (in no chunk) are never written: zeros keep them finite.
    new = torch.zeros if tables.may_pad else torch.empty
    out = new((tokens, value_heads, value_dim), **f32)
    final = torch.empty_like(state)
    shape = {
        "HV": value_heads,
        "GROUP": value_heads // k.shape[1],
        "DK": key_dim,
        "DV": value_dim,
        "BK": triton.next_power_of_2(key_dim),
        "C": CHUNK,
        "PRECISION": _precision(v),
    }
    _chunk_prepare[(chunks, value_heads)](
        k,
        v,
        g,
        beta,
        gamma,
        w_k,
        w_v,
        chunk_starts,
        chunk_lens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        BV=triton.next_power_of_2(value_dim),
        num_warps=8,
        num_stages=1,
        **shape,
    )
    block_v = _value_block(value_dim)
    _chunk_scan[(tables.num_seqs, value_heads, triton.cdiv(value_dim, block_v))](
        q,
        k,
        gamma,
        w_k,
        w_v,
        state,
        out,
        final,
        cu_seqlens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        key_dim**-0.5,
        BV=block_v,
        num_warps=8,
        num_stages=1,
        **shape,
    )
    return out, final
