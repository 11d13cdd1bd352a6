"""`kvshare generate`: one generation from the command line (the offline `LLM` API)."""

from __future__ import annotations

import argparse
import time

from kvshare.engine.cli import (
    add_model_arguments,
    add_require_pool_argument,
    check_engine_fits,
    engine_options,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt")
    add_model_arguments(parser)
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: smallest token set of this probability",
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--kv-pool", default=None, help="unix:/path/to/pool.sock")
    add_require_pool_argument(parser)
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from kvshare.engine.sampling_params import SamplingParams
    from kvshare.llm import LLM, KVPoolUnreachable

    console = Console(stderr=True)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        check_engine_fits(args)
        start = time.monotonic()
        llm = LLM(
            args.model,
            kv_pool=args.kv_pool,
            require_kv_pool=args.require_kv_pool,
            **engine_options(args),
        )  # type: ignore[arg-type]
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
