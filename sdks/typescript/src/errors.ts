/** Typed errors, one per gRPC status the runtime returns (no silent fallbacks). */

import { status, type ServiceError } from "@grpc/grpc-js";

/** Base of every error the SDK raises. `code` is the gRPC status (undefined for client-side checks). */
export class KakeyaError extends Error {
  readonly code: status | undefined;

  constructor(message: string, code?: status) {
    super(message);
    this.name = new.target.name;
    this.code = code ?? (new.target as unknown as { statusCode?: status }).statusCode;
  }
}

/** Bad token ids, empty append, bad maxTokens / sampling / policy; the session is unchanged. */
export class InvalidArgument extends KakeyaError {
  static readonly statusCode = status.INVALID_ARGUMENT;
}

/** Unknown, closed, evicted (TTL / LRU), failed or foreign session id. */
export class SessionNotFound extends KakeyaError {
  static readonly statusCode = status.NOT_FOUND;
}

/**
 * The history would exceed the context; no free session slot (or none left for this key); the KV byte budget cannot
 * hold the session; the state directory's disk is full; an archive or a request too large.
 */
export class ResourceExhausted extends KakeyaError {
  static readonly statusCode = status.RESOURCE_EXHAUSTED;
}

/**
 * An invariant violation (the session was failed and freed); Generate on an empty history; a Generate's speculation
 * the session's policy cannot roll back; K/V past its packed codec's range (rolled back); an archive of another model.
 */
export class FailedPrecondition extends KakeyaError {
  static readonly statusCode = status.FAILED_PRECONDITION;
}

export class Unauthenticated extends KakeyaError {
  static readonly statusCode = status.UNAUTHENTICATED;
}

export class PermissionDenied extends KakeyaError {
  static readonly statusCode = status.PERMISSION_DENIED;
}

/** The server is unreachable or shutting down. */
export class Unavailable extends KakeyaError {
  static readonly statusCode = status.UNAVAILABLE;
}

export class DeadlineExceeded extends KakeyaError {
  static readonly statusCode = status.DEADLINE_EXCEEDED;
}

export class Cancelled extends KakeyaError {
  static readonly statusCode = status.CANCELLED;
}

export class Aborted extends KakeyaError {
  static readonly statusCode = status.ABORTED;
}

/** An engine error during Generate: the session was rolled back to its last committed token. */
export class InternalError extends KakeyaError {
  static readonly statusCode = status.INTERNAL;
}

const BY_CODE = new Map<status, typeof KakeyaError>(
  [InvalidArgument, SessionNotFound, ResourceExhausted, FailedPrecondition, Unauthenticated, PermissionDenied,
    Unavailable, DeadlineExceeded, Cancelled, Aborted, InternalError].map((cls) => [cls.statusCode, cls]),
);

/** A grpc-js ServiceError as the matching typed error (KakeyaError for codes without a class of their own). */
export function fromServiceError(error: ServiceError): KakeyaError {
  const cls = BY_CODE.get(error.code) ?? KakeyaError;
  return new cls(error.details || error.message, error.code);
}
