"""The bench's OpenAI client: what it puts on the wire."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kvshare.bench.client import BenchClient, RequestOptions
from tests.serve.inprocess import stand_in_replica


def _send_prompt(prompt: list[int]) -> bytes:
    """The raw body the client sends for a completion of `prompt`."""
    bodies: list[bytes] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def complete(url: str) -> tuple[int, ...]:
        async with aiohttp.ClientSession() as session:
            client = BenchClient(session, url, "m", text_content=False)
            result = await client.complete(prompt, RequestOptions(max_tokens=1))
        assert result.ttft_s is not None
        return result.token_ids

    replica = stand_in_replica(completions)
    try:
        assert asyncio.run(complete(replica.url)) == (7,)
    finally:
        replica.close()
    return bodies[0]


def test_a_prompt_of_token_ids_goes_as_compact_json() -> None:
    """As the official openai client (httpx) writes JSON: no space after a comma, which
    would add a byte per id for the router and the replica to read."""
    prompt = [101, 2, 30_000, 0]
    raw = _send_prompt(prompt)
    assert b"[101,2,30000,0]" in raw
    assert b", " not in raw and b": " not in raw
    assert json.loads(raw)["prompt"] == prompt
