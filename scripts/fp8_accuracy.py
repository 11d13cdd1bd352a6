"""Accuracy of fp8 KV against the model dtype's KV: teacher-forced over one fixed text.

Both engines run the same weights over the same tokens in prefill steps of --step tokens,
every attention read going through the paged cache (so the fp8 run reads e4m3 keys and
values for the whole context, its own step's included). At each position it compares the
next-token distributions: greedy agreement (same argmax) and the mean absolute difference
of the log-probability of the text's actual next token.

    PYTHONPATH=$PWD python scripts/fp8_accuracy.py                      # SmolLM2, CPU
    PYTHONPATH=$PWD python scripts/fp8_accuracy.py --model shape:qwen3.5-27b \\
        --device cuda --tokens 4096 --step 1024 --out fp8-27b.json      # random weights

The text is the repository's LICENSE (Apache 2.0: fixed, English, ~2,400 SmolLM2 tokens),
repeated up to --tokens when the model has a tokenizer; a model without one (shape:NAME
random weights) reads --tokens seeded random token ids.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from kvshare.engine.attention import PagedAttention, StepMeta
from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine
from kvshare.models.loader import LoadedModel, load_model
from kvshare.uploads import host_to_device

TEXT = Path(__file__).resolve().parents[1] / "LICENSE"


def text_tokens(loaded: LoadedModel, n: int) -> list[int]:
    if loaded.tokenizer is None:
        rng = random.Random(0)
        return [rng.randrange(3, loaded.config.vocab_size) for _ in range(n)]
    ids = loaded.tokenizer.encode(TEXT.read_text())
    return (ids * (-(-n // len(ids))))[:n] if n else ids


@torch.inference_mode()
def teacher_forced(engine: LLMEngine, tokens: list[int], step: int) -> tuple[np.ndarray, ...]:
    """(argmax, log-probability of the actual next token) at positions 0..len-2, one
    sequence prefilled in steps of `step` tokens through the engine's cache."""
    runner, bs = engine.runner, engine.config.block_size
    table = engine.blocks.allocate(engine.blocks.blocks_needed(len(tokens)))
    slot = runner.states.allocate() if runner.states is not None else None
    argmax, logprob = [], []
    try:
        for start in range(0, len(tokens) - 1, step):
            stop = min(start + step, len(tokens) - 1)
            meta = StepMeta((stop - start,), (stop,), (tuple(table),), bs, runner.device)
            slots = None if slot is None else host_to_device(np.asarray([slot]), runner.device)
            # No sliding-window tables: a model with such layers fails PagedAttention's check.
            ctx = PagedAttention(
                runner.layout, meta, runner.backend, runner.states, slots, None, runner.fences
            )
            ids = host_to_device(np.asarray(tokens[start:stop]), runner.device)
            pos = host_to_device(np.arange(start, stop), runner.device)
            logits = runner.model.compute_logits(runner.model(ids, pos, ctx)).float()
            runner.fences.drain()
            logp = logits.log_softmax(-1)
            nxt = torch.as_tensor(tokens[start + 1 : stop + 1], device=logp.device)
            argmax.append(logits.argmax(-1).cpu().numpy())
            logprob.append(logp.gather(1, nxt[:, None])[:, 0].cpu().numpy())
    finally:
        engine.blocks.release(table)
        if slot is not None:
            runner.states.release(slot)
    return np.concatenate(argmax), np.concatenate(logprob)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="the model's (and the reference KV's)")
    parser.add_argument("--tokens", type=int, default=0, help="0: the text once")
    parser.add_argument("--step", type=int, default=512, help="prefill step, tokens")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--weights-seed", type=int, default=0)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    base = EngineConfig.from_argv(
        ["--device", args.device, "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory]
    )
    loaded = load_model(
        args.model, device=args.device, dtype=base.resolved_dtype, seed=args.weights_seed
    )
    tokens = text_tokens(loaded, args.tokens)
    runs = {}
    for kv in ("auto", "fp8"):
        engine = LLMEngine(loaded, EngineConfig(**{**vars(base), "kv_cache_dtype": kv}))
        began = time.perf_counter()
        runs[kv] = teacher_forced(engine, tokens, args.step)
        print(f"{kv}: {len(tokens)} tokens in {time.perf_counter() - began:.1f} s", flush=True)
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    (ref_top, ref_lp), (fp8_top, fp8_lp) = runs["auto"], runs["fp8"]
    diff = np.abs(fp8_lp.astype(np.float64) - ref_lp)
    result = {
        "model": args.model,
        "weights_seed": args.weights_seed if args.model.startswith("shape:") else None,
        "device": args.device,
        "model_dtype": base.resolved_dtype,
        "reference_kv": base.resolved_dtype,
        "text": "LICENSE" if loaded.tokenizer is not None else "random token ids (seed 0)",
        "positions": len(diff),
        "step_tokens": args.step,
        "greedy_agreement": float((fp8_top == ref_top).mean()),
        "mean_abs_logprob_diff": float(diff.mean()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_logprob_reference": float(ref_lp.mean()),
        "mean_logprob_fp8": float(fp8_lp.mean()),
        "machine": f"{platform.node()} {platform.machine()}"
        + (f" {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "date": date.today().isoformat(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
