"""Admission limits: per-key session quotas and KV byte budgets hold, a key's pressure never evicts another key's
sessions unless the operator allows it, refusals name the limit and change nothing, and the byte budget refuses
before any cache exists. Window sizes are bounded by the session's context."""

from __future__ import annotations

import asyncio

import pytest

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.server.testing import tiny_model
from kakeya_runtime.sessions import (
    GenerateParams,
    InvalidArgument,
    ResourceExhausted,
    ServiceConfig,
    SessionService,
)
from kakeya_runtime.sessions.limits import Limits
from kakeya_runtime.sessions.policy import PolicySpec
from kakeya_runtime.sessions.store import SessionState, SessionStore

FULL = PolicySpec.parse("full")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0  # every reading is later: least recently used is well defined
        return self.t


def _store(**limits) -> SessionStore:
    return SessionStore(idle_ttl_s=1e9, clock=Clock(), limits=Limits(**limits))


def _active(store: SessionStore, sessions) -> list[bool]:
    return [s.state is SessionState.ACTIVE for s in sessions]


def test_a_key_filling_its_quota_evicts_only_its_own_sessions():
    store = _store(max_sessions=8, max_sessions_per_key=3)
    b = [store.create("B", FULL, 100, [i]) for i in range(3)]
    a = [store.create("A", FULL, 100, [i]) for i in range(3)]
    store.get("A", a[0].id)  # a[0] is now A's most recently used
    more = [store.create("A", FULL, 100) for _ in range(5)]
    assert _active(store, b) == [True, True, True]  # key B lost nothing
    assert _active(store, a) == [False, False, False] and _active(store, more) == [False, False, True, True, True]
    assert a[1].state is SessionState.EVICTED  # A's least recently used went first, a[0] after the touch


def test_a_full_server_evicts_another_keys_sessions_only_when_the_operator_allows_it():
    for across in (False, True):
        store = _store(max_sessions=4, max_sessions_per_key=4, evict_across_keys=across)
        b = [store.create("B", FULL, 100, [i]) for i in range(4)]
        if not across:
            with pytest.raises(ResourceExhausted, match="limit of 4 sessions") as e:
                store.create("A", FULL, 100)
            assert e.value.limit == "sessions" and "never evicted" in e.value.message
            assert _active(store, b) == [True] * 4 and len(store) == 4
        else:
            a = store.create("A", FULL, 100)
            assert _active(store, b) == [False, True, True, True] and a.state is SessionState.ACTIVE


def test_the_kv_budget_holds_per_key_and_in_total():
    store = _store(max_sessions=16, kv_budget=1000, kv_budget_per_key=700)
    a1 = store.create("A", FULL, 100, reserve_bytes=400)
    with pytest.raises(ResourceExhausted, match="per API key") as e:  # A's own share: a1 is busy, cannot go
        store.begin_op(a1)
        store.create("A", FULL, 100, reserve_bytes=400)
    assert e.value.limit == "kv_budget_per_key" and "busy" in e.value.message
    store.end_op(a1)
    a2 = store.create("A", FULL, 100, reserve_bytes=400)  # a1 idle now: A's own session makes room
    assert a1.state is SessionState.EVICTED and store.kv_reserved_bytes() == 400
    b1 = store.create("B", FULL, 100, reserve_bytes=500)
    store.begin_op(b1)  # busy: B has nothing to give up, and A's a2 (idle) is not B's to evict
    with pytest.raises(ResourceExhausted, match="server's KV budget") as e:  # 400 + 500 + 200 > 1000
        store.create("B", FULL, 100, reserve_bytes=200)
    assert e.value.limit == "kv_budget"
    assert _active(store, [a2, b1]) == [True, True] and store.kv_reserved_bytes() == 900
    store.end_op(b1)
    b2 = store.create("B", FULL, 100, reserve_bytes=200)  # idle again: B's own b1 makes room
    assert _active(store, [a2, b1, b2]) == [True, False, True]
    with pytest.raises(ResourceExhausted, match="more than the whole KV budget") as e:
        store.create("C", FULL, 100, reserve_bytes=701)  # never fits a key's share: refused outright
    assert e.value.limit == "kv_budget_per_key" and _active(store, [a2, b2]) == [True, True]


def test_an_admission_without_eviction_refuses_where_eviction_would_make_room():
    """evict=False (the OpenAI shim's single-shot sessions): any limit reached refuses, naming it, and nothing ends."""
    store = _store(max_sessions=4, max_sessions_per_key=2, kv_budget=1000, kv_budget_per_key=600)
    a = [store.create("A", FULL, 100, reserve_bytes=100) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="per API key") as e:
        store.create("A", FULL, 100, evict=False)
    assert e.value.limit == "sessions_per_key" and "evicts no session" in e.value.message
    assert _active(store, a) == [True, True] and len(store) == 2
    b = store.create("B", FULL, 100, reserve_bytes=500, evict=False)  # room: admitted as usual
    with pytest.raises(ResourceExhausted) as e:  # B's bytes: 500 + 200 > 600
        store.create("B", FULL, 100, reserve_bytes=200, evict=False)
    assert e.value.limit == "kv_budget_per_key" and b.state is SessionState.ACTIVE
    store.create("B", FULL, 100, reserve_bytes=50, evict=False)
    with pytest.raises(ResourceExhausted) as e:  # the server's four sessions
        store.create("C", FULL, 100, evict=False)
    assert e.value.limit == "sessions" and len(store) == 4
    store.create("A", FULL, 100, reserve_bytes=100)  # the same store still evicts for an ordinary create
    assert _active(store, a) == [False, True]


