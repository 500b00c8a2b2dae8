"""The row-wise kernels (csrc/rowwise.cpp): RMSNorm, residual add + RMSNorm, RoPE on q/k (after Gemma's q/k norms).

Each is checked against a float64 reference, and for row invariance: a row's bits are the same alone or among any
number of rows, at any thread count, whatever its neighbours hold."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import Attention, RMSNorm, Rotary

DTYPES = (torch.float32, torch.bfloat16)


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2  # relative to the row's largest value


def ref_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    h = x.double()
    scale = 1.0 + w.double() if unit_offset else w.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos.double() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.double()


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= tol(dtype) * max(want.abs().max().item(), 1.0), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("c", [1, 7, 64, 576, 1153])
def test_rms_norm_matches_fp64_reference(dtype, unit_offset, c):
    gen = torch.Generator().manual_seed(c)
    x = (torch.randn(9, c, generator=gen) * 3).to(dtype)
    w = (torch.randn(c, generator=gen) * 0.5).to(dtype)
    close(native.rms_norm(x, w, 1e-6, unit_offset=unit_offset), ref_norm(x, w, 1e-6, unit_offset), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [5, 576, 640])
def test_add_rms_norm_is_the_rounded_sum_then_its_norm(dtype, c):
    gen = torch.Generator().manual_seed(c)
    x, r = (torch.randn(11, c, generator=gen) * 2).to(dtype), torch.randn(11, c, generator=gen).to(dtype)
    w = torch.randn(c, generator=gen).to(dtype)
    s, y = native.add_rms_norm(x, r, w, 1e-5, unit_offset=True)
    assert torch.equal(s, r + x)  # the sum as a separate add stores it
    assert torch.equal(y, native.rms_norm(s, w, 1e-5, unit_offset=True))
    close(y, ref_norm(s, w, 1e-5, True), dtype)


def qkv_case(b: int, t: int, h: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, t, (h + 2 * hk) * d + 3, generator=gen) * 2).to(dtype)[..., 3:]  # rows not at offset 0
    rotary = Rotary(d, 10000.0)
    cos, sin = rotary.cos_sin(torch.arange(100, 100 + t), dtype)
    return qkv, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 18, 64, 256])
@pytest.mark.parametrize("norms", [False, True])
def test_qkv_rope_matches_fp64_reference(dtype, d, norms):
    b, t, h, hk = 2, 5, 6, 2
    qkv, cos, sin = qkv_case(b, t, h, hk, d, dtype, d)
    gen = torch.Generator().manual_seed(1)
    qw, kw = torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)
    extra = {"q_norm": qw, "k_norm": kw, "eps": 1e-6, "unit_offset": True} if norms else {}
    q, k = native.qkv_rope(qkv, cos.expand(b, t, d), sin.expand(b, t, d), h, hk, **extra)
    assert q.shape == (b, h, t, d) and k.shape == (b, hk, t, d) and q.is_contiguous() and k.is_contiguous()
    q_in = qkv[..., : h * d].reshape(b, t, h, d).transpose(1, 2)
    k_in = qkv[..., h * d : (h + hk) * d].reshape(b, t, hk, d).transpose(1, 2)
    if norms:
        q_in, k_in = ref_norm(q_in, qw, 1e-6, True), ref_norm(k_in, kw, 1e-6, True)
    close(q, ref_rope(q_in, cos, sin), dtype)
    close(k, ref_rope(k_in, cos, sin), dtype)


@contextmanager
def num_threads(threads: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [13, 576, 1027])
def test_norm_rows_same_bits_in_any_call(dtype, c):
    """Rows alone, in calls of 1..N rows at any offset, at 1 and 2 threads, fused or not: the same bits."""
    gen = torch.Generator().manual_seed(c)
    n = 23
    x, r = (torch.randn(n, c, generator=gen) * 4).to(dtype), torch.randn(n, c, generator=gen).to(dtype)
    w = torch.randn(c, generator=gen).to(dtype)
    alone = torch.cat([native.rms_norm(x[i : i + 1], w, 1e-5) for i in range(n)])
    fused = [native.add_rms_norm(x[i : i + 1], r[i : i + 1], w, 1e-5) for i in range(n)]
    s_alone, y_alone = torch.cat([s for s, _ in fused]), torch.cat([y for _, y in fused])
    for threads in (1, 2):
        for size in (1, 2, 5, 16, n):
            for start in range(0, n - size + 1, max(1, size // 2)):
                sl = slice(start, start + size)
                with num_threads(threads):
                    got = native.rms_norm(x[sl], w, 1e-5)
                    s, y = native.add_rms_norm(x[sl], r[sl], w, 1e-5)
                assert torch.equal(got, alone[sl]), (threads, size, start)
                assert torch.equal(s, s_alone[sl]) and torch.equal(y, y_alone[sl])
    # a row's neighbours do not matter
    noisy = x.clone()
    noisy[1::2] = (torch.randn(n // 2, c, generator=gen) * 100).to(dtype)
    assert torch.equal(native.rms_norm(noisy, w, 1e-5)[0::2], alone[0::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [18, 64, 256])
@pytest.mark.parametrize("norms", [False, True])
def test_qkv_rope_rows_same_bits_in_any_call(dtype, d, norms):
    """A token's q/k: one sequence of T tokens, any sub-chunk of it, or one decode row per batch entry (per-row
    cos/sin), at 1 and 2 threads: the same bits."""
    t, h, hk = 13, 3, 1
    qkv, cos, sin = qkv_case(1, t, h, hk, d, dtype, d + 1)
    gen = torch.Generator().manual_seed(2)
    extra = {}
    if norms:
        extra = {"q_norm": torch.randn(d, generator=gen).to(dtype), "k_norm": torch.randn(d, generator=gen).to(dtype),
                 "eps": 1e-6, "unit_offset": True}

    def call(rows, c, s):  # rows (B, T', C), c/s (B, T', D)
        return native.qkv_rope(rows, c, s, h, hk, **extra)

    q_all, k_all = call(qkv, cos[None], sin[None])
    for threads in (1, 2):
        for size in (1, 4, t):
            for start in range(0, t - size + 1, 3):
                sl = slice(start, start + size)
                with num_threads(threads):
                    q, k = call(qkv[:, sl], cos[None, sl], sin[None, sl])
                assert torch.equal(q, q_all[:, :, sl]) and torch.equal(k, k_all[:, :, sl]), (threads, size, start)
        # decode rows: token i as batch row i with its own cos/sin row
        with num_threads(threads):
            q, k = call(qkv[0][:, None], cos[:, None], sin[:, None])
        assert torch.equal(q[:, :, 0], q_all[0].transpose(0, 1)) and torch.equal(k[:, :, 0], k_all[0].transpose(0, 1))


def test_fake_shapes_and_torch_compile():
    """engine.compiled traces these ops: their fake implementations give the real shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    native.load()
    b, t, h, hk, d = 2, 3, 4, 2, 16
    with FakeTensorMode():
        x, w = torch.empty(5, 32, dtype=torch.bfloat16), torch.empty(32, dtype=torch.bfloat16)
        assert native.rms_norm(x, w, 1e-5).shape == (5, 32)
        s, y = native.add_rms_norm(x, x, w, 1e-5)
        assert s.shape == y.shape == (5, 32) and y.dtype == torch.bfloat16
        qkv, cos = torch.empty(b, t, (h + 2 * hk) * d), torch.empty(b, t, d)
        q, k = native.qkv_rope(qkv, cos, cos, h, hk)
        assert q.shape == (b, h, t, d) and k.shape == (b, hk, t, d)

    norm = RMSNorm(32, 1e-5)
    attn = Attention(32, h, hk, d, bias=False, scale=d**-0.5, window=None)
    cos, sin = Rotary(d, 10000.0).cos_sin(torch.arange(t), torch.float32)

    def fn(x, res, qkv):
        s, y = norm.add_forward(x, res)
        q, k, _ = attn._split_rope(qkv, cos, sin)
        return norm(s) + y, q, k

    x, res = torch.randn(b, t, 32), torch.randn(b, t, 32)
    qkv = torch.randn(b, t, (h + 2 * hk) * d)
    with torch.no_grad():
        for got, want in zip(torch.compile(fn, fullgraph=True)(x, res, qkv), fn(x, res, qkv), strict=True):
            assert torch.equal(got, want)


def test_bad_inputs_raise():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="norm weight"):
        native.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.rms_norm(x.half(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        native.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        native.add_rms_norm(x, torch.randn(4, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="heads"):
        native.qkv_rope(torch.randn(1, 2, 10), torch.randn(1, 2, 4), torch.randn(1, 2, 4), 2, 1)
