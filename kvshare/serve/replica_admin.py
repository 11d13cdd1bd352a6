"""How the router carries out an admin call on one replica (`/admin/all/<call>`), by engine.

The calls a bench block start and the regression check need are the same whatever engine
the replicas run: switch the pool on or off, clear it, reset the GPU prefix cache, read
the counters. kvshare's replicas serve them at /admin/<call> (forwarded as they are).
`vllm serve` does not: for its replicas the pool calls go to the pool daemon the cluster
shares (its switch, clear and stats; every replica asks the one pool, so each answer is
the pool's and repeating it is harmless) and the prefix-cache reset to vLLM's own
POST /reset_prefix_cache (served when the replica runs with VLLM_SERVER_DEV_MODE=1).

Contract of `ReplicaAdmin.call`: never raises for a replica or pool that cannot answer;
returns {"status": HTTP status or None when nothing answered, "body": the answer} or
{"status": None, "error": why}. A status >= 400 means the call did not take effect.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import aiohttp

from kvshare.kvpool.client import PoolClient, PoolError, PoolUnavailable

ENGINES = ("kvshare", "vllm")
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# vLLM refuses a reset while blocks are still held (a request finishing this very step):
# asked again for this long before the reset counts as failed.
_VLLM_RESET_RETRY_S = 5.0
_VLLM_RESET_POLL_S = 0.1


class ReplicaAdmin(ABC):
    calls: ClassVar[Mapping[str, str]]  # the admin calls offered, and their HTTP methods
    cache_events: ClassVar[bool]  # whether replicas serve GET /admin/cache_events

    @abstractmethod
    async def call(
        self,
        session: aiohttp.ClientSession,
        url: str,
        call: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> dict[str, Any]:
        """Carry out `call` (one of `calls`) on the replica at `url`."""

    async def close(self) -> None:
        return


class KVShareReplicaAdmin(ReplicaAdmin):
    """kvshare's replicas: the call is forwarded to their /admin/<call>."""

    calls: ClassVar[Mapping[str, str]] = {
        "reset_prefix_cache": "POST",
        "kv_pool": "POST",
        "clear_pool": "POST",
        "stats": "GET",
        "cache_events": "GET",
    }
    cache_events: ClassVar[bool] = True

    async def call(
        self,
        session: aiohttp.ClientSession,
        url: str,
        call: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> dict[str, Any]:
        try:
            async with session.request(
                self.calls[call], f"{url}/admin/{call}", data=body or None, headers=headers
            ) as resp:
                return {"status": resp.status, "body": _parsed(await resp.text())}
        except _UPSTREAM_ERRORS as exc:
            return {"status": None, "error": f"{type(exc).__name__}: {exc}"}


class VLLMReplicaAdmin(ReplicaAdmin):
    """`vllm serve` replicas sharing the pool at `pool_address` (None: they run without one)."""

    calls: ClassVar[Mapping[str, str]] = {
        "reset_prefix_cache": "POST",
        "kv_pool": "POST",
        "clear_pool": "POST",
        "stats": "GET",
    }
    cache_events: ClassVar[bool] = False

    def __init__(self, pool_address: str | None) -> None:
        self.pool = PoolClient(pool_address) if pool_address else None

    async def call(
        self,
        session: aiohttp.ClientSession,
        url: str,
        call: str,
        body: bytes,
        headers: Mapping[str, str],
    ) -> dict[str, Any]:
        if call == "reset_prefix_cache":
            return await self._reset(session, url)
        if call == "stats":  # no engine counters: the pool's
            answer = await self._pool_call("stats", lambda pool: pool.stats())
            return answer | {"body": {"kv_pool": None, "pool": answer["body"]}}
        if call == "clear_pool":
            return await self._pool_call("clear", lambda pool: {"cleared": pool.clear()})
        enabled = _parsed(body.decode(errors="replace")) if body else None
        enabled = enabled.get("enabled") if isinstance(enabled, dict) else None
        if type(enabled) is not bool:
            return {"status": 400, "body": {"error": 'kv_pool takes {"enabled": true|false}'}}

        def switch(pool: PoolClient) -> dict[str, bool]:
            pool.set_enabled(enabled)
            return {"enabled": enabled}

        return await self._pool_call("switch", switch)

    async def _reset(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        deadline = time.monotonic() + _VLLM_RESET_RETRY_S
        try:
            while True:
                async with session.post(f"{url}/reset_prefix_cache") as resp:
                    answer = _parsed(await resp.text())
                    if resp.status == 404:
                        return {
                            "status": 501,
                            "body": {
                                "error": "this vLLM replica has no /reset_prefix_cache: "
                                "start it with VLLM_SERVER_DEV_MODE=1 (kvshare up does)"
                            },
                        }
                    held = isinstance(answer, dict) and answer.get("success") is False
                    if not held or time.monotonic() > deadline:
                        return {"status": 409 if held else resp.status, "body": answer}
                await asyncio.sleep(_VLLM_RESET_POLL_S)
        except _UPSTREAM_ERRORS as exc:
            return {"status": None, "error": f"{type(exc).__name__}: {exc}"}

    async def _pool_call(self, name: str, op: Callable[[PoolClient], Any]) -> dict[str, Any]:
        pool = self.pool
        if pool is None:
            return {"status": 409, "body": {"error": "these replicas run without a pool"}}
        try:
            # The client blocks (a Unix socket, bounded by its timeout): off the event loop.
            return {"status": 200, "body": await asyncio.to_thread(op, pool)}
        except PoolUnavailable as exc:
            return {"status": 503, "body": {"error": f"the pool is unavailable ({name}): {exc}"}}
        except PoolError as exc:
            return {"status": 502, "body": {"error": f"the pool refused {name}: {exc}"}}

    async def close(self) -> None:
        if self.pool is not None:
            await asyncio.to_thread(self.pool.close)


def pool_switch(stats: Mapping[str, Any]) -> bool | None:
    """Whether a replica uses the pool, from its /admin/all/stats body: a kvshare replica's
    own switch, else (vLLM replicas) the shared daemon's; None when the body has neither."""
    for part, key in (("engine", "kv_pool_enabled"), ("pool", "enabled")):
        section = stats.get(part)
        if isinstance(section, Mapping) and isinstance(section.get(key), bool):
            return section[key]
    return None


def pool_switch_calls(switches: Sequence[bool | None]) -> list[tuple[int | None, bool]]:
    """The kv_pool calls that set the replicas' switches back to `switches` (per replica in
    router order; None: unknown, left as it is), as (replica index, enabled): one call for
    every replica (index None) when all had the same known setting, else one per replica
    whose setting is known. A bench or check that switches the pool puts it back with
    these, so that it never leaves a cluster serving with its pool off."""
    known = set(switches)
    if len(known) == 1 and None not in known:
        return [(None, known.pop())]
    return [(i, enabled) for i, enabled in enumerate(switches) if enabled is not None]


def replica_admin(engine: str, pool_address: str | None) -> ReplicaAdmin:
    if engine == "vllm":
        return VLLMReplicaAdmin(pool_address)
    if engine == "kvshare":
        return KVShareReplicaAdmin()
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
