"""The session API the server exposes, as asyncio coroutines: validation, turn-taking, engine hand-off.

Ordering per session: a Generate or AppendTokens on a session whose previous call is still running
waits for it (FIFO, an asyncio.Lock per session), it is not refused. That is what makes "cancel,
then immediately append the next turn" safe: the cancelled Generate may still be finishing its
current decode step on the engine thread, and the append simply queues behind it. CloseSession and
GetSessionInfo never wait; closing cancels an in-flight Generate.

Idle compression (optional, `idle_compress_after_s`): the sweeper claims sessions idle past the
threshold, takes each one's turn like a call would (without counting as activity) and packs its cache
in place on the engine thread with `kv.idle.compress_idle` (the session's own `idle_codec`, else the
server default). The next Generate decompresses it on the engine thread before its prefill; appends
and GetSessionInfo work on a compressed session as on any other.

Model work is handed to the Scheduler's engine threads; the event loop only validates, moves
Python ints and relays events. Validation happens before anything changes, so a refused call
leaves the session exactly as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kakeya_runtime.engine.generate import Engine, FinishReason, GenerateRequest
from kakeya_runtime.engine.sampling import SamplingError, SamplingParams
from kakeya_runtime.engine.self_draft import DraftHead
from kakeya_runtime.engine.speculative import SpecStats, SpeculativeStream
from kakeya_runtime.kv.idle import IdleStats, compress_idle, decompress, is_compressed
from kakeya_runtime.kv.sink_window import PositionLimitError
from kakeya_runtime.kv.sparse import SparseKV
from kakeya_runtime.kv.spec import DEFAULT_Q
from kakeya_runtime.sessions.budget import kv_worst_case_bytes
from kakeya_runtime.sessions.errors import (
    InternalError,
    InvalidArgument,
    InvariantViolation,
    ResourceExhausted,
    SessionError,
    Unavailable,
)
from kakeya_runtime.sessions.limits import Limits
from kakeya_runtime.sessions.policy import CodecSpec, PolicyRegistry, PolicySpec, parse_codec
from kakeya_runtime.sessions.scheduler import Scheduler
from kakeya_runtime.sessions.speculation import (
    SpeculationSpec,
    check_rollback,
    make_proposer,
    parse_speculation,
)
from kakeya_runtime.sessions.store import NullObserver, Session, SessionSnapshot, SessionStore, StoreObserver

_log = logging.getLogger(__name__)

# Temperatures in (0, MIN_TEMPERATURE) decode greedily, as temperature 0 does (the proto and the SDK say so).
# 1e-4 is a normal number in every float format logits may be sampled in (fp16's smallest is 6.1e-5), so no
# denormal or flush-to-zero path turns it into a division by zero; and at 1e-4 a sample already differs from
# the argmax only among logits within about 1e-3 of the top one.
MIN_TEMPERATURE = 1e-4


@dataclass(slots=True, frozen=True)
class ServiceConfig:
    max_sessions: int = 64
    idle_ttl_s: float = 1800.0  # 30 min, seed 000 §2.6
    max_concurrent: int = 1  # in-flight generations across all sessions
    context_length: int | None = None  # per-session limit; None: the model's max positions
    sweep_interval_s: float | None = None  # sweeper period; None: min(ttl / 2, idle_compress_after_s / 2, 30 s)
    idle_compress_after_s: float | None = None  # compress a session's KV idle this long; None: never
    idle_codec: str | None = "d4"  # server default for sessions without an idle_codec (None/"none": only those)
    idle_q: int = DEFAULT_Q  # the default codec's lattice range
    limits: Limits | None = None  # per-key and global session and KV byte limits; None: max_sessions only


@dataclass(slots=True)
class GenerateParams:
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Speculation for this call: (proposer, max_draft_tokens) as the client sent it; None: the session default.
    speculation: tuple[str, int] | None = None


@dataclass(slots=True, frozen=True)
class GenerateStats:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    decode_tokens_per_s: float = 0.0  # (decode_tokens - 1) / decode_s: the first token is TTFT's
    queue_s: float = 0.0
    resume_s: float = 0.0  # decompressing an idle-compressed cache before the prefill (part of ttft_s)
    effective_attention_fraction: float = 1.0  # the last query's share of the prefix it attended to
    sparse: dict[str, Any] | None = None  # the sparse policy's counters for this Generate: total, per layer
    speculation: str = ""  # the draft proposer used ("" when off)
    draft_tokens: int = 0  # drafts the verifier checked
    accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0  # accepted / drafted
    tokens_per_verifier_step: float = 0.0  # emitted tokens per verifier forward
    verifier_steps: int = 0
    speculation_pauses: int = 0  # times the adaptive off-switch paused speculation


@dataclass(slots=True, frozen=True)
class TokensEvent:
    token_ids: list[int]


@dataclass(slots=True, frozen=True)
class DoneEvent:
    finish_reason: FinishReason
    stats: GenerateStats
    history_length: int


GenerateEvent = TokensEvent | DoneEvent


class ServiceObserver(StoreObserver, Protocol):
    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None: ...

    def session_idle_compressed(self, stats: IdleStats) -> None: ...


class _NullServiceObserver(NullObserver):
    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None:
        pass

    def session_idle_compressed(self, stats: IdleStats) -> None:
        pass


_JOB_ENDED = object()  # pushed after a job's last event; alone it means the job never ran


@dataclass(slots=True)
class _Job:
    """Per-Generate state shared by the handler coroutine and the engine thread."""

    session: Session
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    speculation: SpeculationSpec | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)  # queue time includes the turn wait
    finished: bool = False  # set on the loop once the final event was taken
    released: bool = False  # the session's turn was given back (exactly once)

    def emit(self, event: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class SessionService:
    def __init__(self, engine: Engine, *, eos_ids: Sequence[int] = (), config: ServiceConfig | None = None,
                 policies: PolicyRegistry | None = None, observer: ServiceObserver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.config = config or ServiceConfig()
        self.vocab_size = engine.config.vocab_size
        self.eos_ids = tuple(eos_ids)
        model_context = engine.config.max_position_embeddings
        self.context_length = min(self.config.context_length or model_context, model_context)
        self.policies = policies or PolicyRegistry()
        after = self.config.idle_compress_after_s
        if after is not None and not after > 0:
            raise ValueError(f"idle_compress_after_s must be > 0, got {after}")
        # The server default idle codec (None while compression is off). Checked against the model now
        # (lattice head_dim), so a bad default fails at startup rather than at the first sweep.
        parse_codec(self.config.idle_codec, self.config.idle_q)  # name and range, even while off
        self.idle_codec: CodecSpec | None = (
            None if after is None else parse_codec(self.config.idle_codec, self.config.idle_q, engine.config)
        )
        self.observer: ServiceObserver = observer or _NullServiceObserver()
        limits = self.config.limits or Limits(max_sessions=self.config.max_sessions)
        self.store = SessionStore(idle_ttl_s=self.config.idle_ttl_s, observer=self.observer, clock=clock,
                                  limits=limits)
        self._worst_case: dict[PolicySpec, int] = {}
        self.scheduler = Scheduler(self.config.max_concurrent)
        self._sweeper: asyncio.Task | None = None
        self._compressions: set[asyncio.Task] = set()
        self.draft_head: DraftHead | None = None  # built on the first "draft_head" Generate (or set with weights)

    # ---- lifecycle of the service itself ---------------------------------------------------

    def start_sweeper(self) -> None:
        periods = [self.config.idle_ttl_s / 2, 30.0]
        if self.config.idle_compress_after_s is not None:
            periods.append(self.config.idle_compress_after_s / 2)
        interval = self.config.sweep_interval_s or min(periods)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(interval))

    async def _sweep_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.store.sweep()
            self._start_idle_compression()

    async def shutdown(self) -> None:
        tasks = [t for t in (self._sweeper, *self._compressions) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Running generations stop after their current step; queued ones never start.
        await asyncio.to_thread(self.scheduler.shutdown)

    # ---- the API ---------------------------------------------------------------------------

    async def create(self, owner: str, initial_tokens: Sequence[int] = (), policy_name: str = "",
                     policy_params: dict[str, Any] | None = None,
                     speculation: tuple[str, int] | None = None) -> Session:
        """`speculation`: the session's default (proposer, max_draft_tokens) for Generates that set none."""
        if len(initial_tokens) > self.context_length:  # before anything walks or copies the ids
            raise ResourceExhausted(f"initial history of {len(initial_tokens)} tokens exceeds the context length "
                                    f"{self.context_length}")
        self._check_tokens(initial_tokens, "initial_token_ids")
        spec = self.policies.resolve(policy_name, policy_params, self.engine.config, self.context_length)
        default = None if speculation is None else parse_speculation(*speculation)
        check_rollback(spec, default, at_create=True)
        session = self.store.create(owner, spec, self.context_length, initial_tokens,
                                    reserve_bytes=self.kv_reserve(spec))
        session.speculation = default
        return session

    def kv_reserve(self, spec: PolicySpec) -> int:
        """The KV bytes a session with this policy reserves against the budget: its worst case at the context."""
        cost = self._worst_case.get(spec)
        if cost is None:
            cost = self._worst_case[spec] = kv_worst_case_bytes(self.engine.config, spec, self.context_length,
                                                                self.engine.dtype)
        return cost

    async def append(self, owner: str, session_id: str, tokens: Sequence[int]) -> int:
        if not tokens:
            raise InvalidArgument("AppendTokens needs at least one token id")
        if len(tokens) > self.context_length:  # before anything walks or copies the ids
            raise ResourceExhausted(f"{len(tokens)} appended tokens exceed the context length {self.context_length}")
        self._check_tokens(tokens, "token_ids")
        session = self.store.get(owner, session_id)
        await self._take_turn(session)
        try:
            return self._mutate(session, lambda: self.store.append(session, tokens))
        finally:
            self._release_turn(session)

    async def close(self, owner: str, session_id: str) -> None:
        self.store.close(owner, session_id)

    def info(self, owner: str, session_id: str, *, include_history: bool = False) -> SessionSnapshot:
        return self.store.snapshot(owner, session_id, include_history=include_history)

    async def generate(self, owner: str, session_id: str, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        """Stream TokensEvent per committed token, then one DoneEvent. Leaving early cancels."""
        request = self._engine_request(params)
        asked = None if params.speculation is None else parse_speculation(*params.speculation)
        session = self.store.get(owner, session_id)
        speculation = asked if params.speculation is not None else session.speculation
        check_rollback(session.policy, speculation, at_create=False)
        job = _Job(session, request, asyncio.get_running_loop(), speculation)
        await self._take_turn(session)
        handed_off = False
        try:
            self._mutate(session, lambda: self.store.begin_generate(session, request.max_new_tokens, job.cancel))
            try:
                future = self.scheduler.submit(self._run, job)
            except RuntimeError:  # the scheduler was shut down
                handed_off = job.finished = True
                self._end_job(job)
                raise Unavailable("the server is shutting down") from None
            handed_off = True  # from here the turn is released when the engine job ends
            future.add_done_callback(lambda f: self._call_on_loop(job, self._job_ended, job, f))
            while True:
                event = await job.events.get()
                if event is _JOB_ENDED:
                    raise Unavailable("generation did not run: the server is shutting down")
                if isinstance(event, SessionError | DoneEvent):
                    # The engine thread emits nothing and touches the session no more after its final
                    # event, so the turn is free now (a GetSessionInfo right after sees generating=False).
                    job.finished = True
                    self._end_job(job)
                    if isinstance(event, SessionError):
                        raise event
                yield event
                if job.finished:
                    return
        finally:
            if not handed_off:
                self._release_turn(session)
            elif not job.finished:
                job.cancel.set()  # the client went away: stop after the current step

    # ---- idle compression --------------------------------------------------------------------

    def idle_codec_for(self, session: Session) -> CodecSpec | None:
        """The session's own idle_codec, else the server default (None: the session is never compressed)."""
        return session.policy.idle_codec or self.idle_codec

    def _start_idle_compression(self) -> None:
        after = self.config.idle_compress_after_s
        if after is None:
            return
        for session in self.store.claim_idle(after, lambda s: self.idle_codec_for(s) is not None):
            codec = self.idle_codec_for(session)
            assert codec is not None
            task = asyncio.get_running_loop().create_task(self._compress(session, codec, after))
            self._compressions.add(task)
            task.add_done_callback(self._compressions.discard)

    async def _compress(self, session: Session, codec: CodecSpec, after: float) -> None:
        """Holds the session's turn (a Generate arriving now queues behind) while the engine packs it."""
        try:
            if session.turn is None:
                session.turn = asyncio.Lock()
            await session.turn.acquire()
        except BaseException:
            self.store.end_op(session, touch=False)
            raise
        try:
            future = self.scheduler.submit(self._compress_job, session, codec, after)
            await asyncio.wrap_future(future)
        except RuntimeError:  # the scheduler was shut down: the cache stays as it was
            pass
        except Exception:  # the job handles its own failures; anything else is a bug worth a log line
            _log.exception("idle compression of session %s failed", session.id)
        finally:
            session.turn.release()
            self.store.end_op(session, touch=False)

    def _compress_job(self, session: Session, codec: CodecSpec, after: float) -> IdleStats | None:
        """Engine thread: pack the cache in place if the session is still idle (nobody came meanwhile)."""
        store = self.store
        if not store.still_idle(session, after):
            return None
        cache = session.cache
        if cache is None or is_compressed(cache):
            return None
        try:
            stats = compress_idle(cache, codec)
        except Exception as e:  # e.g. a layer kind the codec cannot pack: leave it live, do not retry
            with contextlib.suppress(Exception):
                decompress(cache)
            session.idle_compress_error = f"{type(e).__name__}: {e}"
            return None
        try:
            self._mutate(session, lambda: store.check(session))  # layers keep their lengths: INV-1 holds
        except InvariantViolation:
            return None
        session.idle_compressions += 1
        self.observer.session_idle_compressed(stats)
        return stats

    # ---- internals -------------------------------------------------------------------------

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab_size):
            bad = next(t for t in tokens if not 0 <= t < self.vocab_size)
            raise InvalidArgument(f"{what}: token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def _engine_request(self, p: GenerateParams) -> GenerateRequest:
        if p.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {p.max_tokens}")
        if p.max_tokens > self.context_length:
            raise InvalidArgument(f"max_tokens {p.max_tokens} exceeds the context length {self.context_length}")
        if p.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {p.top_k}")
        if p.top_p is not None and not math.isfinite(p.top_p):
            raise InvalidArgument(f"top_p must be in (0, 1], got {p.top_p}")
        # Below the floor the sampler's scaled logits may overflow (or the temperature flush to zero): greedy.
        temperature = 0.0 if 0.0 <= p.temperature < MIN_TEMPERATURE else p.temperature
        try:
            sampling = SamplingParams(temperature=temperature, top_k=p.top_k or None, top_p=p.top_p, seed=p.seed)
        except SamplingError as e:
            raise InvalidArgument(str(e)) from None
        self._check_tokens(p.stop_token_ids, "stop_token_ids")
        stop = tuple(dict.fromkeys((() if p.ignore_eos else self.eos_ids) + tuple(p.stop_token_ids)))
        return GenerateRequest(max_new_tokens=p.max_tokens, sampling=sampling, stop_ids=stop)

    def _mutate(self, session: Session, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except InvariantViolation as v:
            self.store.fail(session, v)
            raise

    async def _take_turn(self, session: Session) -> None:
        self.store.begin_op(session)
        if session.turn is None:
            session.turn = asyncio.Lock()
        try:
            await session.turn.acquire()
        except BaseException:
            self.store.end_op(session)
            raise
        try:
            self.store.require_active(session)  # it may have been closed or evicted while we waited
        except BaseException:
            self._release_turn(session)
            raise

    def _release_turn(self, session: Session, *, generated: bool = False) -> None:
        session.turn.release()
        self.store.end_op(session, generated=generated)

    @staticmethod
    def _call_on_loop(job: _Job, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            job.loop.call_soon_threadsafe(fn, *args)

    def _job_ended(self, job: _Job, future: Future) -> None:
        # Runs on the loop after every event the job emitted (call_soon_threadsafe is FIFO).
        self._end_job(job)
        job.events.put_nowait(_JOB_ENDED)

    def _end_job(self, job: _Job) -> None:
        """Release the session's turn once per job: at its final event or when its future ends."""
        if not job.released:
            job.released = True
            self._release_turn(job.session, generated=True)

    def _run(self, job: _Job) -> None:
        """Engine thread: prefill history[cached_length:], decode, commit each token as it comes."""
        session, store = job.session, self.store
        started = time.perf_counter()
        queue_s = started - job.submitted_at
        history_at_start = len(session.history)
        if job.cancel.is_set():  # client gone or session closed while queued: touch nothing
            job.emit(DoneEvent(FinishReason.CANCELLED, GenerateStats(queue_s=queue_s), history_at_start))
            return
        stream = None
        resume_s = 0.0
        try:
            if session.cache is None:
                cache = self.policies.build(self.engine, session.policy, session.context_length)
                store.attach_cache(session, cache)
            elif is_compressed(session.cache):
                resume_s = decompress(session.cache).seconds  # idle-compressed: unpack before the prefill
                store.check(session)
            pending = store.pending_tokens(session)
            ids = torch.tensor([pending], dtype=torch.long, device=self.engine.device)  # (1, T)
            if job.speculation is None:
                stream = self.engine.stream(session.cache, ids, job.request, should_stop=job.cancel.is_set)
                for step_ids in stream:
                    token = step_ids[0]
                    store.commit_generated(session, token)
                    job.emit(TokensEvent([token]))
            else:
                stream = self._speculative_stream(session, ids, job)
                for tokens in stream:  # the cache already holds everything before the last of them
                    store.commit_generated_run(session, tokens)
                    for token in tokens:
                        job.emit(TokensEvent([token]))
            store.finish_generate(session)
        except InvariantViolation as v:
            store.fail(session, v)
            job.emit(v)
            return
        except Exception as e:  # an engine error: roll the session back to its last consistent state
            try:
                store.roll_back(session)
            except InvariantViolation as v:  # the session's own record broke: that is a real violation
                store.fail(session, v)
                job.emit(v)
                return
            finally:
                self._record_attention(session)
            if isinstance(e, PositionLimitError):  # the store's context checks should make this unreachable
                job.emit(ResourceExhausted(f"generation stopped at the model's position limit: {e}",
                                           limit="model_positions"))
            else:
                _log.exception("Generate on session %s failed; the session was rolled back", session.id)
                job.emit(InternalError(f"generation failed ({type(e).__name__}); the session was rolled back to "
                                       f"its last committed token and can be used again"))
            return
        sparse_before = session.sparse
        eaf = self._record_attention(session)
        result = stream.result
        assert result is not None
        n = result.decode_tokens
        spec = stream.stats if isinstance(stream, SpeculativeStream) else SpecStats()
        stats = GenerateStats(
            prefill_tokens=result.prefill_tokens,
            prefill_s=result.prefill_s,
            decode_s=result.decode_s,
            decode_tokens=n,
            decode_tokens_per_s=(n - 1) / result.decode_s if n > 1 and result.decode_s > 0 else 0.0,
            queue_s=queue_s,
            resume_s=resume_s,
            ttft_s=resume_s + result.ttft_s,
            effective_attention_fraction=eaf,
            sparse=_sparse_delta(session.sparse, sparse_before) if session.sparse else None,
            speculation="" if job.speculation is None else job.speculation.proposer,
            draft_tokens=spec.drafted,
            accepted_draft_tokens=spec.accepted,
            acceptance_rate=spec.acceptance_rate,
            tokens_per_verifier_step=spec.tokens_per_verifier_step,
            verifier_steps=spec.verifier_steps,
            speculation_pauses=spec.off_switches,
        )
        self.observer.generate_finished(stats, history_at_start)
        job.emit(DoneEvent(result.finish_reason, stats, len(session.history)))

    def _speculative_stream(self, session: Session, ids: torch.Tensor, job: _Job) -> SpeculativeStream:
        """Engine thread: the session's draft proposer (kept between Generates while the setting stays the same, so
        the history index only grows) and a speculative stream over the session's cache."""
        spec = job.speculation
        assert spec is not None
        if session.drafts is None or session.drafts[0].proposer != spec.proposer:
            session.drafts = (spec, make_proposer(spec, self.engine.model, self._draft_head))
        context = self.store.history_tokens(session)
        return SpeculativeStream(self.engine, session.cache, ids, job.request, session.drafts[1], context,
                                 spec.max_draft_tokens, should_stop=job.cancel.is_set)

    def _draft_head(self) -> DraftHead:
        """Engine thread: the served model's EAGLE-style draft head, shared by sessions (random until trained)."""
        if self.draft_head is None:
            self.draft_head = DraftHead(self.engine.model)
        return self.draft_head

    @staticmethod
    def _record_attention(session: Session) -> float:
        """Engine thread, after a Generate: remember the newest query's attention fraction for GetSessionInfo."""
        cache = session.cache
        if cache is not None and not is_compressed(cache):
            with contextlib.suppress(Exception):
                session.attention_fraction = float(cache.effective_attention_fraction)
            if isinstance(cache, SparseKV):
                memory = cache.memory_stats()
                session.sparse = {"total": cache.counters().as_dict(), "layers": cache.layer_counters(),
                                  **{k: memory[k] for k in ("hot_bytes", "cold_bytes", "index_bytes")}}
        return session.attention_fraction


def _sparse_delta(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """This Generate's counts, in total and per layer; a cache rebuilt since (roll back) counts from zero."""
    if before is None or any(v < before["total"].get(k, 0) for k, v in now["total"].items()):
        return {"total": dict(now["total"]), "layers": [dict(x) for x in now["layers"]]}
    diff = lambda a, b: {k: v - b.get(k, 0) for k, v in a.items()}  # noqa: E731
    return {"total": diff(now["total"], before["total"]),
            "layers": [diff(a, b) for a, b in zip(now["layers"], before["layers"], strict=True)]}
