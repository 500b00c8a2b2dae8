"""Bad input gets a typed status and leaves the session exactly as it was (seed 000 §2.10)."""

from __future__ import annotations

import math

import pytest
from kakeya import (
    FailedPrecondition,
    InvalidArgument,
    KvPolicy,
    ResourceExhausted,
    SessionNotFound,
)

from kakeya_runtime.server.testing import TINY_VOCAB

CONTEXT = 512  # tiny_served's context


def _state(session):
    info = session.info(include_history=True)
    return info.history_length, info.cached_length, info.history_token_ids, info.generate_calls


@pytest.fixture
def primed(client):
    """A session that has generated once, so it has both a cache and pending tokens."""
    s = client.create_session(initial_tokens=[5, 6, 7, 8])
    s.generate(max_tokens=3, ignore_eos=True).collect()
    s.append([9])
    yield s
    s.close()


@pytest.mark.parametrize("bad", [[TINY_VOCAB], [1, 2, -1], [10**6], [3, TINY_VOCAB + 5, 4]])
def test_append_out_of_vocab_is_invalid_and_appends_nothing(primed, bad):
    before = _state(primed)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        primed.append(bad)
    assert _state(primed) == before


def test_empty_append_is_invalid(primed):
    before = _state(primed)
    with pytest.raises(InvalidArgument, match="at least one"):
        primed.append([])
    assert _state(primed) == before


def test_token_beyond_int32_is_refused_client_side(primed):
    before = _state(primed)
    with pytest.raises(InvalidArgument):
        primed.append([2**31])
    assert _state(primed) == before


def test_append_beyond_context_is_resource_exhausted_and_session_survives(primed):
    before = _state(primed)
    room = CONTEXT - before[0]
    with pytest.raises(ResourceExhausted, match="context"):
        primed.append([3] * (room + 1))
    assert _state(primed) == before
    assert primed.append([3] * room) == CONTEXT  # exactly full is fine
    with pytest.raises(ResourceExhausted):
        primed.generate(max_tokens=1).collect()  # no room left to generate into


def test_create_with_bad_initial_tokens_creates_nothing(client, server):
    store = server.server.service.store
    n = len(store)
    with pytest.raises(InvalidArgument):
        client.create_session(initial_tokens=[1, TINY_VOCAB])
    with pytest.raises(ResourceExhausted):
        client.create_session(initial_tokens=[1] * (CONTEXT + 1))
    assert len(store) == n


@pytest.mark.parametrize("max_tokens", [0, -1, -(2**31), CONTEXT + 1, 2**31 - 1])
def test_bad_max_tokens_is_invalid(primed, max_tokens):
    before = _state(primed)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        primed.generate(max_tokens=max_tokens).collect()
    assert _state(primed) == before


def test_generate_beyond_context_is_resource_exhausted_then_smaller_works(primed):
    primed.append([7] * (CONTEXT - primed.info().history_length - 6))  # leave room for 6 tokens
    before = _state(primed)
    room = CONTEXT - before[0]
    assert room == 6
    with pytest.raises(ResourceExhausted, match="room for"):
        primed.generate(max_tokens=room + 1).collect()
    assert _state(primed) == before
    assert len(primed.generate(max_tokens=room, ignore_eos=True).collect()) == room


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": -0.5},
        {"temperature": math.nan},
        {"temperature": 1000.0},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_p": 1.5},
        {"temperature": 1.0, "top_p": math.nan},
        {"temperature": 1.0, "top_k": -3},
        {"temperature": 1.0, "seed": 2**63},
        {"stop_tokens": [TINY_VOCAB]},
    ],
)
def test_invalid_sampling_is_invalid_argument(primed, sampling):
    before = _state(primed)
    with pytest.raises(InvalidArgument):
        primed.generate(max_tokens=4, **sampling).collect()
    assert _state(primed) == before


def test_negative_seed_is_refused_client_side(primed):
    with pytest.raises(InvalidArgument):
        primed.generate(max_tokens=4, temperature=1.0, seed=-1)


def test_unknown_session_is_not_found_everywhere(client):
    ghost = client.session("ses_" + "A" * 32)
    for call in (lambda: ghost.append([1]), lambda: ghost.generate(max_tokens=1).collect(), ghost.info, ghost.close):
        with pytest.raises(SessionNotFound):
            call()
    with pytest.raises(SessionNotFound):
        client.session("").info()


def test_closed_session_is_not_found_and_says_why(client):
    s = client.create_session(initial_tokens=[1, 2])
    sid = s.id
    s.close()
    s.close()  # idempotent on the handle
    with pytest.raises(SessionNotFound, match="was closed"):
        client.session(sid).append([3])
    with pytest.raises(SessionNotFound):
        client.session(sid).close()


def test_generate_on_empty_history_is_failed_precondition(client):
    with client.create_session() as s:
        with pytest.raises(FailedPrecondition, match="empty"):
            s.generate(max_tokens=2).collect()
        assert s.info().generate_calls == 0
        s.append([4])
        assert len(s.generate(max_tokens=2, ignore_eos=True).collect()) == 2


def test_unknown_policy_and_bad_params_are_invalid(client, server):
    n = len(server.server.service.store)
    with pytest.raises(InvalidArgument, match="unknown KV policy"):
        client.create_session(policy="sliding_window")
    with pytest.raises(InvalidArgument, match="no parameter"):
        client.create_session(policy=KvPolicy("full", {"window": 64}))
    assert len(server.server.service.store) == n
    with client.create_session(policy=KvPolicy("full")) as s:
        assert s.policy == KvPolicy("full", {})
        assert s.info().policy.name == "full"
    with client.create_session(policy="") as s:  # empty name: the default policy
        assert s.policy.name == "full"