def test_a_session_ended_while_busy_keeps_its_bytes_until_its_cache_is_freed():
    store = _store(kv_budget=1000)
    s = store.create("A", FULL, 100, reserve_bytes=800)
    store.begin_op(s)
    store.close("A", s.id)  # its Generate is still finishing: the cache is still held
    assert store.kv_reserved_bytes() == 800
    with pytest.raises(ResourceExhausted, match="KV budget"):
        store.create("A", FULL, 100, reserve_bytes=800)
    store.end_op(s)
    assert store.kv_reserved_bytes() == 0
    store.create("A", FULL, 100, reserve_bytes=800)


def test_fair_share_defaults():
    two = Limits.fair_share(2, max_sessions=64, kv_budget=1000)
    assert (two.key_sessions, two.key_budget, two.evict_across_keys) == (32, 500, False)
    anyone = Limits.fair_share(0, max_sessions=64, kv_budget=1000)
    assert (anyone.key_sessions, anyone.key_budget) == (64, 1000)
    assert Limits.fair_share(3, max_sessions=64, max_sessions_per_key=50).key_sessions == 50  # explicit wins
    with pytest.raises(ValueError, match="kv_budget"):
        Limits(kv_budget=0)


# ---- through the service: real reservations from the policy, nothing allocated on refusal ----------------------

def _service(**limits) -> SessionService:
    return SessionService(Engine(tiny_model(context=512)), eos_ids=(2,),
                          config=ServiceConfig(limits=Limits(**limits)))


def test_the_byte_budget_refuses_a_session_before_its_cache_is_allocated():
    async def main():
        probe = _service()
        full_bytes = probe.kv_reserve(probe.policies.resolve("full"))
        window = probe.policies.resolve("sink_window", {"sink": 4, "window": 28})
        window_bytes = probe.kv_reserve(window)
        assert window_bytes * 8 < full_bytes
        svc = _service(kv_budget=full_bytes + window_bytes)
        s = await svc.create("A", [5, 6, 7])
        async for _ in svc.generate("A", s.id, GenerateParams(max_tokens=300, ignore_eos=True)):
            pass
        live = svc.store.kv_live_bytes()
        assert 0 < live <= full_bytes  # the worst case it reserved bounds what it holds
        with pytest.raises(ResourceExhausted, match="KV budget") as e:
            await svc.create("B", [5], "full")
        assert e.value.limit == "kv_budget" and len(svc.store) == 1 and svc.store.kv_live_bytes() == live
        w = await svc.create("B", [5], "sink_window", {"sink": 4, "window": 28})  # a bounded policy still fits
        assert w.reserved_bytes == window_bytes and svc.store.kv_reserved_bytes() == full_bytes + window_bytes
        await svc.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(("name", "params", "what"), [
    ("sink_window", {"window": 1_000_000}, "sink + window = 1000004"),
    ("sink_window", {"sink": 500, "window": 13}, "sink + window = 513"),
    ("sink_window", {"window": 8, "spare": 513}, "spare = 513"),
    ("restore", {"window": 1_000_000}, "sink + window = 1000004"),
    ("restore", {"sink": 1000, "window": 8}, "sink + window = 1008"),
])
def test_windows_past_the_context_are_refused_at_create(name, params, what):
    async def main():
        svc = _service()
        with pytest.raises(InvalidArgument, match="exceeds the context of 512") as e:
            await svc.create("A", [1], name, params)
        assert what in e.value.message and len(svc.store) == 0
        ok = await svc.create("A", [1], name, {**params, "sink": 4, "window": 508, "spare": 0} if name == "sink_window"
                              else {**params, "sink": 4, "window": 508})
        assert ok.policy.window == 508  # the largest window that fits is accepted

    asyncio.run(asyncio.wait_for(main(), 30))


def test_with_one_key_a_refusal_names_the_servers_limit():
    """With API keys off (one owner) the per-key share is the whole server: refusals named a 'per API key' budget
    the operator never set, and /metrics counted them under kv_budget_per_key instead of kv_budget."""
    from kakeya_runtime.sessions.limits import plan_admission

    class S:
        def __init__(self, owner: str, reserved: int) -> None:
            self.owner, self.reserved_bytes = owner, reserved

    one = Limits.fair_share(1, max_sessions=2, kv_budget=100)
    held = [S("", 60)]
    with pytest.raises(ResourceExhausted, match="server's KV budget") as e:
        plan_admission(held, [True], "", 60, one)
    assert e.value.limit == "kv_budget"
    with pytest.raises(ResourceExhausted, match="KV budget of the server") as e:
        plan_admission([], [], "", 200, one)
    assert e.value.limit == "kv_budget"
    with pytest.raises(ResourceExhausted, match="server's limit of 2 sessions") as e:
        plan_admission([S("", 1), S("", 1)], [True, True], "", 1, one)
    assert e.value.limit == "sessions"
    two = Limits.fair_share(2, max_sessions=4, kv_budget=100)  # a real share: named as the key's
    with pytest.raises(ResourceExhausted, match="per API key") as e:
        plan_admission(held, [True], "", 60, two)
    assert e.value.limit == "kv_budget_per_key"
