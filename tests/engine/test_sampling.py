"""Sampling: pure functions over logits, seeded reproducibility, support restriction, parameter checks."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine import sampling
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.sampling import (
    NUCLEUS_GUESS,
    SamplingError,
    SamplingParams,
    draw,
    probs_from_logits,
    reference_support,
    sample,
    support,
)
from kakeya_runtime.models import native

# Tiny models: per-op work is far too small to split across threads, and on a shared 2-core machine a
# second OpenMP thread mostly waits on a busy core (see conftest.single_thread).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(params=["kernel", "reference"])
def impl(request, monkeypatch) -> str:
    """Each test below runs on our sampling kernels (csrc/sampling.cpp) and on the torch reference they keep."""
    if request.param == "reference":
        monkeypatch.setattr(sampling, "_kernels", lambda: False)
    return request.param


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


def test_top_k_restricts_support(impl):
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6, 0.0, -1.0, 2.5]])
    params = SamplingParams(temperature=1.0, top_k=3, seed=0)
    assert _draws(logits, params) == {0, 1, 2}
    kept = probs_from_logits(logits, params)
    assert (kept[0, 3:] == 0).all() and (kept[0, :3] > 0).all()
    assert _draws(logits, SamplingParams(temperature=1.0, top_k=0, seed=0)) >= {0, 1, 2, 3, 4, 7}  # 0 = off


def test_top_p_restricts_support(impl):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # Mass before token 2 is 0.8 >= 0.7, so only {0, 1} remain.
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    assert _draws(logits, params) == {0, 1}
    p = probs_from_logits(logits, params)
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert _draws(logits, SamplingParams(temperature=1.0, top_p=0.4, seed=0)) == {0}  # top token always stays
    assert _draws(logits, SamplingParams(temperature=1.0, top_p=1.0, seed=0)) == {0, 1, 2, 3}


def test_temperature_and_greedy(impl):
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


def _reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The textbook transform, over the whole sorted vocabulary in float64: temperature, top-k (ties with the k-th
    kept), top-p (a token goes once the mass before it reaches top_p), renormalised. (V,) -> (V,)."""
    x = logits.double()
    z = (x - x.max()) / params.temperature
    if params.top_k and params.top_k < x.numel():
        z = z.masked_fill(x < torch.topk(x, params.top_k).values[-1], float("-inf"))
    p = torch.softmax(z, 0)
    if params.top_p is not None and params.top_p < 1.0:
        mass = p.tolist()
        order = sorted(range(x.numel()), key=lambda i: (-mass[i], i))
        before = 0.0
        for rank, i in enumerate(order):
            if rank and before >= params.top_p:
                p[i] = 0.0
            before += mass[i]
        p = p / p.sum()
    return p


@pytest.mark.parametrize("params", [
    SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(0.9, top_p=0.8),
    SamplingParams(0.6, top_k=12, top_p=0.7), SamplingParams(2.0, top_p=0.999), SamplingParams(0.05, top_p=0.5),
])
def test_the_support_is_the_textbook_transform(params, impl):
    """Candidates only, not a sort of the vocabulary: the same tokens and (to float rounding) the same probabilities
    as the whole-vocabulary reference, each row alone whatever rows share the call."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g) * 2.5
    got = probs_from_logits(logits, params)
    for b in range(3):
        want = _reference(logits[b], params)
        assert torch.equal(got[b] > 0, want > 0), (b, got[b], want)
        torch.testing.assert_close(got[b].double(), want, atol=1e-6, rtol=1e-5)
        assert torch.equal(probs_from_logits(logits[b : b + 1], params)[0], got[b])  # the row alone: the same bits


def test_ties_at_the_boundaries(impl):
    """top-k keeps every logit tied with the k-th; top-p orders ties by the lower id, so of two tied tokens at its
    boundary the lower id stays."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert probs_from_logits(logits, SamplingParams(1.0, top_k=2))[0].gt(0).tolist() == [True, True, True, True, False]
    even = torch.tensor([[0.0, 0.0, 0.0, 0.0]]).log_softmax(-1)  # four tokens of 0.25
    ids, w = support(even[0], SamplingParams(1.0, top_p=0.5))
    assert ids.tolist() == [0, 1] and torch.allclose(w, torch.tensor([0.25, 0.25], dtype=torch.float64))


def test_a_nucleus_larger_than_the_first_guess(impl):
    """A flat distribution over a large vocabulary: the nucleus holds far more than NUCLEUS_GUESS tokens, and the
    candidates grow until they hold it (the same support as the reference)."""
    vocab = 8 * NUCLEUS_GUESS
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    params = SamplingParams(1.0, top_p=0.9)
    got = probs_from_logits(logits, params)[0]
    assert int((got > 0).sum()) > 4 * NUCLEUS_GUESS
    p = torch.softmax(logits[0].double(), 0)
    sorted_p, order = torch.sort(p, descending=True, stable=True)
    keep = int(((sorted_p.cumsum(0) - sorted_p) < 0.9).sum())
    assert set(torch.nonzero(got).flatten().tolist()) == set(order[:keep].tolist())


