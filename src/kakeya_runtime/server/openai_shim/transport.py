"""uvicorn's h11 protocol with a deadline for reading each request.

uvicorn closes a connection idle between requests (its keep-alive timeout) but not one that never sends a request,
sends its headers a line at a time, or stops in the middle of its body: each such connection was held for ever, and
enough of them ran the process out of file descriptors. Here a request must arrive whole (headers and body) within
READ_S of its connection opening or of the previous response ending; past that the connection is closed. A request
read whole is never cut, however long its answer takes (a generation). (No cap on connections: uvicorn's counts
connections that sent nothing, so a few hundred idle sockets would turn every real request away.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

READ_S = 10.0


class BoundedH11Protocol(H11Protocol):
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(None)

    def on_response_complete(self) -> None:
        answered = self.cycle  # (before super(): it starts a pipelined request's cycle at once)
        super().on_response_complete()
        self._arm(answered)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def _arm(self, answered: Any) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        self._read_deadline = self.loop.call_later(READ_S, self._read_too_slow, answered)

    def _read_too_slow(self, answered: Any) -> None:
        """Close unless the request since `answered` (the last cycle answered; None: none yet) was read whole."""
        cycle = self.cycle
        unread = cycle is None or cycle is answered or (cycle.more_body and not cycle.response_started)
        if unread and not self.transport.is_closing():
            self.transport.close()
