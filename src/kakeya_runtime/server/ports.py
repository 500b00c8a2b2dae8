"""Listen ports checked before the (slow) model load: a port in use answers in one line naming the flag."""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Listen:
    flag: str  # the command-line flag that sets this port, e.g. "--metrics-port"
    host: str
    port: int  # 0: any free port (never in use)


def port_problem(listens: Sequence[Listen]) -> str | None:
    """One line naming the flag to change when a port is taken twice or cannot be bound; None when all are free."""
    seen: dict[int, Listen] = {}
    for listen in listens:
        if listen.port == 0:
            continue
        other = seen.get(listen.port)
        if other is not None:
            return f"{other.flag} and {listen.flag} both ask for port {listen.port}: give one of them another port"
        seen[listen.port] = listen
        error = _bind_error(listen.host, listen.port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            return (f"port {listen.port} on {listen.host} is already in use (another kakeya serve?): "
                    f"choose a free one with {listen.flag}")
        return f"cannot listen on {listen.host}:{listen.port} ({error.strerror or error}): change {listen.flag} or --host"
    return None


def _bind_error(host: str, port: int) -> OSError | None:
    """Bind (and release) host:port the way the servers will: SO_REUSEADDR, no SO_REUSEPORT."""
    bare = host.strip("[]")
    try:
        family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((bare, port), family=family):
            return None
    except OSError as e:  # socket.gaierror included: an unknown host
        return e