def test_draws_follow_the_support(impl):
    """Draws from `sample` match `probs_from_logits` (chi-square over 8k draws), and the same counts reject the
    distribution at a 10% higher temperature (power)."""
    logits = torch.randn(1, 24, generator=torch.Generator().manual_seed(5)) * 2.0
    params = SamplingParams(0.9, top_k=10, top_p=0.95)
    g = torch.Generator().manual_seed(6)
    counts = torch.zeros(24)
    for _ in range(8000):
        counts[int(sample(logits, params, g)[0])] += 1

    def z(p: torch.Tensor) -> float:
        e = p.double() * 8000
        keep = e > 0
        assert counts[~keep].sum() == 0
        dof = int(keep.sum()) - 1
        return float((((counts.double()[keep] - e[keep]) ** 2) / e[keep]).sum() - dof) / (2 * dof) ** 0.5

    assert z(probs_from_logits(logits, params)[0]) < 5.0
    assert z(probs_from_logits(logits, SamplingParams(0.99, top_k=10, top_p=0.95))[0]) > 5.0


def test_draw_never_picks_a_zero_weight_and_refuses_bad_weights(impl):
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0])
    assert {draw(w, g) for _ in range(400)} == {1, 3}
    for bad in (torch.zeros(3), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 1.0])):
        with pytest.raises(RuntimeError, match="sampling"):
            draw(bad, g)
    with pytest.raises(RuntimeError, match="maximum"):
        sample(torch.full((1, 4), float("nan")), SamplingParams(1.0), g)


def test_a_cold_temperature_keeps_the_candidates_few(monkeypatch):
    """At a low temperature most weights underflow to 0: tied at 0, they are not candidates (never drawable), so
    top-p orders the few that are left instead of the whole vocabulary (the reference's sorts counted)."""
    logits = torch.randn(1, 50_000, generator=torch.Generator().manual_seed(7)) * 4.0
    params = SamplingParams(0.05, top_p=0.99)
    sorted_sizes = []
    real_sort = torch.sort

    def counting_sort(t, *args, **kwargs):
        sorted_sizes.append(t.numel())
        return real_sort(t, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    reference_ids, _ = reference_support(logits[0], params)
    monkeypatch.undo()
    assert sorted_sizes and max(sorted_sizes) <= NUCLEUS_GUESS
    for ids in (reference_ids, support(logits[0], params)[0]):
        assert 1 <= ids.numel() <= 8 and int(ids[0]) == int(logits[0].argmax())
    torch.testing.assert_close(probs_from_logits(logits, params)[0].double(), _reference(logits[0], params),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(0.7), SamplingParams(0.7, top_p=0.95), SamplingParams(0.7, top_k=40),
    SamplingParams(0.7, top_k=40, top_p=0.95), SamplingParams(1.0, top_p=0.9), SamplingParams(1e-4, top_p=0.9),
    SamplingParams(50.0, top_p=0.99), SamplingParams(50.0, top_p=1 - 1e-12), SamplingParams(2.0, top_k=1),
])
def test_the_kernels_keep_the_references_support(params):
    """On vocabularies of real sizes (SmolLM2's 49,152, Gemma 3's 262,144; a tail past the vectors' width), every
    candidate rung the kernel lowers through (a top-p that needs the whole drawable vocabulary included): the same
    tokens as the torch reference, the weights to float rounding (the sums run in another order)."""
    g = torch.Generator().manual_seed(11)
    for row in (torch.randn(49_152, generator=g) * 3, torch.randn(262_144, generator=g) * 4,
                torch.randn(1_003, generator=g)):
        (ids, w), (ref_ids, ref_w) = support(row, params), reference_support(row, params)
        assert w.dtype == ref_w.dtype and w.shape == ref_w.shape
        if ref_ids is None:
            assert ids is None
            torch.testing.assert_close(w, ref_w, atol=0, rtol=1e-6)
            continue
        # near-equal weights may trade places in the top-p order: compare each token's weight
        assert sorted(ids.tolist()) == sorted(ref_ids.tolist())
        mine = dict(zip(ids.tolist(), w.tolist(), strict=True))
        torch.testing.assert_close(torch.tensor([mine[i] for i in ref_ids.tolist()], dtype=ref_w.dtype), ref_w,
                                   atol=0, rtol=1e-6)


def test_kernel_top_k_with_many_ties_and_infinities():
    """The top-k threshold is found through a buffer cut back as it fills: ten thousand logits tied at the k-th
    value, and -inf logits, keep exactly what the reference keeps."""
    row = torch.full((20_000,), 1.0)
    row[::7] = float("-inf")
    row[123], row[9_999] = 5.0, 4.0
    for k in (1, 2, 3, 50):
        ids, _ = support(row, SamplingParams(1.0, top_k=k))
        assert torch.equal(ids, reference_support(row, SamplingParams(1.0, top_k=k))[0]), k
    assert support(row, SamplingParams(1.0, top_k=3))[0].numel() == int((row >= 1.0).sum())


def test_kernel_draw_walks_the_blocks_in_order():
    """sample_draw's running sum over blocks of 1,024: u picks the first weight whose running sum passes u * total,
    in any block, and never a zero weight (a zero block included)."""
    w = torch.ones(5_000, dtype=torch.float64)
    w[1_024:2_048] = 0  # the second block holds nothing
    total = float(w.sum())
    for target in (0, 500, 1_023, 1_024, 2_500, 3_975):
        assert native.sample_draw(w, (target + 0.5) / total) == (target if target < 1_024 else target + 1_024)
    assert native.sample_draw(w, 1 - 2**-53) == 4_999
    assert native.sample_draw(torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.float32), 0.0) == 2
