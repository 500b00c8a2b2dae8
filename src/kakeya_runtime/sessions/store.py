"""SessionStore: server-issued ids, append-only raw-token history bound to a per-session KV cache.

The binding (the invariants, checked inside every mutation):

* INV-1: every layer of the session's cache holds exactly `cached_length` positions, and those are
  the K/V of `history[:cached_length]`. `cached_length` is the session's own record of what it
  asked the engine to consume; the layer lengths are what the cache actually did. Between calls
  `cached_length == len(history) - pending`, where pending is what the next Generate prefills:
  the tokens appended since the last Generate, plus the last generated token (the engine never
  feeds its final sample back). At every committed token during a Generate, every layer holds
  exactly `len(history)` positions (everything before the token being committed).
* INV-2: every layer's next position and the history length never decrease over the session.

A violation raises InvariantViolation; the caller fails the session (`fail`), which frees its
cache and counts it. Nothing is ever repaired in place.

Admission (sessions.limits): a new session reserves its worst-case KV bytes and must fit the per-key and global
session and byte limits; the owner's own least recently used idle sessions make room, other keys' only when the
operator allows it. A session that ends while busy keeps its reservation until its cache is actually freed.

Thread model: the store's lock guards the session table and every history/cache bookkeeping
field; the engine thread commits generated tokens under it, handler code appends under it. Tensor
work (building a cache, prefill, decode) happens only on the engine thread, outside the lock.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.kv.idle import is_compressed, sparse_packed_bytes
from kakeya_runtime.sessions.errors import (
    FailedPrecondition,
    InvalidArgument,
    Invariant,
    InvariantViolation,
    ResourceExhausted,
    SessionError,
    SessionNotFound,
    Unavailable,
    quoted,
)
from kakeya_runtime.sessions.limits import Limits, plan_admission
from kakeya_runtime.sessions.policy import PolicySpec

_log = logging.getLogger(__name__)

SESSION_ID_BYTES = 24  # 192 bits from the OS CSPRNG
_TOMBSTONES = 4096  # recently ended ids remembered, so NOT_FOUND can say why


class SessionState(enum.Enum):
    ACTIVE = "active"
    CLOSED = "closed"
    EVICTED = "evicted"
    FAILED = "failed"


class EndReason(enum.Enum):
    """Label of kakeya_session_evicted_total{reason}: why a session's cache was freed."""

    CLOSE = "close"
    TTL = "ttl"
    LRU = "lru"  # made room for a new session (its owner's, or any key's with evict_across_keys)
    FAILED = "failed"


class Outcome(enum.Enum):
    """Label of kakeya_session_total{outcome}."""

    CLOSED = "closed"
    EVICTED = "evicted"
    FAILED = "failed"


_OUTCOME = {EndReason.CLOSE: Outcome.CLOSED, EndReason.TTL: Outcome.EVICTED, EndReason.LRU: Outcome.EVICTED,
            EndReason.FAILED: Outcome.FAILED}
_STATE = {EndReason.CLOSE: SessionState.CLOSED, EndReason.TTL: SessionState.EVICTED,
          EndReason.LRU: SessionState.EVICTED, EndReason.FAILED: SessionState.FAILED}


class StoreObserver(Protocol):
    """What the store reports (the server's Prometheus metrics implement it)."""

    def session_created(self) -> None: ...

    def session_ended(self, outcome: Outcome, reason: EndReason) -> None: ...

    def invariant_violated(self, invariant: Invariant) -> None: ...


class Journal(Protocol):
    """Where committed history is made durable (sessions.journal.StateDir); each hook raises OSError on failure."""

    def created(self, session_id: str, owner: str, policy_name: str, policy_params: dict[str, Any],
                context_length: int, history: Sequence[int], settings: dict[str, Any] | None = None,
                evicts: Sequence[str] = ()) -> None: ...

    def appended(self, session_id: str, tokens: Sequence[int]) -> None: ...

    def size(self, session_id: str) -> int: ...

    def cut(self, session_id: str, size: int) -> None: ...

    def call_ended(self, session_id: str) -> None: ...

    def ended(self, session_id: str) -> None: ...


