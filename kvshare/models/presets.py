"""Named model shapes for random weights (`shape:NAME`): benchmarking at scale without
weights to download, and tiny shapes for tests. Shapes follow the published configs."""

from __future__ import annotations

from kvshare.models.config import ModelConfig, RopeConfig


def _gemma3_kinds(num_layers: int, pattern: int = 6) -> tuple:
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))


def _qwen3_5_kinds(num_layers: int, interval: int = 4) -> tuple:
    """Every `interval`-th layer full (gated) attention, the others Gated DeltaNet."""
    return tuple("linear" if (i + 1) % interval else "full" for i in range(num_layers))


SHAPE_PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0),
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "tiny-qwen3": ModelConfig(
        architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope=RopeConfig(theta=1e6),
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
    ),
    "tiny-gemma3": ModelConfig(
        architecture="gemma3", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
        rope=RopeConfig(theta=1e6, scaling="linear", factor=8.0), local_rope=RopeConfig(theta=1e4),
        hidden_act="gelu_tanh", layer_kinds=_gemma3_kinds(6), sliding_window=64,
        query_pre_attn_scalar=16, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=2, eos_token_ids=(1,),
    ),
    # Two full-attention and six linear layers; value heads share key heads (Hv = 2 Hk), and
    # key and value head dims differ, so that no mix-up of the two passes unnoticed.
    "tiny-qwen3.5": ModelConfig(
        architecture="qwen3_5", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=8, num_heads=4, num_kv_heads=2, head_dim=32, rope=RopeConfig(theta=1e7),
        partial_rotary_factor=0.25, layer_kinds=_qwen3_5_kinds(8), max_position_embeddings=8192,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=1e6),
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "qwen3-32b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=1e6),
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "gemma3-1b": ModelConfig(
        architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
        rope=RopeConfig(theta=1e6), local_rope=RopeConfig(theta=1e4), hidden_act="gelu_tanh",
        layer_kinds=_gemma3_kinds(26), sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1, 106),
    ),
    "gemma3-12b": ModelConfig(
        architecture="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
        rope=RopeConfig(theta=1e6, scaling="linear", factor=8.0), local_rope=RopeConfig(theta=1e4),
        hidden_act="gelu_tanh", layer_kinds=_gemma3_kinds(48), sliding_window=1024,
        query_pre_attn_scalar=256, max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=2, eos_token_ids=(1, 106),
    ),
    "gemma3-27b": ModelConfig(
        architecture="gemma3", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
        num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
        rope=RopeConfig(theta=1e6, scaling="linear", factor=8.0), local_rope=RopeConfig(theta=1e4),
        hidden_act="gelu_tanh", layer_kinds=_gemma3_kinds(62), sliding_window=1024,
        query_pre_attn_scalar=168, max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=2, eos_token_ids=(1, 106),
    ),
    # Qwen/Qwen3.5-27B's text model (config.json text_config); eos: <|im_end|>, <|endoftext|>.
    "qwen3.5-27b": ModelConfig(
        architecture="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256, rope=RopeConfig(theta=1e7),
        partial_rotary_factor=0.25, layer_kinds=_qwen3_5_kinds(64), max_position_embeddings=262144,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, eos_token_ids=(248046, 248044),
    ),
}


def shape_preset(name: str) -> ModelConfig:
    if name not in SHAPE_PRESETS:
        raise ValueError(f"unknown shape preset {name!r}; known: {', '.join(sorted(SHAPE_PRESETS))}")
    return SHAPE_PRESETS[name]
