"""`kvshare generate`: one generation from the command line (offline API)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Collection

from kvshare.engine.config import EngineConfig


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags and every engine flag (EngineConfig's), for commands that run an engine."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="alias (smollm2-135m), .gguf file, HF directory or shape:NAME")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of shape:NAME random weights")
    EngineConfig.add_arguments(parser)


def add_require_pool_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--require-kv-pool", action="store_true",
                        help="exit with an error when the pool cannot be reached at start "
                             "(default: warn and run without it)")


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """Keyword arguments of `LLM` (besides the model) from parsed `add_model_arguments` flags."""
    return {"weights_seed": args.weights_seed, **EngineConfig.flag_values(EngineConfig.from_args(args))}


def engine_argv(args: argparse.Namespace, exclude: Collection[str] = ()) -> tuple[str, ...]:
    """`kvshare serve` flags that give a child process these engine options (not --model);
    ValueError if they are invalid."""
    return ("--weights-seed", str(args.weights_seed),
            *EngineConfig.from_args(args).to_argv(exclude))


def check_engine_fits(args: argparse.Namespace) -> None:
    """The device exists and the model fits in it (ValueError: one sentence saying why not)."""
    from kvshare.preflight import check_model_fits

    check_model_fits(args.model, args.device, args.dtype, engine_options(args)["kv_cache_memory"])  # type: ignore[arg-type]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt")
    add_model_arguments(parser)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: smallest token set of this probability")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--kv-pool", default=None, help="unix:/path/to/pool.sock")
    add_require_pool_argument(parser)
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from kvshare import LLM, SamplingParams
    from kvshare.engine.llm import KVPoolUnreachable

    console = Console(stderr=True)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        check_engine_fits(args)
        start = time.monotonic()
        llm = LLM(args.model, kv_pool=args.kv_pool, require_kv_pool=args.require_kv_pool,
                  **engine_options(args))  # type: ignore[arg-type]
        console.print(f"[dim]loaded {llm.loaded.name} in {time.monotonic() - start:.1f} s[/dim]")
        start = time.monotonic()
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate([args.prompt], params)[0]
    except (ValueError, FileNotFoundError, KVPoolUnreachable) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        return 2
    print(out.text)
    console.print(
        f"[dim]{len(out.token_ids)} tokens in {time.monotonic() - start:.2f} s "
        f"(prompt {len(out.prompt_token_ids)}: gpu hit {out.gpu_hit_tokens}, "
        f"pool hit {out.pool_hit_tokens}, computed {out.computed_tokens}); {out.finish_reason}[/dim]"
    )
    return 0