class NullObserver:
    def session_created(self) -> None:
        pass

    def session_ended(self, outcome: Outcome, reason: EndReason) -> None:
        pass

    def invariant_violated(self, invariant: Invariant) -> None:
        pass


@dataclass(slots=True, eq=False)
class Session:
    id: str
    owner: str  # hash of the API key that created it ("" without auth); others never see it
    policy: PolicySpec
    context_length: int  # history + max_tokens of a Generate must fit
    created_at: float
    last_access: float
    history: list[int] = field(default_factory=list)  # append-only raw token ids
    reserved_bytes: int = 0  # worst-case KV bytes held against the budget (sessions.budget) until the cache is freed
    cache: ModelKV | None = None  # built lazily on the engine thread by the first Generate
    cached_length: int = 0  # INV-1: history[:cached_length] is what the cache holds
    position_high_water: int = 0  # INV-2: no layer's next position may fall below this
    history_high_water: int = 0  # INV-2: the history length never falls below this
    state: SessionState = SessionState.ACTIVE
    busy_ops: int = 0  # calls waiting for or holding the session's turn; busy sessions are not evicted
    generating: bool = False
    generate_calls: int = 0
    inv1_checks: int = 0
    inv2_checks: int = 0
    cancel: threading.Event | None = None  # the in-flight Generate's stop flag
    turn: Any = None  # the service's per-session asyncio.Lock (one Generate/Append at a time)
    # Set on the engine thread after each Generate: the newest query's share of the prefix it attends to
    # (read from here, not the cache, so GetSessionInfo never reads a cache that is being compressed).
    attention_fraction: float = 1.0
    idle_compressions: int = 0  # times the cache was compressed while idle
    sparse: dict | None = None  # the sparse policy's counters and bytes after the last Generate (kv.sparse)
    idle_compress_error: str | None = None  # compression failed once: the session is not retried
    snapshot: Path | None = None  # recovered: the KV snapshot file its first Generate tries to load
    recovered: bool = False  # adopted from the state directory, its cache not yet built
    durable: bool = True  # journaled when the store has a journal (a single-shot HTTP request's session is not)
    speculation: Any = None  # the session's default sessions.speculation.SpeculationSpec (None: off)
    drafts: Any = None  # (SpeculationSpec, DraftProposer) kept between Generates (the history index grows)

    @property
    def pending_length(self) -> int:
        return len(self.history) - self.cached_length

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V tensors held right now: resident plus transient (a restore turn's overlay)."""
        cache = self.cache
        return 0 if cache is None else cache.nbytes

    @property
    def kv_resident_bytes(self) -> int:
        """K/V bytes kept between steps (packed codes while compressed)."""
        cache = self.cache
        if cache is None:
            return 0
        resident = getattr(cache, "resident_nbytes", None)
        return cache.nbytes if resident is None else resident

    @property
    def kv_history_bytes(self) -> int:
        """Token ids the cache keeps besides K/V (restore recomputes from them; O(T) int32)."""
        return 0 if self.cache is None else getattr(self.cache, "history_nbytes", 0)

    @property
    def kv_compressed(self) -> bool:
        cache = self.cache
        return cache is not None and is_compressed(cache)

    @property
    def sparse_info(self) -> dict[str, Any] | None:
        """The sparse policy's counters and bytes as of the last Generate, with the bytes held now while compressed."""
        if self.sparse is None or not self.kv_compressed:
            return self.sparse
        return {**self.sparse, **sparse_packed_bytes(self.cache)}


@dataclass(slots=True, frozen=True)
class SessionSnapshot:
    """A consistent copy of a session's bookkeeping, taken under the store lock."""

    session_id: str
    history_length: int
    cached_length: int
    kv_live_bytes: int
    policy: PolicySpec
    inv1_checks: int
    inv2_checks: int
    generate_calls: int
    idle_s: float
    context_length: int
    generating: bool
    history: tuple[int, ...] | None
    kv_resident_bytes: int = 0
    kv_history_bytes: int = 0
    effective_attention_fraction: float = 1.0
    kv_compressed: bool = False
    idle_compressions: int = 0
    sparse: dict | None = None
    speculation: Any = None  # the session's default SpeculationSpec (None: off)


class SessionStore:
    def __init__(self, *, max_sessions: int = 64, idle_ttl_s: float = 1800.0,
                 observer: StoreObserver | None = None, clock: Callable[[], float] = time.monotonic,
                 limits: Limits | None = None, journal: Journal | None = None) -> None:
        """`limits` (sessions.limits) replaces `max_sessions`, its shorthand. `journal`: where every committed token
        is written before the call that commits it answers (None: sessions live in memory only)."""
        if idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {idle_ttl_s}")
        self.limits = limits or Limits(max_sessions=max_sessions)
        self.max_sessions = self.limits.max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.observer: StoreObserver = observer or NullObserver()
        self.clock = clock
        self._lock = threading.RLock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, tuple[str, EndReason]] = OrderedDict()  # id -> (owner, why)
        self._draining: dict[str, Session] = {}  # ended while busy: their cache (and reservation) not yet freed
        self.journal = journal

    # ---- lookup and lifecycle -------------------------------------------------------------

    def create(self, owner: str, policy: PolicySpec, context_length: int,
               initial_tokens: Sequence[int] = (), reserve_bytes: int = 0, *, evict: bool = True,
               speculation: Any = None, durable: bool = True) -> Session:
        """Admit a new session reserving `reserve_bytes` of the KV budget (sessions.limits: the owner's least
        recently used idle sessions make room; ResourceExhausted, nothing evicted, when they cannot; with
        `evict=False` nothing makes room and any limit reached refuses). `durable=False`: never journaled (a
        session nobody can reach after a restart, such as a single-shot HTTP request's, must not come back)."""
        if len(initial_tokens) > context_length:
            raise ResourceExhausted(
                f"initial history of {len(initial_tokens)} tokens exceeds the context length {context_length}"
            )
        with self._lock:
            self._sweep_locked()
            held = list(self._sessions.values())
            victims = plan_admission(held, [self._busy(s) for s in held], owner, reserve_bytes, self.limits,
                                     draining=list(self._draining.values()), evict=evict)
            now = self.clock()
            sid = "ses_" + secrets.token_urlsafe(SESSION_ID_BYTES)
            session = Session(sid, owner, policy, context_length, created_at=now, last_access=now,
                              history=list(initial_tokens), reserved_bytes=reserve_bytes, speculation=speculation,
                              durable=durable)
            session.history_high_water = len(session.history)
            if self.journal is not None and durable:  # durable before anything is evicted for it: a refusal changes nothing
                with _journal_errors():
                    self.journal.created(sid, owner, policy.name, dict(policy.params), context_length,
                                         session.history, session_settings(session),
                                         evicts=[held[i].id for i in victims if held[i].durable])
            for i in victims:
                self._end_locked(held[i], EndReason.LRU)
            self._sessions[sid] = session
        self.observer.session_created()
        return session

    def adopt(self, session_id: str, owner: str, policy: PolicySpec, context_length: int, history: Sequence[int],
              reserve_bytes: int = 0, snapshot: Any = None, speculation: Any = None, idle_s: float = 0.0) -> Session:
        """A session that already exists in the journal (a restart's recovery): admitted under the same limits as
        a new one, but never by evicting another (ResourceExhausted when it does not fit), with its own id. Its
        cache is built by its first Generate, from `snapshot` when that verifies, else from the history. `idle_s`:
        how long it had been idle (since its journal's last write), so a restart does not reset its idle TTL."""
        if len(history) > context_length:
            raise ResourceExhausted(f"a history of {len(history)} tokens exceeds the context length {context_length}")
        with self._lock:
            if session_id in self._sessions:
                raise InvalidArgument(f"session {quoted(session_id)} exists already")
            held = list(self._sessions.values())
            plan_admission(held, [True] * len(held), owner, reserve_bytes, self.limits,
                           draining=list(self._draining.values()), evict=False)
            now = self.clock()
            session = Session(session_id, owner, policy, context_length, created_at=now,
                              last_access=now - max(0.0, idle_s),
                              history=list(history), reserved_bytes=reserve_bytes, snapshot=snapshot,
                              speculation=speculation, recovered=True)
            session.history_high_water = len(session.history)
            self._sessions[session_id] = session
        self.observer.session_created()
        return session

    def get(self, owner: str, session_id: str) -> Session:
        """The live session with this id owned by `owner` (touching it), else SessionNotFound."""
        with self._lock:
            session = self._lookup_locked(owner, session_id)
            self._touch_locked(session)
            return session

    def _lookup_locked(self, owner: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is not None and session.owner == owner and self._expired(session):
            self._end_locked(session, EndReason.TTL)  # expiry holds on access, not only at sweeps
        if session is None or session.owner != owner or session.state is not SessionState.ACTIVE:
            raise self._not_found(owner, session_id)
        return session

    def require_active(self, session: Session) -> None:
        """For a call that waited for its turn: the session may have ended meanwhile."""
        with self._lock:
            if session.state is not SessionState.ACTIVE:
                raise self._not_found(session.owner, session.id)
            self._touch_locked(session)

    def close(self, owner: str, session_id: str) -> Session:
        with self._lock:
            session = self.get(owner, session_id)
            self._end_locked(session, EndReason.CLOSE)
            return session

    def fail(self, session: Session, violation: InvariantViolation) -> None:
        """An invariant broke: count it, drop the session and free its cache. Never repaired."""
        self.observer.invariant_violated(violation.invariant)
        with self._lock:
            if session.state is SessionState.ACTIVE:
                self._end_locked(session, EndReason.FAILED)
            self._free_locked(session)

    def sweep(self) -> int:
        """Evict sessions idle past the TTL; returns how many."""
        with self._lock:
            return self._sweep_locked()

    def begin_op(self, session: Session) -> None:
        with self._lock:
            session.busy_ops += 1
            self._touch_locked(session)

    def end_op(self, session: Session, *, generated: bool = False, touch: bool = True) -> None:
        """A call releases the session's turn (`generated`: it was the Generate that held the engine;
        `touch=False`: server-side housekeeping such as idle compression, which is not client activity)."""
        with self._lock:
            session.busy_ops -= 1
            if generated:
                session.generating = False
                session.cancel = None
            if touch:
                self._touch_locked(session)
            if session.state is not SessionState.ACTIVE and not session.generating:
                self._free_locked(session)  # ended while busy: free now that nothing uses it

    # ---- idle compression (the service's sweeper; nothing here touches last_access) --------

    def idle_seconds(self, session: Session) -> float:
        with self._lock:
            return 0.0 if self._busy(session) else self.clock() - session.last_access

    def claim_idle(self, threshold_s: float, eligible: Callable[[Session], bool] = lambda s: True) -> list[Session]:
        """Sessions idle past `threshold_s` (not past the TTL) whose cache is live and uncompressed, each
        marked busy (so neither TTL nor LRU frees it meanwhile) without touching it: the caller releases
        each with end_op(touch=False)."""
        with self._lock:
            now = self.clock()
            claimed = []
            for s in self._sessions.values():
                if (s.state is SessionState.ACTIVE and not self._busy(s) and s.cache is not None
                        and s.idle_compress_error is None and threshold_s < now - s.last_access <= self.idle_ttl_s
                        and not is_compressed(s.cache) and eligible(s)):
                    s.busy_ops += 1
                    claimed.append(s)
            return claimed

    def still_idle(self, session: Session, threshold_s: float, *, own_ops: int = 1) -> bool:
        """For a claimed session about to be compressed: nobody used or queued on it since the claim."""
        with self._lock:
            return (session.state is SessionState.ACTIVE and session.busy_ops == own_ops and not session.generating
                    and session.cache is not None and self.clock() - session.last_access > threshold_s)

    def __len__(self) -> int:
        return len(self._sessions)

    def live_sessions(self) -> list[Session]:
        """The active sessions, least recently used first (a copy: the caller may end them)."""
        with self._lock:
            return list(self._sessions.values())

    def kv_live_bytes(self) -> int:
        """K/V bytes held: live sessions' and those of ended ones whose running call has not freed them yet."""
        with self._lock:
            return sum(s.kv_bytes for s in (*self._sessions.values(), *self._draining.values()))

    def kv_reserved_bytes(self) -> int:
        """KV bytes reserved against the budget: live sessions' and those of ended ones not yet freed."""
        with self._lock:
            return sum(s.reserved_bytes for s in (*self._sessions.values(), *self._draining.values()))

    def by_policy(self) -> dict[str, tuple[int, int]]:
        """policy name -> (active sessions, K/V live bytes)."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for s in self._sessions.values():
                n, b = out.get(s.policy.name, (0, 0))
                out[s.policy.name] = (n + 1, b + s.kv_bytes)
        return out

    def snapshot(self, owner: str, session_id: str, *, include_history: bool = False) -> SessionSnapshot:
        with self._lock:
            s = self._lookup_locked(owner, session_id)
            # a read is not use: a monitor polling GetSessionInfo neither keeps a session from TTL eviction or
            # idle compression nor moves it in the LRU order
            idle_s = 0.0 if self._busy(s) else self.clock() - s.last_access
            return SessionSnapshot(
                session_id=s.id,
                history_length=len(s.history),
                cached_length=s.cached_length,
                kv_live_bytes=s.kv_bytes,
                policy=s.policy,
                inv1_checks=s.inv1_checks,
                inv2_checks=s.inv2_checks,
                generate_calls=s.generate_calls,
                idle_s=idle_s,
                context_length=s.context_length,
                generating=s.generating,
                history=tuple(s.history) if include_history else None,
                kv_resident_bytes=s.kv_resident_bytes,
                kv_history_bytes=s.kv_history_bytes,
                effective_attention_fraction=s.attention_fraction,
                kv_compressed=s.kv_compressed,
                idle_compressions=s.idle_compressions,
                sparse=s.sparse_info,
                speculation=s.speculation,
            )

    # ---- mutations (each checks the invariants before and after) --------------------------

    def append(self, session: Session, tokens: Sequence[int]) -> int:
        """Append validated token ids; refuses (nothing appended) when the context would overflow."""
        if not tokens:
            raise InvalidArgument("AppendTokens needs at least one token id")
        with self._lock:
            if session.state is not SessionState.ACTIVE:
                raise self._not_found(session.owner, session.id)
            self.check(session)
            if len(session.history) + len(tokens) > session.context_length:
                raise ResourceExhausted(
                    f"history of {len(session.history)} + {len(tokens)} appended tokens exceeds the "
                    f"context length {session.context_length}"
                )
            mark = self._journal_size(session)
            self._journal_tokens(session, tokens)
            try:
                self.call_ended(session)  # flushed before the tokens count
            except SessionError:  # written but not flushed: cut the record, so the answer "not appended" is true
                try:
                    if mark is not None:
                        self.journal.cut(session.id, mark)
                except OSError:  # the record stays: so do the tokens, and the answer says so
                    session.history.extend(tokens)
                    self.check(session)
                    raise Unavailable(f"the server could not flush the session's journal; the {len(tokens)} tokens "
                                      "were appended but may not survive a crash (see the session's history "
                                      "length)") from None
                raise
            session.history.extend(tokens)
            self.check(session)
            return len(session.history)

    def begin_generate(self, session: Session, max_tokens: int, cancel: threading.Event) -> None:
        """Room and non-empty checks for a Generate about to be queued (nothing changes on refusal)."""
        with self._lock:
            if session.state is not SessionState.ACTIVE:
                raise self._not_found(session.owner, session.id)
            self.check(session)
            if session.pending_length == 0:
                raise FailedPrecondition("the session history is empty: append tokens before Generate")
            if len(session.history) + max_tokens > session.context_length:
                raise ResourceExhausted(
                    f"history of {len(session.history)} tokens + max_tokens {max_tokens} exceeds the context "
                    f"length {session.context_length} (room for {session.context_length - len(session.history)})"
                )
            session.generating = True
            session.cancel = cancel
            session.generate_calls += 1

    def attach_cache(self, session: Session, cache: ModelKV, cached_length: int = 0) -> None:
        """The first Generate's freshly built cache, empty or loaded from a verified snapshot of
        history[:cached_length], checked against the session's record."""
        with self._lock:
            if session.cache is not None or session.cached_length != 0:
                raise InvariantViolation(Invariant.INV1, "a cache was attached to a session that has one")
            session.cache = cache
            session.cached_length = cached_length
            session.snapshot = None
            self.check(session)

    def roll_back(self, session: Session) -> bool:
        """After an engine error mid-Generate: bring the cache back to the session's record (history[:cached_length],
        every token committed before the error included). A cache that cannot trim that far (a ring that already
        overwrote the positions it would need) is dropped instead, and the next Generate rebuilds it from the
        history: bit-exact, since a position's K/V do not depend on how its prefill was chunked. Returns whether
        the cache was kept. Raises InvariantViolation only if the session's own record is inconsistent."""
        with self._lock:
            cache = session.cache
            kept = True
            if cache is not None and not is_compressed(cache) and cache.length != session.cached_length:
                try:
                    cache.trim(session.cached_length)
                except Exception:  # CacheError, or anything the error left it in: the history rebuilds it exactly
                    _log.warning("session %s: its cache could not be trimmed back; it is rebuilt from the history",
                                 session.id, exc_info=True)
                    kept = False
            if not kept:
                session.cache = None
                session.cached_length = 0
                session.position_high_water = 0  # the rebuild starts again from position 0
            self.check(session)
            with contextlib.suppress(SessionError):  # the tokens are written; only their flush failed
                self.call_ended(session)
            return kept

    def keep_prefilled(self, session: Session) -> None:
        """A Generate cancelled between prefill chunks: its cache holds history[:n] for the n positions the chunks
        reached, the same K/V a whole prefill gives them (a position's K/V do not depend on how the prefill was
        chunked), so they stay bound and the next Generate prefills only the rest. A cache whose layers disagree
        (which no chunk boundary leaves) is rolled back instead. Nothing was committed: the history is as before."""
        with self._lock:
            cache = session.cache
            lengths = cache.layer_lengths() if cache is not None and not is_compressed(cache) else []
            if not lengths or len(set(lengths)) != 1 or not session.cached_length <= lengths[0] <= len(session.history):
                self.roll_back(session)
                return
            session.cached_length = lengths[0]
            self.check(session)

    def pending_tokens(self, session: Session) -> list[int]:
        """What the next prefill consumes: history[cached_length:] (incremental prefill)."""
        with self._lock:
            return session.history[session.cached_length:]

    def history_tokens(self, session: Session) -> list[int]:
        """A copy of the whole history (a draft proposer's context)."""
        with self._lock:
            return list(session.history)

    def commit_generated_run(self, session: Session, tokens: Sequence[int]) -> None:
        """A speculative step's tokens, in order, after the cache was trimmed to hold everything before the last of
        them: the same end state (and checks) as committing them one by one with commit_generated."""
        if not tokens:
            return
        with self._lock:
            self._journal_tokens(session, tokens)  # before they exist for anyone (they are streamed after)
            session.history.extend(tokens)
            session.cached_length = len(session.history) - 1
            self.check(session)

    def commit_generated(self, session: Session, token: int) -> None:
        """Called at each sampled token: every layer has consumed all of the history so far."""
        with self._lock:
            self._journal_tokens(session, (token,))  # before the token exists for anyone (it is streamed after)
            session.cached_length = len(session.history)
            self.check(session)
            session.history.append(token)
            self.check(session)

    def check(self, session: Session) -> None:
        """INV-2 then INV-1 against the session's own record; raises InvariantViolation."""
        with self._lock:
            cache = session.cache
            lengths = cache.layer_lengths() if cache is not None else []
            session.inv2_checks += 1
            if len(session.history) < session.history_high_water:
                raise InvariantViolation(
                    Invariant.INV2,
                    f"history shrank from {session.history_high_water} to {len(session.history)} tokens",
                )
            if lengths and min(lengths) < session.position_high_water:
                layer = lengths.index(min(lengths))
                raise InvariantViolation(
                    Invariant.INV2,
                    f"layer {layer}'s next position went back from {session.position_high_water} to {lengths[layer]}",
                )
            session.inv1_checks += 1
            if session.cached_length > len(session.history):
                raise InvariantViolation(
                    Invariant.INV1,
                    f"cached length {session.cached_length} exceeds history length {len(session.history)}",
                )
            expected = session.cached_length
            bad = [(i, n) for i, n in enumerate(lengths) if n != expected]
            if cache is None and expected != 0:
                bad = [(-1, 0)]
            if bad:
                i, n = bad[0]
                raise InvariantViolation(
                    Invariant.INV1,
                    f"layer {i} holds {n} positions, the session has bound {expected} history tokens "
                    f"({len(bad)} layer(s) disagree)",
                )
            session.history_high_water = len(session.history)
            if lengths:
                session.position_high_water = lengths[0]

    def finish_generate(self, session: Session) -> None:
        """After the stream ended: the cache holds the history minus the last sampled token."""
        with self._lock:
            self.check(session)
            if session.pending_length != 1:
                raise InvariantViolation(
                    Invariant.INV1,
                    f"after Generate {session.pending_length} history tokens are unbound (expected exactly the "
                    "last sampled token)",
                )
            self.call_ended(session)

    def call_ended(self, session: Session) -> None:
        """A call that committed tokens is about to answer: make them durable per the journal's fsync policy."""
        if self.journal is not None and session.durable:
            with _journal_errors():
                self.journal.call_ended(session.id)

    def _journal_size(self, session: Session) -> int | None:
        if self.journal is not None and session.durable and session.state is SessionState.ACTIVE:
            with _journal_errors():
                return self.journal.size(session.id)
        return None

    def _journal_tokens(self, session: Session, tokens: Sequence[int]) -> None:
        # A session ended mid-step (closed, evicted) took its journal with it; its last step's tokens go nowhere.
        if self.journal is not None and session.durable and session.state is SessionState.ACTIVE:
            with _journal_errors():
                self.journal.appended(session.id, tokens)

    # ---- internals -------------------------------------------------------------------------

    @staticmethod
    def _busy(session: Session) -> bool:
        return session.busy_ops > 0 or session.generating

    def _expired(self, session: Session) -> bool:
        return not self._busy(session) and self.clock() - session.last_access > self.idle_ttl_s

    def _touch_locked(self, session: Session) -> None:
        session.last_access = self.clock()
        if session.id in self._sessions:
            self._sessions.move_to_end(session.id)

    def _sweep_locked(self) -> int:
        expired = [s for s in self._sessions.values() if self._expired(s)]
        for s in expired:
            self._end_locked(s, EndReason.TTL)
        return len(expired)

    def _end_locked(self, session: Session, reason: EndReason) -> None:
        self._sessions.pop(session.id, None)
        session.state = _STATE[reason]
        if session.cancel is not None:
            session.cancel.set()  # an in-flight Generate stops after its current step
        if self._busy(session):
            self._draining[session.id] = session  # its call frees the K/V (and the reservation) when it ends
        else:
            self._free_locked(session)
        self._ended[session.id] = (session.owner, reason)
        if self.journal is not None and session.durable:
            try:
                self.journal.ended(session.id)
            except OSError:  # the session is gone either way; a file left behind is recovered, then ends again
                _log.warning("could not delete the journal of session %s", session.id, exc_info=True)
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)
        self.observer.session_ended(_OUTCOME[reason], reason)

    def _free_locked(self, session: Session) -> None:
        session.cache = None
        session.snapshot = None
        self._draining.pop(session.id, None)

    def _not_found(self, owner: str, session_id: str) -> SessionNotFound:
        ended = self._ended.get(session_id)
        if ended is not None and ended[0] == owner:
            why = {EndReason.CLOSE: "was closed", EndReason.TTL: "was evicted after its idle TTL",
                   EndReason.LRU: "was evicted to make room for a new session (least recently used)",
                   EndReason.FAILED: "failed an invariant check and was freed"}[ended[1]]
            return SessionNotFound(f"session {session_id} {why}")
        # Unknown and foreign ids read the same, so ids owned by another key are not revealed.
        return SessionNotFound(f"session {quoted(session_id)} not found")


def session_settings(session: Session) -> dict[str, Any]:
    """What a journal keeps of a session besides its policy: its default speculation (sessions.speculation)."""
    spec = session.speculation
    return {} if spec is None else {"speculation": [spec.proposer, spec.max_draft_tokens]}


@contextlib.contextmanager
def _journal_errors():
    """A journal write that failed (its partial record already cut off) as a typed refusal: nothing was committed."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhausted(f"the server's state directory is full: {e.strerror or e}",
                                    limit="state_dir") from None
        raise Unavailable(f"the server could not write the session's journal: {e.strerror or e}") from None
