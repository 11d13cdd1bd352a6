"""Bench fixtures: the SmolLM2 prompt model (tokenizer only) and a fake cluster per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.bench.synthetic import PromptModel, load_prompt_model
from tests.bench.fake_server import FakeCluster, RunningFake, serve_in_thread


@pytest.fixture(scope="session")
def smollm2() -> PromptModel:
    return load_prompt_model("smollm2-135m")


@pytest.fixture
def fake() -> Iterator[RunningFake]:
    yield from serve_in_thread(FakeCluster())
