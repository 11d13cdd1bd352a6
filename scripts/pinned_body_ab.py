"""A pinned request's time to first token through `kvshare router`, with its body passed on
to the replica as it arrives (as the router does) and read whole first (as it did before).

    PYTHONPATH=$PWD python3 scripts/pinned_body_ab.py [--tokens 131072,261888] [--requests 50]

Three processes besides this one: a stand-in replica that reads the body, parses it as a
replica does (kvshare.serve.http, on its array threads) and streams one token back; and
two routers over it, one as built, one whose pinned requests read the body whole before
forwarding it. The bench's client sends each prompt of random token ids to both, pinned,
alternately; the first 5 of each are left out. Prints a table; `--json` writes the times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from kvshare.bench.client import BenchClient, RequestOptions
from kvshare.ports import free_port
from kvshare.serve.http import ArrayReader, parse_json_object
from kvshare.serve.router import Router, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys

WARM_UP = 5
MODES = ("read whole", "as it arrives")


def serve_replica(port: int) -> None:
    reader = ArrayReader()

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"instance": "stand-in"})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await asyncio.to_thread(parse_json_object, await request.read(), reader)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [len(body["prompt"])]}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True)


def serve_router(port: int, replica_port: int, mode: str) -> None:
    if mode == MODES[0]:
        # The pinned path before bodies were passed on: read whole, then forwarded.
        Router._proxy_streamed = Router._proxy_buffered  # type: ignore[method-assign]
    config = RouterConfig((f"http://127.0.0.1:{replica_port}",), "cache-aware")
    app = build_router_app(config, RoutingKeys(None, 256))
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True)


async def time_requests(tokens: int, routers: dict[str, int], requests: int) -> dict:
    rng = random.Random(tokens)
    ids = [rng.randrange(0, 151_000) for _ in range(tokens)]
    times: dict[str, list[float]] = {mode: [] for mode in routers}
    async with aiohttp.ClientSession() as session:
        clients = {
            mode: BenchClient(session, f"http://127.0.0.1:{port}", "m", text_content=False)
            for mode, port in routers.items()
        }
        for _ in range(requests):
            for mode, client in clients.items():
                result = await client.complete(ids, RequestOptions(1, replica=0))
                if result.token_ids != (tokens,) or result.ttft_s is None:
                    raise SystemExit(f"{mode}: the replica read {result.token_ids} ids")
                times[mode].append(result.ttft_s)
    return {mode: [1e3 * t for t in ts[WARM_UP:]] for mode, ts in times.items()}


def wait_listening(ports: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"nothing listens on port {port}") from None
                time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="131072,261888")
    parser.add_argument("--requests", type=int, default=50, help="per router and length")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.serve[0] == "replica":
            serve_replica(int(args.serve[1]))
        else:
            serve_router(int(args.serve[1]), int(args.serve[2]), args.serve[3])
        return 0
    if args.requests <= WARM_UP:
        parser.error(f"--requests must be > {WARM_UP}")
    replica_port = free_port()
    routers = {mode: free_port() for mode in MODES}
    me = [sys.executable, __file__, "--serve"]
    procs = [subprocess.Popen([*me, "replica", str(replica_port)])]
    procs += [
        subprocess.Popen([*me, "router", str(port), str(replica_port), mode])
        for mode, port in routers.items()
    ]
    results = {}
    try:
        wait_listening([replica_port, *routers.values()])
        for tokens in (int(t) for t in args.tokens.split(",")):
            results[tokens] = asyncio.run(time_requests(tokens, routers, args.requests))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    print(f"\n{'tokens':>8} {'body':<14} {'median ms':>10} {'p25':>7} {'p75':>7} {'n':>4}")
    for tokens, by_mode in results.items():
        for mode, ms in by_mode.items():
            q = statistics.quantiles(ms, n=4)
            median = statistics.median(ms)
            print(f"{tokens:>8} {mode:<14} {median:10.2f} {q[0]:7.2f} {q[2]:7.2f} {len(ms):4}")
    if args.json is not None:
        args.json.write_text(json.dumps({"ttft_ms": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
