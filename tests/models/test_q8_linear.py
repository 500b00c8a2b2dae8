"""Grouped int8 weights (GGUF Q8_0 blocks, both bundled models' LM head) multiplied in integers: kakeya::q8_linear.
Its numbers are rebuilt here in plain PyTorch from the definition in csrc/q8_linear.cpp (x rounded per group of 32 to
int16 on a power-of-two step, exact integer group sums, one fused multiply-add per group in order) and compared bit
for bit, for every row count, on every path this CPU has (AMX int8 tiles, AVX-512 VNNI, a row at a time), so a row's
bits depend on that row alone; and the result is close to the exact product."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.weights import pack_group_scales, pack_q8_tiles
from kakeya_runtime.models import native

SHAPES = [(576, 576), (80, 96), (1536, 640)]  # SmolLM2's width; an odd group count (3); Gemma 3's width


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (nearest even), as the kernel's fused multiply-add: the product is exact in fp64
    (24 + 24 bits); the sum's fp64 rounding error (TwoSum) decides the one case fp64 alone would get wrong, a sum
    exactly halfway between two fp32 values."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.float()
    up, down = torch.nextafter(r, torch.tensor(float("inf"))), torch.nextafter(r, torch.tensor(float("-inf")))
    above = (s == (r.double() + up.double()) / 2) & (err > 0)  # halfway to the next value up, and past it
    below = (s == (r.double() + down.double()) / 2) & (err < 0)
    exact = torch.where(above, up, torch.where(below, down, r))
    return torch.where(torch.isfinite(s) & torch.isfinite(err), exact, r)


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
              out_fp32: bool = False) -> torch.Tensor:
    """The kernel's numbers from the codes q (N, K) int8 and d (N, K/32) fp16, for x (M, K) bf16."""
    m, k = x.shape
    n, groups = q.shape[0], k // 32
    xf = x.double().view(m, groups, 32)
    big = xf.abs().amax(-1)
    finite = torch.isfinite(xf).all(-1)
    _, exponent = torch.frexp(torch.where(big > 0, big, torch.ones_like(big)))
    e = (exponent - 1).double()  # big in [2^e, 2^(e+1))
    xq = torch.round(torch.ldexp(xf, (14 - e).unsqueeze(-1)))  # exact scaling, then to nearest even
    xq = torch.where(((big == 0) | ~finite).unsqueeze(-1), torch.zeros_like(xq), xq).long()
    step = torch.ldexp(torch.ones_like(big), e - 14).float()
    step = torch.where(big == 0, torch.zeros_like(step), step)
    step = torch.where(finite, step, torch.full_like(step, float("nan")))
    g = torch.einsum("mgc,ngc->mng", xq, q.long().view(n, groups, 32))  # exact
    scale = d.float().unsqueeze(0) * step.unsqueeze(1)  # (M, N, groups), fp32 products
    acc = torch.zeros(m, n, dtype=torch.float32)
    for s in range(groups):
        acc = fma32(g[..., s].float(), scale[..., s], acc)
    if bias is not None:
        acc = acc + bias.float()
    return acc if out_fp32 else acc.to(torch.bfloat16)


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4).half()
    return q, d


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose groups span magnitudes from 1e-3 to 1e3 (so small values lose bits to their group's largest)."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen)]
    return (torch.randn(m, k, generator=gen) * spread).bfloat16()


@pytest.fixture(params=["amx", "vnni", "avx2", "rows"])
def route(request):
    """Each path in turn: AMX allowed (calls of 2+ rows take it where the CPU has it), then each vector path forced
    (a CPU without one runs the next it has: q8_path says which)."""
    kept = native.routes()
    native.set_routes(kept.attention_amx, request.param == "amx")
    before = native.q8_route("auto" if request.param == "amx" else request.param)
    try:
        yield request.param
    finally:
        native.q8_route(before)
        native.set_routes(kept.attention_amx, kept.linear_amx)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_row_count_gives_the_reference_bits(n, k, threads, route):
    q, d = weights(n, k, seed=n + k)
    qp, sz = pack_q8_tiles(q), pack_group_scales(d)
    x = activations(40, k, seed=k)
    x[3, :32] = 0  # a group of zeros
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    want = {(bias, fp32): reference(x, q, d, None if bias is None else b, fp32)
            for bias in (None, 1) for fp32 in (False, True)}
    if route != "amx":  # the forced path where this CPU has it (every x86 CPU we build for has AVX2)
        assert native.q8_path(4) == route or (route == "vnni" and native.q8_path(4) == "avx2")
    elif torch.ops.kakeya.amx_available():
        assert native.q8_path(4) == "amx"
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in range(1, 41):
            off = (3 * m) % (41 - m)
            for (bias, fp32), full in want.items():
                got = native.q8_linear(x[off : off + m], qp, sz, None if bias is None else b, out_fp32=fp32)
                assert torch.equal(got, full[off : off + m]), (m, off, bias, fp32)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("n", "k"), [(576, 576), (80, 96)])
