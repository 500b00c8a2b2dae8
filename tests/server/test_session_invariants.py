"""INV-1 / INV-2 are checked inside every mutation; a violation fails the session with
FAILED_PRECONDITION, frees it (NOT_FOUND afterwards) and counts kakeya_cache_invariant_violations_total{kind}."""

from __future__ import annotations

import time

import pytest
from kakeya import Client, FailedPrecondition, InvalidArgument, KvPolicy, SessionNotFound

from kakeya_runtime.kv.cache import FullLayerKV
from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape
from kakeya_runtime.sessions.policy import PolicyRegistry


class _OverCountingLayer(FullLayerKV):
    """Claims one position too many after its n-th write: a cache bug the session must catch."""

    fault_at: int = 0
    writes: int = 0

    def update_and_fetch(self, k, v, positions):
        out = super().update_and_fetch(k, v, positions)
        self.writes += 1
        if self.writes == self.fault_at:
            self.length += 1
        return out


class FaultyRegistry(PolicyRegistry):
    """Builds the real caches, then makes layer 0 of every "full" cache over-count at its 3rd write."""

    def build(self, engine, spec, capacity):
        cache = super().build(engine, spec, capacity)
        if spec.name == "full" and spec.idle_codec is not None and spec.idle_codec.kind == "e8":  # the marker
            layer = cache.layers[0]
            layer.__class__ = _OverCountingLayer
            layer.fault_at, layer.writes = 3, 0
        return cache


FAULTY = KvPolicy("full", {"idle_codec": "e8"})


@pytest.fixture
def thread():
    with running_server(tiny_served(), policies=FaultyRegistry()) as t:
        yield t


def _session_obj(thread, sid):
    return thread.server.service.store._sessions[sid]


def test_healthy_sessions_count_checks_and_no_violations(thread):
    with Client(thread.address) as client, client.create_session(initial_tokens=[3, 4, 5]) as s:
        s.generate(max_tokens=4, ignore_eos=True).collect()
        s.append([6])
        info = s.info()
        assert info.inv1_checks >= 6 and info.inv2_checks >= 6  # per committed token, per mutation
        assert info.inv1_violations == info.inv2_violations == 0
    text = scrape(thread)
    assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0
    assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv2"}') == 0


def test_inv1_violation_detected_on_append(thread):
    with Client(thread.address) as client:
        s = client.create_session(initial_tokens=[3, 4, 5])
        s.generate(max_tokens=3, ignore_eos=True).collect()
        _session_obj(thread, s.id).cache.layers[1].length += 1  # one layer runs ahead of the history
        with pytest.raises(FailedPrecondition, match="inv1"):
            s.append([6])
        with pytest.raises(SessionNotFound, match="invariant"):
            s.info()
        text = scrape(thread)
        assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 1
        assert sample(text, "kakeya_session_total", '{outcome="failed"}') == 1
        assert sample(text, "kakeya_session_kv_live_bytes") == 0


def test_inv2_violation_detected_on_generate(thread):
    with Client(thread.address) as client:
        s = client.create_session(initial_tokens=[3, 4, 5, 6])
        s.generate(max_tokens=3, ignore_eos=True).collect()
        obj = _session_obj(thread, s.id)
        obj.cache.trim(obj.cache.length - 1)  # positions went backwards on every layer
        obj.cached_length -= 1
        with pytest.raises(FailedPrecondition, match="inv2"):
            s.generate(max_tokens=2).collect()
        with pytest.raises(SessionNotFound):
            s.append([1])
        assert sample(scrape(thread), "kakeya_cache_invariant_violations_total", '{kind="inv2"}') == 1


def test_inv1_violation_inside_generation_fails_mid_stream(thread):
    with Client(thread.address) as client:
        s = client.create_session(initial_tokens=[3, 4, 5], policy=FAULTY)
        assert s.policy == KvPolicy("full", {"idle_codec": "e8", "idle_q": 38})
        received = []
        with pytest.raises(FailedPrecondition, match="inv1"):
            for tok in s.generate(max_tokens=10, ignore_eos=True):
                received.append(tok)
        assert len(received) == 2  # prefill (write 1), decode (write 2) fine; write 3 over-counts
        with pytest.raises(SessionNotFound):
            s.info()
        deadline = time.time() + 5
        while thread.server.service.store.kv_live_bytes() and time.time() < deadline:
            time.sleep(0.01)
        assert sample(scrape(thread), "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 1
        # Other sessions are unaffected.
        with client.create_session(initial_tokens=[7]) as ok:
            assert len(ok.generate(max_tokens=3, ignore_eos=True).collect()) == 3


def test_policy_params_are_validated_by_the_policy(thread):
    with Client(thread.address) as client, pytest.raises(InvalidArgument, match="bogus"):
        client.create_session(policy=KvPolicy("sink_window", {"bogus": 1}))
