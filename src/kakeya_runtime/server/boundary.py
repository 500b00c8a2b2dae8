"""The status boundary: how every RPC's bytes become a request and every failure becomes a typed status.

A server interceptor wraps each unary handler (whatever servicer is registered) so that:

* request bytes that do not decode (corrupt wire format, a string field that is not UTF-8, messages nested
  past protobuf's recursion limit) answer INVALID_ARGUMENT: the deserializer never raises, it hands the
  handler a `MalformedRequest`, which the wrapper refuses before the servicer sees it;
* a SessionError raised by the servicer answers its own status (sessions.errors.ErrorKind);
* anything else is a bug: it is logged with its traceback and answers INTERNAL with the exception's type
  only, never UNKNOWN with Python's exception text;
* status details are clipped to MAX_DETAILS_CHARS, so no client input echoed into a message can break
  gRPC's metadata limit (a transport RESOURCE_EXHAUSTED in place of the real status);
* a RESOURCE_EXHAUSTED refusal reports the limit it names to `on_limit` (kakeya_limit_refusals_total); every
  status is counted per RPC by the metrics interceptor outside this one (server.metrics.RpcMetricsInterceptor).

Requests over the receive limit are refused by gRPC itself (RESOURCE_EXHAUSTED) before any of this runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kakeya_runtime.sessions.errors import ErrorKind, InvalidArgument, ResourceExhausted, SessionError, clip

_log = logging.getLogger(__name__)

# Details travel percent-encoded in the grpc-message trailer (up to 12 bytes per character); 512 characters
# stay under gRPC's 8 KiB default metadata soft limit whatever they contain.
MAX_DETAILS_CHARS = 512

STATUS_OF: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

LimitHook = Callable[[str], None]


@dataclass(slots=True, frozen=True)
class MalformedRequest:
    """What the deserializer hands over in place of a message it could not decode."""

    reason: str


def details(text: str) -> str:
    """Status details as sent: at most MAX_DETAILS_CHARS characters."""
    return clip(text, MAX_DETAILS_CHARS)


def safe_deserializer(deserialize: Callable[[bytes], Any], rpc: str) -> Callable[[bytes], Any]:
    """A request deserializer that returns MalformedRequest instead of raising (a raising one answers UNKNOWN)."""

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # DecodeError, and whatever else a decoder may raise on hostile bytes
            return MalformedRequest(f"could not decode the {rpc} request: {_decode_reason(e)}")

    return decode


def _decode_reason(error: Exception) -> str:
    # upb says "Error parsing message with type 'kakeya.v1.X': <why>"; keep the why.
    text = str(error)
    why = text.rsplit("': ", 1)[-1] if "': " in text else text or type(error).__name__
    if "MaxDepth" in why or isinstance(error, RecursionError):
        return "messages nested deeper than protobuf's recursion limit (100)"
    return clip(why, 120)


class StatusBoundary(grpc.aio.ServerInterceptor):
    """Decodes requests safely and maps every failure to a typed status (unary requests, and the request stream of
    a stream-unary RPC: each message is decoded safely as it arrives)."""

    def __init__(self, on_limit: LimitHook | None = None) -> None:
        self.on_limit: LimitHook = on_limit or (lambda limit: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or (handler.request_streaming and handler.response_streaming):
            return handler  # unknown method (gRPC answers UNIMPLEMENTED), or bidirectional (none is served): untouched
        rpc = handler_call_details.method.rsplit("/", 1)[-1]
        decode = handler.request_deserializer
        kw = {"request_deserializer": None if decode is None else safe_deserializer(decode, rpc),
              "response_serializer": handler.response_serializer}
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._wrap_client_stream(handler.stream_unary, rpc), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._wrap_stream(handler.unary_stream, rpc), **kw)
        return grpc.unary_unary_rpc_method_handler(self._wrap_unary(handler.unary_unary, rpc), **kw)

    def _wrap_unary(self, behavior: Callable[..., Awaitable[Any]], rpc: str) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                _refuse_malformed(request)
                return await behavior(request, context)
            except Exception as e:  # every failure becomes a status (cancellation is a BaseException: it passes)
                await self._fail(context, e, rpc)

        return handle

    def _wrap_stream(self, behavior: Callable[..., Any], rpc: str) -> Callable[..., AsyncIterator[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                _refuse_malformed(request)
                produced = behavior(request, context)
                if hasattr(produced, "__aiter__"):
                    # aclosing: a client that goes away closes the servicer's generator (and its engine job).
                    async with contextlib.aclosing(produced):
                        async for message in produced:
                            yield message
                else:  # a coroutine that writes through context.write
                    await produced
            except Exception as e:  # every failure becomes a status (cancellation is a BaseException: it passes)
                await self._fail(context, e, rpc)

        return handle

    def _wrap_client_stream(self, behavior: Callable[..., Awaitable[Any]], rpc: str) -> Callable[..., Awaitable[Any]]:
        async def handle(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(_checked(requests), context)
            except Exception as e:  # every failure becomes a status (cancellation is a BaseException: it passes)
                await self._fail(context, e, rpc)

        return handle

    async def _fail(self, context: grpc.aio.ServicerContext, error: Exception, rpc: str) -> None:
        """Answer `error` as a status (always raises: context.abort ends the RPC)."""
        if isinstance(error, grpc.aio.AbortError):  # the servicer aborted with a status of its own
            raise error
        if isinstance(error, SessionError):
            code, message = STATUS_OF[error.kind], error.message
            if isinstance(error, ResourceExhausted):
                self.on_limit(error.limit)
        else:
            _log.error("%s failed with an unexpected error", rpc, exc_info=error)
            code, message = grpc.StatusCode.INTERNAL, f"{rpc} failed ({type(error).__name__}); see the server log"
        # the abort chains this error, whose traceback (and those of the errors it chains) keeps the failed call's
        # frames, an import's buffered archive among them, in a cycle only a full collection frees: answered and
        # logged, they are not needed any more
        chained: BaseException | None = error
        for _ in range(64):  # (a chain is short; the bound only guards against a cycle)
            if chained is None:
                break
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        await context.abort(code, details(message))


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        _refuse_malformed(request)
        yield request


def _refuse_malformed(request: Any) -> None:
    if isinstance(request, MalformedRequest):
        raise InvalidArgument(request.reason)
