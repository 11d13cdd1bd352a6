"""HTTP side of the bench: streamed OpenAI requests timed client-side, and the admin calls.

TTFT is the time from sending a request to the first SSE chunk whose text delta is non-empty:
a role-only first chunk, or an incomplete UTF-8 character held back by the server, is not
content. A model with no tokenizer streams no text; for it, content is the generated ids the
server sends in every choice (`token_ids`, a kvshare extension). Requests ask for
`ignore_eos`, so every request generates exactly max_tokens tokens in both conditions and an
answer that would end at once still has a first token to time.

The target is the router. Admin calls and counters go through its /admin/all/<path>, which
reaches every replica (whatever engine it runs: kvshare.serve.replica_admin) and also makes
the router's cache-aware index forget what the replicas forgot.
Requests carry the keys of KVSHARE_API_KEY and KVSHARE_ADMIN_KEY (kvshare.serve.auth).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvshare.bench.synthetic import Prompt
from kvshare.serve.auth import AccessKeys
from kvshare.serve.replica_admin import pool_switch, pool_switch_calls
from kvshare.serve.server_timing import HEADER as TIMING_HEADER
from kvshare.serve.server_timing import parse_server_timing

REPLICA_HEADER = "x-kvshare-replica"
SESSION_HEADER = "x-session-id"


class BenchError(RuntimeError):
    """The server answered something the bench cannot measure (an HTTP error, a bad stream)."""


@dataclass(frozen=True)
class StreamResult:
    ttft_s: float | None  # None: no chunk had content
    total_s: float  # until the stream ended ([DONE] or close)
    text: str  # the generated text, all deltas joined
    token_ids: tuple[int, ...]  # the generated ids, where the server streams them
    usage: Mapping[str, Any] | None  # the final usage chunk (stream_options.include_usage)
    served_by: str | None  # the replica the router reports in its response header, if any
    chunks: int
    # Milliseconds per phase from the response's Server-Timing headers (replica and router;
    # kvshare.serve.server_timing); empty from a server that sends none.
    server_timing: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ttft_s is not None and not 0.0 <= self.ttft_s <= self.total_s:
            raise ValueError(f"ttft {self.ttft_s} outside [0, total {self.total_s}]")


@dataclass(frozen=True)
class RequestOptions:
    max_tokens: int
    replica: int | None = None  # pin to this replica index (router header); None: router decides
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (TTFT needs a token), got {self.max_tokens}")
        if self.replica is not None and self.replica < 0:
            raise ValueError(f"replica index must be >= 0, got {self.replica}")

    def headers(self) -> dict[str, str]:
        out = {}
        if self.replica is not None:
            out[REPLICA_HEADER] = str(self.replica)
        if self.session_id is not None:
            out[SESSION_HEADER] = self.session_id
        return out


def chunk_content(chunk: Mapping[str, Any]) -> str:
    """The text delta of one streamed chunk: `text` (completions) or `delta.content` (chat)."""
    parts = []
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        parts.append(text or "")
    return "".join(parts)


def chunk_token_ids(chunk: Mapping[str, Any]) -> list[int]:
    return [int(t) for choice in chunk.get("choices") or () for t in choice.get("token_ids") or ()]


@dataclass(frozen=True)
class BenchClient:
    session: aiohttp.ClientSession
    url: str  # the router (or a single replica)
    model: str  # the `model` field sent with each request
    text_content: bool = True  # False: the model has no tokenizer, content is token ids
    keys: AccessKeys = field(default_factory=AccessKeys)

    def __post_init__(self) -> None:
        if self.url.endswith("/"):
            raise ValueError(f"url must not end with '/': {self.url!r}")

    async def complete(self, prompt: Prompt, options: RequestOptions) -> StreamResult:
        return await self._stream("/v1/completions", {"prompt": prompt}, options)

    async def chat(
        self, messages: Sequence[Mapping[str, str]], options: RequestOptions
    ) -> StreamResult:
        return await self._stream("/v1/chat/completions", {"messages": list(messages)}, options)

    async def _stream(
        self, path: str, payload: dict[str, Any], options: RequestOptions
    ) -> StreamResult:
        body = {
            "model": self.model,
            **payload,
            "max_tokens": options.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        # Before the clock starts: a long prompt takes a while. Compact, as the official
        # openai client (httpx) writes it: ", " would add a byte per token id to read and parse.
        data = json.dumps(body, separators=(",", ":")).encode()
        headers = {
            "content-type": "application/json",
            **options.headers(),
            **self.keys.authorization(False),
        }
        ttft = None
        texts: list[str] = []
        ids: list[int] = []
        usage = None
        chunks = 0
        start = time.perf_counter()
        async with self.session.post(self.url + path, data=data, headers=headers) as resp:
            await _check(resp, path)
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                if line[5:].strip() == b"[DONE]":
                    break
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise BenchError(f"{path}: error in stream: {chunk['error']}")
                chunks += 1
                content, new_ids = chunk_content(chunk), chunk_token_ids(chunk)
                if (content if self.text_content else new_ids) and ttft is None:
                    ttft = time.perf_counter() - start
                texts.append(content)
                ids.extend(new_ids)
                usage = chunk.get("usage") or usage
            total = time.perf_counter() - start
            served_by = resp.headers.get(REPLICA_HEADER)
            timing = parse_server_timing(resp.headers.getall(TIMING_HEADER, ()))
        return StreamResult(
            ttft, total, "".join(texts), tuple(ids), usage, served_by, chunks, timing
        )

    async def replicas(self) -> list[str]:
        """Replica base URLs, in router index order (the index that REPLICA_HEADER pins)."""
        replicas = await get_json(
            self.session, self.url + "/admin/replicas", self.keys.authorization(True)
        )
        return [r["url"].rstrip("/") for r in replicas]

    async def admin_all(self, action: str, body: Mapping[str, Any] | None = None) -> Any:
        """POST /admin/<action> on every replica, through the router."""
        path = f"/admin/all/{action}"
        async with self.session.post(
            self.url + path, json=dict(body or {}), headers=self.keys.authorization(True)
        ) as resp:
            await _check(resp, path)
            return await resp.json(content_type=None)

    async def stats(self) -> list[dict[str, Any]]:
        """Every replica's counters (its /admin/stats), in router index order."""
        answer = await get_json(
            self.session, self.url + "/admin/all/stats", self.keys.authorization(True)
        )
        return [replica["body"] for replica in answer["replicas"]]

    async def pool_switches(self) -> list[bool | None]:
        """Whether each replica uses the pool now (None: its counters do not say)."""
        return [pool_switch(body) for body in await self.stats()]

    async def set_pool_switches(
        self, switches: Sequence[bool | None], replicas: Sequence[str]
    ) -> None:
        """Set each replica's pool switch to `switches` (as pool_switches read them);
        `replicas`: their URLs, for a cluster whose replicas had different settings."""
        for index, enabled in pool_switch_calls(switches):
            if index is None:
                await self.admin_all("kv_pool", {"enabled": enabled})
                continue
            url = f"{replicas[index]}/admin/kv_pool"
            async with self.session.post(
                url, json={"enabled": enabled}, headers=self.keys.authorization(True)
            ) as resp:
                await _check(resp, url)


async def get_json(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> Any:
    async with session.get(url, headers=headers) as resp:
        await _check(resp, url)
        return await resp.json(content_type=None)


async def served_models(session: aiohttp.ClientSession, url: str, keys: AccessKeys) -> list[str]:
    return [
        m["id"]
        for m in (await get_json(session, url + "/v1/models", keys.authorization(False)))["data"]
    ]


async def _check(resp: aiohttp.ClientResponse, path: str) -> None:
    if resp.status >= 400:
        raise BenchError(f"{resp.method} {path}: HTTP {resp.status}: {(await resp.text())[:500]}")
