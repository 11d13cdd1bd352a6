"""New keys or values into a packed fp8 cache in one kernel (CUDA; see kv_fp8).

`kv_fp8.PackedBlocks.store` in torch takes a dozen launches a call (convert, amax, scale,
divide, clamp, cast, the block index and two scatters), twice per attention layer: ~380
in a step of Qwen3.5-27B. A step of a few tokens after a pool restore is bound by the
host's launches, so here one launch does it all. The bytes are the torch path's, bit for
bit: the same float32 operations (amax x 1/448 with its floor, an IEEE division, the clamp
to +-448) and the cast to e4m3 (to nearest, ties to even) done with integer operations,
which run the same on the GPU and in Triton's interpreter (whose own float-to-e4m3 cast
rounds some values wrongly). A NaN in x gives other bytes than torch's; a model that
produces one has failed already.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvshare.engine import kv_fp8


@triton.jit
def _round_shift(m, s):
    """m >> s rounded to nearest, ties to even (0 <= m < 2**24, 1 <= s <= 25)."""
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _e4m3_bits(v):
    """The e4m3fn byte of each float32 in v (finite, |v| <= 448), rounded to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal results: the mantissa rounded to 3 bits (a carry may raise the exponent),
    # the exponent rebiased from 127 to 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6: multiples of 2**-9, the mantissa (with its leading one) shifted down;
    # 8 (2**-6) is the smallest normal's encoding. Zeros and float32 subnormals give 0.
    mantissa = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (a >> 23), 25)
    subnormal = _round_shift(mantissa, tl.maximum(shift, 1))
    return (sign | tl.where(a >= 0x3C800000, normal, subnormal)).to(tl.uint8)  # 2**-6


@triton.jit
def _store_kernel(
    x_ptr,
    slots_ptr,
    values_ptr,
    scales_ptr,
    stride_xt,
    stride_xh,
    block_size,
    block_bytes,
    plane_bytes,
    inv_max,
    tiny,
    D: tl.constexpr,
    BD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BD)
    inside = cols < D
    x = tl.load(x_ptr + token * stride_xt + head * stride_xh + cols, mask=inside, other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inv_max, tiny)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    block, offset = slot // block_size, slot % block_size
    row = head * block_size + offset  # head-major inside each plane
    tl.store(values_ptr + block * block_bytes + row * D + cols, _e4m3_bits(scaled), mask=inside)
    tl.store(scales_ptr + (block * block_bytes + plane_bytes) // 4 + row, scale)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, block_size: int) -> None:
    """Quantize x [T, Hkv, D] into `slots` [T] of the packed cache (uint8, contiguous, of
    [slots, Hkv, D + 4] bytes): what `kv_fp8.PackedBlocks.of(cache, block_size).store(slots,
    x)` writes."""
    tokens, heads, dim = x.shape
    if not cache.is_contiguous() or x.stride(-1) != 1 or kv_fp8.head_dim_of(cache) != dim:
        raise ValueError(f"cannot store rows of shape {tuple(x.shape)} into {cache.shape}")
    if not tokens:
        return
    plane, block_bytes = kv_fp8.plane_bytes(block_size, heads, dim)
    _store_kernel[(tokens, heads)](
        x,
        slots,
        cache,
        cache.view(torch.float32),
        x.stride(0),
        x.stride(1),
        block_size,
        block_bytes,
        plane,
        kv_fp8.INV_FP8_MAX,
        kv_fp8.TINY_SCALE,
        D=dim,
        BD=triton.next_power_of_2(dim),
    )
