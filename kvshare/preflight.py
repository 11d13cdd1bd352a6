"""Checks before a command loads a model: the device exists, and the model fits in its memory.

Without them a missing GPU surfaces as a traceback from deep inside torch, and a model
larger than the machine's memory as minutes of silence and then the OOM killer. Each
check raises ValueError with one sentence that says what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvshare.sizes import format_size

if TYPE_CHECKING:
    from kvshare.serve.launcher import UpConfig

CPU_KV_CACHE_BYTES = 1 << 30  # the engine's KV cache on the CPU when none is given
_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    if resolved not in _ITEM_BYTES:
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
        return MemoryNeed(preset.num_parameters() * _ITEM_BYTES[resolved], kv, resolved)
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


def check_up(config: UpConfig) -> None:
    """`kvshare up`'s replicas, all on config.device, fit in its memory."""
    from kvshare.engine.config import EngineConfig

    engine = EngineConfig.from_argv(config.engine_args)
    check_model_fits(
        config.model, config.device, engine.dtype, engine.kv_cache_memory, engines=config.replicas
    )


def check_model_fits(
    model: str, device: str, dtype: str, kv_cache_memory: int | None = None, engines: int = 1
) -> None:
    """`engines` engines of `model` fit in `device`'s memory (estimated; unknown models pass)."""
    check_device(device)
    need = memory_need(model, device, dtype, kv_cache_memory)
    if need is None:
        return
    have = available_bytes(device)
    if engines * need.total <= have:
        return
    where = "GPU memory free" if device.startswith("cuda") else "RAM available"
    what = f"{engines} x " if engines > 1 else ""
    kv = f" + KV cache {format_size(need.kv_bytes)}" if need.kv_bytes else ""
    raise ValueError(
        f"{model} needs about {what}{format_size(need.total)} (weights {format_size(need.weights_bytes)} "
        f"in {need.dtype}{kv}) but {device} has {format_size(have)} {where}: use a smaller model, "
        f"{'--dtype bfloat16, ' if need.dtype == 'float32' else ''}fewer replicas or another device"
    )
