"""Typed session errors. Each carries the status it maps to; the server turns them into gRPC codes."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request is wrong; nothing changed
    NOT_FOUND = "not_found"  # unknown, closed, evicted or foreign session
    RESOURCE_EXHAUSTED = "resource_exhausted"  # a context, session or KV byte limit; nothing changed
    FAILED_PRECONDITION = "failed_precondition"  # invariant violation (session failed) or empty history
    UNAVAILABLE = "unavailable"  # the server is shutting down
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the caller's deadline passed before the change; nothing changed
    INTERNAL = "internal"  # an engine error that left the session consistent


class Invariant(enum.Enum):
    INV1 = "inv1"  # every KV layer holds exactly the session's cached history prefix
    INV2 = "inv2"  # KV positions and history length never decrease


class SessionError(Exception):
    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(SessionError):
    kind = ErrorKind.INVALID_ARGUMENT


class SessionNotFound(SessionError):
    kind = ErrorKind.NOT_FOUND


class ResourceExhausted(SessionError):
    """A limit was reached; `limit` names which (the label of kakeya_limit_refusals_total): context,
    model_positions, sessions, sessions_per_key, kv_budget, kv_budget_per_key, request (an archive too large to
    import), state_dir (the state directory's disk is full)."""

    kind = ErrorKind.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, limit: str = "context") -> None:
        super().__init__(message)
        self.limit = limit


class FailedPrecondition(SessionError):
    kind = ErrorKind.FAILED_PRECONDITION


class Unavailable(SessionError):
    kind = ErrorKind.UNAVAILABLE


class DeadlineExceeded(SessionError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class InternalError(SessionError):
    kind = ErrorKind.INTERNAL


def quoted(text: str, limit: int = 40) -> str:
    """repr() of client input for a message, cut to a prefix when long: 'ses_AbC…' (10240 characters)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    tail = f"… ({len(text)} characters)"
    return text[: max(0, limit - len(tail))] + tail


class InvariantViolation(FailedPrecondition):
    """A session's cache and history disagree: a bug. The session is failed and freed, never repaired."""

    def __init__(self, invariant: Invariant, message: str) -> None:
        what = {Invariant.INV1: "the KV cache does not hold exactly the cached history",
                Invariant.INV2: "a KV position or the history length went back"}[invariant]
        super().__init__(f"internal error, {what} ({invariant.value}): {message}; the session was failed and freed")
        self.invariant = invariant
