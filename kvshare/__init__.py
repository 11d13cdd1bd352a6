"""kvshare: share prefix KV cache between LLM inference replicas through one host-memory pool.

`from kvshare import LLM, SamplingParams` is the offline API; torch loads on first use so
that the `kvshare` command starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvshare.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvshare.engine.sampling_params import SamplingParams
    from kvshare.llm import LLM


def __getattr__(name: str) -> object:
    if name == "LLM":
        from kvshare.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvshare.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvshare' has no attribute {name!r}")
