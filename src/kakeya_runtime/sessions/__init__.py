"""Sessions: server-issued ids, raw-token history bound byte-exactly to a per-session KV cache."""

from kakeya_runtime.sessions.batch import BatchScheduler
from kakeya_runtime.sessions.errors import (
    ErrorKind,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    Invariant,
    InvariantViolation,
    ResourceExhausted,
    SessionError,
    SessionNotFound,
    Unavailable,
)
from kakeya_runtime.sessions.policy import PolicyRegistry, PolicySpec
from kakeya_runtime.sessions.service import (
    DoneEvent,
    GenerateParams,
    GenerateStats,
    ServiceConfig,
    SessionService,
    TokensEvent,
)
from kakeya_runtime.sessions.store import (
    EndReason,
    Outcome,
    Session,
    SessionSnapshot,
    SessionState,
    SessionStore,
)

__all__ = [
    "DoneEvent", "EndReason", "ErrorKind", "FailedPrecondition", "GenerateParams",
    "GenerateStats", "InternalError", "InvalidArgument", "Invariant", "InvariantViolation", "Outcome",
    "PolicyRegistry", "PolicySpec", "ResourceExhausted", "BatchScheduler", "ServiceConfig", "Session", "SessionError",
    "SessionNotFound", "SessionService", "SessionSnapshot", "SessionState", "SessionStore", "TokensEvent",
    "Unavailable",
]
