"""The D4 decode's native points (kakeya::d4_points) give the Python chain's bits."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.kv.lattice import LatticeCodec
from kakeya_runtime.kv.packed import unpack_bits


@pytest.mark.parametrize("q", [1, 2, 7, 38, 1000, 5000])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_d4_native_points_equal_the_python_chain(q, head_dim):
    """Unpack, digits, points and scale in C++, then the same rotation: decode's bits exactly (q = 5000: codes of 53
    bits)."""
    codec = LatticeCodec("d4", q, head_dim)
    x = torch.randn(513, head_dim, generator=torch.Generator().manual_seed(q)) * 3
    x[0] = 0  # the eps-clamped norm
    code, scales = codec.encode(x)
    idx = unpack_bits(code, codec.num_blocks, codec.bits)
    ref = codec.dequantize(codec.point(idx), scales[:, 0], scales[:, 1])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(codec.decode(code, scales, dtype), ref.to(dtype))
    lead = codec.decode(code.view(9, 57, -1), scales.view(9, 57, 2), torch.bfloat16)  # any leading shape
    assert torch.equal(lead.reshape(513, head_dim), ref.to(torch.bfloat16))


@pytest.mark.parametrize("q", [1, 7, 38, 181, 5000])
def test_d4_native_points_of_any_bit_pattern_equal_the_digits(q):
    """Every code a field of `bits` bits can hold, not only those encode writes (the largest too, whose digits
    overflow the four): the native digits, taken by multiplying instead of dividing where exact, are the Python
    digits' (q = 5000: 53-bit codes, the dividing path)."""
    from kakeya_runtime.models import native

    codec = LatticeCodec("d4", q, 64)
    g = torch.Generator().manual_seed(q)
    code = torch.randint(0, 256, (600, codec.code_bytes), dtype=torch.uint8, generator=g)
    code[0] = 255  # every code at its largest
    code[1] = 0
    scales = (torch.rand(600, 2, generator=g) * 4 + 0.01).half()
    got = native.d4_points(code, scales, q=q, bits=codec.bits, codes=codec.num_blocks)
    idx = unpack_bits(code, codec.num_blocks, codec.bits)
    scale = scales[:, 1].float().unsqueeze(1) / float(q)
    want = (codec.point(idx) * scale.unsqueeze(-1)).reshape(600, -1)
    assert torch.equal(got, want)


def test_d4_decode_without_the_kernel_builds_nothing(monkeypatch):
    """KAKEYA_ATTENTION=sdpa (native disabled): the decode takes the Python chain instead of building the kernel
    library for its points (it built it, or failed where the kernel cache could not be written). The values agree
    to rounding (the rotation's matmul takes another path without the kernel)."""
    from kakeya_runtime.models import native

    codec = LatticeCodec("d4", 38, 64)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    code, scales = codec.encode(x)
    with_kernel = codec.decode(code, scales, torch.bfloat16)
    monkeypatch.setattr(native, "enabled", lambda: False)
    monkeypatch.setattr(native, "d4_points", lambda *a, **k: pytest.fail("the kernel was called"))
    torch.testing.assert_close(codec.decode(code, scales, torch.bfloat16), with_kernel, atol=1e-3, rtol=1e-2)
