"""Tiny random-weight HF model folders for vLLM tests (no tokenizer: prompts are token ids)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 2048


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer float32 Llama with random weights (head size 64: vLLM CPU's kernels)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    return folder


def write_tiny_qwen3_next(folder: Path, seed: int = 0) -> Path:
    """A 2-layer float32 Qwen3-Next with random weights: one Gated DeltaNet layer, then one
    gated full-attention layer, each with a 4-expert MoE (vLLM's Qwen3-Next needs one)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=4096,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    model = Qwen3NextForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    return folder
