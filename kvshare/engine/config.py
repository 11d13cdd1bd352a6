"""Engine configuration, checked at construction, and its command-line flags.

A field with `flag(...)` metadata is an engine flag of every command that runs an engine
(`kvshare serve`, `generate`, `up`, ...): `add_arguments` defines it, `from_args` reads it
back and `to_argv` renders it for a child process (`kvshare up` -> `kvshare serve`).
Adding an engine option is adding one such field. This module does not load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvshare.sizes import parse_size

AttentionBackendName = Literal["auto", "sdpa", "varlen"]
ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = ("auto", "sdpa", "varlen")
KVCacheDtype = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("auto", "fp8")
_FLAG = "kvshare.flag"
# A CUDA replica's restores by default: on the H200 a 131,072-token hit of shape:qwen3.5-27b
# took 179 ms in 4 even groups against 211 ms whole (bf16; fp8 102 against 141;
# docs/results/2026-12-05-h200-session.md). Up to 8 lets the groups shrink to one slot at
# the end (kvpool.transfer.LayerGroups).
CUDA_LAYER_GROUPS = 8


@dataclass(frozen=True)
class Flag:
    """How one field is a command-line flag: `parse` reads its text, `render` writes it
    back (parse(render(v)) == v). A bool field is an on/off pair (--x / --no-x)."""

    help: str
    parse: Callable[[str], Any] | None = None
    render: Callable[[Any], str] = str
    choices: tuple[str, ...] | None = None


def flag(default: Any, help: str, **how: Any) -> Any:
    """A dataclass field with a default that is also a command-line flag (see Flag)."""
    return field(default=default, metadata={_FLAG: Flag(help, **how)})


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    KV cache size: `kv_cache_memory` bytes when given; otherwise on CUDA the cache takes
    what is left of `gpu_memory_fraction` of the device after everything else the engine
    allocates there (kvshare.engine.memory), and on the CPU 1 GiB. `gpu_memory_fraction`
    bounds all of the replica's device memory, so several replicas can share one GPU.
    """

    device: str = flag("cpu", "cpu or cuda[:N]")
    dtype: str = flag("auto", "auto, float32, bfloat16, float16")
    block_size: int = flag(16, "tokens per KV cache block (a power of two)", parse=int)
    max_num_batched_tokens: int = flag(
        4096, "token budget of one engine step (prefill chunk size)", parse=int
    )
    max_num_seqs: int = flag(64, "most sequences in one engine step", parse=int)
    max_model_len: int | None = flag(
        None,
        "longest prompt + output in tokens; refused at start past the model's context or the "
        "KV cache (default: the model's context, capped at the cache)",
        parse=int,
    )
    kv_cache_memory: int | None = flag(None, "KV cache size, e.g. 2GiB", parse=_size)
    gpu_memory_fraction: float = flag(
        0.9, "share of the GPU this replica may use, everything included", parse=float, render=repr
    )
    enable_prefix_caching: bool = flag(
        True, "reuse the KV of prompt prefixes already on the device"
    )
    attention_backend: AttentionBackendName = flag(
        "auto",
        "attention kernel (auto: varlen on CUDA in bfloat16/float16, else sdpa)",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_dtype: KVCacheDtype = flag(
        "auto",
        "KV cache storage: auto (the model's dtype) or fp8 (e4m3, a float32 scale per token "
        "and KV head: about half of bfloat16's bytes)",
        choices=KV_CACHE_DTYPES,
    )
    cuda_graphs: bool = flag(True, "capture decode steps as CUDA graphs (CUDA only)")
    pool_load_layer_groups: int = flag(
        0,
        "bring a pool restore in at most this many groups of layers, so that the step's "
        "first layers compute while the last are still copied (1: whole pages; 0: "
        f"{CUDA_LAYER_GROUPS} on CUDA, whole on the CPU; global attention layers only, "
        "each group's part of a page at least 512 KiB, the groups shrinking toward the end)",
        parse=int,
    )
    seed: int = 0
    # Hybrid (linear-attention) models: recurrent-state snapshots kept on the device for
    # prefix reuse, and how often a long prefill leaves one (besides its last chunk boundary).
    num_state_snapshots: int = 8
    snapshot_interval_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least one block")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not 0.05 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in [0.05, 1], got {self.gpu_memory_fraction}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.num_state_snapshots < 0 or self.snapshot_interval_tokens < self.block_size:
            raise ValueError(
                "num_state_snapshots must be >= 0 and snapshot_interval_tokens >= block_size"
            )
        if self.pool_load_layer_groups < 0:
            raise ValueError(
                f"pool_load_layer_groups must be >= 0, got {self.pool_load_layer_groups}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def resolved_pool_load_layer_groups(self) -> int:
        """Groups of layers a restore comes in. Auto (0): CUDA_LAYER_GROUPS on CUDA, where
        the copy engine brings the last layers while the first compute; whole on the CPU,
        where the copies run on the cores that compute."""
        if self.pool_load_layer_groups:
            return self.pool_load_layer_groups
        return CUDA_LAYER_GROUPS if self.device.startswith("cuda") else 1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per flagged field (--max-num-seqs for max_num_seqs), its default the field's."""
        for each, how in _flags():
            name = "--" + each.name.replace("_", "-")
            if each.type in (bool, "bool"):
                parser.add_argument(
                    name, action=argparse.BooleanOptionalAction, default=each.default, help=how.help
                )
            else:
                parser.add_argument(
                    name, type=how.parse, default=each.default, choices=how.choices, help=how.help
                )

    @classmethod
    def flag_values(cls, source: object) -> dict[str, Any]:
        """The flagged fields' values of `source`, parsed arguments or a config (keyword
        arguments of EngineConfig)."""
        return {each.name: getattr(source, each.name) for each, _ in _flags()}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of parsed arguments (ValueError if they are invalid)."""
        return cls(**cls.flag_values(args))

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> EngineConfig:
        """The config that engine flags in `argv` give; other flags are ignored
        (ValueError if the engine flags are invalid)."""
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
        cls.add_arguments(parser)
        try:
            args, _ = parser.parse_known_args(list(argv))
        except argparse.ArgumentError as exc:
            raise ValueError(str(exc)) from None
        return cls.from_args(args)

    def to_argv(self, exclude: Collection[str] = ()) -> tuple[str, ...]:
        """The flags that make `from_args` return this config (fields without a flag keep
        their defaults); a field named in `exclude` is left out."""
        argv: list[str] = []
        for each, how in _flags():
            value = getattr(self, each.name)
            name = "--" + each.name.replace("_", "-")
            if each.name in exclude or value is None:
                continue
            if isinstance(value, bool):
                argv.append(name if value else "--no-" + name[2:])
            else:
                argv += [name, how.render(value)]
        return tuple(argv)


def _flags() -> list[tuple[dataclasses.Field, Flag]]:
    return [
        (each, each.metadata[_FLAG])
        for each in dataclasses.fields(EngineConfig)
        if _FLAG in each.metadata
    ]
