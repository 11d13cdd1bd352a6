"""The pool daemon: owns the arena file and the index, serves clients on a Unix socket.

Single-threaded asyncio: every request runs to completion on the event loop before the
next one starts, so the index needs no locks and each request is atomic.

Robustness rules:
- A malformed request (unknown op, missing or mistyped fields, a contract violation)
  gets an error response; the connection stays open.
- A frame that cannot be parsed (over the size limit, or not msgpack) closes that
  connection only.
- A connection that closes, for any reason, loses its leases, reservations and claims
  (so clients waiting for what it was producing stop waiting at once).
- No request can kill the daemon: unexpected exceptions are logged and answered.
- `set_enabled` false (an operator's switch, e.g. the OFF blocks of a benchmark) makes
  every lookup a miss and every reserve store nothing, whatever engine the clients run.
- No client can take the pool from the others: each connection holds at most
  `max_client_fraction` of it (see PoolIndex), and connections past `max_clients`
  get an error answer and are closed (their clients recompute).

Files: the daemon owns its socket, its arena and `<socket>.lock` (kvpool.ownership)
and removes all three at shutdown. A second daemon on the same socket or arena path
refuses to start; files left by a daemon that died are removed by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshare.kvpool.arena import DEFAULT_SLAB_BYTES, Arena, ArenaGeometry
from kvshare.kvpool.index import PoolIndex, PoolRequestError
from kvshare.kvpool.keys import KEY_BYTES
from kvshare.kvpool.ownership import (
    PoolInUseError,
    claim_socket,
    clean_folder,
    publish_address,
    release_socket,
    remove_if_unlocked,
    unpublish_address,
)
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.paths import check_private_dir, ensure_private_dir
from kvshare.kvpool.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_body,
    encode_frame,
    frame_length,
)
from kvshare.kvpool.remote import MooncakeTier, RemoteCache, RemoteConfig

log = logging.getLogger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107
# How long a refused connection may take to send its first request (to be answered).
_REFUSAL_READ_S = 5.0

Handler = Callable[[int, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class PoolConfig:
    """`max_client_fraction`: the share of the arena's slabs one connection may hold
    reserved or pinned. `max_clients`: connections served at once. `runtime_dir`: the
    per-user folder where the daemon publishes its address and removes what dead
    daemons left there at start (None: neither). `remote`: the second tier, shared
    between hosts (None: this host's pool only)."""

    size_bytes: int
    socket_path: str
    arena_path: str
    slab_bytes: int = DEFAULT_SLAB_BYTES
    preallocate: bool = False
    max_client_fraction: float = 0.5
    max_clients: int = 64
    runtime_dir: str | None = None
    remote: RemoteConfig | None = None

    def __post_init__(self) -> None:
        ArenaGeometry(self.size_bytes, self.slab_bytes)
        if not 0.0 < self.max_client_fraction <= 1.0:
            raise ValueError(
                f"max_client_fraction must be in (0, 1], got {self.max_client_fraction}"
            )
        if self.max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {self.max_clients}")
        if not self.socket_path or len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"socket path must be 1..{_MAX_SOCKET_PATH_BYTES} bytes, got {self.socket_path!r}"
            )
        if not self.arena_path:
            raise ValueError("arena path must not be empty")
        if self.runtime_dir is not None and not os.path.isabs(self.runtime_dir):
            raise ValueError(f"runtime_dir must be an absolute path, got {self.runtime_dir!r}")

    @property
    def max_client_bytes(self) -> int:
        geometry = ArenaGeometry(self.size_bytes, self.slab_bytes)
        usable = geometry.slab_count * geometry.slab_bytes
        return max(1, int(usable * self.max_client_fraction))


