"""Model and engine flags shared by every command that runs an engine (`kvshare generate`,
`kvshare serve`, the checks and benchmarks), and the preflight check of their values."""

from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by every command that runs an engine."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="alias (smollm2-135m), .gguf file, HF directory or shape:NAME")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of shape:NAME random weights")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="token budget of one engine step (prefill chunk size)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one engine step")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's context length)")
    parser.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9,
                        help="share of the GPU this replica may use (weights + cache)")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "sdpa", "varlen"),
                        help="attention kernel (auto: varlen on CUDA in bfloat16/float16, else sdpa)")


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    from kvshare.sizes import parse_size

    return {
        "device": args.device,
        "dtype": args.dtype,
        "weights_seed": args.weights_seed,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        "gpu_memory_fraction": args.gpu_memory_fraction,
        "attention_backend": args.attention_backend,
    }


def check_engine_fits(args: argparse.Namespace) -> None:
    """The device exists and the model fits in it (ValueError: one sentence saying why not)."""
    from kvshare.preflight import check_model_fits

    check_model_fits(args.model, args.device, args.dtype, engine_options(args)["kv_cache_memory"])  # type: ignore[arg-type]
