"""Model and engine flags shared by every command that runs an engine (`kvshare generate`,
`kvshare serve`, the checks and benchmarks), and the preflight check of their values."""

from __future__ import annotations

import argparse
from collections.abc import Collection

from kvshare.engine.config import EngineConfig


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags and every engine flag (EngineConfig's), for commands that run an engine."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="alias (smollm2-135m), .gguf file, HF directory or shape:NAME",
    )
    parser.add_argument(
        "--weights-seed", type=int, default=0, help="seed of shape:NAME random weights"
    )
    EngineConfig.add_arguments(parser)


def add_require_pool_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--require-kv-pool",
        action="store_true",
        help="exit with an error when the pool cannot be reached at start "
        "(default: warn and run without it)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """Keyword arguments of `LLM` (besides the model) from parsed `add_model_arguments` flags."""
    return {
        "weights_seed": args.weights_seed,
        **EngineConfig.flag_values(EngineConfig.from_args(args)),
    }


def engine_argv(args: argparse.Namespace, exclude: Collection[str] = ()) -> tuple[str, ...]:
    """`kvshare serve` flags that give a child process these engine options (not --model);
    ValueError if they are invalid."""
    return (
        "--weights-seed",
        str(args.weights_seed),
        *EngineConfig.from_args(args).to_argv(exclude),
    )


def check_engine_fits(args: argparse.Namespace) -> None:
    """The device exists and the model fits in it (ValueError: one sentence saying why not)."""
    from kvshare.preflight import check_model_fits

    check_model_fits(args.model, args.device, args.dtype, engine_options(args)["kv_cache_memory"])  # type: ignore[arg-type]
