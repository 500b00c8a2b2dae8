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

Stop strings (sessions.stops) are matched on the engine thread as each token commits, so a Generate ends on the
very token that completes one: that token and all before it are in the history and were streamed, nothing after.

Model work is handed to the engine loop (sessions.batch: continuous batching); the event loop only validates, moves
Python ints and relays events. Validation happens before anything changes, so a refused call
leaves the session exactly as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kakeya_runtime.engine.generate import Engine, FinishReason, GenerateRequest, TokenStream
from kakeya_runtime.engine.sampling import SamplingError, SamplingParams
from kakeya_runtime.engine.self_draft import DraftHead
from kakeya_runtime.engine.speculative import SpecStats, SpeculativeStream
from kakeya_runtime.kv.idle import IdleStats, compress_idle, decompress, is_compressed
from kakeya_runtime.kv.lattice import CodecRangeError
from kakeya_runtime.kv.policy import governed_layers
from kakeya_runtime.kv.sink_window import PositionLimitError
from kakeya_runtime.kv.sparse import SparseCounters, SparseKV
from kakeya_runtime.kv.spec import DEFAULT_Q, stored_params
from kakeya_runtime.sessions import archive, snapshot
from kakeya_runtime.sessions.batch import (
    DEFAULT_MAX_BATCH,
    DEFAULT_SHORT_PROMPT,
    DEFAULT_STEP_TOKENS,
    BatchScheduler,
)
from kakeya_runtime.sessions.budget import kv_worst_case_bytes
from kakeya_runtime.sessions.chunk_budget import DEFAULT_SLOWDOWN
from kakeya_runtime.sessions.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    InvariantViolation,
    ResourceExhausted,
    SessionError,
    Unavailable,
    quoted,
)
from kakeya_runtime.sessions.journal import StateDir, StateDirError
from kakeya_runtime.sessions.limits import Limits
from kakeya_runtime.sessions.policy import CodecSpec, PolicyRegistry, PolicySpec, parse_codec
from kakeya_runtime.sessions.speculation import (
    SpeculationSpec,
    check_rollback,
    draft_tokens,
    make_proposer,
    owner_histories,
    parse_speculation,
)
from kakeya_runtime.sessions.stops import Detokenize, StopWatch, check_stop_strings
from kakeya_runtime.sessions.store import (
    NullObserver,
    Session,
    SessionSnapshot,
    SessionStore,
    StoreObserver,
    session_settings,
)

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
    max_concurrent: int = DEFAULT_MAX_BATCH  # Generates running at once: the engine loop's max batch (1: serial)
    step_tokens: int | None = DEFAULT_STEP_TOKENS  # tokens per engine step; None: sized by measurement (batch)
    step_slowdown: float = DEFAULT_SLOWDOWN  # the measured budget's bound: a chunk step vs a decode step (batch)
    short_prompt: int = DEFAULT_SHORT_PROMPT  # prompts up to this many tokens are read in one step, see batch
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
    stop: tuple[str, ...] = ()  # stop strings (sessions.stops): generation ends after the token completing one
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
    stop_string: str | None = None  # the stop string that ended the generation (finish_reason STOP)


GenerateEvent = TokensEvent | DoneEvent


class ServiceObserver(StoreObserver, Protocol):
    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None: ...

    def generate_done(self, reason: FinishReason) -> None:
        """Every Generate that answered its final event, by finish reason (one that began decoding, or not)."""

    def session_idle_compressed(self, stats: IdleStats) -> None: ...

    def kv_restored(self, source: str) -> None:
        """A recovered or imported session's cache was built: source "snapshot", or "recompute" after a snapshot
        was refused (a session without one simply prefills its history, as any new session does)."""


class _NullServiceObserver(NullObserver):
    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None:
        pass

    def generate_done(self, reason: FinishReason) -> None:
        pass

    def session_idle_compressed(self, stats: IdleStats) -> None:
        pass

    def kv_restored(self, source: str) -> None:
        pass


@dataclass(slots=True, frozen=True)
class RecoveryStats:
    sessions: int
    tokens: int  # history tokens recovered, all sessions together
    snapshots: int  # sessions with a KV snapshot to load at their first Generate
    dropped_bytes: int  # torn journal tails cut off (never acknowledged to a client)
    # The served weights of the last start where they were others (another format or build): its snapshots are
    # refused at each session's first Generate, which recomputes the cache from the history.
    previous_weights: str | None = None


