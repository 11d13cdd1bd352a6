"""Build the HF transformers reference model for a kvshare model (same weights, float32)."""

from __future__ import annotations

import torch
import transformers

from kvshare.models.decoder import CausalLM
from kvshare.models.loader import hf_state_dict


def hf_model_for(model: CausalLM) -> transformers.PreTrainedModel:
    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf())
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [m for m in missing if m != "lm_head.weight" or not model.config.tie_word_embeddings]
    assert not missing and not unexpected, (missing, unexpected)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


@torch.inference_mode()
def hf_last_logits(hf: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens with HF's own KV cache; EOS is not special (like ignore_eos)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
