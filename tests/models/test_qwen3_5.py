"""Qwen3.5 (gated attention + Gated DeltaNet): config, layers, parity with HF transformers.

The model runs against a dense test context (tests/models/dense_context.py) that carries each
sequence's KV and linear-attention state between steps as the engine will. Parity: float32,
CPU, the tiny hybrid's logits within 1e-4 of HF's Qwen3_5ForCausalLM and 32 greedy tokens
identical, with the prompt in one step, split over steps, and token by token; a context that
drops the state between steps must fail that comparison.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from kvshare.models.config import ModelConfig
from kvshare.models.decoder import CausalLM
from kvshare.models.gated_deltanet import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule_reference,
    prepare_qk,
    recurrent_gated_delta_rule,
)
from kvshare.models.loader import hf_state_dict, load_model
from kvshare.models.presets import SHAPE_PRESETS, shape_preset
from tests.engine.hf_reference import hf_greedy, hf_last_logits
from tests.models.dense_context import DenseContext, forward_step, greedy

TINY = "tiny-qwen3.5"

# Digests (pool namespaces) of the presets that existed before Qwen3.5: adding fields to
# ModelConfig must not change them.
GOLDEN_DIGESTS = {
    "gemma3-12b": "0febde71e6e2faf087b6f451250d006d",
    "gemma3-1b": "77cc000a504d4fba6ac65ba2225f46ff",
    "gemma3-27b": "5840896b3eff2948f34a18f73d68017b",
    "qwen3-32b": "0224cbb13ab8f5917232e8c19823f1c6",
    "qwen3-8b": "03efe7fd791cd07127e44dbdd997e755",
    "tiny-gemma3": "ae51d18402fffb1dda43e39ab4911a6b",
    "tiny-llama": "5aa1aed6f6e3dee49cf883a582e7c660",
    "tiny-qwen3": "bb5ecae3a21c78284095442b7d05c814",
}

# The text part of Qwen/Qwen3.5-27B's published config.json (its multimodal wrapper).
PUBLISHED_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False,
        "attn_output_gate": True,
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "vocab_size": 248320,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    },
}
PUBLISHED_27B["text_config"]["layer_types"] *= 16


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_reference(model: CausalLM) -> transformers.PreTrainedModel:
    hf_config = transformers.AutoConfig.for_model(**model.config.to_hf())
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf.eval()


@pytest.fixture(scope="module")
def tiny() -> tuple[CausalLM, transformers.PreTrainedModel]:
    model = load_model("shape:" + TINY, seed=7).model
    return model, hf_reference(model)


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


# ---- config --------------------------------------------------------------------------------


def test_published_27b_config_reads_as_the_preset() -> None:
    config = ModelConfig.from_hf(json.loads(json.dumps(PUBLISHED_27B)))
    preset = shape_preset("qwen3.5-27b")
    # The preset also stops at <|im_end|> (the wrapper's eos); everything else is as published.
    assert replace(config, eos_token_ids=preset.eos_token_ids) == preset
    without_types = {**PUBLISHED_27B["text_config"]}
    del without_types["layer_types"]  # full_attention_interval gives the same kinds
    assert ModelConfig.from_hf(without_types).layer_kinds == preset.layer_kinds


def test_27b_shape_properties() -> None:
    c = shape_preset("qwen3.5-27b")
    assert c.attention_layers == tuple(range(3, 64, 4)) and len(c.linear_layers) == 48
    assert c.rotary_dim == 64 and c.attn_output_gate and c.unit_offset_norms and c.qk_norm
    assert c.q_proj_size == 2 * 24 * 256
    assert c.conv_state_shape == (2 * 16 * 128 + 48 * 128, 3)
    assert c.recurrent_state_shape == (48, 128, 128)
    # reference/H200-LIMITS.md: 65,536 B/token of bf16 KV, 154 MB of state per sequence.
    assert c.kv_bytes_per_token_per_layer * 2 * len(c.attention_layers) == 65536
    assert c.state_bytes_per_sequence(2) == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) == 153_944_064
    assert 26.5e9 < c.num_parameters() < 27.5e9


def test_older_presets_keep_their_digests() -> None:
    assert {name: SHAPE_PRESETS[name].digest() for name in GOLDEN_DIGESTS} == GOLDEN_DIGESTS
    tiny = shape_preset(TINY)
    assert replace(tiny, partial_rotary_factor=0.5).digest() != tiny.digest()
    assert replace(tiny, linear_conv_kernel_dim=3).digest() != tiny.digest()


def test_models_without_linear_layers_have_no_state() -> None:
    config = shape_preset("tiny-qwen3")
    assert config.linear_layers == () and config.attention_layers == (0, 1)
    assert config.state_bytes_per_sequence(2) == 0 and config.rotary_dim == config.head_dim


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architecture": "qwen3"}, "linear .* layers need architecture qwen3_5"),
        ({"linear_num_key_heads": 0}, "linear_num_key_heads must be positive"),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) must be a multiple of"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim must be at least 2"),
        ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor must be in \(0, 1\]"),
        ({"partial_rotary_factor": 0.3}, "rotary part of a head must be even"),
    ],
)
def test_invalid_qwen3_5_config(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(shape_preset(TINY), **change)  # type: ignore[arg-type]


def test_unknown_layer_type_is_rejected() -> None:
    hf = shape_preset(TINY).to_hf()
    hf["layer_types"] = ["sliding_attention"] * 8
    with pytest.raises(ValueError, match="unsupported qwen3_5 layer types"):
        ModelConfig.from_hf(hf)


# ---- parity with HF ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces", [(), (7, 64, 5), (1,) * 40], ids=["whole", "steps", "token-by-token"]
)
def test_matches_hf(
    tiny: tuple[CausalLM, transformers.PreTrainedModel], pieces: tuple[int, ...]
) -> None:
    model, hf = tiny
    prompt = random_prompt(1, 150)
    last, tokens = greedy(
        model, DenseContext(model.config, torch.float32), prompt, 32, pieces=pieces
    )
    assert rel_error(last, hf_last_logits(hf, prompt)) < 1e-4
    assert tokens == hf_greedy(hf, prompt, 32)


def test_every_position_matches_hf(tiny: tuple[CausalLM, transformers.PreTrainedModel]) -> None:
    model, hf = tiny
    prompt = random_prompt(2, 70)
    ours = forward_step(model, DenseContext(model.config, torch.float32), [("s", prompt, 0)])
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt])).logits[0]
    assert rel_error(ours, theirs) < 1e-4


def test_dropping_the_state_between_steps_is_caught(
    tiny: tuple[CausalLM, transformers.PreTrainedModel],
) -> None:
    model, hf = tiny
    prompt = random_prompt(1, 150)
    broken = DenseContext(model.config, torch.float32, carry_state=False)
    last, tokens = greedy(model, broken, prompt, 32, pieces=(7, 64, 5))
    assert rel_error(last, hf_last_logits(hf, prompt)) > 1e-2
    assert tokens != hf_greedy(hf, prompt, 32)


def test_packed_sequences_match_separate_runs(
    tiny: tuple[CausalLM, transformers.PreTrainedModel],
) -> None:
    model, _ = tiny
    prompts = {"a": random_prompt(3, 70), "b": random_prompt(4, 5), "c": random_prompt(5, 1)}
    alone = {
        s: forward_step(model, DenseContext(model.config, torch.float32), [(s, p, 0)])
        for s, p in prompts.items()
    }
    ctx = DenseContext(model.config, torch.float32)
    # Step 1: a's first 40 tokens, b and c whole; step 2: the rest of a with one decode each.
    packed = forward_step(
        model, ctx, [("a", prompts["a"][:40], 0), ("b", prompts["b"], 0), ("c", prompts["c"], 0)]
    )
    assert rel_error(packed[:40], alone["a"][:40]) < 1e-5
    assert rel_error(packed[40:45], alone["b"]) < 1e-5 and rel_error(packed[45:], alone["c"]) < 1e-5
    nxt = {s: int(alone[s][-1].argmax()) for s in "bc"}
    packed = forward_step(
        model, ctx, [("b", [nxt["b"]], 5), ("a", prompts["a"][40:], 40), ("c", [nxt["c"]], 1)]
    )
    assert rel_error(packed[1:31], alone["a"][40:]) < 1e-5
    for s, row in (("b", 0), ("c", 31)):
        ref = forward_step(
            model, DenseContext(model.config, torch.float32), [(s, [*prompts[s], nxt[s]], 0)]
        )
        assert rel_error(packed[row], ref[-1]) < 1e-5


# ---- the gated delta rule and the conv -----------------------------------------------------


def random_inputs(
    seq_lens: tuple[int, ...],
    key_heads: int = 2,
    value_heads: int = 4,
    key_dim: int = 32,
    value_dim: int = 16,
    seed: int = 0,
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(seq_lens)
    return [
        torch.randn(tokens, key_heads, key_dim, generator=gen),
        torch.randn(tokens, key_heads, key_dim, generator=gen),
        torch.randn(tokens, value_heads, value_dim, generator=gen),
        -torch.rand(tokens, value_heads, generator=gen) * 2.0,  # g <= 0
        torch.rand(tokens, value_heads, generator=gen),  # beta in (0, 1)
        torch.randn(len(seq_lens), value_heads, key_dim, value_dim, generator=gen),
    ]


@pytest.mark.parametrize("length", [1, 5, 64, 65, 130])
def test_chunked_and_recurrent_forms_match_hf(length: int) -> None:
    q, k, v, g, beta, state = random_inputs((length,))
    hf_args = dict(
        query=q[None],
        key=k[None],
        value=v[None],
        g=g[None],
        beta=beta[None],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    hf_out, hf_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(**hf_args)
    hf_chunk_out, hf_chunk_state = hf_qwen3_5.torch_chunk_gated_delta_rule(**hf_args)
    pq, pk = (x.transpose(0, 1) for x in prepare_qk(q, k, 4))
    args = (pq, pk, v.transpose(0, 1), g.t(), beta.t(), state[0])
    for out, final in (
        recurrent_gated_delta_rule(*args),
        chunk_gated_delta_rule(*args),
        chunk_gated_delta_rule(*args, chunk=16),
    ):
        assert rel_error(out.transpose(0, 1), hf_out[0]) < 1e-5
        assert rel_error(final, hf_state[0]) < 1e-5
    assert rel_error(hf_chunk_out, hf_out) < 1e-5 and rel_error(hf_chunk_state, hf_state) < 1e-5


def test_packed_reference_forms_agree() -> None:
    seq_lens = (3, 1, 70, 64, 2)
    inputs = random_inputs(seq_lens, seed=1)
    out_r, state_r = gated_delta_rule_reference(*inputs, seq_lens, chunked=False)
    out_c, state_c = gated_delta_rule_reference(*inputs, seq_lens, chunked=True)
    assert rel_error(out_c, out_r) < 1e-5 and rel_error(state_c, state_r) < 1e-5
    # Decode: one vectorized step equals stepping the sequences one by one.
    decode = random_inputs((1, 1, 1), seed=2)
    out_d, state_d = gated_delta_rule_reference(*decode, (1, 1, 1))
    out_1, state_1 = gated_delta_rule_reference(*decode, (1, 1, 1), chunked=False)
    assert torch.allclose(out_d, out_1, atol=1e-6) and torch.allclose(state_d, state_1, atol=1e-6)


def test_causal_conv_carries_its_state() -> None:
    gen = torch.Generator().manual_seed(0)
    channels, kernel, lengths = 24, 4, (9, 2, 1, 5)
    weight = torch.randn(channels, kernel, generator=gen)
    xs = [torch.randn(n, channels, generator=gen) for n in lengths]
    fresh = torch.zeros(1, channels, kernel - 1)
    whole, _ = causal_conv1d(torch.cat(xs), weight, fresh, (sum(lengths),))
    hf = hf_qwen3_5.causal_conv1d_fn(torch.cat(xs).t()[None], weight, activation="silu")[0].t()
    assert torch.allclose(whole, hf, atol=1e-6)
    # The same sequence in pieces (a piece of 1 takes the decode path), state carried.
    state, outs = fresh, []
    for x in xs:
        out, state = causal_conv1d(x, weight, state, (len(x),))
        outs.append(out)
    assert torch.allclose(torch.cat(outs), whole, atol=1e-6)
    assert torch.equal(state[0], torch.cat(xs)[-(kernel - 1) :].t())
    # Several sequences packed in one call, each from its own state.
    states = torch.randn(3, channels, kernel - 1, generator=gen)
    packed, new = causal_conv1d(torch.cat(xs[:3]), weight, states, lengths[:3])
    for i, (x, out) in enumerate(zip(xs[:3], packed.split(lengths[:3]))):
        alone, alone_state = causal_conv1d(x, weight, states[i : i + 1], (len(x),))
        assert torch.allclose(out, alone, atol=1e-6) and torch.equal(new[i], alone_state[0])


# ---- loading and random weights ------------------------------------------------------------


def test_hf_checkpoint_round_trip(
    tiny: tuple[CausalLM, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    model, hf = tiny
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config == model.config
    for (name, ours), (_, theirs) in zip(loaded.model.named_parameters(), model.named_parameters()):
        assert torch.equal(ours, theirs), name


def test_multimodal_checkpoint_names(
    tiny: tuple[CausalLM, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    model, _ = tiny
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in hf_state_dict(model).items()
    }
    # Vision tower and multi-token-prediction head of the published checkpoints: not ours.
    tensors |= {
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 2),
        "mtp.layers.0.mlp.up_proj.weight": torch.zeros(2, 2),
    }
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "text_config": model.config.to_hf()})
    )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path))
    a = loaded.model.model.layers[0].linear_attn.in_proj.weight
    assert torch.equal(a, model.model.layers[0].linear_attn.in_proj.weight)
    del tensors["model.language_model.layers.2.linear_attn.in_proj_b.weight"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks 1 tensors.*layers\.2\.linear_attn\.in_proj\.weight#2"
    ):
        load_model(str(tmp_path))


def test_random_gdn_parameters_are_in_range() -> None:
    model = load_model("shape:" + TINY, seed=3).model
    gdn = model.model.layers[0].linear_attn
    a = gdn.A_log.exp()
    assert a.min() >= 0.01 and a.max() <= 16.0
    assert gdn.dt_bias.min() >= 0.5 and gdn.dt_bias.max() <= 1.5
    assert (gdn.norm.weight - 1.0).abs().max() <= 0.1
    assert gdn.conv1d.weight.abs().max() <= 0.5 and gdn.conv1d.weight.abs().max() > 0.4
    assert model.model.layers[0].input_layernorm.weight.abs().max() <= 0.1  # (1 + w) norms
    assert not torch.equal(gdn.A_log, model.model.layers[1].linear_attn.A_log)


def test_random_64_layer_model_stays_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 27B layer pattern and head ratios, narrow: bf16 activations stay finite and bounded."""
    narrow = replace(
        shape_preset("qwen3.5-27b"),
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_heads=6,
        num_kv_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )
    monkeypatch.setitem(SHAPE_PRESETS, "narrow-qwen3.5", narrow)
    model = load_model("shape:narrow-qwen3.5", dtype="bfloat16", seed=0).model
    ctx = DenseContext(narrow, torch.bfloat16)
    logits = forward_step(model, ctx, [("s", random_prompt(6, 300), 0)])
    logits = torch.cat((logits, forward_step(model, ctx, [("s", [5], 300)])))
    assert logits.isfinite().all() and 0.1 < logits.std() < 100.0
