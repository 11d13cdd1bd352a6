"""Random weights are a pure function of (shape, seed, dtype), in range, and complete."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import xxhash

from kvshare.models import loader, random_weights
from kvshare.models.decoder import CausalLM
from kvshare.models.loader import load_model
from kvshare.models.random_weights import fill_random_weights_, fill_uniform_

CASES = [
    ("tiny-llama", 0, "float32"),
    ("tiny-gemma3", 7, "bfloat16"),
    ("tiny-qwen3", 1, "float16"),
    ("tiny-qwen3.5", 2, "bfloat16"),
]
BOUND = 0.02 * math.sqrt(3.0)

_DIGEST_SCRIPT = """
import json, sys
import torch, xxhash
from kvshare.models.loader import load_model

def digest(shape, seed, dtype):
    h = xxhash.xxh3_128()
    for name, p in load_model("shape:" + shape, dtype=dtype, seed=seed).model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

print(json.dumps([digest(*case) for case in json.loads(sys.argv[1])]))
"""


def digest(shape: str, seed: int, dtype: str) -> str:
    h = xxhash.xxh3_128()
    for name, p in load_model("shape:" + shape, dtype=dtype, seed=seed).model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        h.update(p.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_bit_identical_in_another_process() -> None:
    env = {
        **os.environ,
        "PYTHONHASHSEED": str(int(os.environ.get("PYTHONHASHSEED", "0") or 0) + 4711),
    }
    result = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(result.stdout) == [digest(*case) for case in CASES]


def test_seed_shape_and_dtype_change_the_weights() -> None:
    digests = {digest(*case) for case in CASES}
    digests |= {digest("tiny-llama", 1, "float32"), digest("tiny-llama", 0, "bfloat16")}
    assert len(digests) == len(CASES) + 2
    a = dict(load_model("shape:tiny-qwen3", seed=0).model.named_parameters())
    b = dict(load_model("shape:tiny-qwen3", seed=1).model.named_parameters())
    for name in a:  # every tensor changes with the seed, not just some
        assert not torch.equal(a[name], b[name]), name
    # Each parameter draws its own stream: same-shaped tensors differ.
    q0, q1 = (
        a["model.layers.0.self_attn.qkv_proj.weight"],
        a["model.layers.1.self_attn.qkv_proj.weight"],
    )
    assert not torch.equal(q0, q1)


@pytest.mark.parametrize(
    ("shape", "dtype"), [("tiny-llama", "float32"), ("tiny-gemma3", "bfloat16")]
)
def test_values_lie_in_the_intended_range(shape: str, dtype: str) -> None:
    loaded = load_model("shape:" + shape, dtype=dtype, seed=3)
    norm_center = 0.0 if loaded.config.unit_offset_norms else 1.0
    for name, p in loaded.model.named_parameters():
        center, half = (norm_center, 0.1) if name.endswith("norm.weight") else (0.0, BOUND)
        lo, hi = (torch.tensor(v, dtype=p.dtype).item() for v in (center - half, center + half))
        values = p.float()
        assert lo <= values.min().item() and values.max().item() <= hi, name
        # Spread over the whole interval, centred: a wrong scale or offset shows here.
        if p.numel() >= 1000:
            assert values.max().item() - values.min().item() > 1.9 * half, name
            assert abs(values.mean().item() - center) < 0.05 * half, name
            assert abs(values.std().item() - half / math.sqrt(3.0)) < 0.05 * half, name
        else:
            assert values.max().item() - values.min().item() > half, name


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3.5"])
def test_every_parameter_is_written(monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    empty = loader.empty_model

    def nan_model(*args: object) -> CausalLM:
        model = empty(*args)  # type: ignore[arg-type]
        for p in model.parameters():
            p.fill_(float("nan"))
        return model

    monkeypatch.setattr(loader, "empty_model", nan_model)
    model = load_model("shape:" + shape, seed=2).model
    assert not list(model.buffers())
    for name, p in model.named_parameters():
        assert not p.isnan().any(), name


def test_slicing_does_not_change_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = torch.empty(10_000)
    fill_uniform_(whole, key=12345, low=-1.0, high=1.0)
    monkeypatch.setattr(random_weights, "_SLICE", 999)
    sliced = torch.full((10_000,), float("nan"))
    fill_uniform_(sliced, key=12345, low=-1.0, high=1.0)
    assert torch.equal(whole, sliced)


def test_fill_is_independent_of_the_model_instance() -> None:
    a = load_model("shape:tiny-llama", seed=5).model
    b = load_model("shape:tiny-llama", seed=5).model
    with torch.no_grad():
        for p in b.parameters():
            p.zero_()
    fill_random_weights_(b, 5, unit_offset_norms=False)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_weights_id_names_shape_seed_and_dtype() -> None:
    assert (
        load_model("shape:tiny-qwen3", seed=9, dtype="bfloat16").weights_id
        == "random:tiny-qwen3:9:bfloat16"
    )
    assert load_model("shape:tiny-llama").weights_id == "random:tiny-llama:0:float32"
    assert load_model("shape:tiny-llama", dtype="fp16").weights_id == "random:tiny-llama:0:float16"


def test_unknown_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown shape preset 'nope'; known: .*tiny-llama"):
        load_model("shape:nope")


@pytest.mark.cuda
def test_cuda_weights_equal_cpu_weights() -> None:
    cpu = load_model("shape:tiny-gemma3", dtype="bfloat16", seed=4).model
    gpu = load_model("shape:tiny-gemma3", dtype="bfloat16", seed=4, device="cuda").model
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert torch.equal(a, b.cpu()), name
    big_cpu, big_gpu = torch.empty(3 << 23), torch.empty(3 << 23, device="cuda")  # spans slices
    fill_uniform_(big_cpu, key=-77, low=-0.5, high=0.5)
    fill_uniform_(big_gpu, key=-77, low=-0.5, high=0.5)
    assert torch.equal(big_cpu, big_gpu.cpu())
