"""kakeya::argmax_rows (csrc/argmax.cpp) gives torch.argmax's answer on every row: ties go to the first index
(within a lane, across lanes, across the threads' slices and in the tail), a NaN anywhere wins at its first place,
rows of -inf or of one value pick index 0, at any thread count; greedy sampling takes it."""

import pytest
import torch

from kakeya_runtime.engine import sampling
from kakeya_runtime.models import native

SLICE = 1 << 15  # argmax.cpp's kSlice


@pytest.fixture(scope="module", autouse=True)
def kernels():
    native.load()


def _same(x: torch.Tensor) -> None:
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1)), (native.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("v", [1, 15, 16, 17, 100, SLICE - 1, SLICE, SLICE + 3, 3 * SLICE + 17, 262_144])
def test_random_rows_of_every_length(v):
    g = torch.Generator().manual_seed(v)
    _same(torch.randn(3, v, generator=g))
    _same(torch.randint(-3, 4, (3, v), generator=g).float())  # many ties


def test_ties_go_to_the_first_index_wherever_they_fall():
    v = 3 * SLICE + 21
    for places in ([5, 6], [3, 19], [40, SLICE + 2], [SLICE + 7, 2 * SLICE], [v - 3, v - 1], [16, v - 2],
                   [2 * SLICE + 1, v - 1]):
        x = torch.zeros(1, v)
        x[0, places] = 7.0
        _same(x)
    _same(torch.full((2, v), -float("inf")))
    _same(torch.full((2, 33), 2.5))
    x = torch.full((1, 40), -1.0)
    x[0, 3], x[0, 20] = -0.0, 0.0  # equal values: the first
    _same(x)
    x[0, 35] = float("inf")
    _same(x)


def test_the_first_nan_wins():
    v = 2 * SLICE + 9
    for places in ([0], [7, 3], [20], [SLICE + 5], [v - 1], [v - 4, SLICE + 1]):
        x = torch.randn(2, v)
        x[0, 10] = 100.0
        x[0, places] = float("nan")
        out = native.argmax_rows(x)
        assert out[0] == min(places) and out[1] == x[1].argmax()
        _same(x[1:])


def test_strided_rows_and_any_thread_count():
    base = torch.randn(4, 5000)
    x = base[:, 100:4100]  # rows not contiguous with each other
    threads = torch.get_num_threads()
    try:
        answers = []
        for n in (1, 2):
            torch.set_num_threads(n)
            answers.append(native.argmax_rows(x))
            _same(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(answers[0], answers[1])


def test_bad_input_is_refused():
    for x in (torch.randn(3, 4, 5), torch.randn(3, 4).double(), torch.randn(3, 0), torch.randn(4, 3).t()):
        with pytest.raises(RuntimeError, match="argmax_rows"):
            native.argmax_rows(x)


def test_greedy_sampling_takes_it(monkeypatch):
    calls = []
    real = native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    logits = torch.randn(2, 49_152)
    assert torch.equal(sampling.greedy(logits), logits.argmax(-1))
    assert calls == [(2, 49_152)]
    assert torch.equal(sampling.greedy(logits.bfloat16()), logits.bfloat16().argmax(-1))  # other dtypes: torch's
    assert len(calls) == 1
