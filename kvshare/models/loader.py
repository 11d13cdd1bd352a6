"""One loader for every model source: HF directory, GGUF file, packaged alias, random shape.

`load_model(spec)` returns the model on its device, in its dtype, with its tokenizer (when
the source has one) and a `weights_id` that names the exact weights: the pool namespace
uses it so that replicas with different weights never share KV.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvshare.models.config import ModelConfig
from kvshare.models.decoder import PACKED_PARAMETERS, CausalLM, packed_shard_sizes
from kvshare.models.presets import shape_preset
from kvshare.models.random_weights import fill_random_weights_
from kvshare.models.tokenizer import Tokenizer
from kvshare.spec import SHAPE_PREFIX

_CHECKPOINT_PREFIXES = ("model.language_model.", "language_model.")
# Parts of multimodal / multi-token-prediction checkpoints (Qwen3.5) a text model does not use.
_UNUSED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_FUSED = tuple(dict.fromkeys(fused for fused, _ in PACKED_PARAMETERS.values()))


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    weights_id: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
) -> LoadedModel:
    """Load `spec`: an alias (smollm2-135m), a .gguf file, an HF directory or shape:NAME."""
    device = torch.device(device)
    torch_dtype = parse_dtype(dtype)
    if spec.startswith(SHAPE_PREFIX):
        return _load_random(spec, device, torch_dtype, seed)
    path = resolve_model_path(spec)
    if path.suffix == ".gguf":
        return _load_gguf(spec, path, device, torch_dtype)
    if path.is_dir() and (path / "config.json").exists():
        return _load_hf_dir(path, device, torch_dtype)
    raise ValueError(
        f"{spec!r} is neither a packaged alias, a .gguf file, an HF directory nor shape:NAME"
    )


def load_tokenizer(spec: str | None) -> Tokenizer | None:
    """The tokenizer of a model spec, found as load_model finds it, reading no weights.

    None for no spec, for `shape:NAME` and for an HF directory without tokenizer.json (the
    engine then has none either). Routing keys and benchmark prompts use this so that they
    tokenize exactly as the replicas do.
    """
    if spec is None or spec.startswith(SHAPE_PREFIX):
        return None
    path = resolve_model_path(spec)
    if path.suffix == ".gguf":
        from kvshare.models.gguf_file import read_gguf_tokenizer

        return read_gguf_tokenizer(path)
    if path.is_dir() and (path / "config.json").exists():
        return Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    raise ValueError(
        f"{spec!r} is neither a packaged alias, a .gguf file, an HF directory nor shape:NAME"
    )


def resolve_model_path(spec: str) -> Path:
    """The file or directory behind a packaged alias or a path."""
    from kvshare.models.packaged import PACKAGED_ALIASES, packaged_model_path

    if spec in PACKAGED_ALIASES:
        return packaged_model_path(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {spec!r} not found (no such file or directory, not an alias)"
        )
    return path


def empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The module tree with uninitialized storage on `device` (no wasted init pass)."""
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    return model.to_empty(device=device).eval().requires_grad_(False)


def _load_random(spec: str, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    shape = spec[len(SHAPE_PREFIX) :]
    config = shape_preset(shape)
    model = empty_model(config, device, dtype)
    fill_random_weights_(model, seed, unit_offset_norms=config.unit_offset_norms)
    weights_id = f"random:{shape}:{seed}:{str(dtype).removeprefix('torch.')}"
    return LoadedModel(name=spec, config=config, model=model, tokenizer=None, weights_id=weights_id)


def _load_gguf(spec: str, path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from kvshare.models.gguf_file import read_gguf

    gguf = read_gguf(path)
    config = ModelConfig.from_hf(gguf.config)
    model = empty_model(config, device, dtype)
    load_weights_(
        model, ((name, torch.from_numpy(np.asarray(t))) for name, t in gguf.tensors.items())
    )
    return LoadedModel(
        name=spec,
        config=config,
        model=model,
        tokenizer=gguf.tokenizer,
        weights_id=f"gguf:{gguf.file_digest}",
    )


def _load_hf_dir(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    model = empty_model(config, device, dtype)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)

    load_weights_(model, tensors())
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    return LoadedModel(
        name=path.name,
        config=config,
        model=model,
        tokenizer=tokenizer,
        weights_id=f"hf:{_files_digest(files)}",
    )


def _files_digest(files: Iterable[Path]) -> str:
    digest = xxhash.xxh3_128()
    for file in files:
        with file.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def load_weights_(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model`, packing q/k/v, gate/up and GDN in_proj_* into fused params.

    Every parameter must be written exactly once; a missing or unexpected tensor is an error
    (a silently uninitialized weight would be garbage output).
    """
    params = dict(model.named_parameters())
    written: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in tensors:
            if hf_name.startswith(_UNUSED_PREFIXES):
                continue
            name = hf_name
            for prefix in _CHECKPOINT_PREFIXES:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix) :]
            if name == "lm_head.weight" and model.lm_head is None:
                continue  # tied to the embedding
            target, shard = _packed_target(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}"
                )
            param = params[target]
            if shard is None:
                _copy_checked(param, tensor, hf_name)
                written.add(target)
            else:
                rows = _shard_rows(model, target, shard)
                _copy_checked(param[rows], tensor, hf_name)
                written.add(f"{target}#{shard}")
    expected = set()
    for name in params:
        fused = _fused_of(name)
        shards = len(packed_shard_sizes(model.config, fused)) if fused else 0
        expected.update({name} if shards == 0 else {f"{name}#{i}" for i in range(shards)})
    if missing := sorted(expected - written):
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _packed_target(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in PACKED_PARAMETERS.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def _fused_of(name: str) -> str | None:
    return next((fused for fused in _FUSED if f".{fused}." in name), None)


def _shard_rows(model: CausalLM, target: str, shard: int) -> slice:
    fused = _fused_of(target)
    assert fused is not None
    sizes = packed_shard_sizes(model.config, fused)
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under HF checkpoint names, fused ones split back into their
    parts (copies): what `load_weights_` reads, e.g. to build an HF reference model."""
    parts: dict[str, list[str]] = {}
    for part, (fused, _) in sorted(PACKED_PARAMETERS.items(), key=lambda item: item[1][1]):
        parts.setdefault(fused, []).append(part)
    out = {}
    for name, param in model.named_parameters():
        fused = _fused_of(name)
        if fused is None:
            out[name] = param.detach().clone()
            continue
        chunks = param.detach().split(packed_shard_sizes(model.config, fused), dim=0)
        for part, chunk in zip(parts[fused], chunks):
            out[name.replace(f".{fused}.", f".{part}.")] = chunk.clone()
    return out


def _copy_checked(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dest.shape)}"
        )
    dest.copy_(src)
