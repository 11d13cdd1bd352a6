"""Who may call what (kvshare.serve.auth), on a bare app with the servers' middleware and on
the router over fake replicas that check keys the same way: api and admin keys, the
loopback-only admin plane without a key, keys from the environment and files, and the
router's fan-out and proxy reaching nothing but what they name."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web

from kvshare.bench.client import BenchClient, BenchError, served_models
from kvshare.serve.auth import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    OPEN_PATHS,
    AccessKeys,
    access_keys,
    access_middleware,
    is_loopback,
    read_key,
)
from kvshare.serve.cli import register
from kvshare.serve.http import Handler, error_middleware
from kvshare.serve.router import ADMIN_CALLS, RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.validate.regression import _Service
from tests.serve.inprocess import BackgroundServer

API, ADMIN = "api-secret", "admin-secret"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def guarded_app(keys: AccessKeys, remote: str | None = None) -> tuple[web.Application, list[str]]:
    """An app with the servers' middleware that records the calls past the probes; `remote`
    poses as the client's address."""
    calls: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        if request.path not in OPEN_PATHS:
            calls.append(f"{request.method} {request.path}")
        return web.json_response(
            {"status": "ok", "instance": "fake", "path": request.path, "data": []}
        )

    @web.middleware
    async def pose(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=remote) if remote else request)

    app = web.Application(middlewares=[pose, error_middleware, access_middleware(keys)])
    for path in ("/health", "/metrics", "/version", "/v1/completions", "/v1/models"):
        app.router.add_route("*", path, handle)
    for call in ADMIN_CALLS:
        app.router.add_route("*", f"/admin/{call}", handle)
    return app, calls


@contextlib.contextmanager
def serving(app: web.Application) -> Iterator[httpx.Client]:
    server = BackgroundServer(app)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            yield client
    finally:
        server.close()


def statuses(client: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, int]:
    paths = {
        "v1": ("POST", "/v1/completions"),
        "admin": ("POST", "/admin/clear_pool"),
        "health": ("GET", "/health"),
        "metrics": ("GET", "/metrics"),
        "version": ("GET", "/version"),
    }
    return {
        name: client.request(method, path, headers=headers).status_code
        for name, (method, path) in paths.items()
    }


OPEN = {"health": 200, "metrics": 200, "version": 200}


def test_api_key_alone_guards_api_and_admin() -> None:
    app, calls = guarded_app(AccessKeys(api_key=API))
    with serving(app) as client:
        assert statuses(client) == {"v1": 401, "admin": 401, **OPEN}
        assert statuses(client, bearer("wrong")) == {"v1": 401, "admin": 401, **OPEN}
        assert statuses(client, bearer(API)) == {"v1": 200, "admin": 200, **OPEN}
        refused = client.post("/admin/clear_pool")
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert calls.count("POST /admin/clear_pool") == 1


def test_the_admin_key_is_separate_from_the_api_key() -> None:
    app, calls = guarded_app(AccessKeys(api_key=API, admin_key=ADMIN))
    with serving(app) as client:
        assert statuses(client, bearer(API)) == {"v1": 200, "admin": 401, **OPEN}
        assert statuses(client, bearer(ADMIN)) == {"v1": 401, "admin": 200, **OPEN}
    assert calls.count("POST /admin/clear_pool") == 1


def test_an_admin_key_without_an_api_key_leaves_the_api_open() -> None:
    app, _ = guarded_app(AccessKeys(admin_key=ADMIN))
    with serving(app) as client:
        assert statuses(client) == {"v1": 200, "admin": 401, **OPEN}
        assert statuses(client, bearer(ADMIN))["admin"] == 200


