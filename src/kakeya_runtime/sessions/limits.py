"""Admission: the session limits, per API key and global, and which idle sessions a new one may evict.

Four limits, all checked before a session exists (so before its cache is ever allocated):

* `max_sessions_per_key`: sessions one key (owner) holds at once;
* `kv_budget_per_key`: KV bytes one key's sessions may reserve;
* `max_sessions`: sessions in the store;
* `kv_budget`: KV bytes all sessions may reserve.

A session reserves its worst-case KV bytes (sessions.budget) when it is created and gives them back when it ends,
so what the budget admits can never outgrow it, whatever the sessions later do. When a limit would be exceeded,
the owner's own least recently used idle sessions are evicted, oldest first, until the new one fits; other keys'
sessions only with `evict_across_keys` (an operator's choice). Busy sessions are never evicted. If evicting
everything allowed still would not make room, nothing is evicted and the refusal names the limit. A caller may
also admit without evicting anything (`evict=False`: the OpenAI shim's throwaway single-shot sessions never
displace a key's own sessions); then any limit reached is a refusal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kakeya_runtime.sessions.errors import ResourceExhausted


@dataclass(slots=True, frozen=True)
class Limits:
    max_sessions: int = 64
    max_sessions_per_key: int | None = None  # None: max_sessions
    kv_budget: int | None = None  # bytes; None: no byte budget
    kv_budget_per_key: int | None = None  # bytes; None: kv_budget
    evict_across_keys: bool = False  # may a key's new session evict another key's idle sessions?

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_key", "kv_budget", "kv_budget_per_key"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @classmethod
    def fair_share(cls, num_keys: int, *, max_sessions: int = 64, max_sessions_per_key: int | None = None,
                   kv_budget: int | None = None, kv_budget_per_key: int | None = None,
                   evict_across_keys: bool = False) -> Limits:
        """Per-key limits left unset default to an equal share of the global ones among `num_keys` keys, so one
        key can never crowd the others out (one key, or none: the key gets everything)."""
        n = max(1, num_keys)
        return cls(max_sessions=max_sessions,
                   max_sessions_per_key=max_sessions_per_key or max(1, max_sessions // n),
                   kv_budget=kv_budget,
                   kv_budget_per_key=kv_budget_per_key or (None if kv_budget is None else max(1, kv_budget // n)),
                   evict_across_keys=evict_across_keys)

    @property
    def key_sessions(self) -> int:
        """Sessions one key may hold: its own limit, within the server's."""
        return min(self.max_sessions_per_key or self.max_sessions, self.max_sessions)

    @property
    def key_budget(self) -> int | None:
        """KV bytes one key may reserve: its own budget, within the server's (a per-key budget above the server's
        was reported as the caller's share, which no session could use)."""
        budgets = [b for b in (self.kv_budget_per_key, self.kv_budget) if b is not None]
        return min(budgets) if budgets else None

    @property
    def tighter_key_limits(self) -> tuple[int | None, int | None]:
        """The per-key session count and byte budget where they are tighter than the server's (else None: the
        server's limit is the one a refusal names; one key, or none, leaves no per-key limit an operator set)."""
        sessions = self.key_sessions if self.key_sessions < self.max_sessions else None
        budget = self.key_budget
        if budget is not None and self.kv_budget is not None and budget >= self.kv_budget:
            budget = None
        return sessions, budget


class Held(Protocol):
    """What admission reads of a session in the store."""

    owner: str
    reserved_bytes: int