_JOB_ENDED = object()  # pushed after a job's last event; alone it means the job never ran


@dataclass(slots=True)
class _Job:
    """Per-Generate state shared by the handler coroutine and the engine thread."""

    session: Session
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    stops: tuple[str, ...] = ()  # stop strings, checked
    speculation: SpeculationSpec | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)  # queue time includes the turn wait
    finished: bool = False  # set on the loop once the final event was taken
    released: bool = False  # the session's turn was given back (exactly once)

    def emit(self, event: Any) -> None:
        _on_loop(self.loop, self.events.put_nowait, event)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """loop.call_soon_threadsafe(fn, *args), or held until the end of a batched step's deliveries (`_deliveries`)
    when the engine thread is inside them."""
    if _held.calls is not None:
        _held.calls.append((loop, fn, args))
        return
    with contextlib.suppress(RuntimeError):  # loop already closed: nobody is listening
        loop.call_soon_threadsafe(fn, *args)


class _Held(threading.local):
    calls: list[tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple[Any, ...]]] | None = None


_held = _Held()


@contextlib.contextmanager
def _deliveries() -> Iterator[None]:
    """Around a batched step's deliveries (BatchScheduler.deliveries), on the engine thread: what its turns hand to
    the event loop (tokens, the final event, the job's end) is held, then handed to each loop in ONE wake-up, in
    order, instead of one per token. A wake-up is a write to the loop's socket that schedules its thread: ~130 us a
    token on the engine thread, about a tenth of a step's per-row cost at 8 rows. The tokens reach their queues
    right after the step's last delivery."""
    if _held.calls is not None:
        yield
        return
    _held.calls = []
    try:
        yield
    finally:
        held, _held.calls = _held.calls, None
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        for loop, fn, args in held:
            by_loop.setdefault(loop, []).append((fn, args))
        for loop, calls in by_loop.items():
            with contextlib.suppress(RuntimeError):  # loop already closed: nobody is listening
                loop.call_soon_threadsafe(_run_all, calls)


