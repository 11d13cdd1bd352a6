"""Load a GGUF checkpoint as Hugging Face-style config, float32 weights and tokenizer.

Weights come out exactly as transformers' GGUF loader produces them: dequantized to float32, in
HF's [out_features, in_features] layout, under HF parameter names, with llama.cpp's reordering of
the attention query/key rows undone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import xxhash

from kvshare.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama",)

_DIGEST_CHUNK_BYTES = 16 << 20

# GGUF tensor name -> HF parameter name, for tensors outside the decoder blocks.
_LLAMA_GLOBAL_TENSORS: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# `blk.N.<key>` -> `model.layers.N.<value>`.
_LLAMA_BLOCK_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GGUFModel:
    config: dict[str, Any]  # an HF config.json dict
    tensors: dict[str, np.ndarray]  # HF parameter name -> float32, HF layout
    tokenizer: Tokenizer
    file_digest: str  # xxh3_128 hex of the file's bytes: identifies the exact weights


def read_gguf(path: str | Path) -> GGUFModel:
    """Read and dequantize a whole GGUF file. Raises ValueError for what it cannot load faithfully."""
    reader = gguf.GGUFReader(path)
    metadata = _metadata(reader)
    _check_architecture(metadata)
    has_lm_head = any(tensor.name == "output.weight" for tensor in reader.tensors)
    config = llama_config(metadata, tie_word_embeddings=not has_lm_head)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)  # before the slow part: it may refuse too
    tensors = {hf_tensor_name(tensor.name): _hf_weight(tensor, config) for tensor in reader.tensors}
    _check_shapes(tensors, config)
    return GGUFModel(
        config=config, tensors=tensors, tokenizer=tokenizer, file_digest=file_digest(path)
    )


def read_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file; no tensor is read."""
    return Tokenizer.from_gguf_metadata(_metadata(gguf.GGUFReader(path)))


def file_digest(path: str | Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while chunk := file.read(_DIGEST_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def llama_config(metadata: Mapping[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """The HF `LlamaConfig` dict that the `llama.*` metadata describes."""

    def field(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    num_heads = field("attention.head_count")
    hidden_size = field("embedding_length")
    num_kv_heads = field("attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ValueError("per-layer llama.attention.head_count_kv is not supported")
    head_dim = field("attention.key_length", hidden_size // num_heads)
    if field("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            "partial rotary embeddings (rope.dimension_count != head_dim) are not supported"
        )
    if metadata.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"rope scaling {metadata['llama.rope.scaling.type']!r} is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": field("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        "hidden_size": hidden_size,
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _exact_float32(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": _exact_float32(field("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": field("context_length"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _LLAMA_GLOBAL_TENSORS:
        return _LLAMA_GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LLAMA_BLOCK_TENSORS:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"model.layers.{match[1]}.{_LLAMA_BLOCK_TENSORS[match[2]]}"


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to attn_q / attn_k.

    HF's rotary embedding pairs dimension i of a head with i + head_dim/2 (`rotate_half`);
    llama.cpp's llama rope pairs dimensions 2i and 2i+1. So `convert_hf_to_gguf.py` reorders each
    head's rows from [a_0 .. a_{d/2-1}, b_0 .. b_{d/2-1}] to [a_0, b_0, a_1, b_1, ...]
    (`reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`); this is the inverse.
    """
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    # `GGUF.*` fields are the file header (version, counts), not key/value metadata.
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def _check_architecture(metadata: Mapping[str, Any]) -> None:
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )


def _hf_weight(tensor: gguf.ReaderTensor, config: Mapping[str, Any]) -> np.ndarray:
    # numpy's shape for a GGUF tensor is its ggml dims reversed: [rows, row_length], which for a
    # matrix is already HF's [out_features, in_features]. np.array copies off the file's memmap.
    weight = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if tensor.name.endswith(".attn_q.weight"):
        return unpermute_rotary_rows(weight, config["num_attention_heads"])
    if tensor.name.endswith(".attn_k.weight"):
        return unpermute_rotary_rows(weight, config["num_key_value_heads"])
    return weight


def _check_shapes(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> None:
    expected = _llama_shapes(config)
    if tensors.keys() != expected.keys():
        missing, extra = (
            sorted(expected.keys() - tensors.keys()),
            sorted(tensors.keys() - expected.keys()),
        )
        raise ValueError(
            f"GGUF tensors do not match the config: missing {missing}, unexpected {extra}"
        )
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"{name} has shape {tensors[name].shape}, the config implies {shape}")


def _llama_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    block = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in block.items()})
    return shapes


def _exact_float32(value: float) -> float:
    # GGUF stores these as float32: 1e-5 comes back as 9.999999747378752e-06. The shortest decimal
    # that round-trips the float32 is the value the model's config.json had.
    return float(str(np.float32(value)))
