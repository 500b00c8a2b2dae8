"""Fixed-width integer codes <-> a dense little-endian bit stream in uint8, one stream per vector.

A vector of K codes of `bits` bits each takes exactly ceil(K * bits / 8) bytes, so the stored tensor's
`nbytes` is the codec's bit budget rounded up to a whole byte per vector. Code j occupies bits
[j*bits, (j+1)*bits) of the stream; packing works on 64-bit words (a code straddles at most two).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch
from torch import Tensor

if sys.byteorder != "little":  # the uint8 <-> int64 views below assume it
    raise ImportError("kakeya_runtime.kv.packed needs a little-endian machine")

MAX_BITS = 62


def packed_nbytes(num_codes: int, bits: int) -> int:
    return (num_codes * bits + 7) // 8


@lru_cache(maxsize=64)
def _layout(num_codes: int, bits: int) -> tuple[int, Tensor, Tensor, Tensor, Tensor]:
    """Number of 64-bit words, and per code: its first word, its bit offset, whether it spills into
    the next word, and the mask of the bits it takes from the first word (after the shift)."""
    start = torch.arange(num_codes, dtype=torch.int64) * bits
    word, offset = start // 64, start % 64
    spills = offset + bits > 64
    low_mask = torch.where(offset == 0, -1, (1 << (64 - offset).clamp(max=63)) - 1)
    return (num_codes * bits + 63) // 64, word, offset, spills, low_mask


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """codes: (..., K) int64, each in [0, 2**bits) -> (..., ceil(K*bits/8)) uint8."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    *lead, k = codes.shape
    num_words, word, offset, spills, _ = _on(_layout(k, bits), codes.device)
    flat = codes.reshape(-1, k)
    words = flat.new_zeros(flat.shape[0], num_words + 1)  # +1: spill target of the last code
    # Bits never overlap, so adding is OR; a left shift past bit 63 drops the spilled bits (wraps).
    words.index_add_(1, word, flat << offset)
    high = torch.where(spills, flat >> (64 - offset).clamp(max=63), 0)
    words.index_add_(1, word + 1, high)
    out = words[:, :num_words].contiguous().view(torch.uint8)[:, : packed_nbytes(k, bits)]
    return out.reshape(*lead, packed_nbytes(k, bits))


def unpack_bits(packed: Tensor, num_codes: int, bits: int) -> Tensor:
    """Inverse of pack_bits: (..., nbytes) uint8 -> (..., K) int64."""
    *lead, nbytes = packed.shape
    if nbytes != packed_nbytes(num_codes, bits):
        raise ValueError(f"{nbytes} bytes do not hold {num_codes} codes of {bits} bits")
    num_words, word, offset, spills, low_mask = _on(_layout(num_codes, bits), packed.device)
    flat = packed.reshape(-1, nbytes)
    buf = flat.new_zeros(flat.shape[0], (num_words + 1) * 8)
    buf[:, :nbytes] = flat
    words = buf.view(torch.int64)  # (N, num_words + 1)
    lo = (words[:, word] >> offset) & low_mask  # the mask drops the arithmetic shift's sign smear
    hi = torch.where(spills, words[:, word + 1] << (64 - offset).clamp(max=63), 0)
    codes = (lo | hi) & ((1 << bits) - 1)
    return codes.reshape(*lead, num_codes)


def _on(layout: tuple, device: torch.device) -> tuple:
    return tuple(t.to(device) if isinstance(t, Tensor) else t for t in layout)
