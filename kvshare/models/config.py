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

Architecture = Literal["llama", "qwen3", "gemma3", "qwen3_5"]
# "full" and "sliding" layers attend over a KV cache; "linear" layers (Qwen3.5's Gated
# DeltaNet) carry a fixed-size recurrent state per sequence instead.
LayerKind = Literal["full", "sliding", "linear"]
RopeScaling = Literal["default", "linear", "llama3"]
Activation = Literal["silu", "gelu_tanh"]

_HF_MODEL_TYPES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
}
# The text model_type of a multimodal wrapper whose text_config does not name its own.
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}
_HF_ARCHITECTURES: dict[Architecture, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
}
_HF_LAYER_TYPES: dict[str, LayerKind] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "linear",
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
        raise ValueError(
            f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)"
        )

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
    """Shape and numerics of a decoder-only model (Llama, Qwen3, Gemma 3 or Qwen3.5)."""

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
    # Qwen3.5: rotary embedding on the first `rotary_dim` of each head only, and the shape
    # of the Gated DeltaNet ("linear") layers; the linear fields are 0 in models without them.
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
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
        object.__setattr__(self, "partial_rotary_factor", float(self.partial_rotary_factor))
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
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"the rotary part of a head must be even and non-empty, got {self.rotary_dim}"
            )
        if self.linear_layers:
            self._validate_linear()

    def _validate_linear(self) -> None:
        if self.architecture != "qwen3_5":
            raise ValueError(
                f"linear (Gated DeltaNet) layers need architecture qwen3_5, not {self.architecture}"
            )
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive in a model with linear layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(
                f"linear_conv_kernel_dim must be at least 2, got {self.linear_conv_kernel_dim}"
            )

    # Derived properties: what the layers and the engine ask of the config.
    @property
    def uses_gemma_norms(self) -> bool:
        """Gemma: sandwich norms around attention and MLP, scaled embeddings."""
        return self.architecture == "gemma3"

    @property
    def unit_offset_norms(self) -> bool:
        """RMSNorm scales by (1 + w) in float32 (Gemma 3, Qwen3.5), not by w after the cast."""
        return self.architecture in ("gemma3", "qwen3_5")

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "gemma3", "qwen3_5")

    @property
    def attn_output_gate(self) -> bool:
        """Qwen3.5: q_proj also yields a per-head gate; attention output is scaled by sigmoid(gate)."""
        return self.architecture == "qwen3_5"

    @property
    def q_proj_size(self) -> int:
        """Rows of q_proj: the queries, followed per head by the gate when there is one."""
        return self.num_heads * self.head_dim * (2 if self.attn_output_gate else 1)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rotary embedding rotates (HF: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    # The layers the engine allocates for: KV cache (attention) or recurrent state (linear).
    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind != "linear")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's causal conv: its q, k and v, concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per sequence and linear layer, in the model dtype: the last kernel-1 conv inputs."""
        return self.linear_conv_dim, self.linear_conv_kernel_dim - 1

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """Per sequence and linear layer, float32: (value heads, key head dim, value head dim)."""
        return self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim

    def state_bytes_per_sequence(self, dtype_size: int) -> int:
        """Bytes of conv (model dtype of `dtype_size` bytes) and recurrent (float32) state of one
        sequence over all linear layers; 0 for models without them."""
        conv = self.conv_state_shape[0] * self.conv_state_shape[1] * dtype_size
        heads, dk, dv = self.recurrent_state_shape
        return len(self.linear_layers) * (conv + heads * dk * dv * 4)

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
        """Projections, MLPs and embeddings (norms and other per-channel vectors left out)."""
        attn = self.hidden_size * (
            self.q_proj_size + self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        )
        linear = (
            self.hidden_size
            * (self.linear_conv_dim + 2 * self.linear_value_dim + 2 * self.linear_num_value_heads)
            + self.linear_conv_dim * self.linear_conv_kernel_dim
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        num_linear = len(self.linear_layers)
        return (
            (self.num_layers - num_linear) * attn
            + num_linear * linear
            + self.num_layers * mlp
            + embed
        )

    def digest(self) -> str:
        """Stable digest of everything that changes the model's numbers (pool namespace)."""
        fields = asdict(self)
        # Fields added later count only when set: older configs keep their digests (namespaces).
        for name, default in _LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode())

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict (text configs; a multimodal text_config is unwrapped)."""
        if "text_config" in hf:
            text_type = _TEXT_MODEL_TYPES.get(hf.get("model_type", ""), "gemma3_text")
            hf = {**hf["text_config"], "model_type": hf["text_config"].get("model_type", text_type)}
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
        # Qwen3.5's HF default head_dim is 256, not hidden // heads.
        head_dim = int(
            hf.get("head_dim") or (256 if arch == "qwen3_5" else hf["hidden_size"] // num_heads)
        )
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
            # Qwen3.5's mrope_section is ignored: for text its three position streams are equal,
            # which makes multimodal rope the plain rope.
            rope = RopeConfig.from_hf(
                float(rope_params.get("rope_theta", hf.get("rope_theta", 1e4))),
                rope_params or hf.get("rope_scaling"),
            )
        linear: dict[str, Any] = {}
        if arch == "qwen3_5":
            kinds = _qwen3_5_layer_kinds(hf)
            linear = _qwen3_5_linear_fields(hf, rope_params)
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
            **linear,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict of this model (used to build the reference model in tests)."""
        hf: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.architecture]],
            "model_type": _TEXT_MODEL_TYPES.get(self.architecture, self.architecture),
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
                layer_types=[_hf_layer_type(k) for k in self.layer_kinds],
                # HF types it as an int (256, 168): a float such as 16.0 is rejected.
                query_pre_attn_scalar=int(self.query_pre_attn_scalar)
                if self.query_pre_attn_scalar.is_integer()
                else self.query_pre_attn_scalar,
                rope_parameters={
                    "full_attention": {
                        "rope_type": "default",
                        "rope_theta": self.rope.theta,
                        **(self.rope.to_hf() or {}),
                    },
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": self.local_rope.theta,
                    },
                },
            )
        elif self.architecture == "qwen3_5":
            hf.update(
                hidden_act=act,
                layer_types=[_hf_layer_type(k) for k in self.layer_kinds],
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": self.rope.theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                    **(self.rope.to_hf() or {}),
                },
                linear_num_key_heads=self.linear_num_key_heads,
                linear_num_value_heads=self.linear_num_value_heads,
                linear_key_head_dim=self.linear_key_head_dim,
                linear_value_head_dim=self.linear_value_head_dim,
                linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            )
        else:
            hf.update(hidden_act=act, rope_theta=self.rope.theta, rope_scaling=self.rope.to_hf())
            if self.rope.to_hf():
                hf["rope_parameters"] = {"rope_theta": self.rope.theta, **self.rope.to_hf()}
        return hf


