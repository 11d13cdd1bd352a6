"""Build the HF transformers reference model for a kvshare model (same weights, float32)."""

from __future__ import annotations

import torch
import transformers

from kvshare.models.decoder import PACKED_PARAMETERS, CausalLM


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under HF names: fused qkv / gate_up split back into their parts."""
    config = model.config
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    sizes = {"qkv_proj": (q, kv, kv), "gate_up_proj": (config.intermediate_size,) * 2}
    fused_parts: dict[str, list[str]] = {}
    for part, (fused, _) in PACKED_PARAMETERS.items():
        fused_parts.setdefault(fused, []).append(part)
    out = {}
    for name, param in model.named_parameters():
        for fused, parts in fused_parts.items():
            if f".{fused}." in name:
                for part, chunk in zip(parts, param.detach().split(sizes[fused], dim=0)):
                    out[name.replace(f".{fused}.", f".{part}.")] = chunk.clone()
                break
        else:
            out[name] = param.detach().clone()
    return out


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