def test_non_finite_and_extreme_inputs_give_the_reference_bits(n, k, route):
    """NaN and infinities in x make that row's outputs NaN (its group's step is NaN), in no other row; a non-finite d
    reaches its row's output as a float product would; tiny (subnormal bf16) and huge groups are rounded alike on
    every path."""
    q, d = weights(n, k, seed=7 * k)
    d[0, 0], d[17, 1], d[40, 2] = float("inf"), float("nan"), float("-inf")
    q[0, :32:2] = 0
    qp, sz = pack_q8_tiles(q), pack_group_scales(d)
    x = activations(24, k, seed=n)
    x[2, 5] = float("nan")
    x[7, 0] = float("inf")
    x[11, 3], x[11, 40] = float("inf"), float("-inf")
    x[13, :32] = torch.tensor(1e-39).bfloat16() * torch.arange(1, 33)  # subnormal bf16
    x[14, 32:64] = 3e38
    x[15, :] = torch.tensor(2.0**-133).bfloat16()
    for m in (1, 5, 24):
        for fp32 in (False, True):
            got = native.q8_linear(x[:m], qp, sz, out_fp32=fp32)
            want = reference(x[:m], q, d, out_fp32=fp32)
            assert torch.equal(got.isnan(), want.isnan()), (m, fp32)
            assert torch.equal(got[~want.isnan()], want[~want.isnan()]), (m, fp32)
    got = native.q8_linear(x, qp, sz, out_fp32=True)
    assert got[[2, 7, 11]].isnan().all() and not got[[0, 1, 3, 13, 14]][:, 41:].isnan().any()
    assert got[:, [0, 17, 40]].isnan().any(0).all()  # the non-finite d's reach their rows


def test_the_result_is_close_to_the_exact_product():
    """Against the product in fp64 of x and W = q * d: x's rounding to 15 bits of its group's largest value is
    finer than bf16's own, so the error is that of fp32 sums, far below a bf16 step of the output."""
    n, k = 1536, 640
    q, d = weights(n, k, seed=3)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    w = q.double() * d.double().repeat_interleave(32, 1)
    exact = x.double() @ w.T
    got = native.q8_linear(x, pack_q8_tiles(q), pack_group_scales(d), out_fp32=True).double()
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 2e-4


def test_dequant_is_the_weight_rounded_once_and_quant_linear_takes_grouped_weights_here():
    q, d = weights(80, 96, seed=11)
    qp, sz = pack_q8_tiles(q), pack_group_scales(d)
    w = (q.float().view(80, 3, 32) * d.float()[..., None]).view(80, 96).bfloat16()
    assert torch.equal(native.q8_dequant(qp, sz), w)
    assert torch.equal(native.quant_dequant(qp, sz, 8), w)
    rows = torch.tensor([5, 0, 79, 5])
    assert torch.equal(native.q8_dequant(qp, sz, rows), w[rows])
    x = activations(5, 96, seed=1)
    assert torch.equal(native.quant_linear(x, qp, sz, 8), native.q8_linear(x, qp, sz))
    with pytest.raises(RuntimeError, match="out of range"):
        native.q8_dequant(qp, sz, torch.tensor([80]))


def test_bad_shapes_are_refused_with_what_was_expected():
    q, d = weights(32, 64, seed=0)
    qp, sz = pack_q8_tiles(q), pack_group_scales(d)
    with pytest.raises(RuntimeError, match="x must be"):
        native.q8_linear(torch.zeros(2, 32).bfloat16(), qp, sz)
    with pytest.raises(RuntimeError, match="sz must be"):
        native.q8_linear(torch.zeros(2, 64).bfloat16(), qp, sz.float())
    with pytest.raises(RuntimeError, match="bias must be"):
        native.q8_linear(torch.zeros(2, 64).bfloat16(), qp, sz, torch.zeros(31))