def plan_admission(held: Sequence[Held], busy: Sequence[bool], owner: str, cost: int, limits: Limits,
                   draining: Sequence[Held] = (), *, evict: bool = True) -> list[int]:
    """Indices into `held` (least recently used first) of the sessions to evict so that one more session of
    `owner` reserving `cost` bytes fits every limit; ResourceExhausted (evicting nothing) when it cannot.
    `draining`: sessions that ended while busy and still hold their cache (their bytes count, nothing else).
    `evict=False`: nothing may be evicted, so any limit already reached refuses."""
    for budget, what, limit in ((limits.tighter_key_limits[1], "per API key", "kv_budget_per_key"),
                                (limits.kv_budget, "of the server", "kv_budget")):
        if budget is not None and cost > budget:  # would not fit in an empty store: evict nothing
            raise ResourceExhausted(
                f"this session may need up to {size_text(cost)} of KV cache, more than the whole KV budget {what} "
                f"({size_text(budget)}): choose a bounded KV policy or a shorter context", limit=limit)
    use = _Usage(held, owner, draining)
    own = [i for i, s in enumerate(held) if s.owner == owner and not busy[i]] if evict else []
    others = ([i for i, s in enumerate(held) if s.owner != owner and not busy[i]]
              if evict and limits.evict_across_keys else [])
    victims: list[int] = []
    while _key_over(use, cost, limits) and own:  # a key's own limits: only its own sessions make room
        victims.append(use.drop(own.pop(0)))
    candidates = own + others  # the owner's first, then (if allowed) other keys', each least recently used first
    while _server_over(use, cost, limits) and candidates:
        victims.append(use.drop(candidates.pop(0)))
    refusal = _key_over(use, cost, limits) or _server_over(use, cost, limits)
    if refusal is not None:
        limit, reason = refusal
        if not evict:
            raise ResourceExhausted(f"{reason}: close a session or retry later (this request evicts no session)",
                                    limit=limit)
        evictable = [b for s, b in zip(held, busy, strict=True) if s.owner == owner or limits.evict_across_keys]
        busy_note = " and the sessions that could make room are busy" if any(evictable) else ""
        scope = "" if limits.evict_across_keys or "per API key" in reason else \
            " (another key's sessions are never evicted for it)"
        raise ResourceExhausted(f"{reason}{busy_note}: close a session or retry later{scope}", limit=limit)
    return victims


class _Usage:
    """Sessions and reserved bytes, in total and the owner's, as planned evictions take them away."""

    def __init__(self, held: Sequence[Held], owner: str, draining: Sequence[Held]) -> None:
        self.held, self.owner = held, owner
        self.count = len(held)
        self.total = sum(s.reserved_bytes for s in (*held, *draining))
        self.key_count = sum(1 for s in held if s.owner == owner)
        self.key_total = sum(s.reserved_bytes for s in (*held, *draining) if s.owner == owner)

    def drop(self, i: int) -> int:
        s = self.held[i]
        self.count -= 1
        self.total -= s.reserved_bytes
        if s.owner == self.owner:
            self.key_count -= 1
            self.key_total -= s.reserved_bytes
        return i


def _key_over(use: _Usage, cost: int, limits: Limits) -> tuple[str, str] | None:
    sessions, budget = limits.tighter_key_limits
    if sessions is not None and use.key_count + 1 > sessions:
        return "sessions_per_key", f"the session quota of {sessions} per API key is reached"
    if budget is not None and use.key_total + cost > budget:
        return "kv_budget_per_key", (f"the KV budget of {size_text(budget)} per API key is exhausted "
                                     f"({size_text(use.key_total)} reserved, this session may need up to {size_text(cost)})")
    return None


def _server_over(use: _Usage, cost: int, limits: Limits) -> tuple[str, str] | None:
    if use.count + 1 > limits.max_sessions:
        return "sessions", f"the server's limit of {limits.max_sessions} sessions is reached"
    if limits.kv_budget is not None and use.total + cost > limits.kv_budget:
        return "kv_budget", (f"the server's KV budget of {size_text(limits.kv_budget)} is exhausted ({size_text(use.total)} "
                             f"reserved, this session may need up to {size_text(cost)})")
    return None


def size_text(n: int) -> str:
    """A byte count for people: 1.5 GiB, 12.0 MiB, 300 bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
