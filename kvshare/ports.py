"""Free TCP ports for child processes that must be told their port before they start."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that were free a moment ago. All sockets are held open until every
    port is picked, so the same port is never handed out twice in one call; another process
    may still take one before the caller binds it."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(n):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(probe)
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
