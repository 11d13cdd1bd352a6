"""The Triton gated-delta-rule kernels against the torch reference.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, which must be set before
triton is imported: hence a subprocess); on a GPU they run compiled, also at Qwen3.5-27B's
head shapes and with the whole model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvshare.models.gated_deltanet import causal_conv1d_reference, gated_delta_rule_reference

# (seq_lens, key heads, value heads, key dim, value dim, dtype): decode batches, prefill of
# lengths around the chunk (64), several sequences per call incl. 1-token ones, head dims
# that are no powers of two, bf16 inputs. Every case starts from a non-zero state.
CASES = [
    ((1, 1, 1), 2, 4, 32, 16, "float32"),
    ((5,), 2, 4, 32, 16, "float32"),
    ((64,), 2, 2, 32, 32, "float32"),
    ((65, 3, 130), 2, 4, 32, 16, "float32"),
    ((1, 7, 1), 1, 3, 48, 24, "float32"),
    ((70, 2), 2, 4, 32, 16, "bfloat16"),
]


def random_inputs(
    seq_lens: tuple[int, ...],
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(seq_lens) + key_dim)
    tokens = sum(seq_lens)
    # q, k, v as the module passes them: views into one projection row per token.
    qkv = torch.randn(tokens, 2 * key_heads * key_dim + value_heads * value_dim, generator=gen)
    q, k, v = qkv.to(dtype).split(
        (key_heads * key_dim, key_heads * key_dim, value_heads * value_dim), -1
    )
    return [
        *(
            x.to(device).view(tokens, -1, d)
            for x, d in ((q, key_dim), (k, key_dim), (v, value_dim))
        ),
        (-torch.rand(tokens, value_heads, generator=gen) * 2.0).to(device),
        torch.rand(tokens, value_heads, generator=gen).to(device),
        torch.randn(len(seq_lens), value_heads, key_dim, value_dim, generator=gen).to(device),
    ]


def errors(case: tuple, device: str = "cpu") -> tuple[float, float]:
    from kvshare.models import gdn_triton

    seq_lens, *shape, dtype = case
    inputs = random_inputs(tuple(seq_lens), *shape, getattr(torch, dtype), device)
    out, final = gdn_triton.gated_delta_rule(*inputs, tuple(seq_lens))
    ref_out, ref_final = gated_delta_rule_reference(*(x.cpu() for x in inputs), tuple(seq_lens))
    rel = [
        ((a.cpu() - b).norm() / b.norm()).item() for a, b in ((out, ref_out), (final, ref_final))
    ]
    return rel[0], rel[1]


# (seq_lens, channels, dtype) of the causal conv: segments shorter than its state, several
# sequences, channel counts that are no multiple of the kernel's block.
CONV_CASES = [
    ((9, 2, 1, 5), 24, "float32"),
    ((70,), 200, "float32"),
    ((3, 130, 1), 136, "bfloat16"),
]


def conv_errors(case: tuple, device: str = "cpu") -> tuple[float, bool]:
    from kvshare.models import gdn_triton

    seq_lens, channels, dtype = case
    gen = torch.Generator().manual_seed(channels)
    x, weight = (
        torch.randn(sum(seq_lens), channels, generator=gen),
        torch.randn(channels, 4, generator=gen),
    )
    state = torch.randn(len(seq_lens), channels, 3, generator=gen)
    args = [t.to(getattr(torch, dtype)) for t in (x, weight, state)]
    out, new_state = gdn_triton.causal_conv1d(*(t.to(device) for t in args), tuple(seq_lens))
    ref_out, ref_state = causal_conv1d_reference(*args, tuple(seq_lens))
    rel = ((out.cpu().float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    return rel, torch.equal(new_state.cpu(), ref_state)


# (lengths the tables are built with, lengths uploaded into them, rows): a captured graph's
# tables, built for one shape and re-filled for each step, rows past the step's tokens padding.
PADDED_CASES = [
    ((16,), (9,), 16),
    ((11, 21), (1, 23), 32),
    ((32, 32), (64, 2), 80),
]


def padded_errors(case: tuple, device: str = "cpu") -> list[float]:
    """Both kernels over padded rows (NaN inputs there) with re-uploaded tables, against
    the same sequences unpadded: [rule output, rule state, conv output, conv state
    (relative errors over the real rows), largest |output| of a padding row]."""
    from kvshare.models import gdn_triton

    built, seq_lens, rows = case
    seq_lens = tuple(seq_lens)
    tokens = sum(seq_lens)
    tables = gdn_triton.PrefillTables(tuple(built), 3, torch.device(device), rows=rows)
    tables.upload(seq_lens)
    inputs = random_inputs(seq_lens, 2, 4, 32, 16, torch.float32, device)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, torch.full((rows - tokens, *x.shape[1:]), float("nan"))))

    padded = [pad(x) if i < 5 else x for i, x in enumerate(inputs)]
    out, final = gdn_triton.gated_delta_rule(*padded, seq_lens, tables)
    ref_out, ref_final = gdn_triton.gated_delta_rule(*inputs, seq_lens)
    gen = torch.Generator().manual_seed(tokens)
    x, weight = torch.randn(tokens, 24, generator=gen), torch.randn(24, 4, generator=gen)
    state = torch.randn(len(seq_lens), 24, 3, generator=gen)
    conv, conv_state = gdn_triton.causal_conv1d(pad(x), weight, state, seq_lens, tables)
    ref_conv, ref_conv_state = gdn_triton.causal_conv1d(x, weight, state, seq_lens)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return [
        rel(out[:tokens], ref_out),
        rel(final, ref_final),
        rel(conv[:tokens], ref_conv),
        rel(conv_state, ref_conv_state),
        out[tokens:].abs().max().item() if rows > tokens else 0.0,
    ]


_SCRIPT = """
import json, sys
from tests.models.test_gdn_triton import conv_errors, errors, padded_errors
cases, conv_cases, padded_cases = json.loads(sys.argv[1])
print(json.dumps([[errors(case) for case in cases], [conv_errors(case) for case in conv_cases],
                  [padded_errors(case) for case in padded_cases]]))