def _run_all(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:  # as the loop does with a failing callback: logged, the others still run
            _log.exception("a callback handed to the event loop failed")


class SessionService:
    def __init__(self, engine: Engine, *, eos_ids: Sequence[int] = (), config: ServiceConfig | None = None,
                 policies: PolicyRegistry | None = None, observer: ServiceObserver | None = None,
                 clock: Callable[[], float] = time.monotonic, state: StateDir | None = None,
                 model_id: str = "", checkpoint: str = "", detokenize: Detokenize | None = None) -> None:
        """`state`: the state directory that makes sessions durable (sessions.journal); `model_id`: the served
        weights' fingerprint (sessions.snapshot.model_fingerprint), which KV snapshots must match; `checkpoint`: the
        checkpoint they come from (sessions.snapshot.checkpoint_id), which archives must match; `detokenize` (token
        ids -> text, special tokens skipped) enables stop strings (None refuses them)."""
        self.engine = engine
        self.state = state
        self.model_id = (state.model_id if state is not None else model_id
                         or snapshot.model_fingerprint(engine.config.model_type, engine.model, engine.dtype))
        self.checkpoint = (state.checkpoint if state is not None else checkpoint
                           or snapshot.checkpoint_id_of(engine.config.model_type, engine.model))
        self.config = config or ServiceConfig()
        self.vocab_size = engine.config.vocab_size
        self.eos_ids = tuple(eos_ids)
        model_context = engine.config.max_position_embeddings
        if self.config.context_length is not None and self.config.context_length > model_context:
            raise ValueError(f"--context {self.config.context_length} exceeds the model's {model_context} positions "
                             "(leave it out for the model's)")
        self.context_length = self.config.context_length or model_context
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
                                  limits=limits, journal=state)
        self._worst_case: dict[tuple[PolicySpec, int], int] = {}
        self._governed = governed_layers(engine.config)  # the layers a sparse cache counts (kv.policy)
        self._ending = False  # end_generations was called: a cancelled Generate answers UNAVAILABLE
        self.scheduler = BatchScheduler(engine, max_batch=self.config.max_concurrent,
                                        step_tokens=self.config.step_tokens, slowdown=self.config.step_slowdown,
                                        short_prompt=self.config.short_prompt, deliveries=_deliveries)
        self._sweeper: asyncio.Task | None = None
        self._compressions: set[asyncio.Task] = set()
        self.detokenize = detokenize
        self.draft_head: DraftHead | None = None  # built on the first "draft_head" Generate (or set with weights)

    # ---- lifecycle of the service itself ---------------------------------------------------

    def start_sweeper(self) -> None:
        periods = [self.config.idle_ttl_s / 2, 30.0]
        if self.config.idle_compress_after_s is not None:
            periods.append(self.config.idle_compress_after_s / 2)
        interval = self.config.sweep_interval_s or min(periods)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(interval))

    async def _sweep_forever(self, interval: float) -> None:
        since = self.store.clock()
        while True:
            await asyncio.sleep(interval)
            if self.state is not None:
                self.state.heartbeat()  # so a restart knows when this server was last alive (idle times)
                since = self._record_access(since)
            self.store.sweep()
            self._start_idle_compression()

    @property
    def generating(self) -> int:
        """Generates running or queued now."""
        return sum(1 for session in self.store.live_sessions() if session.generating)

    def end_generations(self) -> None:
        """Shutting down, the grace period over: every running Generate stops after its current step, streams every
        token it committed, then fails UNAVAILABLE (not a cancel the client asked for; not a stream cut off with a
        committed token it never sent)."""
        self._ending = True
        for session in self.store.live_sessions():
            if session.generating and session.cancel is not None:
                session.cancel.set()

    async def shutdown(self) -> None:
        tasks = [t for t in (self._sweeper, *self._compressions) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Running generations stop after their current step; queued ones never start.
        await asyncio.to_thread(self.scheduler.shutdown)
        if self.state is not None:  # the engine is idle now: keep each live cache for the next start, then close
            await asyncio.to_thread(self._snapshot_all)
            self._record_access(None)
            self.state.close()

    def recover(self) -> RecoveryStats:
        """Adopt every session of the state directory (before serving). A session the served policies or limits
        cannot hold stops the start (StateDirError naming it and what to change): none is dropped silently."""
        if self.state is None:
            return RecoveryStats(0, 0, 0, 0)
        found = self.state.recover()
        tokens = snapshots = dropped = 0
        # Idle time counts while a server ran: from a session's last write to when the last server was last seen
        # alive (its heartbeat, or the newest journal write), so neither a restart resets it nor downtime adds to it
        alive = max([r.mtime for r in found] + [self.state.last_alive or 0.0])
        for r in found:
            try:
                self._check_tokens(r.history, "the journal's history")  # a journal of another vocabulary
                spec = self.policies.resolve(r.policy_name, stored_params(r.policy_params), self.engine.config,
                                             r.context_length)
                speculation = r.settings.get("speculation")
                default = None if speculation is None else parse_speculation(*speculation)
                self.store.adopt(r.id, r.owner, spec, r.context_length, r.history,
                                 reserve_bytes=self.kv_reserve(spec, r.context_length), snapshot=r.snapshot,
                                 speculation=default, idle_s=alive - r.mtime)
            except SessionError as e:
                raise StateDirError(f"cannot recover session {r.id} ({len(r.history)} tokens, policy {r.policy_name}): "
                                    f"{e.message}; start with limits and policies that admit it") from None
            tokens += len(r.history)
            snapshots += r.snapshot is not None
            dropped += r.dropped_bytes
        return RecoveryStats(len(found), tokens, snapshots, dropped, self.state.previous_weights)

    def _record_access(self, since: float | None) -> float:
        """Each durable session used since `since` (store clock; None: all) gets its last use onto its journal
        (StateDir.accessed): reads keep a session alive but write nothing, and a restart counts idle time from the
        journal. Returns the store clock now, the next call's `since`."""
        assert self.state is not None
        now, wall = self.store.clock(), time.time()
        for session in self.store.live_sessions():
            if session.durable and (since is None or session.last_access > since):
                self.state.accessed(session.id, wall - (now - session.last_access))
        return now

    def _snapshot_all(self) -> int:
        """At shutdown, on the (idle) engine: write a KV snapshot of every session holding a live cache."""
        assert self.state is not None
        written = 0
        for session in self.store.live_sessions():
            cache = session.cache
            if cache is None or session.cached_length == 0 or session.generating or not session.durable:
                continue
            try:
                data = snapshot.dump(cache, session.history, session.cached_length, self.model_id)
                self.state.write_snapshot(session.id, data)
                written += 1
            except Exception:  # the journal still holds the history: the next start recomputes this cache
                _log.warning("could not snapshot session %s at shutdown", session.id, exc_info=True)
        return written

    # ---- the API ---------------------------------------------------------------------------

    async def create(self, owner: str, initial_tokens: Sequence[int] = (), policy_name: str = "",
                     policy_params: dict[str, Any] | None = None, *, evict: bool = True,
                     speculation: tuple[str, int] | None = None, durable: bool = True) -> Session:
        """A new session; `evict=False` admits it only if no other session has to make room (sessions.limits);
        `speculation`: the session's default (proposer, max_draft_tokens) for Generates that set none;
        `durable=False`: kept out of the state directory (it does not survive a restart)."""
        if len(initial_tokens) > self.context_length:  # before anything walks or copies the ids
            raise ResourceExhausted(f"initial history of {len(initial_tokens)} tokens exceeds the context length "
                                    f"{self.context_length}")
        self._check_tokens(initial_tokens, "initial_token_ids")
        spec = self.policies.resolve(policy_name, policy_params, self.engine.config, self.context_length)
        default = None if speculation is None else parse_speculation(*speculation)
        check_rollback(spec, default, at_create=True)
        return self.store.create(owner, spec, self.context_length, initial_tokens, reserve_bytes=self.kv_reserve(spec),
                                 evict=evict, speculation=default, durable=durable)

    def kv_reserve(self, spec: PolicySpec, context_length: int | None = None) -> int:
        """The KV bytes a session with this policy reserves against the budget: its worst case at its context (the
        server's, or a recovered session's own, kept from a start with a longer --context)."""
        context = context_length or self.context_length
        cost = self._worst_case.get((spec, context))
        if cost is None:
            cost = self._worst_case[(spec, context)] = kv_worst_case_bytes(self.engine.config, spec, context,
                                                                           self.engine.dtype)
        return cost

    async def append(self, owner: str, session_id: str, tokens: Sequence[int],
                     deadline_passed: Callable[[], bool] = lambda: False) -> int:
        """Append `tokens` once the session's earlier calls are done; refused (nothing appended) when the caller's
        deadline passed meanwhile: it was told DEADLINE_EXCEEDED, and a retry must not append them twice."""
        if not tokens:
            raise InvalidArgument("AppendTokens needs at least one token id")
        if len(tokens) > self.context_length:  # before anything walks or copies the ids
            raise ResourceExhausted(f"{len(tokens)} appended tokens exceed the context length {self.context_length}")
        self._check_tokens(tokens, "token_ids")
        session = self.store.get(owner, session_id)
        await self._take_turn(session)
        try:
            if deadline_passed():
                raise DeadlineExceeded("the caller's deadline passed before the tokens were appended; nothing "
                                       "was appended")
            return self._mutate(session, lambda: self.store.append(session, tokens))
        finally:
            self._release_turn(session)

    async def close(self, owner: str, session_id: str) -> None:
        self.store.close(owner, session_id)
        self.scheduler.withdraw_cancelled()  # its queued Generate ends now, freeing the cache and reservation

    def info(self, owner: str, session_id: str, *, include_history: bool = False) -> SessionSnapshot:
        snap = self.store.snapshot(owner, session_id, include_history=include_history)
        if snap.sparse is None and snap.policy.name == "sparse":  # no cache yet: nothing counted, nothing held
            zero = SparseCounters().as_dict()
            snap = dataclasses.replace(snap, sparse={"total": zero, "layers": [zero] * len(self._governed),
                                                     "hot_bytes": 0, "cold_bytes": 0, "index_bytes": 0})
        return snap

    async def generate(self, owner: str, session_id: str, params: GenerateParams) -> AsyncIterator[GenerateEvent]:
        """Stream TokensEvent per committed token, then one DoneEvent. Leaving early cancels."""
        request = self._engine_request(params)
        stops = self._stop_strings(params.stop)
        asked = None if params.speculation is None else parse_speculation(*params.speculation)
        session = self.store.get(owner, session_id)
        speculation = asked if params.speculation is not None else session.speculation
        check_rollback(session.policy, speculation, at_create=False)
        job = _Job(session, request, asyncio.get_running_loop(), stops, speculation)
        await self._take_turn(session)
        handed_off = False
        try:
            self._mutate(session, lambda: self.store.begin_generate(session, request.max_new_tokens, job.cancel))
            try:
                future = self.scheduler.submit_turn(_Turn(self, job), session.owner)
            except RuntimeError:  # the scheduler was shut down
                handed_off = job.finished = True
                self._end_job(job)
                raise Unavailable("the server is shutting down") from None
            handed_off = True  # from here the turn is released when the engine job ends
            future.add_done_callback(lambda f: self._call_on_loop(job, self._job_ended, job, f))
            while True:
                event = await job.events.get()
                if event is _JOB_ENDED:  # no final event: the server stopped it, or its error handling broke
                    if self.scheduler.closing:
                        raise Unavailable("generation did not run: the server is shutting down")
                    raise InternalError("generation failed; see the server log")
                if isinstance(event, SessionError | DoneEvent):
                    # The engine thread emits nothing and touches the session no more after its final
                    # event, so the turn is free now (a GetSessionInfo right after sees generating=False).
                    job.finished = True
                    self._end_job(job)
                    if isinstance(event, SessionError):
                        raise event
                    if event.finish_reason is FinishReason.CANCELLED and self._ending:
                        raise Unavailable(f"the server is shutting down; the session keeps every token streamed "
                                          f"({event.history_length} in its history)")
                yield event
                if job.finished:
                    return
        finally:
            if not handed_off:
                self._release_turn(session)
            elif not job.finished:
                job.cancel.set()  # the client went away: stop after the current step, or leave the queue now
                self.scheduler.withdraw_cancelled()

    # ---- export and import -------------------------------------------------------------------

    async def export(self, owner: str, session_id: str, *, include_kv: bool = False) -> bytes:
        """The session as an archive (sessions.archive): policy, context, history, and with `include_kv` a snapshot
        of its cache (when it has one: a session that never generated, or was recovered and has not yet, has none)."""
        session = self.store.get(owner, session_id)
        await self._take_turn(session)  # a consistent history and cache: no Generate or Append runs meanwhile
        try:
            history = list(session.history)
            kv = None
            if include_kv:
                if session.cache is not None and session.cached_length > 0:
                    kv = await asyncio.wrap_future(self.scheduler.submit(
                        snapshot.dump, session.cache, history, session.cached_length, self.model_id))
                elif session.snapshot is not None and self.state is not None:  # recovered, not yet loaded
                    kv = await asyncio.to_thread(self._current_snapshot, session.snapshot)
            spec = session.policy
            return await asyncio.to_thread(  # a checksum and copies of hundreds of MB: not on the event loop
                archive.encode, self.model_id, spec.name, dict(spec.params), session.context_length, history, kv,
                session_settings(session), checkpoint=self.checkpoint)
        except RuntimeError:  # the scheduler was shut down
            raise Unavailable("the server is shutting down") from None
        finally:
            self._release_turn(session)

    def _current_snapshot(self, path: Path) -> bytes | None:
        """A recovered session's snapshot file, if these weights computed it (else, or unreadable: None)."""
        assert self.state is not None
        try:
            data = self.state.read_snapshot(path)
            return data if snapshot.metadata(data)["model"] == self.model_id else None
        except (OSError, ValueError):  # RecordError, SnapshotError: the history is the truth
            return None

    async def import_session(self, owner: str, data: bytes, *, load_kv: bool = True) -> tuple[Session, bool]:
        """A new session (a new id, owned by `owner`) from an archive of this checkpoint (in any weight format); with
        a KV snapshot of these weights, the snapshot is checked against the history it records and loaded now, and a
        bad one refuses the import (nothing is created). A snapshot of other weights (another format or build), or
        any with `load_kv` False, is not used: the first Generate computes the cache. Returns the session and whether
        its cache came from the snapshot."""
        try:  # off the event loop: checking hundreds of MB takes a while, and every other call must go on
            arc = await asyncio.to_thread(archive.decode, data)
        except archive.ArchiveError as e:
            raise InvalidArgument(f"ImportSession: {e}") from None
        if not load_kv:
            arc.kv = None
        theirs, ours = snapshot.compared_checkpoints(self.checkpoint, arc.checkpoint, arc.model)
        if theirs != ours:
            raise FailedPrecondition(f"the archive holds a session of the model {quoted(theirs)}, this server "
                                     f"serves {ours}")
        if arc.kv is not None and arc.model != self.model_id:
            _log.info("ImportSession: the archive's KV snapshot was computed by the weights %s, not %s; the first "
                      "Generate computes the cache", arc.model, self.model_id)
            arc.kv = None
        speculation = arc.settings.get("speculation")
        if speculation is not None and not (isinstance(speculation, list) and len(speculation) == 2
                                            and isinstance(speculation[0], str) and isinstance(speculation[1], int)):
            raise InvalidArgument("ImportSession: the archive's speculation setting is not [proposer, max_draft_tokens]")
        if arc.kv is not None:  # before admission: a refused import must not have evicted anyone to make room
            try:
                snapshot.check_header(arc.kv, arc.history, self.model_id, self.engine.config.num_hidden_layers)
            except snapshot.SnapshotError as e:
                raise InvalidArgument(f"ImportSession: {e}") from None
        session = await self.create(owner, arc.history, arc.policy_name, stored_params(arc.policy_params),
                                    speculation=None if speculation is None else tuple(speculation))
        if arc.kv is None:
            return session, False
        await self._take_turn(session)
        try:
            future = self.scheduler.submit(self._load_imported, session, arc.kv)
            await asyncio.wrap_future(future)
        except BaseException as e:
            self._release_turn(session)
            self.store.close(owner, session.id)  # a refused import leaves nothing behind
            if isinstance(e, snapshot.SnapshotError):
                raise InvalidArgument(f"ImportSession: {e}") from None
            if isinstance(e, RuntimeError):
                raise Unavailable("the server is shutting down") from None
            raise
        self._release_turn(session)
        return session, True

    def _load_imported(self, session: Session, kv: bytes) -> None:
        cache = self.policies.build(self.engine, session.policy, session.context_length)
        n = snapshot.load(cache, kv, session.history, self.model_id)
        self.store.attach_cache(session, cache, n)
        self._record_attention(session)  # GetSessionInfo shows the sparse policy's bytes before a first Generate
        self.observer.kv_restored("snapshot")

    # ---- idle compression --------------------------------------------------------------------

    def idle_codec_for(self, session: Session) -> CodecSpec | None:
        """The session's own idle_codec, else the server default (None: the session is never compressed, as its
        idle_codec "none" asks)."""
        own = session.policy.idle_codec
        if own is None:
            return self.idle_codec
        return None if own.kind == "none" else own

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

    def _stop_strings(self, stop: Sequence[str]) -> tuple[str, ...]:
        stops = check_stop_strings(stop)
        if stops and self.detokenize is None:
            raise InvalidArgument("stop strings need the model's tokenizer and this server has none: "
                                  "use stop_token_ids")
        return stops

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
        _on_loop(job.loop, fn, *args)  # after the job's events (FIFO, held with them inside a step's deliveries)

    def _job_ended(self, job: _Job, future: Future) -> None:
        # Runs on the loop after every event the job emitted (call_soon_threadsafe is FIFO).
        self._end_job(job)
        job.events.put_nowait(_JOB_ENDED)

    def _end_job(self, job: _Job) -> None:
        """Release the session's turn once per job: at its final event or when its future ends."""
        if not job.released:
            job.released = True
            self._release_turn(job.session, generated=True)

    def _build_cache(self, session: Session) -> None:
        """Engine thread: the session's first cache, from its verified snapshot when it has one (a recovered or
        imported session), else empty (the prefill then computes the whole history)."""
        source, recovered = session.snapshot, session.recovered
        session.recovered = False  # counted once: a cache dropped later (a rollback) is no restart's
        if source is not None:
            try:
                assert self.state is not None  # only recovery sets a snapshot, and only with a state directory
                data = self.state.read_snapshot(source)
                cache = self.policies.build(self.engine, session.policy, session.context_length)
                n = snapshot.load(cache, data, session.history, self.model_id)
                self.store.attach_cache(session, cache, n)
                self._record_attention(session)
                self.observer.kv_restored("snapshot")
                return
            except (OSError, ValueError) as e:  # SnapshotError, RecordError: the history is the truth, recompute
                _log.warning("session %s: KV snapshot refused (%s); recomputing it from the history", session.id, e)
                self.observer.kv_restored("recompute")
                session.snapshot = None
        elif recovered:  # no snapshot (a crash, or a session that never generated): the history is prefilled
            self.observer.kv_restored("history")
        self.store.attach_cache(session, self.policies.build(self.engine, session.policy, session.context_length))

    def _speculative_stream(self, session: Session, ids: torch.Tensor, job: _Job,
                            ends_at: Callable[[int], bool] | None = None) -> SpeculativeStream:
        """Engine thread: the session's draft proposer (kept between Generates while the setting stays the same, so
        the history index only grows) and a speculative stream over the session's cache."""
        spec = job.speculation
        assert spec is not None
        if session.drafts is None or session.drafts[0].proposer != spec.proposer:
            session.drafts = (spec, make_proposer(spec, self.engine.model, self._draft_head,
                                                  owner_histories(self.store.live_sessions, session)))
        context = self.store.history_tokens(session)
        return SpeculativeStream(self.engine, session.cache, ids, job.request, session.drafts[1], context,
                                 draft_tokens(spec, session.policy), should_stop=job.cancel.is_set, ends_at=ends_at,
                                 short_prompt=self.scheduler.short_prompt)

    def _draft_head(self) -> DraftHead:
        """Engine thread: the served model's EAGLE-style draft head, shared by sessions (random until trained)."""
        if self.draft_head is None:
            self.draft_head = DraftHead(self.engine.model)
        return self.draft_head

    @staticmethod
    def _record_attention(session: Session) -> float:
        """Engine thread, after a Generate or a snapshot load: remember the newest query's attention fraction and the
        sparse policy's counters and bytes for GetSessionInfo."""
        cache = session.cache
        if cache is not None and not is_compressed(cache):
            with contextlib.suppress(Exception):
                session.attention_fraction = float(cache.effective_attention_fraction)
            if isinstance(cache, SparseKV):
                memory = cache.memory_stats()
                session.sparse = {"total": cache.counters().as_dict(), "layers": cache.layer_counters(),
                                  **{k: memory[k] for k in ("hot_bytes", "cold_bytes", "index_bytes")}}
        return session.attention_fraction


@dataclass(slots=True)
class _Turn:
    """A Generate as the engine loop drives it (sessions.batch.Turn): open the session's stream, commit and relay
    each step's tokens, end with stats, or roll the session back on an engine error. Runs on the engine thread."""

    service: SessionService
    job: _Job
    stream: TokenStream | SpeculativeStream | None = None
    watch: StopWatch | None = None
    ends_at: Callable[[int], bool] | None = None
    queue_s: float = 0.0
    resume_s: float = 0.0
    history_at_start: int = 0
    parked_unread_s: float = 0.0  # parked for another key's turn (sessions.batch) before its prompt's first chunk
    parked_before_first_s: float = 0.0  # ... while its prompt was read (inside prefill_s and ttft_s)
    parked_after_first_s: float = 0.0  # ... after its first token (inside decode_s)

    def resumed(self, parked_s: float) -> None:
        """Time parked is a wait for a row (queue_s), not prefill or decode time."""
        stream = self.stream
        result = None if stream is None else stream.result
        if result is not None and result.decode_tokens > 0:
            self.parked_after_first_s += parked_s
        elif result is not None or isinstance(stream, SpeculativeStream):  # (a speculative row parks once begun)
            self.parked_before_first_s += parked_s
        else:  # no chunk read yet: its prefill clock has not started
            self.parked_unread_s += parked_s

    def begin(self) -> TokenStream | SpeculativeStream | None:
        """Prefill history[cached_length:] next, then decode; None when the turn already answered."""
        job, svc = self.job, self.service
        session, store = job.session, svc.store
        self.queue_s = time.perf_counter() - job.submitted_at
        self.history_at_start = len(session.history)
        if job.cancel.is_set():  # client gone or session closed while queued: touch nothing
            self._done(DoneEvent(FinishReason.CANCELLED, GenerateStats(queue_s=self.queue_s), self.history_at_start))
            return None
        try:
            if session.cache is None:
                svc._build_cache(session)
            elif is_compressed(session.cache):
                self.resume_s = decompress(session.cache).seconds  # idle-compressed: unpack before the prefill
                store.check(session)
            pending = store.pending_tokens(session)
            ids = torch.tensor([pending], dtype=torch.long, device=svc.engine.device)  # (1, T)
            watch = StopWatch.new(svc.detokenize, job.stops) if job.stops and svc.detokenize else None
            stop_ids = set(job.request.stop_ids)
            self.watch = watch
            self.ends_at = None if watch is None else (lambda token: token not in stop_ids and watch.push(token))
            if job.speculation is None:
                self.stream = svc.engine.stream(session.cache, ids, job.request, should_stop=job.cancel.is_set)
                return self.stream
            # the stream cuts a step at a completed stop string itself (and trims the cache to match)
            self.stream = svc._speculative_stream(session, ids, job, self.ends_at)
            return self.stream
        except Exception as e:
            self.fail(e)
            return None

    def cancelled(self) -> bool:
        return self.job.cancel.is_set()

    def _done(self, event: DoneEvent) -> None:
        self.service.observer.generate_done(event.finish_reason)
        self.job.emit(event)

    def deliver(self, tokens: list[int]) -> bool:
        session, store, job = self.job.session, self.service.store, self.job
        if isinstance(self.stream, SpeculativeStream):  # the cache already holds everything before the last token
            store.commit_generated_run(session, tokens)
            for token in tokens:
                job.emit(TokensEvent([token]))
            return False
        (token,) = tokens
        store.commit_generated(session, token)
        job.emit(TokensEvent([token]))
        return self.ends_at is not None and self.ends_at(token)

    def finish(self) -> None:
        job, svc, stream = self.job, self.service, self.stream
        session, store = job.session, svc.store
        assert stream is not None
        if stream.prefill_left > 0:  # cancelled between prefill chunks
            store.keep_prefilled(session)  # the chunks read stay cached; nothing was committed
            waited = self.queue_s + self.parked_unread_s + self.parked_before_first_s
            self._done(DoneEvent(FinishReason.CANCELLED, GenerateStats(queue_s=waited, resume_s=self.resume_s),
                               self.history_at_start))
            return
        stop_string = None
        if self.watch is not None and self.watch.matcher.matched is not None:
            stop_string = self.watch.matcher.matched
        store.finish_generate(session)
        sparse_before = session.sparse
        eaf = svc._record_attention(session)
        result = stream.result
        assert result is not None
        if stop_string is not None:
            result.finish_reason = FinishReason.STOP
        n = result.decode_tokens
        spec = stream.stats if isinstance(stream, SpeculativeStream) else SpecStats()
        before, after = self.parked_before_first_s, self.parked_after_first_s
        decode_s = max(0.0, result.decode_s - after)
        stats = GenerateStats(
            prefill_tokens=result.prefill_tokens,
            prefill_s=max(0.0, result.prefill_s - before),
            decode_s=decode_s,
            decode_tokens=n,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            queue_s=self.queue_s + self.parked_unread_s + before + after,
            resume_s=self.resume_s,
            ttft_s=self.resume_s + max(0.0, result.ttft_s - before),
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
        svc.observer.generate_finished(stats, self.history_at_start)
        self._done(DoneEvent(result.finish_reason, stats, len(session.history), stop_string))

    def fail(self, e: Exception) -> None:
        """An error after the turn began: an invariant violation fails the session; an engine error rolls it back
        to its last consistent state (every token committed before the error included)."""
        job, svc = self.job, self.service
        session, store = job.session, svc.store
        if isinstance(e, InvariantViolation):
            store.fail(session, e)
            job.emit(e)
            return
        try:
            store.roll_back(session)
        except InvariantViolation as v:  # the session's own record broke: that is a real violation
            store.fail(session, v)
            job.emit(v)
            return
        finally:
            svc._record_attention(session)
        if isinstance(e, PositionLimitError):  # the store's context checks should make this unreachable
            job.emit(ResourceExhausted(f"generation stopped at the model's position limit: {e}",
                                       limit="model_positions"))
        elif isinstance(e, SessionError):  # e.g. the journal could not be written: its own typed status
            job.emit(e)
        elif isinstance(e, CodecRangeError):  # this model's K/V and the session's packed codec do not fit
            job.emit(FailedPrecondition(f"{e}; the session was rolled back to its last committed token"))
        else:
            _log.error("Generate on session %s failed; the session was rolled back", session.id, exc_info=e)
            job.emit(InternalError(f"generation failed ({type(e).__name__}); the session was rolled back to "
                                   f"its last committed token and can be used again"))



def _sparse_delta(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """This Generate's counts, in total and per layer; a cache rebuilt since (roll back) counts from zero."""
    if before is None or any(v < before["total"].get(k, 0) for k, v in now["total"].items()):
        return {"total": dict(now["total"]), "layers": [dict(x) for x in now["layers"]]}
    diff = lambda a, b: {k: v - b.get(k, 0) for k, v in a.items()}  # noqa: E731
    return {"total": diff(now["total"], before["total"]),
            "layers": [diff(a, b) for a, b in zip(now["layers"], before["layers"], strict=True)]}
