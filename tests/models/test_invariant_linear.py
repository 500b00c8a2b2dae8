"""Our projection kernel (kakeya::linear): right against an fp64 reference, and a row's result independent of the
rows beside it and of the thread count (decode, turns, prompts and batches of sessions compute alike)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import Linear, linear

SHAPES = [  # (N, K): SmolLM2's fused qkv, o, fused gate/up, down; Gemma 3's head width; odd sizes
    (960, 576), (576, 576), (3072, 576), (576, 1536), (1536, 640), (100, 70), (17, 33), (48, 16),
]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_reference(n, k, dtype, bias):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(37, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = native.linear(x, w, b)
    assert y.shape == (37, n) and y.dtype == dtype
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the fp32 sum
    torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("n", "k"), [(576, 576), (100, 70), (192, 64)])
def test_nan_and_inf_rows_get_the_same_bits_in_any_call(n, k):
    """Rows whose outputs are NaN or infinite (a NaN input, an infinite weight) round to the same bf16 bits in a
    decode call of 1-3 rows as in a 512-row call: few-row calls split the outputs differently over the threads, and
    the vector and scalar roundings to bf16 differ on NaN."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(512, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    x[5, 3] = float("nan")
    x[6, 0] = float("inf")
    w[17, 2] = float("-inf")  # output column 17: -inf, or NaN where a row's x[:, 2] is 0 or the row holds an inf
    y = native.linear(x, w)
    assert torch.isnan(y[5]).all() and torch.isinf(y[6]).any()
    whole = y.view(torch.int16)
    for m in (1, 2, 3, 4):
        for off in (0, 4, 5, 6):
            assert torch.equal(native.linear(x[off : off + m], w).view(torch.int16), whole[off : off + m]), (m, off)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (3072, 576), (100, 70), (1536, 640)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_call(n, k, dtype, threads):
    """Row i of a 512-row call equals row i computed in calls of 1, 2, 3, 7, 16, 17, 21, 33, 64 and 100 rows, at
    any offset, on 1 or 2 threads. A library GEMM fails this (its kernels and blockings change with M)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(512, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    whole = native.linear(x, w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 7, 16, 17, 21, 33, 64, 100):
            for off in (0, 3, 200):
                assert torch.equal(native.linear(x[off : off + m], w), whole[off : off + m]), (m, off)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (100, 70), (49, 576)])
@pytest.mark.parametrize("out_fp32", [False, True])
def test_few_row_calls_with_bias_match_a_prefill_call(n, k, out_fp32):
    """Calls of 1 to 64 rows (decode, verifier steps, batched sessions: blocks of 16 W rows in 4 x 4, 3 x 4 and 2 x 8
    tiles) with a bias, rounded or fp32, equal the rows of a 512-row call (the prefill tiling), whole blocks and a
    partial last one (N = 100, 49) alike."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(512, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    whole = native.linear(x, w, b, out_fp32=out_fp32)
    for m in (*range(1, 18), 31, 32, 33, 63, 64, 65):
        assert torch.equal(native.linear(x[7 : 7 + m], w, b, out_fp32=out_fp32), whole[7 : 7 + m]), m


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_weights_packed_once_give_the_same_bits(n, k):
    """`linear_pack(w)` (W's tiles laid out once, at load) changes the layout only: every call, of any number of
    rows, with or without bias, rounded or fp32, equals the call without it bit for bit. Shapes off the AMX
    path get an empty pack (and calls with it are the plain calls)."""
    gen = torch.Generator().manual_seed(3 * n + k)
    x = torch.randn(545, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed = native.linear_pack(w)
    on_amx = native.linear_path(torch.bfloat16, k, n) == "amx"
    assert packed.dtype == torch.int32 and (packed.numel() > 0) == on_amx
    if on_amx:
        assert packed.numel() == (n + 31) // 32 * 2 * (k // 32) * 256
    for m in (1, 31, 32, 33, 64, 100, 512, 545):
        for bias in (None, b):
            for fp32 in (False, True):
                want = native.linear(x[:m], w, bias, out_fp32=fp32)
                got = native.linear(x[:m], w, bias, out_fp32=fp32, packed=packed)
                assert torch.equal(got, want), (m, bias is not None, fp32)


def test_dense_linear_packs_at_load_and_follows_in_place_updates(monkeypatch):
    """With KAKEYA_PACK_WEIGHTS=1, quantize_model(bf16) packs the projections (not the head); a weight changed in
    place is re-packed before its next many-row call, so the results always match the unpacked call."""
    from kakeya_runtime.engine.weights import DenseLinear

    monkeypatch.setenv(native.PACK_ENV, "0")
    assert DenseLinear(torch.zeros(64, 64, dtype=torch.bfloat16), None, pack=True).packed is None  # off by default
    monkeypatch.setenv(native.PACK_ENV, "1")
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(960, 576, generator=gen) * 0.04).to(torch.bfloat16)
    lin = DenseLinear(w.clone(), None, pack=True)
    if native.linear_path(torch.bfloat16, 576, 960) == "amx":
        assert lin.packed is not None and lin.packed.numel() > 0
    x = torch.randn(64, 576, generator=gen).to(torch.bfloat16)
    assert torch.equal(lin(x), native.linear(x, lin.weight))
    with torch.no_grad():
        lin.weight.mul_(2)
    assert torch.equal(lin(x), native.linear(x, lin.weight))
    assert DenseLinear(w, None).packed is None  # packing is opt-in (quantize_model asks for it)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_output_is_the_unrounded_sum(dtype):
    """out_fp32 (the LM head's logits) returns the fp32 sums; the default output is exactly their rounding to
    the input dtype, and the fp32 rows are invariant too."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 576, generator=gen).to(dtype)
    w = (torch.randn(960, 576, generator=gen) * 0.04).to(dtype)
    b = torch.randn(960, generator=gen).to(dtype)
    y32 = native.linear(x, w, b, out_fp32=True)
    assert y32.dtype == torch.float32
    assert torch.equal(y32.to(dtype), native.linear(x, w, b))
    for m, off in ((1, 0), (3, 17), (21, 19)):
        assert torch.equal(native.linear(x[off : off + m], w, b, out_fp32=True), y32[off : off + m])


def test_layers_linear_keeps_leading_dims_and_strided_rows():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 64, generator=gen).transpose(1, 2)  # (2, 3, 5, 64), rows not contiguous overall
    w = torch.randn(48, 64, generator=gen)
    y = linear(x, w)
    assert y.shape == (2, 3, 5, 48)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_linear_module_is_an_nn_linear_with_the_same_state_dict():
    lin = torch.nn.Linear(64, 32)
    ours = Linear(64, 32)
    ours.load_state_dict(lin.state_dict())
    x = torch.randn(4, 64)
    torch.testing.assert_close(ours(x), lin(x), atol=1e-5, rtol=1e-5)
    assert isinstance(ours, torch.nn.Linear)


def test_path_is_chosen_per_weight_not_per_call():
    """The code a weight runs on depends on its dtype and shape (and the CPU), never on the number of rows."""
    path = native.linear_path(torch.bfloat16, 576, 960)
    assert path in ("amx", "avx512-bf16", "avx2", "generic")
    assert native.linear_path(torch.float32, 576, 960) in ("avx512", "avx2", "generic")
    if native.routes().linear_amx:  # the calibrated route (models/native.py)
        assert path == "amx"


def test_bad_inputs_raise():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.linear(x.bfloat16(), w)
    with pytest.raises(RuntimeError, match=r"\(M, K\)"):
        native.linear(x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="bias must be"):
        native.linear(x, w, torch.randn(5))
    with pytest.raises(RuntimeError, match="not supported"):
        native.linear(x.half(), w.half())


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_is_row_invariant_and_matches_torch(act, dtype):
    """The MLP's act(gate) * up in one pass: a row's result is the same bits alone or among others (an odd
    width too: its tail runs the same vector code), and it matches PyTorch's two-op computation in fp32."""
    g = torch.Generator().manual_seed(5)
    for width in (1536, 37):
        x = (torch.randn(70, 2 * width, generator=g) * 3).to(dtype)
        y = native.gated_act(x, act)
        assert y.shape == (70, width) and y.dtype == dtype
        assert torch.equal(native.gated_act(x[9:10], act), y[9:10])
        assert torch.equal(native.gated_act(x[:33], act), y[:33])
        gate, up = x[:, :width].float(), x[:, width:].float()
        ref = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
