"""DerivedTensor: a parameter-derived tensor computed once, and again whenever a source changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvshare.models.layers import DerivedTensor
from kvshare.models.loader import load_model
from kvshare.models.random_weights import fill_random_weights_
from tests.models.dense_context import DenseContext, greedy


class Counted:
    def __init__(self, param: nn.Parameter) -> None:
        self.param, self.calls = param, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return 1.0 + self.param


def test_computed_once_while_the_source_is_unchanged() -> None:
    param = nn.Parameter(torch.zeros(4))
    derived, compute = DerivedTensor(), Counted(param)
    first = derived.get((param,), compute)
    assert derived.get((param,), compute) is first and compute.calls == 1
    assert torch.equal(first, torch.ones(4))


@pytest.mark.parametrize(
    "change",
    [
        lambda p: None,  # no change: the control case, nothing recomputed
        lambda p: torch.no_grad()(p.add_)(1.0),  # in place, as the loaders write weights
        lambda p: setattr(p, "data", torch.full((4,), 2.0)),  # as Module.to moves them
    ],
    ids=["unchanged", "in-place", "new-storage"],
)
def test_recomputed_when_the_source_changes(change) -> None:
    param = nn.Parameter(torch.zeros(4))
    derived, compute = DerivedTensor(), Counted(param)
    derived.get((param,), compute)
    change(param)
    value = derived.get((param,), compute)
    assert torch.equal(value, 1.0 + param.detach())
    unchanged = compute.calls == 1
    assert unchanged == (torch.count_nonzero(param.detach()) == 0)


def test_computed_in_inference_mode_serves_a_forward_that_records_autograd() -> None:
    param = nn.Parameter(torch.zeros(4))
    derived = DerivedTensor()
    with torch.inference_mode():
        derived.get((param,), lambda: 1.0 + param)
    x = torch.ones(4, requires_grad=True)
    (x * derived.get((param,), lambda: 1.0 + param)).sum().backward()
    assert torch.equal(x.grad, torch.ones(4))


def test_a_model_that_has_run_follows_a_reload_of_its_weights() -> None:
    """Gated DeltaNet's kept -exp(A_log) and dt_bias are what the weights are now: a tiny
    Qwen3.5 run with one seed's weights, then filled in place with another seed's, answers
    exactly as a model loaded with the second seed. (The norms keep 1 + w on CUDA only.)"""
    reloaded = load_model("shape:tiny-qwen3.5", seed=7).model
    prompt = list(range(3, 40))
    first, _ = greedy(reloaded, DenseContext(reloaded.config, torch.float32), prompt, 2)
    fill_random_weights_(reloaded, 8, unit_offset_norms=reloaded.config.unit_offset_norms)
    fresh = load_model("shape:tiny-qwen3.5", seed=8).model
    got, got_tokens = greedy(reloaded, DenseContext(reloaded.config, torch.float32), prompt, 4)
    want, want_tokens = greedy(fresh, DenseContext(fresh.config, torch.float32), prompt, 4)
    assert not torch.equal(first, want)  # the seeds differ where the test looks
    assert torch.equal(got, want) and got_tokens == want_tokens
