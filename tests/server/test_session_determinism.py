"""INV-3 and incremental prefill, end to end through the SDK.

INV-3: with a fixed seed the generated stream is bit-identical however the history was built: one
AppendTokens, N single-token appends, CreateSession initial tokens, or a mix, across turns too.
The model fixture is parametrized: adding a real model is one entry in MODELS.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from kakeya import Client

from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.sampling import SamplingParams
from kakeya_runtime.server.grpc_app import ServedModel, ServerThread
from kakeya_runtime.server.testing import running_server, tiny_served


def _real(source: str) -> Callable[[], ServedModel]:
    def load() -> ServedModel:
        from kakeya_runtime.models.loader import ModelLoadError, load_model

        try:
            return ServedModel.from_loaded(load_model(source, dtype=torch.bfloat16), source)
        except ModelLoadError as e:  # the bundled weights package is not installed here
            pytest.skip(f"{source} unavailable: {e}")

    return load


MODELS: dict[str, Callable[[], ServedModel]] = {
    "tiny-llama": lambda: tiny_served("llama"),
    "tiny-gemma3": lambda: tiny_served("gemma3"),  # sliding-window ring caches on 2 of 3 layers
}
_HAS_LOADER = importlib.util.find_spec("kakeya_runtime.models.loader") is not None
# Bundled real models (deselect with -m "not real_model"); fewer sampled tokens keep them ~10 s each.
REAL_MODELS = {"smollm2": _real("smollm2"), "gemma3-270m": _real("gemma3-270m")}


@pytest.fixture(scope="module", params=list(MODELS) + [
    pytest.param(name, marks=[pytest.mark.real_model, pytest.mark.skipif(not _HAS_LOADER, reason="no loader yet")])
    for name in REAL_MODELS
])
def model_server(request) -> Iterator[ServerThread]:
    factory = MODELS.get(request.param) or REAL_MODELS[request.param]
    with running_server(factory()) as thread:
        thread.real = request.param not in MODELS
        thread.max_tokens = 4 if thread.real else 12  # real decode steps are ~50x dearer here
        yield thread


def _histories(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    lo = 3  # skip the tiny tokenizer's special ids; any id is legal, this just keeps histories "text-like"
    return [[rng.randrange(lo, vocab) for _ in range(n)] for n in (1, 37, 300)]


SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 20240601, "ignore_eos": True}


def _build(client: Client, shape: str, history: list[int]):
    if shape == "one_append":
        s = client.create_session()
        s.append(history)
    elif shape == "single_token_appends":
        s = client.create_session()
        for t in history:
            s.append([t])
    elif shape == "initial_tokens":
        s = client.create_session(initial_tokens=history)
    elif shape == "initial_then_append":
        half = len(history) // 2
        s = client.create_session(initial_tokens=history[:half])
        if history[half:]:
            s.append(history[half:])
    else:
        raise ValueError(shape)
    return s


SHAPES = ("one_append", "single_token_appends", "initial_tokens", "initial_then_append")


def test_inv3_same_stream_however_history_was_built(model_server):
    with Client(model_server.address) as client:
        vocab = client.model_info().vocab_size
        for history in _histories(vocab):
            streams = {}
            for shape in SHAPES:
                with _build(client, shape, history) as s:
                    assert s.info().history_length == len(history)
                    gen = s.generate(max_tokens=model_server.max_tokens, **SAMPLED)
                    streams[shape] = gen.collect()
                    assert gen.stats.prefill_tokens == len(history)
            assert len(set(map(tuple, streams.values()))) == 1, streams
            if model_server.real:
                continue
            # A repeat with the same seed is identical too.
            with client.create_session(initial_tokens=history) as s:
                assert s.generate(max_tokens=model_server.max_tokens, **SAMPLED).collect() == streams["one_append"]


def test_inv3_holds_across_turns(model_server):
    with Client(model_server.address) as client:
        vocab = client.model_info().vocab_size
        h1, h2, h3 = _histories(vocab)
        turns = [h2, h1, h3[:50]]
        outputs = []
        shapes = ("one_append", "single_token_appends", "initial_then_append")
        for shape in shapes[:2] if model_server.real else shapes:
            with client.create_session() as s:
                out = []
                for i, turn in enumerate(turns):
                    if shape == "one_append":
                        s.append(turn)
                    elif shape == "single_token_appends":
                        for t in turn:
                            s.append([t])
                    else:
                        s.append(turn[: len(turn) // 2 or 1])
                        if turn[len(turn) // 2 or 1:]:
                            s.append(turn[len(turn) // 2 or 1:])
                    gen = s.generate(max_tokens=model_server.max_tokens, **{**SAMPLED, "seed": 7 + i})
                    out.append(gen.collect())
                    # Incremental prefill: only the turn plus the previous turn's last sampled token.
                    assert gen.stats.prefill_tokens == len(turn) + (1 if i else 0)
                outputs.append(out)
        assert all(out == outputs[0] for out in outputs)


def test_incremental_prefill_matches_direct_engine_and_prefills_only_the_delta(server, client):
    """Multi-turn through the server equals the engine driven by hand with the same pieces."""
    h1, a2, a3 = [11, 12, 13, 14, 15] * 8, [21, 22, 23], [31] * 20
    with client.create_session(initial_tokens=h1) as s:
        g1 = s.generate(max_tokens=6, ignore_eos=True)
        out1 = g1.collect()
        s.append(a2)
        info = s.info()
        assert info.cached_length == len(h1) + len(out1) - 1  # the last sample is not in the KV
        assert info.history_length == len(h1) + len(out1) + len(a2)
        g2 = s.generate(max_tokens=5, ignore_eos=True)
        out2 = g2.collect()
        s.append(a3)
        g3 = s.generate(max_tokens=4, ignore_eos=True)
        out3 = g3.collect()
        assert [g.stats.prefill_tokens for g in (g1, g2, g3)] == [len(h1), len(a2) + 1, len(a3) + 1]
        final = s.info(include_history=True)
        assert list(final.history_token_ids) == h1 + out1 + a2 + out2 + a3 + out3
        assert final.cached_length == final.history_length - 1

    engine = Engine(server.server.served.model)
    cache = engine.new_cache(capacity=512)
    ref = []
    pending = h1
    for n, appended in ((6, a2), (5, a3), (4, None)):
        r = engine.generate(cache, torch.tensor([pending]), GenerateRequest(n, sampling=SamplingParams()))
        ref.append(r.token_ids[0])
        pending = [r.token_ids[0][-1], *(appended or [])]
    assert ref == [out1, out2, out3]
