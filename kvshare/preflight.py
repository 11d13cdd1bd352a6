"""Checks before a command loads a model: the device exists, and the model fits in its memory.

Without them a missing GPU surfaces as a traceback from deep inside torch, and a model
larger than the machine's memory as minutes of silence and then the OOM killer. Each
check raises ValueError with one sentence that says what to change.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvshare.engine.config import EngineConfig
from kvshare.engine.memory import (
    ITEM_BYTES,
    DeviceMemoryPlan,
    kv_bytes_per_token,
    plan_device_memory,
    staging_bytes,
)
from kvshare.sizes import format_size

if TYPE_CHECKING:
    from kvshare.models.config import ModelConfig
    from kvshare.serve.launcher import UpConfig

CPU_KV_CACHE_BYTES = 1 << 30  # the engine's KV cache on the CPU when none is given


@dataclass(frozen=True)
class MemoryNeed:
    """Estimated bytes one engine holds: weights, and the KV cache when its size is known."""

    weights_bytes: int
    kv_bytes: int
    dtype: str

    @property
    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes


def check_device(device: str) -> None:
    """`device` is cpu, or a CUDA device this torch can use."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {device}: expected cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        build = (
            f"a CPU build ({torch.__version__})"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}, but sees no GPU"
        )
        raise ValueError(
            f"--device {device}: no CUDA GPU is usable here (torch is {build}); use --device cpu"
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
            f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )


def memory_need(
    model: str, device: str, dtype: str, kv_cache_memory: int | None
) -> MemoryNeed | None:
    """The estimate for `model` (shape:NAME or a local file/folder); None when it is unknown."""
    resolved = (
        dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    )
    if resolved not in ITEM_BYTES:
        return None
    kv = (
        kv_cache_memory
        if kv_cache_memory is not None
        else (0 if device.startswith("cuda") else CPU_KV_CACHE_BYTES)
    )
    if model.startswith("shape:"):
        from kvshare.models.presets import SHAPE_PRESETS

        preset = SHAPE_PRESETS.get(model.removeprefix("shape:"))
        if preset is None:
            return None
        return MemoryNeed(preset.num_parameters() * ITEM_BYTES[resolved], kv, resolved)
    path = Path(model)
    if path.is_file():
        return MemoryNeed(path.stat().st_size, kv, resolved)
    if path.is_dir():
        weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        return MemoryNeed(weights, kv, resolved) if weights else None
    return None


def available_bytes(device: str) -> int:
    """Memory a new engine on `device` can take now: free GPU memory, or available RAM."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def model_config(model: str) -> ModelConfig | None:
    """The shape of `model` (shape:NAME or an HF folder) without loading it; None when unknown."""
    from kvshare.models.config import ModelConfig

    if model.startswith("shape:"):
        from kvshare.models.presets import SHAPE_PRESETS

        return SHAPE_PRESETS.get(model.removeprefix("shape:"))
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    try:
        return ModelConfig.from_hf(json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def device_plan(
    model: str,
    engine: EngineConfig,
    device_bytes: int,
    pool_chunk_tokens: int | None = None,
) -> DeviceMemoryPlan | None:
    """The engine's device-memory budget for `model` on a device of `device_bytes`, as the
    engine will compute it at start (weights estimated, the pool's staging buffers when
    `pool_chunk_tokens` is given); None when the model's shape or size is unknown.
    ValueError naming the parts when they do not fit."""
    config = model_config(model)
    need = memory_need(model, engine.device, engine.dtype, engine.kv_cache_memory)
    if config is None or need is None:
        return None
    staging = 0
    if pool_chunk_tokens is not None:
        staging = staging_bytes(kv_bytes_per_token(config, engine) * pool_chunk_tokens)
    graphs = engine.cuda_graphs and need.dtype in ("bfloat16", "float16")
    return plan_device_memory(config, engine, device_bytes, need.weights_bytes, staging, graphs)


def check_up(config: UpConfig) -> None:
    """`kvshare up`'s replicas, all on config.device, fit in its memory."""
    engine = EngineConfig.from_argv(config.engine_args)
    fraction = config.replica_gpu_fraction
    if fraction is not None:
        engine = replace(engine, device=config.device, gpu_memory_fraction=fraction)
    check_model_fits(
        config.model,
        config.device,
        engine.dtype,
        engine.kv_cache_memory,
        engines=config.replicas,
        engine=engine,
        pool_chunk_tokens=config.chunk_tokens if config.kv_pool else None,
    )


def check_model_fits(
    model: str,
    device: str,
    dtype: str,
    kv_cache_memory: int | None = None,
    engines: int = 1,
    engine: EngineConfig | None = None,
    pool_chunk_tokens: int | None = None,
) -> None:
    """`engines` engines of `model` fit in `device`'s memory (estimated; unknown models pass).
    On CUDA each engine's whole budget (`engine`'s gpu_memory_fraction) must fit, and the
    engines' shares together must fit the memory free now."""
    check_device(device)
    if device.startswith("cuda"):
        _check_gpu_fits(model, device, engines, engine, dtype, kv_cache_memory, pool_chunk_tokens)
        return
    need = memory_need(model, device, dtype, kv_cache_memory)
    if need is None:
        return
    have = available_bytes(device)
    if engines * need.total <= have:
        return
    what = f"{engines} x " if engines > 1 else ""
    kv = f" + KV cache {format_size(need.kv_bytes)}" if need.kv_bytes else ""
    raise ValueError(
        f"{model} needs about {what}{format_size(need.total)} (weights {format_size(need.weights_bytes)} "
        f"in {need.dtype}{kv}) but {device} has {format_size(have)} RAM available: use a smaller model, "
        f"{'--dtype bfloat16, ' if need.dtype == 'float32' else ''}fewer replicas or another device"
    )


def _check_gpu_fits(
    model: str,
    device: str,
    engines: int,
    engine: EngineConfig | None,
    dtype: str,
    kv_cache_memory: int | None,
    pool_chunk_tokens: int | None,
) -> None:
    import torch

    if engine is None:
        engine = EngineConfig(device=device, dtype=dtype, kv_cache_memory=kv_cache_memory)
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        plan = device_plan(model, engine, total, pool_chunk_tokens)
    except ValueError as exc:
        raise ValueError(f"{model}: {exc}") from None
    if plan is None:
        return
    have = available_bytes(device)
    if engines * plan.limit > have:
        what = f"{engines} x " if engines > 1 else ""
        raise ValueError(
            f"{model} takes {what}{format_size(plan.limit)} (--gpu-memory-fraction "
            f"{engine.gpu_memory_fraction:g} of {format_size(total)}) but {device} has "
            f"{format_size(have)} GPU memory free: lower the fraction, or use fewer replicas"
        )