"""


def tolerance(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 1e-2  # bf16: intermediate rounding differs, not the math


def test_kernels_match_the_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")  # a test dependency on x86-64 Linux (pyproject.toml)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps([CASES, CONV_CASES, PADDED_CASES])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rule, conv, padded = json.loads(result.stdout)
    for case, (out_err, state_err) in zip(CASES, rule):
        assert out_err < tolerance(case[-1]) and state_err < tolerance(case[-1]), (
            case,
            out_err,
            state_err,
        )
    for case, (out_err, state_equal) in zip(CONV_CASES, conv):
        assert out_err < tolerance(case[-1]) and state_equal, (case, out_err)
    # Padded rows, tables re-filled: the real rows as without padding, padding rows zero.
    for case, (*errs, padding) in zip(PADDED_CASES, padded):
        assert all(e < 1e-6 for e in errs) and padding == 0.0, (case, errs, padding)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case",
    [
        *CASES,
        ((4096,), 16, 48, 128, 128, "bfloat16"),  # Qwen3.5-27B's heads
        ((1000, 1, 333, 64), 16, 48, 128, 128, "float32"),
        ((1,) * 32, 16, 48, 128, 128, "bfloat16"),
    ],
)
def test_kernels_match_the_reference_on_cuda(case: tuple) -> None:
    out_err, state_err = errors(case, "cuda")
    # TF32 matmuls for 16-bit inputs: a little looser than their own rounding.
    assert out_err < tolerance(case[-1]) and state_err < tolerance(case[-1]), (out_err, state_err)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [*CONV_CASES, ((4096, 7, 1), 10240, "bfloat16")])
def test_conv_kernel_matches_the_reference_on_cuda(case: tuple) -> None:
    out_err, state_equal = conv_errors(case, "cuda")
    assert out_err < tolerance(case[-1]) and state_equal, out_err


@pytest.mark.cuda
def test_tiny_model_on_cuda_matches_cpu() -> None:
    from kvshare.models.loader import load_model
    from tests.models.dense_context import DenseContext, greedy

    cpu = load_model("shape:tiny-qwen3.5", seed=7).model
    gpu = load_model("shape:tiny-qwen3.5", seed=7, device="cuda").model
    prompt = list(range(3, 150))
    cpu_last, cpu_tokens = greedy(
        cpu, DenseContext(cpu.config, torch.float32), prompt, 16, pieces=(70,)
    )
    gpu_last, gpu_tokens = greedy(
        gpu, DenseContext(gpu.config, torch.float32, "cuda"), prompt, 16, pieces=(70,)
    )
    assert ((gpu_last.cpu() - cpu_last).norm() / cpu_last.norm()).item() < 1e-4
    assert gpu_tokens == cpu_tokens


@pytest.mark.parametrize("seq_lens", [(9, 2, 1, 5), (70,), (3, 130, 1), (1, 1, 1), (32,)])
def test_conv_indices_are_the_packed_sequences_positions(seq_lens: tuple[int, ...]) -> None:
    """The host-built indices of the causal conv equal what the device used to compute from
    seq_lens (per token: sequence, position; per sequence: its last inputs' positions, rows
    of x and columns of the old state), segments shorter than the state included."""
    pytest.importorskip("triton")
    from kvshare.models.gdn_triton import conv_indices

    width = 3
    lens = torch.tensor(seq_lens)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    back = lens[:, None] - width + torch.arange(width)
    expected = (
        seq,
        torch.arange(sum(seq_lens)) - starts[seq],
        back,
        (starts[:, None] + back).clamp(min=0),
        (back + width).clamp(max=width - 1),
    )
    for got, want in zip(conv_indices(seq_lens, width), expected, strict=True):
        assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.cuda
@pytest.mark.parametrize("seq_lens", [(32,), (5, 70, 1)])
def test_prefill_kernels_never_make_the_host_wait_for_the_device(
    seq_lens: tuple[int, ...],
) -> None:
    """The step after a pool restore is issued while its stream still waits for the copy.
    A synchronizing call in a linear-attention layer (a pageable upload, repeat_interleave
    over a device tensor) holds the host there until the copy ends, and the rest of the
    step is then issued behind the GPU: none may synchronize, and with the stream busy,
    both calls return before it is idle."""
    from kvshare.models import gdn_triton

    inputs = random_inputs(seq_lens, 16, 48, 128, 128, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(1)
    channels = 2 * 16 * 128 + 48 * 128
    conv = [
        torch.randn(sum(seq_lens), channels, generator=gen).to("cuda", torch.bfloat16),
        torch.randn(channels, 4, generator=gen).to("cuda", torch.bfloat16),
        torch.randn(len(seq_lens), channels, 3, generator=gen).to("cuda", torch.bfloat16),
    ]
    expected = (
        gdn_triton.gated_delta_rule(*inputs, seq_lens),
        gdn_triton.causal_conv1d(*conv, seq_lens),
    )
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles ahead of the calls
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = (
            gdn_triton.gated_delta_rule(*inputs, seq_lens),
            gdn_triton.causal_conv1d(*conv, seq_lens),
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    busy = not torch.cuda.current_stream().query()
    assert busy, "the calls returned only once the stream was idle"
    for pair_got, pair_expected in zip(got, expected, strict=True):
        for a, b in zip(pair_got, pair_expected, strict=True):
            assert torch.equal(a, b)
