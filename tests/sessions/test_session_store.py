"""SessionStore on its own: ids, ownership, append-only history, TTL/LRU, and the invariant checks."""

from __future__ import annotations

import pytest

from kakeya_runtime.sessions.errors import (
    FailedPrecondition,
    InvalidArgument,
    Invariant,
    InvariantViolation,
    ResourceExhausted,
    SessionNotFound,
)
from kakeya_runtime.sessions.policy import PolicyRegistry, PolicySpec
from kakeya_runtime.sessions.store import EndReason, Outcome, SessionState, SessionStore

FULL = PolicySpec.parse("full")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def session_created(self) -> None:
        self.events.append("created")

    def session_ended(self, outcome: Outcome, reason: EndReason) -> None:
        self.events.append((outcome, reason))

    def invariant_violated(self, invariant: Invariant) -> None:
        self.events.append(invariant)


class FakeLayer:
    def __init__(self) -> None:
        self.length = 0
        self.nbytes = 100


class FakeCache:
    """What the store reads from a cache: per-layer lengths and bytes."""

    def __init__(self, num_layers: int = 3) -> None:
        self.layers = [FakeLayer() for _ in range(num_layers)]

    def layer_lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def advance(self, n: int) -> None:  # what a prefill/decode does to every layer
        for layer in self.layers:
            layer.length += n


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def rec():
    return Recorder()


@pytest.fixture
def store(clock, rec):
    return SessionStore(max_sessions=3, idle_ttl_s=60, observer=rec, clock=clock)


def test_ids_are_long_random_and_unique(store):
    ids = set()
    for _ in range(3):
        s = store.create("", FULL, 100)
        ids.add(s.id)
        store.close("", s.id)
    assert len(ids) == 3
    assert all(i.startswith("ses_") and len(i) == 4 + 32 for i in ids)  # 24 bytes = 192 bits, base64url


def test_owner_scoping(store):
    s = store.create("alice", FULL, 100, [1, 2])
    assert store.get("alice", s.id) is s
    with pytest.raises(SessionNotFound, match="not found"):
        store.get("bob", s.id)
    with pytest.raises(SessionNotFound):
        store.close("bob", s.id)
    store.close("alice", s.id)
    with pytest.raises(SessionNotFound, match="not found"):  # bob learns nothing about alice's ids
        store.get("bob", s.id)
    with pytest.raises(SessionNotFound, match="was closed"):
        store.get("alice", s.id)


def test_append_is_validated_and_atomic(store):
    s = store.create("", FULL, 10, [1, 2, 3])
    with pytest.raises(InvalidArgument):
        store.append(s, [])
    with pytest.raises(ResourceExhausted):
        store.append(s, list(range(8)))
    assert s.history == [1, 2, 3]
    assert store.append(s, [4] * 7) == 10
    with pytest.raises(ResourceExhausted):
        store.create("", FULL, 10, list(range(11)))


def test_generate_room_and_empty_history(store):
    empty = store.create("", FULL, 10)
    with pytest.raises(FailedPrecondition, match="empty"):
        store.begin_generate(empty, 1, None)
    s = store.create("", FULL, 10, [1] * 8)
    with pytest.raises(ResourceExhausted, match="room for 2"):
        store.begin_generate(s, 3, None)
    assert not s.generating and s.generate_calls == 0
    store.begin_generate(s, 2, None)
    assert s.generating and s.generate_calls == 1


