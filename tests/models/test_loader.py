"""HF directory loading (round trip through transformers' save_pretrained), checkpoint
errors, ModelConfig validation and the HF config round trip of every shape preset."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvshare.models.config import ModelConfig, RopeConfig
from kvshare.models.loader import load_model
from kvshare.models.presets import SHAPE_PRESETS, shape_preset

TINY = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_model(config: ModelConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """The HF model of `config` with every parameter random (norms included)."""
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    return model


def hf_tensor_for(ours: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    for fused, parts in FUSED.items():
        if f".{fused}." in ours:
            return torch.cat([hf[ours.replace(fused, part)] for part in parts])
    return hf[ours]


@pytest.fixture(scope="module", params=TINY)
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, dict]:
    name = request.param
    path = tmp_path_factory.mktemp(name)
    model = hf_model(shape_preset(name))
    model.save_pretrained(path)
    return name, path, {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_directory_round_trip(saved: tuple[str, Path, dict]) -> None:
    name, path, hf = saved
    assert list(path.glob("*.safetensors"))
    loaded = load_model(str(path))
    assert loaded.config == shape_preset(name)
    assert loaded.weights_id.startswith("hf:") and loaded.tokenizer is None
    params = dict(loaded.model.named_parameters())
    for ours, p in params.items():
        assert torch.equal(p, hf_tensor_for(ours, hf)), ours
    if not loaded.config.tie_word_embeddings:
        assert torch.equal(loaded.model.lm_head.weight, hf["lm_head.weight"])
    # Every HF tensor landed somewhere (tied lm_head aside).
    covered = {
        n.replace(fused, part)
        for n in params
        for fused, parts in FUSED.items()
        if f".{fused}." in n
        for part in parts
    } | set(params)
    assert set(hf) - covered <= {"lm_head.weight"}


def test_hf_directory_in_bfloat16(saved: tuple[str, Path, dict]) -> None:
    _, path, hf = saved
    loaded = load_model(str(path), dtype="bfloat16")
    p = loaded.model.model.norm.weight
    assert p.dtype == torch.bfloat16 and torch.equal(p, hf["model.norm.weight"].to(torch.bfloat16))


def test_weights_id_follows_the_bytes(saved: tuple[str, Path, dict], tmp_path: Path) -> None:
    name, path, _ = saved
    first = load_model(str(path)).weights_id
    assert load_model(str(path)).weights_id == first
    hf_model(shape_preset(name), seed=1).save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).weights_id != first


def write_checkpoint(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def test_missing_tensor_is_a_clear_error(saved: tuple[str, Path, dict], tmp_path: Path) -> None:
    name, _, hf = saved
    tensors = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(
        ValueError, match=r"checkpoint lacks 1 tensors.*layers\.1\.self_attn\.qkv_proj\.weight#1"
    ):
        load_model(str(write_checkpoint(tmp_path, shape_preset(name), tensors)))


def test_wrong_shape_is_a_clear_error(saved: tuple[str, Path, dict], tmp_path: Path) -> None:
    name, _, hf = saved
    tensors = dict(hf)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.up_proj.weight' has shape \(127, 64\), expected \(128, 64\)",
    ):
        load_model(str(write_checkpoint(tmp_path, shape_preset(name), tensors)))


def test_unexpected_tensor_is_a_clear_error(saved: tuple[str, Path, dict], tmp_path: Path) -> None:
    name, _, hf = saved
    tensors = {**hf, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.extra\.weight' has no place"
    ):
        load_model(str(write_checkpoint(tmp_path, shape_preset(name), tensors)))


def test_multimodal_prefix_is_accepted(tmp_path: Path) -> None:
    config = shape_preset("tiny-gemma3")
    hf = hf_model(config).state_dict()
    # (lm_head is tied and stored anyway: the loader must skip it.)
    tensors = {k.replace("model.", "model.language_model.", 1): v.clone() for k, v in hf.items()}
    assert "lm_head.weight" in tensors
    loaded = load_model(str(write_checkpoint(tmp_path, config, tensors)))
    assert torch.equal(loaded.model.model.embed_tokens.weight, hf["model.embed_tokens.weight"])


def test_directory_without_weights_or_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(shape_preset("tiny-llama").to_hf()))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="neither"):
        load_model(str(tmp_path))


# ---- ModelConfig -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHAPE_PRESETS))
def test_hf_config_round_trip(name: str) -> None:
    config = SHAPE_PRESETS[name]
    back = ModelConfig.from_hf(json.loads(json.dumps(config.to_hf())))
    assert back == config
    assert back.digest() == config.digest()
    # A config read from HF converts back into one that transformers accepts.
    hf = transformers.AutoConfig.for_model(**back.to_hf())
    assert hf.num_hidden_layers == config.num_layers


def test_llama3_rope_round_trip() -> None:
    rope = RopeConfig(
        theta=5e5,
        scaling="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position=8192,
    )
    config = replace(shape_preset("tiny-llama"), rope=rope)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_equal_configs_have_equal_digests() -> None:
    base = shape_preset("tiny-gemma3")
    ints = replace(
        base,
        rope=replace(base.rope, theta=1_000_000, factor=8),
        query_pre_attn_scalar=16,
        rms_norm_eps=0,
    )
    floats = replace(
        base,
        rope=replace(base.rope, theta=1e6, factor=8.0),
        query_pre_attn_scalar=16.0,
        rms_norm_eps=0.0,
    )
    assert ints == floats and ints.digest() == floats.digest()
    assert replace(base, sliding_window=32).digest() != base.digest()


def test_gemma3_multimodal_config_is_unwrapped() -> None:
    config = shape_preset("tiny-gemma3")
    text = config.to_hf()
    del text["layer_types"]
    text["sliding_window_pattern"] = 6
    assert ModelConfig.from_hf({"model_type": "gemma3", "text_config": text}) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 0}, "vocab_size must be positive"),
        ({"num_layers": -1}, "num_layers must be positive"),
        ({"num_kv_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"layer_kinds": ("full",)}, "1 layer kinds for 2 layers"),
        ({"layer_kinds": ("full", "sliding")}, "sliding layers need a positive sliding_window"),
        ({"architecture": "gemma3"}, "gemma3 needs query_pre_attn_scalar"),
    ],
)
def test_invalid_model_config(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(shape_preset("tiny-llama"), **change)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"theta": 0.0}, "rope theta must be positive"),
        ({"factor": -1.0}, "rope scaling factor must be positive"),
    ],
)
def test_invalid_rope_config(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeConfig(**{"theta": 1e4, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
        ({"hidden_act": "relu"}, "unsupported activation 'relu'"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "unsupported rope scaling type 'yarn'",
        ),
    ],
)
def test_unsupported_hf_configs(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**shape_preset("tiny-qwen3").to_hf(), **change})
