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