_LATER_FIELDS: dict[str, object] = {
    "partial_rotary_factor": 1.0,
    "linear_num_key_heads": 0,
    "linear_num_value_heads": 0,
    "linear_key_head_dim": 0,
    "linear_value_head_dim": 0,
    "linear_conv_kernel_dim": 0,
}


def _gemma3_layer_kinds(hf: dict[str, Any]) -> tuple[LayerKind, ...]:
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern", 6))
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))


def _hf_layer_type(kind: LayerKind) -> str:
    return next(name for name, k in _HF_LAYER_TYPES.items() if k == kind)


def _qwen3_5_layer_kinds(hf: dict[str, Any]) -> tuple[LayerKind, ...]:
    if hf.get("layer_types"):
        unknown = set(hf["layer_types"]) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"unsupported qwen3_5 layer types {sorted(unknown)}")
        return tuple(_HF_LAYER_TYPES[t] for t in hf["layer_types"])
    interval = int(hf.get("full_attention_interval", 4))
    return tuple(
        "linear" if (i + 1) % interval else "full" for i in range(int(hf["num_hidden_layers"]))
    )


def _qwen3_5_linear_fields(hf: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary and Gated DeltaNet shape, with HF's Qwen3_5TextConfig defaults."""
    return {
        "partial_rotary_factor": float(
            rope_params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        ),
        "linear_num_key_heads": int(hf.get("linear_num_key_heads", 16)),
        "linear_num_value_heads": int(hf.get("linear_num_value_heads", 32)),
        "linear_key_head_dim": int(hf.get("linear_key_head_dim", 128)),
        "linear_value_head_dim": int(hf.get("linear_value_head_dim", 128)),
        "linear_conv_kernel_dim": int(hf.get("linear_conv_kernel_dim", 4)),
    }
