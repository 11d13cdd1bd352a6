"""Model configuration: one frozen dataclass for every supported decoder family.

The config is the single description of a model's shape that the engine, the pool
namespace and the loaders agree on. It converts from and to HF `config.json` dicts, so
that checkpoints load directly and tests can build the HF reference model from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import xxhash

Architecture = Literal["llama", "qwen3", "gemma3"]
LayerKind = Literal["full", "sliding"]
RopeScaling = Literal["default", "linear", "llama3"]
Activation = Literal["silu", "gelu_tanh"]

_HF_MODEL_TYPES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_HF_ARCHITECTURES: dict[Architecture, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer kind. `factor` and the llama3 fields apply to scaled types."""

    theta: float
    scaling: RopeScaling = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        # Floats, so that equal configs (e.g. theta 10000 and 10000.0) have equal digests.
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")

    @classmethod
    def from_hf(cls, theta: float, scaling: dict[str, Any] | None) -> RopeConfig:
        if not scaling:
            return cls(theta=theta)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return cls(theta=theta)
        if kind == "linear":
            return cls(theta=theta, scaling="linear", factor=float(scaling["factor"]))
        if kind == "llama3":
            return cls(
                theta=theta,
                scaling="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position=int(scaling["original_max_position_embeddings"]),
            )
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")

    def to_hf(self) -> dict[str, Any] | None:
        if self.scaling == "default":
            return None
        if self.scaling == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position,
        }


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama, Qwen3 or Gemma 3)."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    hidden_act: Activation = "silu"
    attention_bias: bool = False
    # Gemma 3: per-layer kinds, the window of sliding layers (keys a query sees, itself
    # included), the rotary embedding of the sliding layers, and the query scale.
    layer_kinds: tuple[LayerKind, ...] = ()
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        # Floats, so that equal configs (e.g. 16 and 16.0) have equal digests.
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        if self.query_pre_attn_scalar is not None:
            object.__setattr__(self, "query_pre_attn_scalar", float(self.query_pre_attn_scalar))
        if not self.layer_kinds:
            object.__setattr__(self, "layer_kinds", ("full",) * self.num_layers)
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window")
        if self.architecture == "gemma3" and self.query_pre_attn_scalar is None:
            raise ValueError("gemma3 needs query_pre_attn_scalar")

    # Derived properties: what the layers and the engine ask of the config.
    @property
    def uses_gemma_norms(self) -> bool:
        """Gemma: RMSNorm scales by (1 + w) in float32, sandwich norms, scaled embeddings."""
        return self.architecture == "gemma3"

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "gemma3")

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_kinds[layer] == "sliding" else None

    def rope_of(self, layer: int) -> RopeConfig:
        if self.layer_kinds[layer] == "sliding" and self.local_rope is not None:
            return self.local_rope
        return self.rope

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Elements (K and V) per token per layer; multiply by the dtype's item size."""
        return 2 * self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed

    def digest(self) -> str:
        """Stable digest of everything that changes the model's numbers (pool namespace)."""
        return xxhash.xxh3_128_hexdigest(json.dumps(asdict(self), sort_keys=True).encode())

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict (text configs; Gemma 3's text_config is unwrapped)."""
        if "text_config" in hf:
            hf = {**hf["text_config"], "model_type": hf["text_config"].get("model_type", "gemma3_text")}
        model_type = hf.get("model_type", "")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(_HF_MODEL_TYPES))})"
            )
        arch = _HF_MODEL_TYPES[model_type]
        act_name = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act_name!r}")
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        rope_params = hf.get("rope_parameters") or {}
        kinds: tuple[LayerKind, ...] = ()
        local_rope = None
        if arch == "gemma3":
            global_params = rope_params.get("full_attention", {})
            local_params = rope_params.get("sliding_attention", {})
            rope = RopeConfig.from_hf(
                float(global_params.get("rope_theta", hf.get("rope_theta", 1e6))),
                global_params or hf.get("rope_scaling"),
            )
            local_rope = RopeConfig.from_hf(
                float(local_params.get("rope_theta", hf.get("rope_local_base_freq", 1e4))), None
            )
            kinds = _gemma3_layer_kinds(hf)
        else:
            rope = RopeConfig.from_hf(
                float(rope_params.get("rope_theta", hf.get("rope_theta", 1e4))),
                rope_params or hf.get("rope_scaling"),
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rope=rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
            hidden_act=_ACTIVATIONS[act_name],
            attention_bias=bool(hf.get("attention_bias", False)),
            layer_kinds=kinds,
            sliding_window=int(hf["sliding_window"]) if arch == "gemma3" else None,
            local_rope=local_rope,
            query_pre_attn_scalar=(
                float(hf.get("query_pre_attn_scalar", 256)) if arch == "gemma3" else None
            ),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict of this model (used to build the reference model in tests)."""
        hf: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.architecture]],
            "model_type": "gemma3_text" if self.architecture == "gemma3" else self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "torch_dtype": "float32",
        }
        act = "gelu_pytorch_tanh" if self.hidden_act == "gelu_tanh" else "silu"
        if self.architecture == "gemma3":
            assert self.local_rope is not None
            hf.update(
                hidden_activation=act,
                sliding_window=self.sliding_window,
                layer_types=[
                    "sliding_attention" if k == "sliding" else "full_attention" for k in self.layer_kinds
                ],
                # HF types it as an int (256, 168): a float such as 16.0 is rejected.
                query_pre_attn_scalar=int(self.query_pre_attn_scalar)
                if self.query_pre_attn_scalar.is_integer() else self.query_pre_attn_scalar,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": self.rope.theta,
                                       **(self.rope.to_hf() or {})},
                    "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope.theta},
                },
            )
        else:
            hf.update(hidden_act=act, rope_theta=self.rope.theta, rope_scaling=self.rope.to_hf())
            if self.rope.to_hf():
                hf["rope_parameters"] = {"rope_theta": self.rope.theta, **self.rope.to_hf()}
        return hf


def _gemma3_layer_kinds(hf: dict[str, Any]) -> tuple[LayerKind, ...]:
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern", 6))
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))

