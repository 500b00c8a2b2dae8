"""Close, idle TTL, LRU eviction: NOT_FOUND afterwards, counted by reason on /metrics."""

from __future__ import annotations

import time

import pytest
from kakeya import Client, ResourceExhausted, SessionNotFound

from kakeya_runtime.server.testing import SlowModel, running_server, tiny_model, tiny_served
from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import scrape_metrics as scrape


def test_metrics_endpoint_reports_the_session_lifecycle():
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        text = scrape(thread)
        for name in ("kakeya_session_active", "kakeya_session_kv_live_bytes", "kakeya_session_total", "kakeya_session_evicted_total",
                     "kakeya_cache_invariant_violations_total", "kakeya_session_history_tokens", "kakeya_generate_prefill_tokens",
                     "kakeya_generate_prefill_duration_seconds", "kakeya_generate_ttft_seconds", "kakeya_generate_decode_tokens_per_second"):
            assert f"# TYPE {name} " in text
        assert sample(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0

        s = client.create_session(initial_tokens=list(range(3, 43)))
        s.generate(max_tokens=5, ignore_eos=True).collect()
        s.append([7, 8])
        s.generate(max_tokens=5, ignore_eos=True).collect()
        text = scrape(thread)
        assert sample(text, "kakeya_session_active") == 1
        assert sample(text, "kakeya_session_kv_live_bytes") == s.info().kv_live_bytes > 0
        assert sample(text, "kakeya_generate_prefill_tokens_count") == 2
        assert sample(text, "kakeya_generate_prefill_tokens_sum") == 40 + 3  # 40, then 2 appended + 1 last sample
        assert sample(text, "kakeya_session_history_tokens_sum") == 40 + 47
        assert sample(text, "kakeya_generate_ttft_seconds_count") == 2
        assert sample(text, "kakeya_generate_decode_tokens_per_second_count") == 2

        s.close()
        text = scrape(thread)
        assert sample(text, "kakeya_session_active") == 0
        assert sample(text, "kakeya_session_kv_live_bytes") == 0
        assert sample(text, "kakeya_session_total", '{outcome="closed"}') == 1
        assert sample(text, "kakeya_session_evicted_total", '{reason="close"}') == 1


def test_idle_ttl_evicts_and_counts():
    with running_server(tiny_served(), idle_ttl_s=0.3, sweep_interval_s=0.05) as thread, \
            Client(thread.address) as client:
        touched = client.create_session(initial_tokens=[5])
        swept = client.create_session(initial_tokens=[6])
        time.sleep(0.5)
        # The background sweeper evicts without anyone touching the session...
        assert len(thread.server.service.store) == 0
        with pytest.raises(SessionNotFound, match="idle TTL"):
            touched.append([1])
        with pytest.raises(SessionNotFound, match="idle TTL"):
            swept.info()
        text = scrape(thread)
        assert sample(text, "kakeya_session_evicted_total", '{reason="ttl"}') == 2
        assert sample(text, "kakeya_session_total", '{outcome="evicted"}') == 2


def test_ttl_is_checked_on_access_even_before_the_sweeper_runs():
    with running_server(tiny_served(), idle_ttl_s=0.2, sweep_interval_s=60) as thread, \
            Client(thread.address) as client:
        s = client.create_session(initial_tokens=[5])
        s.info()
        time.sleep(0.35)
        with pytest.raises(SessionNotFound, match="idle TTL"):
            s.info()


def test_a_generating_session_is_not_idle():
    slow = SlowModel(tiny_model(), delay_s=0.05)
    with running_server(tiny_served(model=slow), idle_ttl_s=0.25, sweep_interval_s=0.05) as thread, \
            Client(thread.address) as client:
        s = client.create_session(initial_tokens=[5, 6])
        out = s.generate(max_tokens=12, ignore_eos=True).collect()  # ~0.6 s, longer than the TTL
        assert len(out) == 12
        assert s.info().history_length == 14


def test_lru_eviction_at_capacity():
    with running_server(tiny_served(), max_sessions=2) as thread, Client(thread.address) as client:
        a = client.create_session(initial_tokens=[1])
        b = client.create_session(initial_tokens=[2])
        a.append([3])  # a is now the most recently used
        c = client.create_session(initial_tokens=[4])
        with pytest.raises(SessionNotFound, match="least recently used"):
            b.info()
        assert a.info().history_length == 2
        assert c.info().history_length == 1
        text = scrape(thread)
        assert sample(text, "kakeya_session_evicted_total", '{reason="lru"}') == 1
        assert sample(text, "kakeya_session_active") == 2


def test_busy_sessions_are_never_evicted_for_capacity():
    slow = SlowModel(tiny_model(), delay_s=0.05)
    with running_server(tiny_served(model=slow), max_sessions=1) as thread, Client(thread.address) as client:
        s = client.create_session(initial_tokens=[1, 2])
        gen = s.generate(max_tokens=40, ignore_eos=True)
        it = iter(gen)
        next(it)  # generating now
        with pytest.raises(ResourceExhausted, match="busy"):
            client.create_session()
        gen.cancel()
        s.append([3])  # waits for the cancelled Generate to wind down
        assert client.create_session(initial_tokens=[9]).info().history_length == 1  # s evicted (LRU)
        with pytest.raises(SessionNotFound):
            s.info()
        assert thread.server.service.store.kv_live_bytes() == 0
