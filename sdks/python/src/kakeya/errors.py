"""Typed exceptions, one per gRPC status the runtime returns (seed 000 §2.10: no silent fallbacks)."""

from __future__ import annotations

import grpc


class KakeyaError(Exception):
    """Base of every error the SDK raises. `code` is the gRPC status (None for client-side checks)."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(KakeyaError):
    """Bad token ids, empty append, bad max_tokens / sampling / policy; the session is unchanged."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFound(KakeyaError):
    """Unknown, closed, evicted (TTL / LRU), failed or foreign session id."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(KakeyaError):
    """The history would exceed the context; no free session slot (or none left for this key); the KV byte budget
    cannot hold the session; the state directory's disk is full; an archive or a request too large."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KakeyaError):
    """An invariant violation (the session was failed and freed); Generate on an empty history; a Generate's
    speculation the session's policy cannot roll back; K/V past its packed codec's range (rolled back); an archive
    of another model."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(KakeyaError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KakeyaError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(KakeyaError):
    """The server is unreachable or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KakeyaError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KakeyaError):
    code = grpc.StatusCode.CANCELLED


class Aborted(KakeyaError):
    code = grpc.StatusCode.ABORTED


class InternalError(KakeyaError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KakeyaError]] = {
    cls.code: cls
    for cls in (InvalidArgument, SessionNotFound, ResourceExhausted, FailedPrecondition, Unauthenticated,
                PermissionDenied, Unavailable, DeadlineExceeded, Cancelled, Aborted, InternalError)
}


def from_rpc_error(error: grpc.RpcError) -> KakeyaError:
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    cls = _BY_CODE.get(code, KakeyaError)
    return cls(details, code=code)