def test_without_keys_admin_calls_come_from_loopback_only() -> None:
    app, _ = guarded_app(AccessKeys())
    with serving(app) as client:
        assert statuses(client) == {"v1": 200, "admin": 200, **OPEN}
    remote_app, calls = guarded_app(AccessKeys(), remote="203.0.113.7")
    with serving(remote_app) as client:
        assert statuses(client) == {"v1": 200, "admin": 403, **OPEN}
        assert client.get("/admin/stats").json()["error"]["code"] == "admin_loopback_only"
    assert not any("/admin/" in c for c in calls)
    keyed_app, _ = guarded_app(AccessKeys(admin_key=ADMIN), remote="203.0.113.7")
    with serving(keyed_app) as client:  # a key lets a remote admin in
        assert statuses(client, bearer(ADMIN))["admin"] == 200


def test_loopback_addresses() -> None:
    for address in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(address), address
    for address in ("10.0.0.1", "203.0.113.7", "::ffff:10.0.0.1", "fe80::1%eth0", "", None, "x"):
        assert not is_loopback(address), address


def test_keys_from_flag_file_or_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {API_KEY_ENV: "from-env"}
    assert read_key("from-flag", None, API_KEY_ENV, env) == "from-flag"
    assert read_key(None, str(key_file), API_KEY_ENV, env) == "from-file"
    assert read_key(None, None, API_KEY_ENV, env) == "from-env"
    assert read_key(None, None, ADMIN_KEY_ENV, env) is None
    assert read_key(None, None, API_KEY_ENV, {API_KEY_ENV: ""}) is None
    (tmp_path / "empty").write_text("\n")
    for flag, path, message in (
        ("a", str(key_file), "not both"),
        (None, str(tmp_path / "empty"), "empty"),
        (None, str(tmp_path / "missing"), "cannot read"),
    ):
        with pytest.raises(ValueError, match=message):
            read_key(flag, path, API_KEY_ENV, env)
    for bad in ("", " padded", "two\nlines"):
        with pytest.raises(ValueError):
            AccessKeys(api_key=bad)
    assert AccessKeys(API, ADMIN).environment() == {API_KEY_ENV: API, ADMIN_KEY_ENV: ADMIN}
    assert AccessKeys(api_key=API).admin_credential == API


def test_serve_and_router_read_keys_from_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN + "\n")
    monkeypatch.setenv(API_KEY_ENV, API)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    for argv in (["serve", "--model", "m"], ["router", "--replica", "http://h:1"], ["up"]):
        keys = access_keys(parser.parse_args([*argv, "--admin-key-file", str(admin_file)]))
        assert keys == AccessKeys(API, ADMIN), argv


# ------------------------------------------------------------------ router


@contextlib.contextmanager
def keyed_router(keys: AccessKeys) -> Iterator[tuple[httpx.Client, list[list[str]]]]:
    """A router with `keys` over two fake replicas that hold the same keys."""
    replicas = [guarded_app(keys) for _ in range(2)]
    servers = [BackgroundServer(app) for app, _ in replicas]
    config = RouterConfig(
        tuple(s.url for s in servers),
        "round-robin",
        health_interval=60.0,
        api_key=keys.api_key,
        admin_key=keys.admin_key,
    )
    try:
        with serving(build_router_app(config, RoutingKeys(None, 16))) as client:
            yield client, [calls for _, calls in replicas]
    finally:
        for server in servers:
            server.close()


def test_router_guards_api_and_admin_with_its_keys() -> None:
    with keyed_router(AccessKeys(API, ADMIN)) as (client, calls):
        body = {"model": "m", "prompt": "hi"}
        assert client.post("/v1/completions", json=body).status_code == 401
        assert client.post("/v1/completions", json=body, headers=bearer(ADMIN)).status_code == 401
        assert client.post("/v1/completions", json=body, headers=bearer(API)).status_code == 200
        for method, path in (("GET", "/admin/replicas"), ("POST", "/admin/all/clear_pool")):
            assert client.request(method, path).status_code == 401, path
            assert client.request(method, path, headers=bearer(API)).status_code == 401, path
        assert client.get("/health").status_code == client.get("/metrics").status_code == 200
        assert client.get("/admin/replicas", headers=bearer(ADMIN)).status_code == 200
        # The fan-out carries the admin key: replicas that check it answer.
        cleared = client.post("/admin/all/clear_pool", headers=bearer(ADMIN))
        assert cleared.status_code == 200, cleared.text
        assert [a["status"] for a in cleared.json()["replicas"]] == [200, 200]
    assert [c.count("POST /admin/clear_pool") for c in calls] == [1, 1]


