"""API keys: `authorization: Bearer <key>` metadata, checked by a server interceptor.

Sessions are owned by the hash of the key that created them; every lookup compares owners, so a
session is invisible (NOT_FOUND) to any other key. Without keys (loopback only) everyone is "".
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc

AUTH_HEADER = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)  # answered without a key: they reveal only up or down


def owner_of(key: str) -> str:
    # Sessions store a digest, never the key itself.
    return hashlib.sha256(key.encode()).hexdigest()[:32]


MIN_KEY_LENGTH = 8
MAX_KEY_LENGTH = 4096  # gRPC refuses request metadata past 8-16 KiB: a longer key could never be presented


def check_key(key: str, what: str = "API keys") -> None:
    """A key a client can send: a bearer token in gRPC metadata and HTTP headers, so printable ASCII without spaces
    (KAKEYA_API_KEY also splits several keys at spaces), at most MAX_KEY_LENGTH characters."""
    if len(key) < MIN_KEY_LENGTH:
        raise ValueError(f"{what} must be at least {MIN_KEY_LENGTH} characters long")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"{what} must be at most {MAX_KEY_LENGTH} characters long (no client could send a longer "
                         "one in a request header)")
    if not (key.isascii() and key.isprintable()) or any(ch.isspace() for ch in key):
        raise ValueError(f"{what} must be printable ASCII without spaces (no client could send anything else as a "
                         "bearer token)")


class ApiKeyAuth:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = list(dict.fromkeys(k for k in keys if k))
        for key in self._keys:
            check_key(key)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def count(self) -> int:
        """Distinct keys (0: auth off)."""
        return len(self._keys)

    def owner(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """The caller's owner id, or None when a key is required and missing or wrong."""
        if not self._keys:
            return ""
        presented = _bearer(metadata)
        if presented is None:
            return None
        # Compare against every key in constant time so timing reveals nothing about which matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented.encode(), key.encode())
        return owner_of(presented) if ok else None


def _bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for name, value in metadata or ():
        if name.lower() == AUTH_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC without a valid key with UNAUTHENTICATED, before any handler runs (and, as the
    interceptor before the status boundary, before its request is even decoded)."""

    def __init__(self, auth: ApiKeyAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES)
                or self.auth.owner(handler_call_details.invocation_metadata) is not None):
            return handler
        return self._deny(handler)

    async def _abort(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer ...)")

    async def _abort_stream(self, request, context: grpc.aio.ServicerContext):
        await self._abort(request, context)
        yield  # pragma: no cover - never reached; makes this an async generator

    def _deny(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        # The request is never looked at (its deserializer, the StatusBoundary's, never raises).
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._abort_stream, **kw)
        if handler.stream_stream:  # server reflection
            return grpc.stream_stream_rpc_method_handler(self._abort_stream, **kw)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._abort, **kw)
        return grpc.stream_unary_rpc_method_handler(self._abort, **kw)  # ImportSession: nothing of it is read
