"""Python client for the Kakeya runtime (gRPC kakeya.v1). Light: grpcio + protobuf only.

    from kakeya import Client
    with Client("127.0.0.1:50051") as client, client.create_session() as session:
        session.append(token_ids)
        for token_id in session.generate(max_tokens=128):
            ...

Tokenization (opt-in, `pip install kakeya[tokenize]`) lives in `kakeya.tokenization`.
"""

from kakeya.aio import AsyncClient, AsyncGeneration, AsyncSession
from kakeya.client import Client, Generation, Session
from kakeya.errors import (
    Aborted,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    KakeyaError,
    PermissionDenied,
    ResourceExhausted,
    SessionNotFound,
    Unauthenticated,
    Unavailable,
)
from kakeya.types import (
    FinishReason,
    GenerateResult,
    GenerateStats,
    KvPolicy,
    ModelInfo,
    SessionInfo,
    SparseStats,
    Speculation,
)

__version__ = "0.1.0"

__all__ = [
    "Aborted", "AsyncClient", "AsyncGeneration", "AsyncSession", "Cancelled", "Client", "DeadlineExceeded",
    "FailedPrecondition", "FinishReason", "GenerateResult", "GenerateStats", "Generation", "InternalError",
    "InvalidArgument", "KakeyaError", "KvPolicy", "ModelInfo", "PermissionDenied", "ResourceExhausted", "Session",
    "SessionInfo", "SessionNotFound", "SparseStats", "Speculation", "Unauthenticated", "Unavailable",
]