def test_generation_bookkeeping_keeps_inv1(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.attach_cache(s, FakeCache())
    assert store.pending_tokens(s) == [5, 6, 7]
    s.cache.advance(3)  # prefill
    store.commit_generated(s, 50)
    s.cache.advance(1)  # decode feeds 50
    store.commit_generated(s, 51)
    store.finish_generate(s)
    assert s.history == [5, 6, 7, 50, 51] and s.cached_length == 4 and s.pending_length == 1
    store.append(s, [8])
    assert store.pending_tokens(s) == [51, 8]  # incremental prefill: last sample + appended
    assert s.inv1_checks == s.inv2_checks > 0


def test_inv1_detects_a_layer_out_of_step(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.attach_cache(s, FakeCache())
    s.cache.advance(3)
    s.cache.layers[2].length += 1  # one layer consumed a token the others did not
    with pytest.raises(InvariantViolation) as e:
        store.commit_generated(s, 9)
    assert e.value.invariant is Invariant.INV1 and "layer 2" in str(e.value)


def test_inv1_detects_an_engine_that_did_not_consume_the_history(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.attach_cache(s, FakeCache())
    s.cache.advance(2)  # prefill dropped a token
    with pytest.raises(InvariantViolation, match="inv1"):
        store.commit_generated(s, 9)


def test_inv1_after_generate_exactly_one_token_is_unbound(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.attach_cache(s, FakeCache())
    s.cache.advance(3)
    store.commit_generated(s, 9)
    s.cache.advance(1)  # the engine fed the final sample back: it must not
    with pytest.raises(InvariantViolation, match="inv1"):
        store.finish_generate(s)


def test_inv2_detects_positions_going_back(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.attach_cache(s, FakeCache())
    s.cache.advance(3)
    store.commit_generated(s, 9)
    s.cache.advance(-1)
    s.cached_length -= 1
    with pytest.raises(InvariantViolation) as e:
        store.check(s)
    assert e.value.invariant is Invariant.INV2


def test_inv2_detects_history_shrinking(store):
    s = store.create("", FULL, 100, [5, 6, 7])
    store.check(s)
    s.history.pop()
    with pytest.raises(InvariantViolation, match="history shrank"):
        store.check(s)


def test_fail_frees_and_counts(store, rec):
    s = store.create("", FULL, 100, [5])
    store.attach_cache(s, FakeCache())
    violation = InvariantViolation(Invariant.INV1, "test")
    store.fail(s, violation)
    assert s.state is SessionState.FAILED and s.cache is None and len(store) == 0
    assert rec.events[-2:] == [Invariant.INV1, (Outcome.FAILED, EndReason.FAILED)]
    with pytest.raises(SessionNotFound, match="invariant"):
        store.get("", s.id)


def test_lru_evicts_least_recently_used_idle_session(store, clock, rec):
    a, b, c = (store.create("", FULL, 100, [i]) for i in range(3))
    clock.t += 1
    store.get("", a.id)  # touch a
    d = store.create("", FULL, 100)
    assert b.state is SessionState.EVICTED and b.cache is None
    assert {s.id for s in (a, c, d)} == {s.id for s in store._sessions.values()}
    assert (Outcome.EVICTED, EndReason.LRU) in rec.events
    with pytest.raises(SessionNotFound, match="least recently used"):
        store.get("", b.id)


def test_busy_sessions_are_skipped_by_lru(store):
    sessions = [store.create("", FULL, 100, [i]) for i in range(3)]
    for s in sessions:
        store.begin_op(s)
    with pytest.raises(ResourceExhausted, match="busy"):
        store.create("", FULL, 100)
    store.end_op(sessions[1])
    store.create("", FULL, 100)
    assert sessions[1].state is SessionState.EVICTED


def test_ttl(store, clock, rec):
    a = store.create("", FULL, 100, [1])
    b = store.create("", FULL, 100, [2])
    store.begin_op(b)  # busy: never idle
    clock.t += 61
    assert store.sweep() == 1
    assert a.state is SessionState.EVICTED and b.state is SessionState.ACTIVE
    assert (Outcome.EVICTED, EndReason.TTL) in rec.events
    store.end_op(b)  # touches
    clock.t += 30
    assert store.snapshot("", b.id).idle_s == 30  # idle time before this call
    assert store.snapshot("", b.id).idle_s == 30  # ...which is a read, not a use: a monitor keeps nothing alive
    clock.t += 31
    with pytest.raises(SessionNotFound, match="idle TTL"):  # expiry is enforced on access too
        store.get("", b.id)


def test_close_while_busy_defers_freeing(store):
    s = store.create("", FULL, 100, [1])
    store.attach_cache(s, FakeCache())
    store.begin_op(s)
    store.close("", s.id)
    assert s.cache is not None  # still in use by the running call
    store.end_op(s)
    assert s.cache is None


def test_snapshot_and_live_bytes(store):
    s = store.create("", FULL, 100, [1, 2])
    assert store.kv_live_bytes() == 0  # no cache until the first Generate
    store.attach_cache(s, FakeCache())
    snap = store.snapshot("", s.id, include_history=True)
    assert snap.history == (1, 2) and snap.kv_live_bytes == 300 == store.kv_live_bytes()
    assert store.snapshot("", s.id).history is None


def test_policy_registry():
    reg = PolicyRegistry()
    assert reg.names() == ["full", "sink_window", "restore", "sparse"]  # the default first
    assert reg.resolve("", None) == PolicySpec.parse("full") and reg.resolve("", None).params == {}
    # Struct numbers arrive as floats: normalised to ints, defaults filled in.
    spec = reg.resolve("sink_window", {"window": 8.0, "sink": "2"})
    assert spec.params == {"sink": 2, "window": 8, "codec": "identity", "spare": 0}
    assert spec.label == "sink_window(2+8)"
    restore = reg.resolve("restore", {"granularity": "per_turn", "codec": "d4"})
    assert restore.params["granularity"] == "per_turn" and restore.params["q"] == 38
    with pytest.raises(InvalidArgument, match="unknown KV policy 'sliding'"):
        reg.resolve("sliding", {})
    with pytest.raises(InvalidArgument, match="no parameter"):
        reg.resolve("full", {"x": 1})
    for bad in ({"window": 0}, {"sink": -1}, {"window": True}, {"window": 2.5}, {"codec": "d5"}, {"codec": "d4", "q": 10**6},
                {"idle_codec": "zip"}):
        with pytest.raises(InvalidArgument):
            reg.resolve("sink_window", bad)
    with pytest.raises(InvalidArgument, match="granularity"):
        reg.resolve("restore", {"granularity": "per_token"})


def test_policy_registry_checks_codecs_against_the_model(make_tiny_config):
    reg = PolicyRegistry()
    odd = make_tiny_config("llama", head_dim=12)  # not a power of two: no lattice codec fits
    assert reg.resolve("sink_window", {"codec": "d4"}).codec.kind == "d4"  # no model: name and range only
    with pytest.raises(InvalidArgument, match="head_dim"):
        reg.resolve("sink_window", {"codec": "d4"}, odd)
    with pytest.raises(InvalidArgument, match="head_dim"):
        reg.resolve("full", {"idle_codec": "e8"}, odd)
    assert reg.resolve("full", {"idle_codec": "identity"}, odd).idle_codec.kind == "identity"


def test_policy_registry_can_restrict_the_policies():
    reg = PolicyRegistry(["full", "sink_window"])
    assert reg.names() == ["full", "sink_window"]
    with pytest.raises(InvalidArgument, match="available: full, sink_window"):
        reg.resolve("restore")
    with pytest.raises(ValueError):
        PolicyRegistry(["sink_window"])  # the default must stay
    with pytest.raises(ValueError):
        PolicyRegistry(["full", "bogus"])
