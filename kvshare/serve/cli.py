"""`kvshare serve` (one replica), `kvshare router` (N replicas behind one API) and
`kvshare up` (pool + replicas + router on this host)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING

from kvshare.engine.cli import (
    add_model_arguments,
    add_require_pool_argument,
    check_engine_fits,
    engine_options,
)
from kvshare.kvpool.faults import BREAK_ORDERS
from kvshare.serve import collector
from kvshare.serve.policies import DEFAULT_POOL_CREDIT
from kvshare.spec import DEFAULT_CHUNK_TOKENS

if TYPE_CHECKING:
    from aiohttp import web

    from kvshare.kvpool.faults import FaultInjection

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvshare.serve.auth import add_key_arguments
    from kvshare.serve.launcher import add_up_arguments
    from kvshare.serve.policies import POLICIES

    serve = subparsers.add_parser(
        "serve", help="serve one model over an OpenAI-compatible HTTP API"
    )
    add_model_arguments(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-pool",
        metavar="unix:PATH",
        help="the shared pool's socket (default: the per-user default socket)",
    )
    pool.add_argument("--no-kv-pool", action="store_true", help="run without the shared pool")
    add_require_pool_argument(serve)
    serve.add_argument(
        "--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="tokens per pool page"
    )
    add_key_arguments(serve)
    serve.add_argument(
        "--cache-salt-required",
        action="store_true",
        help="refuse (400) /v1 requests without a cache_salt: tenants share no prefix cache",
    )
    serve.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    serve.add_argument(
        "--max-body-bytes", default="8MiB", help="largest request body (default: 8MiB)"
    )
    serve.add_argument("--log-level", default="INFO", choices=_LOG_LEVELS, help="log verbosity")
    # Test-only: break the pool's load ordering so `kvshare validate regression` can show
    # it catches the wrong answers that follow (never use in production).
    serve.add_argument(
        "--unsafe-break-stream-order", choices=BREAK_ORDERS, default="", help=argparse.SUPPRESS
    )
    serve.add_argument("--unsafe-load-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    serve.add_argument("--unsafe-skip-checksums", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=run_serve)

    router = subparsers.add_parser("router", help="route the OpenAI API over several replicas")
    router.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL (repeat; the order gives replica indexes)",
    )
    router.add_argument(
        "--policy", default="cache-aware", choices=POLICIES, help="how a request picks its replica"
    )
    router.add_argument("--host", default="127.0.0.1", help="address to bind")
    router.add_argument("--port", type=int, default=8080, help="port to listen on")
    router.add_argument(
        "--model",
        help="the served model, for its tokenizer and chat template "
        "(routing keys); without one, keys hash the raw prompt text",
    )
    router.add_argument("--block-tokens", type=int, default=16, help="routing-key block size")
    router.add_argument(
        "--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="the pool's tokens per page"
    )
    router.add_argument(
        "--pool-credit",
        type=float,
        default=DEFAULT_POOL_CREDIT,
        help="cache-aware: worth of a pool-resident token relative to a GPU hit "
        "(default: 1 - restore/prefill time per token measured on an H200; docs/serving.md)",
    )
    router.add_argument(
        "--load-penalty-tokens",
        type=float,
        default=64.0,
        help="cache-aware: score cost of one request in flight, in tokens",
    )
    router.add_argument(
        "--queued-work-weight",
        type=float,
        default=1.0,
        help="cache-aware: score cost of one prompt token a replica must compute for "
        "other requests before this one's step (docs/serving.md)",
    )
    router.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    router.add_argument(
        "--max-body-bytes",
        default="64MiB",
        help="largest request body; larger ones get 413 (default: 64MiB)",
    )
    router.add_argument(
        "--max-buffered-bytes",
        default="512MiB",
        help="request bodies held at once; a request waits up to 10 s for room, "
        "then gets 503 (default: 512MiB)",
    )
    router.add_argument(
        "--engine",
        default="kvshare",
        choices=("kvshare", "vllm"),
        help="what the replicas run; with vllm, /admin/all/ switches, clears and reads the "
        "pool at --kv-pool and resets prefix caches through vLLM's /reset_prefix_cache",
    )
    router.add_argument(
        "--kv-pool",
        metavar="unix:PATH",
        help="--engine vllm: the pool daemon the replicas share (default: none)",
    )
    add_key_arguments(router)
    router.add_argument("--log-level", default="INFO", choices=_LOG_LEVELS, help="log verbosity")
    router.set_defaults(func=run_router)

    up = subparsers.add_parser(
        "up",
        help="start pool + replicas + router on this host",
        description="With no arguments: 2 replicas of SmolLM2-135M-Instruct "
        "on the CPU, a 2 GiB pool, the router on port 8080.",
    )
    add_up_arguments(up)
    up.set_defaults(func=run_up)


def injected_faults(args: argparse.Namespace) -> FaultInjection | None:
    """The faults the hidden --unsafe-* flags inject (None: none, the only production value)."""
    from kvshare.kvpool.faults import FaultInjection, injected

    return injected(
        FaultInjection(
            break_order=args.unsafe_break_stream_order,
            load_delay=args.unsafe_load_delay,
            skip_checksums=args.unsafe_skip_checksums,
        )
    )


def run_serve(args: argparse.Namespace) -> int:
    from kvshare.kvpool.paths import default_pool_address
    from kvshare.llm import LLM, KVPoolUnreachable
    from kvshare.serve.auth import access_keys
    from kvshare.serve.server import ServeConfig, build_app
    from kvshare.sizes import parse_size

    logging.basicConfig(level=args.log_level, format=_LOG_FORMAT)
    if args.no_kv_pool and args.require_kv_pool:
        print(
            "kvshare serve: --require-kv-pool and --no-kv-pool contradict each other",
            file=sys.stderr,
        )
        return 2
    pool = None if args.no_kv_pool else args.kv_pool or default_pool_address()
    try:
        keys = access_keys(args)
        config = ServeConfig(
            args.served_model_name or args.model,
            api_key=keys.api_key,
            max_body_bytes=parse_size(args.max_body_bytes),
            admin_key=keys.admin_key,
            cache_salt_required=args.cache_salt_required,
        )
        check_engine_fits(args)
        llm = LLM(
            args.model,
            kv_pool=pool,
            require_kv_pool=args.require_kv_pool,
            chunk_tokens=args.chunk_tokens,
            kv_pool_faults=injected_faults(args),
            **engine_options(args),
        )  # type: ignore[arg-type]
    except (ValueError, FileNotFoundError, KVPoolUnreachable) as exc:
        print(f"kvshare serve: {exc}", file=sys.stderr)
        return 2
    engine = llm.engine
    banner = (
        f"kvshare serve: {config.served_model_name} ready on http://{args.host}:{args.port} "
        f"({engine.blocks.num_blocks} KV blocks, context {engine.max_model_len}, "
        f"pool {pool or 'off'})"
    )
    try:
        return _run_app("serve", build_app(engine, config), args, banner)
    finally:
        if engine.connector is not None:
            engine.connector.close()


def run_router(args: argparse.Namespace) -> int:
    from kvshare.models.loader import load_tokenizer
    from kvshare.serve.auth import access_keys
    from kvshare.serve.policies import PolicyConfig
    from kvshare.serve.router import RouterConfig, build_router_app
    from kvshare.serve.routing_keys import RoutingKeys
    from kvshare.sizes import parse_size

    logging.basicConfig(level=args.log_level, format=_LOG_FORMAT)
    try:
        access = access_keys(args)
        tokenizer = load_tokenizer(args.model)
        config = RouterConfig(
            tuple(args.replica),
            args.policy,
            PolicyConfig(
                pool_credit=args.pool_credit,
                load_penalty_tokens=args.load_penalty_tokens,
                queued_work_weight=args.queued_work_weight,
                chunk_tokens=args.chunk_tokens,
            ),
            block_tokens=args.block_tokens,
            health_interval=args.health_interval,
            api_key=access.api_key,
            admin_key=access.admin_key,
            max_body_bytes=parse_size(args.max_body_bytes),
            max_buffered_bytes=parse_size(args.max_buffered_bytes),
            engine=args.engine,
            kv_pool=args.kv_pool,
        )
        keys = RoutingKeys(tokenizer, config.block_tokens)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvshare router: {exc}", file=sys.stderr)
        return 2
    if tokenizer is None and args.policy == "cache-aware":
        logging.getLogger(__name__).warning(
            "no tokenizer for %s: routing keys hash raw prompt text (token-id prompts stay exact)",
            args.model,
        )
    banner = (
        f"kvshare router: {args.policy} over {len(config.replicas)} replicas, "
        f"ready on http://{args.host}:{args.port}"
    )
    return _run_app("router", build_router_app(config, keys), args, banner)


def _run_app(command: str, app: web.Application, args: argparse.Namespace, banner: str) -> int:
    """Serve `app` until Ctrl-C/SIGTERM; print `banner` once listening (the ready line)."""
    from aiohttp import web

    collector.settle_startup()
    try:
        web.run_app(
            app,
            host=args.host,
            port=args.port,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=2.0,
            print=lambda _: print(banner, flush=True),
        )
    except OSError as exc:
        print(f"kvshare {command}: {exc}", file=sys.stderr)
        return 1
    finally:
        collector.release_at_exit()
    return 0


def run_up(args: argparse.Namespace) -> int:
    from kvshare.preflight import check_up
    from kvshare.serve.launcher import Cluster, up_config

    try:
        config = up_config(args)
        check_up(config)
    except ValueError as exc:
        print(f"kvshare up: {exc}", file=sys.stderr)
        return 2
    # SIGTERM shuts down like Ctrl-C: KeyboardInterrupt unwinds through Cluster.__exit__.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with Cluster(config) as cluster:
            print(
                f"kvshare up: router {cluster.url}; replicas {', '.join(cluster.replica_urls)}; "
                f"pool {cluster.pool_address if config.kv_pool else 'off'} (Ctrl-C stops all)",
                flush=True,
            )
            print(f"kvshare up: {cluster.supervise()}; shutting down", file=sys.stderr)
            return 1
    except RuntimeError as exc:
        print(f"kvshare up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvshare up: stopped; pool files removed", file=sys.stderr)
        return 130
