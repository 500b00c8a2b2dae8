"""An engine error after a Generate began leaves the session as it was before the call: the cache is rolled
back to the last committed token (or rebuilt from the history when a ring cannot trim that far), the call
answers INTERNAL, no invariant violation is counted, and the next Generate gives exactly the tokens a fresh
session with the same history gives."""

from __future__ import annotations

import pytest
from kakeya import Client, InternalError, KvPolicy

from kakeya_runtime.kv.cache import FullLayerKV, SlidingLayerKV
from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape
from kakeya_runtime.sessions.policy import PolicyRegistry


class InjectedFault(RuntimeError):
    pass


def _failing(layer_cls):
    class Failing(layer_cls):
        """Raises at its n-th write, after the layers before it have already stored the step's K/V."""

        fail_at = 0
        writes = 0

        def update_and_fetch(self, k, v, positions):
            self.writes += 1
            if self.writes == self.fail_at:
                raise InjectedFault("injected engine fault")
            return super().update_and_fetch(k, v, positions)

    return Failing


class FaultyRegistry(PolicyRegistry):
    """The first "full" cache whose idle codec is e8 (the marker) fails in its last layer at the write `fail_at`
    (a cache rebuilt after the fault is healthy)."""

    fail_at = 2
    armed = True

    def build(self, engine, spec, capacity):
        cache = super().build(engine, spec, capacity)
        if self.armed and spec.name == "full" and spec.idle_codec is not None and spec.idle_codec.kind == "e8":
            self.armed = False
            layer = cache.layers[-1]
            layer.__class__ = _failing(SlidingLayerKV if isinstance(layer, SlidingLayerKV) else FullLayerKV)
            layer.fail_at, layer.writes = self.fail_at, 0
        return cache


FAULTY = KvPolicy("full", {"idle_codec": "e8"})
HISTORY = [(7 * i) % 90 + 3 for i in range(40)]  # past the tiny Gemma's 8-token sliding window


def _state(session):
    info = session.info(include_history=True)
    return list(info.history_token_ids), info.history_length


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(("fail_at", "committed"), [(1, 0), (2, 1), (5, 4)])  # prefill; first / fourth decode step
def test_engine_error_rolls_back_and_the_session_goes_on(kind, fail_at, committed):
    registry = FaultyRegistry()
    registry.fail_at = fail_at
    with running_server(tiny_served(kind), policies=registry) as thread, Client(thread.address) as client:
        s = client.create_session(initial_tokens=HISTORY, policy=FAULTY)
        got = []
        with pytest.raises(InternalError, match="rolled back"):
            for tok in s.generate(max_tokens=8, ignore_eos=True, seed=1, temperature=0.7):
                got.append(tok)
        assert len(got) == committed  # tokens streamed before the fault stay committed, nothing else
        history, length = _state(s)
        assert history == HISTORY + got and length == len(HISTORY) + committed
        # A full cache trims back. Gemma's sliding rings keep kv.cache.SLIDING_SPARE spare slots, so a decode step's
        # fault trims back too; a fault in the 40-token prefill has overwritten what a trim needs, so the rings are
        # dropped and the next Generate rebuilds them from the history.
        kept = thread.server.service.store._sessions[s.id].cache is not None
        assert kept == (kind == "llama" or fail_at > 1)
        after = s.generate(max_tokens=6, ignore_eos=True, seed=3, temperature=0.7).collect()
        with client.create_session(initial_tokens=history) as fresh:
            assert fresh.generate(max_tokens=6, ignore_eos=True, seed=3, temperature=0.7).collect() == after
        text = scrape(thread)
        assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0
        assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv2"}') == 0


def test_tiny_temperature_is_exact_not_an_error(client):
    """Any temperature in the documented range (0, 100] samples: 1e-40 is the argmax, not NaN."""
    with client.create_session(initial_tokens=HISTORY) as s, client.create_session(initial_tokens=HISTORY) as g:
        tiny = s.generate(max_tokens=8, ignore_eos=True, seed=5, temperature=1e-40).collect()
        assert tiny == g.generate(max_tokens=8, ignore_eos=True).collect()
