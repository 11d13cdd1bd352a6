"""Who may call what, for the replica server and the router alike.

- /health, /metrics and /version are open (probes and scrapers).
- Every other path needs `Authorization: Bearer <api key>` when an api key is set.
- /admin/* needs the admin key when one is set, else the api key when one is set. With
  neither, /admin/* answers only clients on a loopback address: clear_pool empties the pool
  every replica shares, so an unauthenticated admin call must come from this host. A
  reverse proxy on the same host makes every client look local; set a key behind one.

Keys come from a flag, a file (`--api-key-file`) or the environment (KVSHARE_API_KEY,
KVSHARE_ADMIN_KEY); a flag is visible to every user in /proc/PID/cmdline, so `kvshare up`
hands keys to its children through their environment.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvshare.serve.errors import APIError
from kvshare.serve.http import Handler

API_KEY_ENV = "KVSHARE_API_KEY"
ADMIN_KEY_ENV = "KVSHARE_ADMIN_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


@dataclass(frozen=True)
class AccessKeys:
    """The keys a server checks; None means that key is not set."""

    api_key: str | None = None
    admin_key: str | None = None

    def __post_init__(self) -> None:
        for name, key in (("api key", self.api_key), ("admin key", self.admin_key)):
            if key is not None and (not key or key != key.strip() or not key.isprintable()):
                raise ValueError(
                    f"the {name} must be non-empty printable text without "
                    "surrounding whitespace (leave it unset for no key)"
                )

    @property
    def admin_credential(self) -> str | None:
        """The key /admin/* needs: the admin key, else the api key, else none (loopback only)."""
        return self.admin_key if self.admin_key is not None else self.api_key

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> AccessKeys:
        """The keys in KVSHARE_API_KEY and KVSHARE_ADMIN_KEY: what clients such as the
        bench and validate send, and what a server reads when given no key flag or file."""
        return cls(
            read_key(None, None, API_KEY_ENV, environ), read_key(None, None, ADMIN_KEY_ENV, environ)
        )

    def authorization(self, admin: bool) -> dict[str, str]:
        """The header a client holding these keys sends to /admin (`admin`) or /v1."""
        key = self.admin_credential if admin else self.api_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def environment(self) -> dict[str, str]:
        """The environment variables that hand these keys to a child process."""
        keys = {API_KEY_ENV: self.api_key, ADMIN_KEY_ENV: self.admin_key}
        return {name: key for name, key in keys.items() if key is not None}


def read_key(
    flag: str | None, path: str | None, env_name: str, environ: Mapping[str, str] = os.environ
) -> str | None:
    """A key from its flag, else its file (first line, newline stripped), else `env_name`;
    None when none is given. ValueError for both a flag and a file, or an empty key."""
    if flag is not None and path is not None:
        raise ValueError(f"give the key or its file, not both ({env_name})")
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the key file {path}: {exc.strerror}") from None
        lines = text.splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"the key file {path} is empty")
        return lines[0].strip()
    if flag is not None:
        return flag
    value = environ.get(env_name)
    return value.strip() if value is not None and value.strip() else None


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def bearer_matches(request: web.Request, key: str) -> bool:
    """Constant-time check of the request's `Authorization: Bearer` header against `key`
    (digests first: the comparison time does not depend on the key's length either)."""
    given = hashlib.sha256(request.headers.get("Authorization", "").encode()).digest()
    expected = hashlib.sha256(f"Bearer {key}".encode()).digest()
    return hmac.compare_digest(given, expected)


def _is_admin(request: web.Request) -> bool:
    """By the route that will answer, and by the path for one that matched nothing."""
    resource = request.match_info.route.resource
    paths = [request.path] if resource is None else [request.path, resource.canonical]
    return any(p == "/admin" or p.startswith("/admin/") for p in paths)


def _unauthorized(what: str) -> APIError:
    return APIError(
        401,
        f"missing or invalid {what} (send 'Authorization: Bearer <key>')",
        code="invalid_api_key",
    )


def access_middleware(
    keys: AccessKeys,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def check_access(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if _is_admin(request):
            required = keys.admin_credential
            if required is None:
                if not is_loopback(request.remote):
                    raise APIError(
                        403,
                        "admin calls without a key are accepted from this host "
                        "only; start the server with --admin-key-file or "
                        f"{ADMIN_KEY_ENV} to allow remote ones",
                        code="admin_loopback_only",
                    )
            elif not bearer_matches(request, required):
                raise _unauthorized("admin key" if keys.admin_key is not None else "API key")
        elif keys.api_key is not None and not bearer_matches(request, keys.api_key):
            raise _unauthorized("API key")
        return await handler(request)

    return check_access


def add_key_arguments(parser: argparse.ArgumentParser) -> None:
    """--api-key[-file] and --admin-key[-file]: the keys `access_keys` reads."""
    keys = parser.add_argument_group(
        "access keys",
        f"Without a key, /v1 is open and /admin answers loopback clients only. "
        f"A key on the command line is visible to every local user (/proc/PID/cmdline): "
        f"prefer a key file or ${API_KEY_ENV} / ${ADMIN_KEY_ENV}.",
    )
    keys.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 (and on "
        f"/admin without an admin key); default: ${API_KEY_ENV}",
    )
    keys.add_argument(
        "--api-key-file", metavar="PATH", help="read the API key from this file's first line"
    )
    keys.add_argument("--admin-key", help=f"require this key on /admin; default: ${ADMIN_KEY_ENV}")
    keys.add_argument(
        "--admin-key-file", metavar="PATH", help="read the admin key from this file's first line"
    )


def access_keys(args: argparse.Namespace) -> AccessKeys:
    """The keys of parsed `add_key_arguments` flags, else the environment (ValueError if invalid)."""
    return AccessKeys(
        read_key(args.api_key, args.api_key_file, API_KEY_ENV),
        read_key(args.admin_key, args.admin_key_file, ADMIN_KEY_ENV),
    )