def test_router_fan_out_sends_the_api_key_when_there_is_no_admin_key() -> None:
    with keyed_router(AccessKeys(api_key=API)) as (client, calls):
        answer = client.get("/admin/all/stats", headers=bearer(API))
        assert answer.status_code == 200 and [a["status"] for a in answer.json()["replicas"]] == [
            200,
            200,
        ]
    assert all(c == ["GET /admin/stats"] for c in calls)


def raw_request(client: httpx.Client, method: str, target: str, headers: dict[str, str]) -> int:
    """The status of `target` sent byte for byte (httpx would normalize the path)."""
    host, port = client.base_url.host, client.base_url.port
    lines = [
        f"{method} {target} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        "Content-Length: 2",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n{}").encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


TRAVERSALS = (
    "/admin/all/..%2Fv1%2Fcompletions",
    "/admin/all/..%2fv1%2fcompletions",
    "/admin/all/%2E%2E%2Fv1%2Fcompletions",
    "/admin/all/../../v1/completions",
    "/admin/all/..%5Cv1%5Ccompletions",
    "/admin/all/stats%2F..%2F..%2Fv1%2Fmodels",
    "/admin/all/clear_pool/extra",
    "/admin/all/replicas",
    "/admin/all/..",
    "/v1/..%2Fadmin%2Fclear_pool",
    "/v1/../admin/clear_pool",
    "/v1/%2e%2e/admin/clear_pool",
    "/v1/x/..%2F..%2Fadmin%2Fclear_pool",
    "/v1/.%2F..%2Fadmin/clear_pool",
    "/v1/completions/..%2F..%2Fadmin%2Fclear_pool",
)


@pytest.mark.parametrize("keys", [AccessKeys(), AccessKeys(API, ADMIN)], ids=["no-keys", "keys"])
def test_router_reaches_nothing_but_the_named_calls(keys: AccessKeys) -> None:
    # The client holds the keys: only the path could take it elsewhere.
    api, admin = ({}, {}) if keys.api_key is None else (bearer(API), bearer(ADMIN))
    with keyed_router(keys) as (client, calls):
        for target in TRAVERSALS:
            fan_out = target.startswith("/admin/")
            status = raw_request(client, "POST", target, admin if fan_out else api)
            assert status == (404 if fan_out else 400), (target, status)
        assert client.get("/admin/all/clear_pool", headers=admin).status_code == 405
    assert calls == [[], []]


def test_bench_and_validate_clients_send_the_keys_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, API)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    keys = AccessKeys.from_environment()
    assert keys == AccessKeys(API, ADMIN)

    async def bench(url: str, keys: AccessKeys) -> list[str]:
        async with aiohttp.ClientSession() as session:
            assert await served_models(session, url, keys) == []
            client = BenchClient(session, url, "m", keys=keys)
            await client.admin_all("reset_prefix_cache")
            return await client.replicas()

    with keyed_router(keys) as (client, calls):
        url = str(client.base_url).rstrip("/")
        assert len(asyncio.run(bench(url, keys))) == 2
        with pytest.raises(BenchError, match="401"):
            asyncio.run(bench(url, AccessKeys()))
        service = _Service(url)
        service.admin_all("clear_pool")
        assert service.http.get(f"{url}/admin/replicas", headers=service.admin).status_code == 200
    assert [c.count("POST /admin/clear_pool") for c in calls] == [1, 1]
    assert [c.count("POST /admin/reset_prefix_cache") for c in calls] == [1, 1]
