"""The one attention computation against a plain reference (K/V repeated per query head, fp64 softmax), on our
kernel (the default) and on PyTorch's (the sdpa backend)."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import attend, attention_mask


@pytest.fixture(params=["native", "sdpa"], autouse=True)
def backend(request):
    native.set_backend(request.param)
    yield request.param
    native.set_backend("native")


def reference(q, k, v, q_pos, k_pos, scale, window, sink):
    groups = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(groups, dim=1)
    vr = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ kr.transpose(-1, -2) * scale  # (B, H, T, S)
    scores = scores.masked_fill(~attention_mask(q_pos, k_pos, window, sink), float("-inf"))
    return torch.softmax(scores, dim=-1) @ vr


CASES = [  # (heads, kv heads, new tokens, keys, window, sink)
    (9, 3, 1, 700, None, 0),  # grouped decode over a long cache
    (9, 3, 17, 300, None, 0),  # a chunk appended to a cache: masked, grouped
    (8, 2, 12, 200, 64, 4),  # sink + window rule on a chunk
    (4, 4, 5, 40, None, 0),  # no grouping (MHA)
    (6, 2, 33, 33, None, 0),  # a fresh prompt: the causal kernel
]


@pytest.mark.parametrize(("h", "hk", "t", "s", "window", "sink"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_matches_reference(h, hk, t, s, window, sink, dtype):
    gen = torch.Generator().manual_seed(h * 1000 + t)
    q = torch.randn(2, t, h, 16, generator=gen).transpose(1, 2).to(dtype)  # (B, H, T, D), strided like the model's
    k = torch.randn(2, hk, s, 16, generator=gen).to(dtype)
    v = torch.randn(2, hk, s, 16, generator=gen).to(dtype)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    want = reference(q, k, v, q_pos, k_pos, 0.25, window, sink)
    out, row = attend(q, k, v, q_pos, k_pos, scale=0.25, window=window, sink=sink)
    assert row is None and out.shape == (2, h, t, 16) and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    traced, row = attend(q, k, v, q_pos, k_pos, scale=0.25, window=window, sink=sink, trace=True)
    torch.testing.assert_close(traced.double(), want, atol=tol, rtol=tol)
    assert row.shape == (2, h, s)


def test_grouped_decode_reads_a_sliced_cache():
    """Decode attends over the filled prefix of a preallocated buffer (a non-contiguous view)."""
    buf_k, buf_v = torch.randn(1, 3, 64, 16), torch.randn(1, 3, 64, 16)
    k, v = buf_k[:, :, :41], buf_v[:, :, :41]
    q = torch.randn(1, 9, 1, 16)
    pos = torch.arange(41)
    out, _ = attend(q, k, v, pos[-1:], pos, scale=0.3, window=None)
    torch.testing.assert_close(out.double(), reference(q, k, v, pos[-1:], pos, 0.3, None, 0), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("q_pos", "k_pos"), [
    (torch.arange(20, 26), torch.arange(30)),  # queries before the newest keys: the general masked path
    (torch.arange(40, 46), torch.cat((torch.arange(4), torch.arange(30, 46)))),  # a gapped prefix, then the chunk
    (torch.tensor([40, 42, 41]), torch.cat((torch.arange(10), torch.tensor([40, 42, 41])))),  # not increasing
])
def test_chunk_paths_match_reference(q_pos, k_pos):
    """A chunk over a cache takes the two-call (prefix + causal chunk) path only when the keys really are the
    prefix then the chunk; every shape of positions gives the reference result."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 6, q_pos.shape[0], 16, generator=gen)
    k, v = torch.randn(2, 1, 2, k_pos.shape[0], 16, generator=gen)
    out, _ = attend(q, k, v, q_pos, k_pos, scale=0.3, window=None)
    torch.testing.assert_close(out.double(), reference(q, k, v, q_pos, k_pos, 0.3, None, 0), atol=2e-5, rtol=2e-5)