class PoolDaemon:
    """Serves one arena. Use: `await PoolDaemon(config).serve()` until `stop()`."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.generation = os.urandom(16)
        self.index = PoolIndex(
            ArenaGeometry(config.size_bytes, config.slab_bytes), config.max_client_bytes
        )
        self.refused_connections = 0
        self.enabled = True
        self._next_conn = 1
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._connection_tasks: set[asyncio.Task[None]] = set()
        self._stopping: asyncio.Event | None = None
        self.remote = (
            RemoteCache(config.remote, self.index, MooncakeTier(config.remote))
            if config.remote is not None
            else None
        )
        self._handlers: dict[str, Handler] = {
            "hello": self._hello,
            "lookup": self._lookup,
            "unclaim": self._unclaim,
            "release": self._release,
            "invalidate": self._invalidate,
            "reserve": self._reserve,
            "commit": self._commit,
            "abort": self._abort,
            "clear": self._clear,
            "set_enabled": self._set_enabled,
            "stats": self._stats,
        }

    async def serve(
        self, on_ready: Callable[[], None] | None = None, handle_signals: bool = True
    ) -> None:
        """Create the arena and socket, serve until `stop()` (or SIGINT/SIGTERM when
        `handle_signals`), then close every connection and remove both.

        PoolInUseError (a ValueError) if a live daemon owns the socket or arena path."""
        self._stopping = asyncio.Event()
        config = self.config
        if config.runtime_dir is not None:
            ensure_private_dir(config.runtime_dir)
            for path in clean_folder(config.runtime_dir).removed:
                log.warning("removed %s, left by a pool daemon that died", path)
        socket_dir = os.path.dirname(os.path.abspath(config.socket_path))
        os.makedirs(socket_dir, mode=0o700, exist_ok=True)
        check_private_dir(socket_dir)
        lock_fd = claim_socket(config.socket_path, config.arena_path)
        try:
            await self._serve_claimed(on_ready, handle_signals)
        finally:
            release_socket(lock_fd, config.socket_path)
            if config.runtime_dir is not None:
                unpublish_address(config.runtime_dir, config.socket_path)

    async def _serve_claimed(
        self, on_ready: Callable[[], None] | None, handle_signals: bool
    ) -> None:
        assert self._stopping is not None
        listener = _bind_private_socket(self.config.socket_path)
        arena: Arena | None = None
        try:
            arena = _create_arena(self.config)
            if self.config.runtime_dir is not None:
                publish_address(self.config.runtime_dir, self.config.socket_path)
            if self.remote is not None:
                self.remote.start(arena)
            server = await asyncio.start_unix_server(self._serve_connection, sock=listener)
            loop = asyncio.get_running_loop()
            if handle_signals:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(signum, self.stop)
            if on_ready is not None:
                on_ready()
            await self._stopping.wait()
            server.close()
            # Abort (not close): a client that stops reading must not hold the shutdown
            # in a flush. Each connection's task then ends on its own; let them finish
            # rather than have asyncio.run cancel them mid-request.
            for writer in self._writers.values():
                writer.transport.abort()
            await asyncio.gather(*self._connection_tasks)
            await server.wait_closed()
        finally:
            if self.remote is not None:
                self.remote.close()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
            if arena is not None:
                arena.unlink()
                arena.close()

    def stop(self) -> None:
        """Ask `serve` to shut down; safe to call from a signal handler on the loop."""
        if self._stopping is not None:
            self._stopping.set()

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(self._writers) >= self.config.max_clients:
            await self._refuse(reader, writer)
            return
        conn = self._next_conn
        self._next_conn += 1
        self._writers[conn] = writer
        task = asyncio.current_task()
        assert task is not None
        self._connection_tasks.add(task)
        try:
            while True:
                header = await reader.readexactly(LENGTH.size)
                request = decode_body(await reader.readexactly(frame_length(header)))
                if self.remote is not None and self.enabled:
                    await self.remote.before(request)
                response = self._respond(conn, request)
                if self.remote is not None:
                    self.remote.after(request, response)
                writer.write(encode_frame(response))
                await writer.drain()
        except ProtocolError as error:
            log.warning("closing connection %d: %s", conn, error)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.index.disconnect(conn)
            del self._writers[conn]
            self._connection_tasks.discard(task)
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the first request of a connection over `max_clients` with an error
        (the client takes the pool as down: recompute), then close it."""
        self.refused_connections += 1
        log.warning(
            "refusing a connection: %d clients connected, the limit", self.config.max_clients
        )
        error = (
            f"pool daemon refuses the connection: it serves at most "
            f"{self.config.max_clients} clients"
        )
        try:
            header = await asyncio.wait_for(reader.readexactly(LENGTH.size), _REFUSAL_READ_S)
            body = await asyncio.wait_for(reader.readexactly(frame_length(header)), _REFUSAL_READ_S)
            request = decode_body(body)
            request_id = request.get("id") if isinstance(request, dict) else None
            writer.write(encode_frame({"id": request_id, "ok": False, "error": error}))
            await asyncio.wait_for(writer.drain(), _REFUSAL_READ_S)
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    def _respond(self, conn: int, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            return {"id": None, "ok": False, "error": "a request must be a map"}
        request_id = request.get("id")
        op = request.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"id": request_id, "ok": False, "error": f"unknown op {op!r}"}
        try:
            response = handler(conn, request)
        except (PoolRequestError, ValueError, TypeError, KeyError) as error:
            return {"id": request_id, "ok": False, "error": f"{op}: {error}"}
        except Exception as error:
            log.exception("op %s failed", op)
            return {"id": request_id, "ok": False, "error": f"{op}: internal error: {error!r}"}
        response["id"] = request_id
        response["ok"] = True
        return response

    # -- ops -------------------------------------------------------------------

    def _hello(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "arena_path": self.config.arena_path,
            "arena_bytes": self.config.size_bytes,
            "slab_bytes": self.config.slab_bytes,
            "generation": self.generation,
            "header_bytes": HEADER_BYTES,
        }

    def _lookup(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        states = None
        if "states" in request:
            states = [(int(i), k) for i, k in _list_of(request, "states", list)]
            if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for _, k in states):
                raise ValueError(f"every state key must be {KEY_BYTES} bytes")
        keys = _keys(request, "keys")
        claim = request.get("claim", False)
        if type(claim) is not bool:
            raise ValueError(f"field 'claim' must be a bool, got {claim!r}")
        # The state pages the caller will store (its snapshots), claimed with the keys.
        claim_states = _keys(request, "claim_states") if "claim_states" in request else []
        if claim_states and not claim:
            raise ValueError("field 'claim_states' needs 'claim'")
        head = request.get("head", False)
        if type(head) is not bool:
            raise ValueError(f"field 'head' must be a bool, got {head!r}")
        if head and (states is not None or claim or "page" in request):
            raise ValueError("a head lookup takes keys only")
        # Released first, in this one step of the index: pages the two leases share stay
        # pinned throughout, and the caller's quota does not count them twice.
        if "release" in request:
            self.index.release(conn, _int(request, "release"))
        if not self.enabled:
            return {"lease": 0, "pages": []}
        lease, pages = self.index.lookup(conn, keys, states, counted=not head)
        if head:
            return {"lease": lease, "pages": pages}
        # What others are producing past the committed run, before this caller claims
        # the rest: the caller may wait for those keys instead of computing them.
        in_progress, idle_s = self.index.in_progress(conn, keys, states)
        if claim:
            self.index.claim(conn, [*keys, *claim_states])
        return {"lease": lease, "pages": pages, "in_progress": in_progress, "idle_s": idle_s}

    def _unclaim(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        return {"unclaimed": self.index.unclaim(conn, _keys(request, "keys"))}

    def _release(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        self.index.release(conn, _int(request, "lease"))
        return {}

    def _invalidate(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        keys = _keys(request, "keys")
        return {"invalidated": self.index.invalidate(conn, _int(request, "lease"), keys)}

    def _reserve(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        keys = _keys(request, "keys")
        extends = _keys(request, "extends") if request.get("extends") is not None else []
        if not self.enabled:
            _int(request, "payload_bytes")
            return {"pages": [], "present": [], "dropped": 0}
        reserved, present, dropped = self.index.reserve(
            conn, keys, _int(request, "payload_bytes"), extends
        )
        return {"pages": reserved, "present": present, "dropped": dropped}

    def _commit(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        keys = _keys(request, "keys")
        checksums = _list_of(request, "checksums", bytes)
        offsets = _list_of(request, "offsets", int) if request.get("offsets") is not None else None
        self.index.commit(conn, keys, checksums, offsets)
        return {}

    def _abort(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        return {"aborted": self.index.abort(conn, _keys(request, "keys"))}

    def _clear(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        return {"cleared": self.index.clear()}

    def _set_enabled(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        enabled = request.get("enabled")
        if type(enabled) is not bool:
            raise ValueError(f"field 'enabled' must be a bool, got {enabled!r}")
        self.enabled = enabled
        log.info("pool %s by a client", "enabled" if enabled else "disabled")
        return {}

    def _stats(self, conn: int, request: dict[str, Any]) -> dict[str, Any]:
        stats = self.index.stats()
        stats["enabled"] = self.enabled
        stats["generation"] = self.generation.hex()
        stats["arena_path"] = self.config.arena_path
        stats["connections"] = len(self._writers)
        stats["max_clients"] = self.config.max_clients
        stats["refused_connections"] = self.refused_connections
        if self.remote is not None:
            stats["remote"] = self.remote.stats()
        return {"stats": stats}


def _keys(request: dict[str, Any], name: str) -> list[bytes]:
    keys = _list_of(request, name, bytes)
    for key in keys:
        if len(key) != KEY_BYTES:
            raise ValueError(f"every key must be {KEY_BYTES} bytes, got {len(key)}")
    return keys


def _list_of(request: dict[str, Any], name: str, kind: type) -> list[Any]:
    values = request.get(name)
    if not isinstance(values, list) or not all(type(v) is kind for v in values):
        raise ValueError(f"field {name!r} must be a list of {kind.__name__}")
    return values


def _int(request: dict[str, Any], name: str) -> int:
    value = request.get(name)
    if type(value) is not int:
        raise ValueError(f"field {name!r} must be an int, got {value!r}")
    return value


def _bind_private_socket(path: str) -> socket.socket:
    """Bind a listening Unix socket at `path` with mode 0600 from the first instant.

    Refuses if a daemon already answers there; removes a stale socket file.
    """
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ValueError(f"{path} exists and is not a socket")
        if _socket_answers(path):
            raise ValueError(f"a pool daemon is already serving at {path}")
        log.warning("removing stale socket %s", path)
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask applies to bind(): no window in which the socket is wider than 0600.
    previous_umask = os.umask(0o177)
    try:
        listener.bind(path)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(previous_umask)
    listener.listen(128)
    listener.setblocking(False)
    return listener


def _socket_answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _create_arena(config: PoolConfig) -> Arena:
    """Create the arena file. One left by a daemon that died (nobody holds its flock) is
    replaced; one a live daemon holds means PoolInUseError, and it is left alone."""

    def create() -> Arena:
        return Arena.create(
            config.arena_path, config.size_bytes, config.slab_bytes, config.preallocate
        )

    try:
        return create()
    except FileExistsError:
        pass
    removed = remove_if_unlocked(config.arena_path)
    if removed is None:
        raise PoolInUseError(
            f"arena {config.arena_path} is in use by another live pool daemon: "
            "give each daemon its own arena path"
        )
    if removed:
        log.warning("replaced stale arena %s, left by a pool daemon that died", config.arena_path)
    try:
        return create()
    except FileExistsError as error:
        raise PoolInUseError(
            f"arena {config.arena_path} was just created by another daemon"
        ) from error
