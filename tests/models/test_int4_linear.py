"""Our int4 kernel (kakeya::int4_linear): the products of its dequantized weights up to fp32 accumulation and one
bf16 rounding, and a row's result independent of the rows beside it and of the thread count."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.weights import Int4Linear, quantize_int4
from kakeya_runtime.models import native

pytestmark = pytest.mark.skipif(not native.int4_native(), reason="no AVX512-BF16 / VBMI int4 kernel on this CPU")

SHAPES = [(960, 576), (576, 1536), (1536, 640), (64, 32), (128, 64)]  # SmolLM2 qkv, down; Gemma 3 qkv; small


def _layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w[0, :32] = 0.0  # a constant group (scale clamped)
    codes, scales_zeros = quantize_int4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    deq = ((codes.view(n, k // 32, 32).float() - 8) * scales_zeros.transpose(0, 1).float()[..., :1]
           + scales_zeros.transpose(0, 1).float()[..., 1:]).view(n, k)  # (N, K) fp32, exact
    return packed, scales_zeros, deq


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_its_dequantized_weights(n, k):
    packed, sz, deq = _layer(n, k, n + k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = native.int4_linear(x, packed, sz, 32)
    assert y.shape == (37, n) and y.dtype == torch.bfloat16
    want = x.double() @ deq.double().t()
    # one bf16 rounding of the sum (2^-8 relative), plus fp32 accumulation of terms up to 136 |x| |s| per weight
    bound = 2.0**-8 * want.abs() + 1e-5 * (x.double().abs() @ deq.double().abs().t() + 1)
    assert ((y.double() - want).abs() <= bound).all()
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).double()  # PyTorch's kernel, same weights
    assert ((y.double() - ref).abs() <= 2 * bound).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536)])
def test_a_row_gets_the_same_bits_in_any_call(n, k, threads):
    packed, sz, _ = _layer(n, k, 3)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = native.int4_linear(x, packed, sz, 32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 16, 17, 64, 129):
            for off in (0, 5, 150):
                assert torch.equal(native.int4_linear(x[off : off + m], packed, sz, 32), whole[off : off + m]), (m, off)
    finally:
        torch.set_num_threads(old)


def test_int4_linear_module_runs_it_where_blocks_are_whole():
    gen = torch.Generator().manual_seed(5)
    whole, tail = Int4Linear(torch.randn(128, 64, generator=gen) * 0.1, None), Int4Linear(torch.randn(80, 64) * 0.1, None)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    assert whole._native_ok and not tail._native_ok
    assert torch.equal(whole(x), native.int4_linear(x, whole.packed, whole.scales_zeros, 32))
    assert torch.equal(tail(x), torch.ops.aten._weight_int4pack_mm_for_cpu(x, tail.packed, 32, tail.scales_zeros))


def test_rejects_partial_blocks_and_odd_shapes():
    packed, sz, _ = _layer(64, 64, 6)
    with pytest.raises(RuntimeError):
        native.int4_linear(torch.zeros(2, 48, dtype=torch.bfloat16), packed, sz, 32)  # K does not match
    with pytest.raises(RuntimeError):
        native.int4_linear(torch.zeros(2, 64), packed, sz, 32)  # fp32 x
