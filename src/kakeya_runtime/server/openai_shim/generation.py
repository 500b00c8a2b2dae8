"""A shim request as a single-shot session of the session service: admit, create, generate, close.

Admission is deliberate about what a throwaway session may cost others:
* the shim's own queue: more than max_concurrent + max_queue requests in flight, or max_queue (at least one)
  Generates already waiting for a batch row, answer 429 `queue_full` (counted as the limit "openai_queue");
* the session limits (sessions.limits) without eviction: a key at its session or KV quota (or a full server)
  gets 429 naming the limit, and none of its own sessions (which may be long gRPC conversations) is evicted
  to make room for a session that lives for one reply. The refusal is atomic with the creation, in the store.

Stop strings end the generation in the session service (sessions.stops), on the same token as here; this side
only holds back text that may still become a stop string, so a streamed reply never shows part of one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request

from kakeya_runtime.engine.generate import FinishReason
from kakeya_runtime.server.openai_shim.errors import OpenAIError, call, from_session_error
from kakeya_runtime.server.openai_shim.parsing import ShimRequest
from kakeya_runtime.server.openai_shim.responses import Finish, Piece
from kakeya_runtime.sessions.errors import ResourceExhausted, SessionError, Unavailable
from kakeya_runtime.sessions.service import DoneEvent, SessionService
from kakeya_runtime.sessions.stops import Detokenize, StopMatcher, StreamDecoder

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}
# OpenAI-style codes for the session limits a single-shot session may hit (sessions.limits names them).
_LIMIT_CODES = {"sessions": "sessions_full", "sessions_per_key": "session_quota_exceeded",
                "kv_budget": "kv_budget_exhausted", "kv_budget_per_key": "kv_quota_exceeded"}


QUEUE_LIMIT = "openai_queue"  # kakeya_limit_refusals_total's label for the shim's own queue


class ClientGone(Exception):
    """The client disconnected before the reply was ready."""


class SingleShot:
    """Runs shim requests as sessions of `service`, counting those in flight against the shim's queue."""

    def __init__(self, service: SessionService, detokenize: Detokenize, *, max_queue: int,
                 on_limit: Callable[[str], None] | None = None) -> None:
        self.service = service
        self.detokenize = detokenize
        self.max_queue = max_queue
        self.on_limit = on_limit or (lambda limit: None)
        self.active = 0  # shim generations admitted and not yet finished
        self.closing = False  # shutting down: new requests and generations ended early answer 503
        self._live: dict[str, str] = {}  # session id -> owner of each generation in flight

    def close(self) -> None:
        """Shutting down: refuse new requests with 503 (in-flight ones run on until `end_all`)."""
        self.closing = True

    async def end_all(self) -> None:
        """End every generation still in flight (the shutdown's grace is over): each answers 503 — an error body,
        or an error event and [DONE] on a stream — instead of a reply that merely looks cut short."""
        for session_id, owner in list(self._live.items()):
            with contextlib.suppress(SessionError):
                await self.service.close(owner, session_id)

    async def generate(self, owner: str, req: ShimRequest) -> AsyncIterator[Piece]:
        """Text pieces with stop strings applied, then one Finish."""
        service = self.service
        if self.closing:
            raise _shutting_down()
        limit = service.config.max_concurrent + self.max_queue
        backlog = service.scheduler.backlog  # waiting for a batch row, not merely not picked up yet
        if self.active >= limit or backlog >= max(self.max_queue, 1):
            self.on_limit(QUEUE_LIMIT)
            raise OpenAIError(429, f"the server is busy ({self.active} requests in flight, {backlog} generations "
                                   "waiting for room); retry shortly", type="rate_limit_error",
                              code="queue_full", headers={"retry-after": "1"})
        self.active += 1
        try:
            session = await self._create(owner, req)
            self._live[session.id] = owner
            try:
                async for item in self._pieces(owner, session.id, req):
                    yield item
            except OpenAIError:
                if self.closing:  # its session was ended by end_all
                    raise _shutting_down() from None
                raise
            finally:
                self._live.pop(session.id, None)
                with contextlib.suppress(SessionError):
                    await service.close(owner, session.id)
        finally:
            self.active -= 1

    async def _create(self, owner: str, req: ShimRequest) -> Any:
        try:
            # not journaled: after a crash nobody could reach (or close) it, and it would hold the key's quota
            return await self.service.create(owner, req.prompt_ids, evict=False, durable=False)
        except ResourceExhausted as e:
            if e.limit not in _LIMIT_CODES:
                raise OpenAIError(429, e.message, type="rate_limit_error", code="resource_exhausted",
                                  headers={"retry-after": "1"}) from None
            self.on_limit(e.limit)
            raise OpenAIError(429, f"{e.message}. This OpenAI-compatible API runs each request as a short-lived "
                                   "session and never evicts your API key's other sessions to make room for it.",
                              type="rate_limit_error", code=_LIMIT_CODES[e.limit],
                              headers={"retry-after": "1"}) from None
        except SessionError as e:
            raise from_session_error(e) from None

    async def _pieces(self, owner: str, session_id: str, req: ShimRequest) -> AsyncIterator[Piece]:
        eos = set(self.service.eos_ids)
        decoder = StreamDecoder(self.detokenize)
        stops = StopMatcher(req.params.stop)
        count = 0
        events = self.service.generate(owner, session_id, req.params)
        async with contextlib.aclosing(events):  # leaving early (disconnect) cancels the engine job
            while True:
                event = await call(anext(events))
                if isinstance(event, DoneEvent):
                    if event.finish_reason is FinishReason.CANCELLED and self.closing:
                        raise _shutting_down()  # ended by end_all: not a reply that is complete
                    text = "" if stops.stopped else stops.push(decoder.flush()) + stops.flush()
                    if text:
                        yield text
                    yield Finish(_FINISH[event.finish_reason], count)
                    return
                for token in event.token_ids:
                    count += 1
                    if token in eos:
                        continue
                    text = stops.push(decoder.push(token))  # "" once a stop string matched: the service ends here
                    if text:
                        yield text


def _shutting_down() -> OpenAIError:
    return from_session_error(Unavailable("the server is shutting down; retry on another instance or after it "
                                          "restarts"))


async def until_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """`awaitable`'s result, or ClientGone (with the work cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone
    return work.result()
