"""The kakeya.v1 gRPC server (grpc.aio): messages in, session-service calls, messages out.

Handlers run on the asyncio event loop and never touch tensors: they translate protobuf messages
into SessionService calls, which hand model work to the engine threads and relay tokens back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import ssl
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from kakeya_runtime import __version__
from kakeya_runtime.engine.generate import Engine, FinishReason
from kakeya_runtime.engine.serving import ServingChoice, served_as_loaded
from kakeya_runtime.kv.policy import governed_layers
from kakeya_runtime.kv.spec import CODEC_KINDS, DEFAULT_Q
from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.server.auth import ApiKeyAuth, AuthInterceptor, check_key
from kakeya_runtime.server.boundary import StatusBoundary
from kakeya_runtime.server.health import add_health_and_reflection
from kakeya_runtime.server.metrics import RpcMetricsInterceptor, RuntimeMetrics
from kakeya_runtime.sessions import records
from kakeya_runtime.sessions.batch import DEFAULT_MAX_BATCH, DEFAULT_SHORT_PROMPT, DEFAULT_STEP_TOKENS
from kakeya_runtime.sessions.budget import default_kv_budget
from kakeya_runtime.sessions.chunk_budget import DEFAULT_SLOWDOWN
from kakeya_runtime.sessions.errors import (
    InvalidArgument,
    ResourceExhausted,
    SessionError,
    quoted,
)
from kakeya_runtime.sessions.journal import FsyncPolicy, StateDir
from kakeya_runtime.sessions.limits import Limits
from kakeya_runtime.sessions.policy import PolicyRegistry, PolicySpec
from kakeya_runtime.sessions.service import (
    DoneEvent,
    GenerateParams,
    RecoveryStats,
    ServiceConfig,
    SessionService,
)
from kakeya_runtime.sessions.snapshot import checkpoint_id, checkpoint_id_of, model_fingerprint
from kakeya_runtime.sessions.stops import detokenizer

try:
    from kakeya_runtime._proto import runtime_pb2 as pb
    from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - a checkout that skipped `make proto`
    raise ImportError("gRPC stubs missing: run `python -m kakeya_runtime.protogen` (or `make proto`)") from e

# Gemma 3's tokenizer.json alone is ~33 MB: GetModelInfo must be allowed to carry it.
MAX_SEND_BYTES = 256 * 1024 * 1024
# The receive limit, by default sized to the largest valid request: a context full of token ids (a valid id is
# a non-negative int32, at most 5 varint bytes) plus headroom for the policy params, the id and the framing.
TOKEN_ID_WIRE_BYTES = 5
REQUEST_HEADROOM_BYTES = 1024 * 1024
ARCHIVE_CHUNK_BYTES = 1024 * 1024  # ExportSession's chunks: under any receive limit request_bytes_for allows
# A connection must finish its TLS and HTTP/2 handshake within this (gRPC's default, 60 s, let connections that
# send nothing pile up towards the file-descriptor limit); the OpenAI shim gives a request as long.
HANDSHAKE_S = 10.0
# A connection with no call in progress for this long is closed (gRPC's default keeps it for ever, so connections that
# handshake and then send nothing piled up as well); a client's channel reconnects by itself at its next call.
IDLE_CONNECTION_S = 300.0
_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


class InsecureBindError(ValueError):
    """A non-loopback bind without an API key, or without TLS unless acknowledged (`insecure`)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve anywhere


def check_step_slowdown(value: float) -> None:
    """ValueError unless `value` is a usable --step-slowdown (a chunk step's bound over a decode step's time)."""
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"--step-slowdown must be a finite number > 1, got {value}")


