"""Our quantized projection kernel (kakeya::quant_linear): int4 / int5 / int8 weights dequantized to bf16 inside the kernel,
then multiplied as kakeya::linear multiplies bf16 weights. Its result is linear(x, W')'s bit for bit (W' the
kernel's own dequantization; int8: over the codes, then scaled), a row's bits do not depend on the rows beside it or the thread count, on either route
(AMX tiles, or the AVX-512 / at::vec path CPUs without AMX take), and it is right against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.weights import (
    pack_group_scales,
    pack_int5,
    pack_scales,
    pack_tiles,
    quantize_int4,
    quantize_int5,
    quantize_int8,
)
from kakeya_runtime.models import native

SHAPES = [(960, 576), (576, 1536), (3072, 576), (48, 64), (16, 32)]  # SmolLM2's qkv, down, gate/up; small
ROWS = (1, 2, 3, 7, 16, 31, 32, 33, 64, 200, 512)


def quantized(n: int, k: int, bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, sz) in the kernel's layout and the float weight they came from."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    if bits == 4:
        codes, sz = quantize_int4(w, dtype=torch.float32)
        return pack_tiles(codes, 4), pack_scales(sz), w
    if bits == 5:
        codes, d = quantize_int5(w)
        return pack_int5(codes), pack_group_scales(d), w
    q, scales = quantize_int8(w)
    return pack_tiles(q, 8), scales, w


def dequant_reference(n: int, k: int, bits: int, seed: int = 0) -> torch.Tensor:
    """W' from the codes in plain torch: fp32 (q - 8) * scale + zero (int4), (q - 16) * d (int5) or q * scale (int8),
    rounded to bf16."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    if bits == 4:
        codes, sz = quantize_int4(w, dtype=torch.float32)
        sz = sz.transpose(0, 1).float()  # (N, K/32, 2)
        return ((codes.view(n, k // 32, 32).float() - 8) * sz[..., :1] + sz[..., 1:]).view(n, k).bfloat16()
    if bits == 5:
        codes, d = quantize_int5(w)
        return ((codes.view(n, k // 32, 32).float() - 16) * d.float()[..., None]).view(n, k).bfloat16()
    q, scales = quantize_int8(w)
    return (q.float() * scales.float()[:, None]).bfloat16()


@pytest.fixture(params=["amx", "avx512"])
def route(request):
    """Each projection route in turn (on a CPU without AMX both are the AVX-512 / at::vec path)."""
    kept = native.routes()
    native.set_routes(kept.attention_amx, request.param == "amx")
    amx = request.param == "amx" and bool(torch.ops.kakeya.amx_available())
    assert native.quant_path(4) == ("amx" if amx else "avx2" if native.linear_path(torch.bfloat16, 64, 64) == "avx2"
                                    else "panels")
    try:
        yield request.param
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_dequantized_weights_are_the_plain_formula(n, k, bits):
    """The weights' values: the affine (int4) or scaled (int8) value rounded once to bf16 (int4's fused
    multiply-add may round differently from torch's separate multiply and add: at most one bf16 step), and any rows
    of it alone are the same bits as in the whole."""
    q, sz, _ = quantized(n, k, bits)
    got = native.quant_dequant(q, sz, bits)
    want = dequant_reference(n, k, bits)
    assert got.shape == (n, k) and got.dtype == torch.bfloat16
    ulp = want.float().abs() * 2.0**-7 + 1e-30
    assert ((got.float() - want.float()).abs() <= ulp).all()
    if bits == 5:  # an fp16 d times a 5-bit integer is exact in fp32: one rounding, the same bits
        assert torch.equal(got, want)
    rows = torch.tensor([0, n - 1, 5 % n, n // 2, 0])
    assert torch.equal(native.quant_dequant(q, sz, bits, rows), got[rows])


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_equals_linear_on_the_dequantized_weights(n, k, bits, route):
    """int4: y is kakeya::linear(x, W') bit for bit, W' the kernel's dequantized weights; int8: kakeya::linear's
    fp32 sums over the codes (exact in bf16) times the row scales plus bias in one fused multiply-add, rounded once.
    With and without bias, for every row count (both AMX paths: few rows with W' tiles dequantized per step, many
    rows with W' panels dequantized per call)."""
    q, sz, w = quantized(n, k, bits, seed=n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(512, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    if bits in (4, 5):
        wd = native.quant_dequant(q, sz, bits)

        def want(xs, bias=None):
            return native.linear(xs, wd, bias)
    else:
        codes = quantize_int8(w)[0].bfloat16()

        def want(xs, bias=None):
            acc = native.linear(xs, codes, out_fp32=True).double()
            fused = acc * sz.double() + (0.0 if bias is None else bias.double())  # exact: fma before its rounding
            return fused.float().bfloat16()
    for m in ROWS:
        assert torch.equal(native.quant_linear(x[:m], q, sz, bits), want(x[:m])), (m, route)
    assert torch.equal(native.quant_linear(x[:40], q, sz, bits, b), want(x[:40], b))
    assert torch.equal(native.quant_linear(x[:3], q, sz, bits, b), want(x[:3], b))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536)])
def test_a_row_gets_the_same_bits_in_any_call(n, k, bits, threads, route):
    """Row i of a 512-row call equals row i computed in calls of any size at any offset, on 1 or 2 threads."""
    q, sz, _ = quantized(n, k, bits, seed=n)
    x = torch.randn(512, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    whole = native.quant_linear(x, q, sz, bits)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in ROWS:
            for off in (0, 3, 300):
                if off + m <= 512:
                    assert torch.equal(native.quant_linear(x[off : off + m], q, sz, bits), whole[off : off + m]), (m, off)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_fp64_reference(n, k, bits):
    """Against x W'^T in float64: one bf16 rounding of an fp32 sum. And W' against the float weights: half a
    quantization step (plus bf16 rounding), as engine/weights.py's tests bound it."""
    q, sz, w = quantized(n, k, bits, seed=3 * n + k)
    wd = native.quant_dequant(q, sz, bits)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = native.quant_linear(x, q, sz, bits)
    want = x.double() @ wd.double().t()
    torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=2e-2)
    if bits == 4:
        step = sz.permute(0, 2, 1, 3).reshape(n, k // 32, 2)[..., 0].repeat_interleave(32, dim=1)
    elif bits == 5:
        step = sz.float().transpose(1, 2).reshape(n, k // 32).abs().repeat_interleave(32, dim=1)
    else:
        step = sz.float()[:, None].expand(n, k)
    # int5 (Q5_0's rule): codes -16..15 with the largest magnitude at -16, so a value near +max rounds to 15: 1 step
    half = 1.0 if bits == 5 else 0.6
    assert ((wd.float() - w).abs() <= half * step + 2.0**-7 * (w.abs() + 8 * step) + 1e-6).all()


def test_checks_its_inputs():
    q, sz, _ = quantized(64, 64, 4)
    with pytest.raises(RuntimeError, match="bf16"):
        native.quant_linear(torch.zeros(2, 64), q, sz, 4)
    with pytest.raises(RuntimeError, match="bits"):
        native.quant_linear(torch.zeros(2, 64).bfloat16(), q, sz, 6)
    with pytest.raises(RuntimeError, match="5-bit"):  # int4's 32 bytes a row are no whole row of 5-bit codes
        native.quant_linear(torch.zeros(2, 64).bfloat16(), q, sz, 5)
    q5, sz5, _ = quantized(64, 64, 5)
    with pytest.raises(RuntimeError, match="int5 sz"):  # int4's scales with int5 codes
        native.quant_linear(torch.zeros(2, 64).bfloat16(), q5, sz, 5)
    with pytest.raises(RuntimeError, match="sz"):
        native.quant_linear(torch.zeros(2, 64).bfloat16(), q, sz[:1].contiguous(), 4)
    with pytest.raises(RuntimeError, match="out of range"):
        native.quant_dequant(q, sz, 4, torch.tensor([64]))
    assert native.quant_linear(torch.zeros(0, 64).bfloat16(), q, sz, 4).shape == (0, 64)


def test_compiles_under_torch_compile():
    """engine.compiled traces the quantized projections: the op has a fake implementation."""
    q, sz, _ = quantized(64, 64, 4)
    x = torch.randn(3, 64).bfloat16()
    fn = torch.compile(lambda t: native.quant_linear(t, q, sz, 4) * 2, fullgraph=True)
    assert torch.equal(fn(x), native.quant_linear(x, q, sz, 4) * 2)


def plain_weights(n: int, k: int, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, sz) packed, and W' computed without the kernel: int4 fma(q - 8, scale, zero) in float64 (exact here: the
    product has 28 significant bits and the zero point is of the same magnitude), rounded to fp32 once as the fused
    multiply-add rounds, then to bf16; int8 the codes. And the int8 scales as fp32 (ones for int4)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5
    if bits == 4:
        codes, sz = quantize_int4(w, dtype=torch.float32)
        s = sz.transpose(0, 1).double().repeat_interleave(32, dim=1)  # (N, K, 2)
        wd = ((codes.double() - 8) * s[..., 0] + s[..., 1]).float().bfloat16()
        return pack_tiles(codes, 4), pack_scales(sz), wd, torch.ones(n)
    if bits == 5:  # (q - 16) * d: exact in fp32, one rounding to bf16
        codes, d = quantize_int5(w)
        wd = ((codes.view(n, k // 32, 32).float() - 16) * d.float()[..., None]).view(n, k).bfloat16()
        return pack_int5(codes), pack_group_scales(d), wd, torch.ones(n)
    q, scales = quantize_int8(w)
    return pack_tiles(q, 8), scales, q.bfloat16(), scales.float()


def assert_every_row_count(x, q, sz, bits, b, want, threads):
    """Rows off..off+m of x for every m in 1..40 (at shifting offsets), with bias b and without, on `threads`
    threads: the bits of want[None] / want[1] (with bias) there."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in range(1, 41):
            off = (3 * m) % (41 - m)
            for bias in (None, 1):
                got = native.quant_linear(x[off : off + m], q, sz, bits, None if bias is None else b)
                assert torch.equal(got, want[bias][off : off + m]), (m, off, bias)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (80, 96), (208, 160), (16, 32), (1536, 640)])
def test_few_rows_keep_the_reference_bits(n, k, bits, threads, route):
    """Every row count 1..40 (the few-row path below 32 rows, the many-row path from 32) against kakeya::linear on W'
    computed in plain torch from the codes (int8: its fp32 sums times the scales plus bias, one rounding), with and
    without bias, on 1 and 2 threads: the layout, the dequantization and the tile sequence, whatever the kernel's
    few-row path does to be fast, give the bits they gave before."""
    q, sz, wd, scale = plain_weights(n, k, bits, seed=7 * n + k)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(40, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    if bits in (4, 5):
        want = {bias: native.linear(x, wd, None if bias is None else b) for bias in (None, 1)}
    else:
        acc = native.linear(x, wd, out_fp32=True).double() * scale.double()
        want = {None: acc.float().bfloat16(), 1: (acc + b.double()).float().bfloat16()}
    assert_every_row_count(x, q, sz, bits, b, want, threads)


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (576, 576), (80, 96)])
def test_non_finite_rows_get_the_same_bits_in_any_call(n, k, bits, route):
    """Rows holding NaN and ±inf: every prefix of a 40-row call (the few-row path up to 16 rows off AMX, below 32 on
    it) gives the 40-row call's bits, compared raw (NaN's payload too: each path rounds a column as the other does)."""
    q, sz, _, _ = plain_weights(n, k, bits, seed=n + 5 * k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    x[2, 5] = float("nan")
    x[7, 0] = float("inf")
    x[11, 3], x[11, 9] = float("inf"), float("-inf")
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
    for bias in (None, b):
        whole = native.quant_linear(x, q, sz, bits, bias).view(torch.int16)
        assert whole[2].eq(whole[2]).all()  # the NaN row is in the comparison (as bits)
        for m in range(1, 41):
            got = native.quant_linear(x[:m], q, sz, bits, bias)
            assert torch.equal(got.view(torch.int16), whole[:m]), (m, bias is None)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_rows_that_lie_apart_get_the_bits_of_the_same_rows_together(bits, route):
    """Rows of x a view of a wider tensor (a row stride other than K: the few-row paths gather them into pairs
    themselves) give, for every row count 1..17, the bits of the same rows made contiguous."""
    q, sz, _ = quantized(576, 1536, bits, seed=3)
    wide = torch.randn(17, 1600, generator=torch.Generator().manual_seed(5)).bfloat16()
    for m in range(1, 18):
        x = wide[:m, :1536]
        assert x.stride(0) == 1600
        assert torch.equal(native.quant_linear(x, q, sz, bits), native.quant_linear(x.contiguous(), q, sz, bits)), m
