"""The sparse policy through the real in-process server and SDK (tiny fp32 model): a seeded session built turn by
turn equals one built in one shot, its counters reach GetSessionInfo and /metrics alike, and specs past the
context are refused before a session exists."""

from __future__ import annotations

import random

import pytest
import torch
from kakeya import Client, InvalidArgument, KvPolicy

from kakeya_runtime.server.testing import metric_value as sample
from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.server.testing import scrape_metrics as scrape

SPARSE = KvPolicy("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2})


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sparse_sessions_reproduce_and_report():
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        # turn by turn: appends and greedy replies, the cold tier filling across turns
        turns = client.create_session(initial_tokens=_tokens(40, 1), policy=SPARSE)
        history = _tokens(40, 1)
        for i in range(3):
            reply = turns.generate(max_tokens=5, ignore_eos=True).collect()
            piece = _tokens(30 + 7 * i, 10 + i)
            turns.append(piece)
            history += [*reply, *piece]
        turns_out = turns.generate(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True).collect()
        # one shot: the same history prefilled at once
        one = client.create_session(initial_tokens=history, policy=SPARSE)
        one_out = one.generate(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True).collect()
        assert one_out == turns_out and len(history) == 166

        info = one.info()
        assert info.policy.name == "sparse" and info.policy_label.startswith("sparse(2+16")
        sp = info.sparse
        assert sp is not None and len(sp.layers) == 2
        assert 0 < sp.total["blocks_selected"] < sp.total["blocks_scored"]
        assert 0 < sp.attended_fraction < 0.5
        assert sp.hot_bytes > 0 and sp.cold_bytes > 0 and sp.index_bytes > 0
        assert 0 < info.effective_attention_fraction < 0.3
        assert sp.total["queries"] == 2 * 2 * (166 + 29)  # layers x KV heads x query tokens
        assert client.create_session(initial_tokens=history).info().sparse is None  # full: no sparse stats
        fresh = client.create_session(initial_tokens=history, policy=SPARSE).info().sparse  # before a Generate
        assert fresh is not None and len(fresh.layers) == 2 and fresh.total["steps"] == 0
        assert fresh.hot_bytes == fresh.cold_bytes == fresh.index_bytes == 0  # no cache built yet: nothing held

        text = scrape(thread)
        for name in ("blocks_scored", "blocks_selected", "positions_attended", "positions_visible"):
            # /metrics holds every sparse Generate of the server: the three above plus the reference turns
            per_layer = [sample(text, f"kakeya_sparse_{name}_total", f'{{layer="{i}"}}') for i in range(2)]
            assert sum(per_layer) >= sp.total[name] > 0


def test_sparse_specs_past_the_context_are_refused():
    with running_server(tiny_served(context=128)) as thread, Client(thread.address) as client:
        for params in ({"window": 200}, {"block": 129}, {"sink": 100, "window": 40}):
            with pytest.raises(InvalidArgument, match="exceeds the context of 128"):
                client.create_session(policy=KvPolicy("sparse", params))
        with pytest.raises(InvalidArgument):
            client.create_session(policy=KvPolicy("sparse", {"topk": 0}))
        with pytest.raises(InvalidArgument, match="no head profile"):  # at creation: every Generate refused it once
            client.create_session([1, 2], policy=KvPolicy("sparse", {"heads": "profile"}))
        assert len(thread.server.service.store) == 0