@dataclass(slots=True)
class ServedModel:
    """The model plus what GetModelInfo hands to clients (tokenizer and template as data)."""

    name: str
    model: DecoderModel
    tokenizer_json: str = ""
    chat_template: str | None = None
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    # What `kakeya serve --weights/--compile` chose (engine.serving): reported by GetModelInfo and /metrics.
    serving: ServingChoice | None = None
    decode_forward: Any = None  # the compiled decode step (engine.compiled.CompiledDecode), if any
    # The checkpoint the weights come from, whatever their served format (sessions.snapshot.checkpoint_id); empty:
    # taken from `model` as it is.
    checkpoint: str = ""

    @classmethod
    def from_loaded(cls, loaded: Any, name: str) -> ServedModel:
        """From models.loader.LoadedModel (model, tokenizer_json, chat_template, eos_ids, bos_id, source)."""
        return cls(name, loaded.model, loaded.tokenizer_json or "", loaded.chat_template,
                   tuple(loaded.eos_ids), loaded.bos_id, checkpoint=checkpoint_id(name, loaded.source))


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (tests)
    metrics_port: int | None = None  # None: no HTTP /metrics; 0: any free port
    api_keys: tuple[str, ...] = ()
    max_sessions: int = 64
    idle_ttl_s: float = 1800.0
    max_concurrent: int = DEFAULT_MAX_BATCH  # Generates batched at once (the engine loop's max batch; 1: serial)
    step_tokens: int | None = DEFAULT_STEP_TOKENS  # tokens per engine step; None: sized by measurement (sessions.batch)
    step_slowdown: float = DEFAULT_SLOWDOWN  # that measured budget's bound: a step with a prompt chunk vs one without
    short_prompt: int = DEFAULT_SHORT_PROMPT  # prompts up to this many tokens are read in one step (sessions.batch)
    context_length: int | None = None  # None: the model's max positions
    sweep_interval_s: float | None = None
    idle_compress_after_s: float | None = None  # compress sessions idle this long; None: never
    idle_codec: str | None = "d4"  # identity | d4 | e8, for sessions without an idle_codec; None/"none": no default
    idle_q: int = DEFAULT_Q
    grace_s: float = 2.0  # shutdown: how long in-flight RPCs get to finish
    max_request_bytes: int | None = None  # gRPC receive limit; None: request_bytes_for(the context length)
    max_sessions_per_key: int | None = None  # None: an equal share of max_sessions among the API keys
    kv_budget: int | None = None  # KV bytes all sessions may reserve; None: sized to the machine (sessions.budget)
    kv_budget_per_key: int | None = None  # None: an equal share of kv_budget among the API keys
    evict_across_keys: bool = False  # may a key's new session evict other keys' idle sessions?
    tls_cert: str | None = None  # PEM certificate chain; with tls_key, gRPC is served over TLS only
    tls_key: str | None = None  # PEM private key
    insecure: bool = False  # acknowledges a non-loopback bind without TLS (API keys cross the network in clear)
    metrics_host: str = "127.0.0.1"  # /metrics bind address (loopback unless asked)
    metrics_key: str | None = None  # /metrics answers only `authorization: Bearer <metrics_key>`; None: anyone
    openai_port: int | None = None  # the deprecated OpenAI-style HTTP shim (server/openai_shim/), on host; None: off
    openai_max_queue: int = 16  # shim requests beyond max_concurrent + this many answer 429
    state_dir: str | None = None  # durable sessions (sessions.journal): journals and KV snapshots here; None: memory only
    fsync: str = "call"  # always | call | never: when journal records reach the disk (sessions.journal)
    extra_options: list[tuple[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        if not is_loopback(self.host) and not any(self.api_keys):
            raise InsecureBindError(
                f"refusing to listen on non-loopback host {self.host!r} without an API key (--api-key)"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its private key (--tls-key)")
        for what, path in (("TLS certificate", self.tls_cert), ("TLS key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{what} {path!r} is not a readable file")
        if self.tls_cert is not None and self.tls_key is not None:  # gRPC itself only says it could not bind
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.tls_cert, self.tls_key)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--tls-cert {self.tls_cert!r} and --tls-key {self.tls_key!r} are not a PEM "
                                 f"certificate chain and its private key ({e.__class__.__name__}: {e})") from None
        for flag, port in (("--port", self.port), ("--metrics-port", self.metrics_port),
                           ("--openai-port", self.openai_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be a port in [0, 65535], got {port}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context must be >= 1, got {self.context_length}")
        if not (math.isfinite(self.idle_ttl_s) and self.idle_ttl_s > 0):
            raise ValueError(f"--ttl must be a finite number of seconds > 0, got {self.idle_ttl_s}")
        if self.openai_max_queue < 0:
            raise ValueError(f"--openai-max-queue must be >= 0, got {self.openai_max_queue}")
        for key in self.api_keys:
            if not key:  # `--api-key "$KEY"` with KEY unset: serving without keys is not what was asked
                raise ValueError("an --api-key is empty (an unset variable?): give the key, or leave the flag out")
            check_key(key)
        if not is_loopback(self.host) and self.tls_cert is None and not self.insecure:
            raise InsecureBindError(
                f"refusing to listen on non-loopback host {self.host!r} without TLS (--tls-cert/--tls-key): API keys "
                "and tokens would cross the network in clear; pass --insecure to accept that"
            )
        if self.metrics_key is not None:
            check_key(self.metrics_key, "the metrics key")
        for name in ("max_sessions", "max_sessions_per_key", "kv_budget", "kv_budget_per_key"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for flag, value in (("--max-batch", self.max_concurrent), ("--step-tokens", self.step_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        check_step_slowdown(self.step_slowdown)
        if self.short_prompt < 0:
            raise ValueError(f"--short-prompt must be >= 0, got {self.short_prompt}")
        if self.idle_compress_after_s is not None and not (math.isfinite(self.idle_compress_after_s)
                                                           and self.idle_compress_after_s > 0):
            raise ValueError(f"--idle-compress-after must be a finite number of seconds > 0 (idle_compress_after_s), "
                             f"got {self.idle_compress_after_s}")
        if self.idle_codec is not None and self.idle_codec.lower() not in (*CODEC_KINDS, "none"):
            raise ValueError(f"--idle-codec (idle_codec) must be one of {', '.join((*CODEC_KINDS, 'none'))}, got "
                             f"{self.idle_codec!r}")
        if self.fsync not in {p.value for p in FsyncPolicy}:
            raise ValueError(f"--fsync must be one of {', '.join(p.value for p in FsyncPolicy)}, got {self.fsync!r}")
        if self.state_dir is not None and Path(self.state_dir).exists() and not Path(self.state_dir).is_dir():
            raise ValueError(f"the state directory {self.state_dir!r} is not a directory")
        if self.max_request_bytes is not None and not 0 < self.max_request_bytes < 2**31:
            raise ValueError(f"--max-request-bytes (max_request_bytes) must be in [1, 2**31), got "
                             f"{self.max_request_bytes}")


def request_bytes_for(context_length: int) -> int:
    """The default receive limit: what the largest valid request (a context of token ids) needs, plus headroom."""
    return min(context_length * TOKEN_ID_WIRE_BYTES + REQUEST_HEADROOM_BYTES, 2**31 - 1)  # gRPC takes an int32


# Imports buffer their archive before reading it, and exports hold theirs until the client has read it: all imports
# together, and all exports together, hold at most this many of the largest archive (~380 MB at SmolLM2's context);
# more answers RESOURCE_EXHAUSTED (16 imports at once once took 7 GB and kept it; 8 unread exports of one session
# held more than the whole KV budget). With API keys, one key's transfers hold at most one largest archive each way:
# another key always has room for its own.
IMPORT_BUFFER_FACTOR = 2
IMPORT_STALL_S = 30.0  # an import that sends nothing this long is refused (it held its buffered bytes for ever)
EXPORT_STALL_S = 30.0  # an export its client does not read for this long is ended (it held its archive for ever)


@dataclass(slots=True)
class _HeldBytes:
    """Bytes that transfers in progress hold (imports or exports), all together and per API key; `take` refuses
    what would pass `each` for one key (when there are keys) or, for all, `each` times the factor or the number of
    keys, whichever is more (so every key has room for one of its own)."""

    what: str  # "imports" or "exports": the limit's name
    each: int
    keys: int  # distinct API keys; 0: auth off
    total: int = 0
    by_key: dict[str, int] = field(default_factory=dict)

    def take(self, owner: str, n: int) -> None:
        if self.total == 0:  # alone, a transfer always goes: an export of a session recovered with a longer
            self._add(owner, n)  # context than this server's may pass `each`, and retrying would never help
            return
        held = self.by_key.get(owner, 0) + n
        if self.keys and held > self.each:
            raise ResourceExhausted(f"this key's other {self.what} in progress hold the bytes one archive may take; "
                                    "retry when they end", limit=self.what)
        # a transfer let through alone past `each` counts as one archive here: it does not take another key's room
        # (at most one such transfer is in progress: it went alone)
        counted = held + sum(min(v, self.each) for k, v in self.by_key.items() if k != owner) if self.keys \
            else self.total + n
        if counted > max(IMPORT_BUFFER_FACTOR, self.keys) * self.each:
            raise ResourceExhausted(f"other {self.what} in progress hold the bytes archives may take at once; "
                                    "retry shortly", limit=self.what)
        self._add(owner, n)

    def _add(self, owner: str, n: int) -> None:
        self.total += n
        self.by_key[owner] = self.by_key.get(owner, 0) + n

    def give_back(self, owner: str, n: int) -> None:
        self.total -= n
        left = self.by_key.pop(owner, 0) - n
        if left:
            self.by_key[owner] = left


def _could_start_archive(head: bytes) -> bool:
    n = min(len(head), len(records.MAGIC))
    return head[:n] == records.MAGIC[:n]


END_GRACE_S = 1.0  # at shutdown, after the grace period: for ended Generates to stream their last tokens


class RuntimeServicer(pb_grpc.RuntimeServiceServicer):
    def __init__(self, service: SessionService, served: ServedModel, auth: ApiKeyAuth, config: ServerConfig) -> None:
        self.service = service
        self.auth = auth
        cfg = service.engine.config
        self.model_info = pb.GetModelInfoResponse(
            model_name=served.name,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(service.eos_ids),
            bos_token_id=served.bos_id,
            context_length=service.context_length,
            tokenizer_json=served.tokenizer_json,
            chat_template=served.chat_template,
            max_sessions=config.max_sessions,
            max_sessions_per_key=service.store.limits.key_sessions,
            kv_budget_bytes=service.store.limits.kv_budget or 0,
            kv_budget_per_key_bytes=service.store.limits.key_budget or 0,
            max_concurrent=config.max_concurrent,
            session_idle_ttl_seconds=config.idle_ttl_s,
            kv_policies=service.policies.names(),
            idle_compress_after_seconds=service.config.idle_compress_after_s or 0.0,
            idle_codec=service.idle_codec.label if service.idle_codec is not None else "",
            runtime_version=__version__,
        )
        serving = served.serving or served_as_loaded(service.engine.model, served.decode_forward is not None)
        fid = serving.fidelity
        self.model_info.MergeFrom(pb.GetModelInfoResponse(
            weight_format=serving.weights, weight_format_source=serving.source, compiled_decode=serving.compiled,
            fidelity_kl=None if fid is None else fid.kl_mean, fidelity_top1=None if fid is None else fid.top1_agree,
            invariant_numerics=serving.invariant, measured_decode_tokens_per_second=serving.decode_tok_s or 0.0))
        # An archive holds at most the context's token ids and a snapshot of the largest cache (full) at the context.
        full = service.policies.resolve("full", {}, cfg, service.context_length)
        self.max_import_bytes = 4 * service.context_length + 2 * service.kv_reserve(full) + REQUEST_HEADROOM_BYTES
        self.imports = _HeldBytes("imports", self.max_import_bytes, auth.count)  # the archives they buffered
        self.exports = _HeldBytes("exports", self.max_import_bytes, auth.count)  # those not yet read
        self._closing: set[asyncio.Task] = set()  # sessions being closed for callers that cancelled their create

    async def _owner(self, context: grpc.aio.ServicerContext) -> str:
        owner = self.auth.owner(context.invocation_metadata())
        if owner is None:  # the interceptor already refused; belt and braces
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        return owner

    async def _unless_abandoned(self, context: grpc.aio.ServicerContext, owner: str, session_id: str) -> None:
        """A session made for a caller whose deadline passed (or who cancelled) meanwhile is closed again: the
        caller is told the call failed and never learns the id, so the session would only hold a slot (and the
        key's quota, evicting its real sessions) until its idle TTL. A cancel the server has not seen yet (the
        create never yielded to the loop) or that comes before the answer leaves is caught when the call ends."""
        context.add_done_callback(lambda ctx: self._close_if_cancelled(ctx, owner, session_id))
        left = context.time_remaining()
        if context.cancelled() or (left is not None and left <= 0):
            with contextlib.suppress(SessionError):
                await self.service.close(owner, session_id)
            try:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the call's deadline passed while the session was made; it was closed again")
            except grpc.aio.AbortError:
                raise
            except Exception:  # the call ended meanwhile (gRPC's own deadline): nothing left to tell, no traceback
                raise asyncio.CancelledError from None

    def _close_if_cancelled(self, context: grpc.aio.ServicerContext, owner: str, session_id: str) -> None:
        if not context.cancelled():
            return
        task = asyncio.get_running_loop().create_task(self._close_quietly(owner, session_id))
        self._closing.add(task)  # (held until done: the loop keeps only weak references to tasks)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, owner: str, session_id: str) -> None:
        with contextlib.suppress(SessionError):  # (closed already: the deadline path above, or the client)
            await self.service.close(owner, session_id)

    # SessionErrors raised here become their typed statuses at the StatusBoundary interceptor. Token id lists
    # go to the service as protobuf containers: it checks their length against the context before copying.

    async def CreateSession(self, request, context):
        owner = await self._owner(context)
        params = params_from_struct(request.policy.params) if request.policy.HasField("params") else {}
        speculation = _speculation(request.speculation) if request.HasField("speculation") else None
        session = await self.service.create(owner, request.initial_token_ids, request.policy.name, params,
                                            speculation=speculation)
        await self._unless_abandoned(context, owner, session.id)
        return pb.CreateSessionResponse(session_id=session.id, history_length=len(session.history),
                                        policy=_policy_pb(session.policy))

    async def AppendTokens(self, request, context):
        owner = await self._owner(context)
        n = await self.service.append(owner, request.session_id, request.token_ids,
                                      deadline_passed=lambda: _deadline_passed(context))
        return pb.AppendTokensResponse(history_length=n)

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        owner = await self._owner(context)
        s = request.sampling
        params = GenerateParams(
            max_tokens=request.max_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else None,
            seed=s.seed if s.HasField("seed") else None,
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            stop=tuple(request.stop),
            speculation=_speculation(request.speculation) if request.HasField("speculation") else None,
        )
        events = self.service.generate(owner, request.session_id, params)
        # aclosing: a client that goes away cancels the engine job via the generator's finally.
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, DoneEvent):
                    st = event.stats
                    yield pb.GenerateResponse(done=pb.GenerateDone(
                        finish_reason=_FINISH[event.finish_reason],
                        history_length=event.history_length,
                        stop_string=event.stop_string or "",
                        stats=pb.GenerateStats(
                            prefill_tokens=st.prefill_tokens, prefill_seconds=st.prefill_s,
                            ttft_seconds=st.ttft_s, decode_seconds=st.decode_s,
                            decode_tokens=st.decode_tokens, decode_tokens_per_second=st.decode_tokens_per_s,
                            queue_seconds=st.queue_s, resume_seconds=st.resume_s,
                            speculation_proposer=st.speculation, draft_tokens=st.draft_tokens,
                            accepted_draft_tokens=st.accepted_draft_tokens, acceptance_rate=st.acceptance_rate,
                            tokens_per_verifier_step=st.tokens_per_verifier_step,
                            verifier_steps=st.verifier_steps, speculation_pauses=st.speculation_pauses,
                        ),
                    ))
                else:
                    yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=event.token_ids))

    async def CloseSession(self, request, context):
        owner = await self._owner(context)
        await self.service.close(owner, request.session_id)
        return pb.CloseSessionResponse()

    async def GetSessionInfo(self, request, context):
        owner = await self._owner(context)
        snap = self.service.info(owner, request.session_id, include_history=request.include_history)
        return pb.GetSessionInfoResponse(
            session_id=snap.session_id,
            history_length=snap.history_length,
            cached_length=snap.cached_length,
            kv_live_bytes=snap.kv_live_bytes,
            policy=_policy_pb(snap.policy),
            invariants=pb.InvariantCounters(inv1_checks=snap.inv1_checks, inv2_checks=snap.inv2_checks),
            generate_calls=snap.generate_calls,
            idle_seconds=snap.idle_s,
            context_length=snap.context_length,
            generating=snap.generating,
            history_token_ids=list(snap.history or ()),
            policy_label=snap.policy.label,
            kv_resident_bytes=snap.kv_resident_bytes,
            kv_history_bytes=snap.kv_history_bytes,
            effective_attention_fraction=snap.effective_attention_fraction,
            kv_compressed=snap.kv_compressed,
            idle_compressions=snap.idle_compressions,
            sparse=_sparse_pb(snap.sparse),
            speculation=None if snap.speculation is None else pb.Speculation(
                proposer=snap.speculation.proposer, max_draft_tokens=snap.speculation.max_draft_tokens),
        )

    async def GetModelInfo(self, request, context):
        await self._owner(context)
        return self.model_info

    async def ExportSession(self, request, context) -> None:
        owner = await self._owner(context)
        data = await self.service.export(owner, request.session_id, include_kv=request.include_kv)
        self.exports.take(owner, len(data))  # refused: the archive is let go at once
        try:
            view = memoryview(data)
            for at in range(0, len(view), ARCHIVE_CHUNK_BYTES):
                chunk = pb.ExportSessionResponse(data=bytes(view[at : at + ARCHIVE_CHUNK_BYTES]))
                try:
                    async with asyncio.timeout(EXPORT_STALL_S):
                        await context.write(chunk)
                except TimeoutError:
                    if context.cancelled() or context.done():
                        raise asyncio.CancelledError from None
                    # the client's pace, not the server's health (UNAVAILABLE said the server was down): its bytes
                    # are let go for other transfers
                    raise ResourceExhausted(f"ExportSession: the archive was not read for {EXPORT_STALL_S:g} s; "
                                            "read it without pausing", limit="exports") from None
                except Exception:  # a failed write: the client went away (its reset may not be seen yet), a cancel
                    raise asyncio.CancelledError from None
        finally:
            self.exports.give_back(owner, len(data))
            view = data = None  # noqa: F841 (a failed export's traceback keeps this frame)

    async def ImportSession(self, request_iterator, context):
        owner = await self._owner(context)
        parts, size, ignore_kv = [], 0, False
        archive_bytes = b""
        try:
            async for chunk in _unless_stalled(request_iterator, IMPORT_STALL_S):
                data = chunk.data
                ignore_kv = ignore_kv or chunk.ignore_kv
                if size < len(records.MAGIC) and not _could_start_archive(b"".join(parts) + data):
                    raise InvalidArgument("ImportSession: not a Kakeya session file (bad magic)")  # before buffering it
                if size + len(data) > self.max_import_bytes:
                    raise ResourceExhausted(f"the archive exceeds {self.max_import_bytes} bytes, the most a session "
                                            "of this server's context can take", limit="request")
                self.imports.take(owner, len(data))
                size += len(data)
                parts.append(data)
            archive_bytes = await asyncio.to_thread(b"".join, parts)  # hundreds of MB: not on the event loop
            parts.clear()
            session, kv_loaded = await self.service.import_session(owner, archive_bytes, load_kv=not ignore_kv)
        finally:
            self.imports.give_back(owner, size)
            parts.clear()  # a failed import's traceback keeps this frame: its buffers must not stay with it
            archive_bytes = data = chunk = None  # noqa: F841
        await self._unless_abandoned(context, owner, session.id)
        return pb.ImportSessionResponse(session_id=session.id, history_length=len(session.history),
                                        kv_loaded=kv_loaded, policy=_policy_pb(session.policy))


class PortTaken(OSError):
    """The gRPC port could not be bound at start."""


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


async def _unless_stalled(requests: AsyncIterator[Any], stall_s: float) -> AsyncIterator[Any]:
    """The request stream, refused (INVALID_ARGUMENT) once it sends nothing for `stall_s` seconds."""
    it = aiter(requests)
    while True:
        try:
            yield await asyncio.wait_for(anext(it), stall_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise InvalidArgument(f"ImportSession: no data for {stall_s:g} s; send the archive without pausing") \
                from None


MAX_PARAM_MAGNITUDE = 2.0**53  # beyond it a JSON number is not an exact integer


def params_from_struct(params: struct_pb2.Struct, where: str = "KV policy params") -> dict[str, Any]:
    """A google.protobuf.Struct as a dict; InvalidArgument for NaN, infinities (JSON has neither) and numbers
    beyond ±2**53."""
    return {key: _value(value, f"{where}[{quoted(key)}]") for key, value in params.fields.items()}


def _value(value: struct_pb2.Value, where: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        x = value.number_value
        if not math.isfinite(x):
            raise InvalidArgument(f"{where} must be a finite number, got {x}")
        if abs(x) > MAX_PARAM_MAGNITUDE:
            raise InvalidArgument(f"{where} is out of range ({x:.3g}; numbers must be within ±2**53)")
        return x
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return params_from_struct(value.struct_value, where)
    if kind == "list_value":
        return [_value(v, f"{where}[{i}]") for i, v in enumerate(value.list_value.values)]
    return None  # null_value, or no value set


def _policy_pb(spec: PolicySpec) -> pb.KvPolicy:
    params = struct_pb2.Struct()
    params.update(spec.params)
    return pb.KvPolicy(name=spec.name, params=params)


class RuntimeServer:
    """One served model: gRPC on host:port, optional Prometheus /metrics, the session service."""

    def __init__(self, served: ServedModel, config: ServerConfig | None = None, *,
                 policies: PolicyRegistry | None = None) -> None:
        self.config = config or ServerConfig()
        self.config.validate()
        self.served = served
        rpcs = list(pb.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name)
        self.metrics = RuntimeMetrics(served.name, rpcs, sparse_layers=governed_layers(served.model.config))
        self.engine = Engine(served.model)
        self.engine.decode_forward = served.decode_forward
        self.engine.verify_cost = None if served.serving is None else served.serving.verify_cost
        eos = served.eos_ids or tuple(served.model.config.eos_token_ids)
        c = self.config
        # Per-key limits left unset are an equal share of the server's among the keys (one key, or none: all).
        limits = Limits.fair_share(
            len(set(c.api_keys)), max_sessions=c.max_sessions, max_sessions_per_key=c.max_sessions_per_key,
            kv_budget=c.kv_budget or default_kv_budget(served.model, self.engine.device),
            kv_budget_per_key=c.kv_budget_per_key, evict_across_keys=c.evict_across_keys)
        self.tls = None if c.tls_cert is None else (Path(c.tls_key).read_bytes(), Path(c.tls_cert).read_bytes())
        model_id = model_fingerprint(served.name, served.model, self.engine.dtype)
        checkpoint = served.checkpoint or checkpoint_id_of(served.name, served.model)
        state = None if c.state_dir is None else StateDir(c.state_dir, model_id, checkpoint, FsyncPolicy(c.fsync))
        try:  # a start that fails after this (recovery, the shim) releases the state directory at once
            self.service = SessionService(
                self.engine,
                eos_ids=eos,
                config=ServiceConfig(max_sessions=c.max_sessions, idle_ttl_s=c.idle_ttl_s,
                                     max_concurrent=c.max_concurrent, step_tokens=c.step_tokens,
                                     step_slowdown=c.step_slowdown,
                                     short_prompt=c.short_prompt,
                                     context_length=c.context_length,
                                     sweep_interval_s=c.sweep_interval_s, idle_compress_after_s=c.idle_compress_after_s,
                                     idle_codec=c.idle_codec, idle_q=c.idle_q, limits=limits),
                policies=policies,
                observer=self.metrics,
                state=state,
                model_id=model_id,
                checkpoint=checkpoint,
                detokenize=detokenizer(served.tokenizer_json) if served.tokenizer_json else None,  # for stop strings
            )
            self.metrics.bind_store(self.service.store, self.service.policies.names())
            self.metrics.bind_scheduler(self.service.scheduler)
            self.metrics.serving(served.serving or served_as_loaded(served.model, served.decode_forward is not None))
            # Every journaled session is back before the first call can arrive (StateDirError when one cannot be).
            self.recovery: RecoveryStats = self.service.recover()
            self.metrics.sessions_recovered(self.recovery.sessions)
            self.auth = ApiKeyAuth(c.api_keys)
            self.max_request_bytes = c.max_request_bytes or request_bytes_for(self.service.context_length)
            self.port: int | None = None
            self.metrics_port: int | None = None
            self.openai_port: int | None = None
            self.health: Any = None  # the grpc.health.v1 servicer while serving
            self.servicer: RuntimeServicer | None = None  # the kakeya.v1 servicer while serving
            self._openai: Any = None  # the OpenAIShim, when configured
            if c.openai_port is not None:  # built now: a model it cannot serve fails before anything binds
                from kakeya_runtime.server.openai_shim import OpenAIShim

                self._openai = OpenAIShim(self.service, served, self.auth, max_queue=c.openai_max_queue,
                                          on_limit=self.metrics.limit_refused)
        except BaseException:
            if state is not None:
                state.close()
            raise
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{host}:{self.port}"

    async def start(self) -> None:
        options = [
            ("grpc.so_reuseport", 0),  # two servers must never share a port silently
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_S * 1000)),
            ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
            *self.config.extra_options,
        ]
        # Metrics outermost (every call and its final status, by RPC); then auth (a caller without a key learns
        # nothing, not even that its bytes were malformed); then the boundary that decodes requests safely and turns
        # every failure into a typed status.
        interceptors = [RpcMetricsInterceptor(self.metrics), AuthInterceptor(self.auth),
                        StatusBoundary(on_limit=self.metrics.limit_refused)]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self.servicer = RuntimeServicer(self.service, self.served, self.auth, self.config)
        pb_grpc.add_RuntimeServiceServicer_to_server(self.servicer, server)
        self.health = await add_health_and_reflection(server, pb.DESCRIPTOR.services_by_name["RuntimeService"].full_name)
        host = self.config.host
        bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(f"{bind_host}:{self.config.port}")
            else:
                self.port = server.add_secure_port(f"{bind_host}:{self.config.port}",
                                                   grpc.ssl_server_credentials([self.tls]))
        except RuntimeError:  # grpc's "Failed to bind": the port was free when checked before the load
            self.port = 0
        if not self.port:
            raise PortTaken(f"could not bind {bind_host}:{self.config.port}: another process took the port while "
                            "the model loaded (--port picks another)")
        await server.start()
        self._server = server
        self.service.start_sweeper()
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port,
                                                        self.config.metrics_key)
        if self._openai is not None:
            # The same bind rules as gRPC (ServerConfig.validate: same host) and the same certificate: HTTPS only.
            tls = None if self.config.tls_cert is None else (self.config.tls_cert, self.config.tls_key)
            self.openai_port = await self._openai.start(host, self.config.openai_port, grace_s=self.config.grace_s,
                                                        grpc_address=self.address, tls=tls)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_s
        if self.health is not None:  # NOT_SERVING at once, while in-flight RPCs finish
            await self.health.enter_graceful_shutdown()
        stopping = None
        if self._server is not None:
            # New calls are refused at once; running ones get the grace period, then each Generate ends at a step
            # boundary, streams every token it committed and fails UNAVAILABLE (END_GRACE_S to send that)
            stopping = asyncio.ensure_future(self._server.stop(self.config.grace_s + END_GRACE_S))
        if self._openai is not None:  # its in-flight requests are the service's sessions: drained in the same grace
            await self._openai.stop()
        if stopping is not None:
            while self.service.generating and loop.time() < deadline and not stopping.done():
                await asyncio.sleep(0.02)
            self.service.end_generations()
            await stopping
            self._server = None
        await self.service.shutdown()
        self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


class ServerThread:
    """Runs a RuntimeServer on its own event loop in a background thread (tests, the chat demo)."""

    def __init__(self, server: RuntimeServer) -> None:
        self.server = server
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, timeout: float = 30.0) -> ServerThread:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.server.start())
            except BaseException as e:
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="kakeya-grpc-loop", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError("server did not start")
        if failure:
            raise failure[0]
        return self

    def call(self, coro: Any, timeout: float | None = 30.0) -> Any:
        """Run a coroutine on the server's loop (tests poke the service this way)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        with contextlib.suppress(RuntimeError):
            self.call(self.server.stop(), timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)
        self._loop = None

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _speculation(msg: pb.Speculation) -> tuple[str, int]:
    return msg.proposer, msg.max_draft_tokens


def _sparse_pb(sparse: dict | None) -> pb.SparseStats | None:
    if not sparse:
        return None
    return pb.SparseStats(total=pb.SparseCounters(**sparse["total"]),
                          layers=[pb.SparseCounters(**x) for x in sparse["layers"]],
                          hot_bytes=sparse["hot_bytes"], cold_bytes=sparse["cold_bytes"],
                          index_bytes=sparse["index_bytes"])
