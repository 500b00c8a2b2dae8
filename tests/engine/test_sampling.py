"""Sampling: pure functions over logits, seeded reproducibility, support restriction, parameter checks."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.sampling import (
    SamplingError,
    SamplingParams,
    filter_logits,
    probs_from_logits,
    sample,
)

# Tiny models: per-op work is far too small to split across threads, and on a shared 2-core machine a
# second OpenMP thread mostly waits on a busy core (see conftest.single_thread).
pytestmark = pytest.mark.usefixtures("single_thread")


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    g = params.make_generator()
    return {int(sample(logits, params, g)[0]) for _ in range(n)}


def test_seeded_sampling_is_reproducible(make_tiny_model):
    engine = Engine(make_tiny_model("llama"))
    prompt = torch.tensor([[5, 6, 7, 8]])

    def run(seed: int) -> list[int]:
        req = GenerateRequest(32, sampling=SamplingParams(temperature=1.0, seed=seed))
        return engine.generate(engine.new_cache(capacity=40), prompt, req).token_ids[0]

    assert run(123) == run(123)
    assert run(123) != run(124)  # 32 draws from a broad distribution: equal only by a ~0 chance
    greedy = engine.generate(engine.new_cache(capacity=40), prompt, GenerateRequest(32)).token_ids[0]
    assert run(123) != greedy


def test_top_k_restricts_support():
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6, 0.0, -1.0, 2.5]])
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    assert _draws(logits, params) == {0, 1, 2}
    filtered = filter_logits(logits, params)
    assert torch.isinf(filtered[0, 3:]).all() and torch.isfinite(filtered[0, :3]).all()
    assert _draws(logits, SamplingParams(temperature=1.0, top_k=0, seed=0)) >= {0, 1, 2, 3, 4, 7}  # 0 = off


def test_top_p_restricts_support():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # Mass before token 2 is 0.8 >= 0.7, so only {0, 1} remain.
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    assert _draws(logits, params) == {0, 1}
    p = probs_from_logits(logits, params)
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert _draws(logits, SamplingParams(temperature=1.0, top_p=0.4, seed=0)) == {0}  # top token always stays
    assert _draws(logits, SamplingParams(temperature=1.0, top_p=1.0, seed=0)) == {0, 1, 2, 3}


def test_temperature_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 2]
    one_hot = probs_from_logits(logits, SamplingParams())
    assert one_hot.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    cold = probs_from_logits(logits, SamplingParams(temperature=0.05))
    hot = probs_from_logits(logits, SamplingParams(temperature=5.0))
    assert cold[0, 1] > 0.99 and hot[0, 1] < 0.6


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
])
def test_invalid_parameters_raise(kwargs, message):
    with pytest.raises(SamplingError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
