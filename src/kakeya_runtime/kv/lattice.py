"""Packed D4 / E8 nested-lattice codes for K/V vectors (the KakeyaLattice v1.4 / v1.5 algorithm, stored).

`kakeyalattice` only simulates its codec (`roundtrip` returns fp32). This module runs the same steps
and keeps what they produce, so the bytes are real:

    x (D,) -> norm = |x| (fp16), unit = x / |x|          # unit-normalise
           -> y = unit @ H / sqrt(D)                     # Sylvester Hadamard rotation
           -> qmax = max|y| (fp16), y' = y * Q / qmax    # per-vector range onto [-Q, Q]^D
           -> closest lattice point per 4-D (D4) or 8-D (E8) block
           -> one integer index per block, bit-packed    # (D/b) * ceil(bits/block) + 32 bits
    decode: index -> lattice point -> * qmax / Q -> @ H -> * norm

Bits per vector match the reference budget: D4 (D/4)*ceil(4*log2(2Q+1) - 1) + 32, E8
(D/8)*ceil(8*log2(2Q+1)) + 32; the stored bytes are that rounded up to a whole byte.

One deliberate difference: the reference clamps the chosen point to [-Q, Q] *after* the search,
which can leave the lattice (an E8 half-integer coordinate of +-(Q+1/2) clamped to +-Q, or a D4 parity
flip to +-(Q+1)). Such points have no index inside the budget, so we search the lattice points inside
the box instead (the parity flip never steps outside, the half-integer coset is limited to +-(Q-1/2)).
Everywhere else the code is the reference's point, bit for bit; tests measure the agreement.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kakeya_runtime.kv.packed import pack_bits, packed_nbytes, unpack_bits
from kakeya_runtime.models import native
from kakeya_runtime.models.layers import linear

LATTICES = ("d4", "e8")
MAX_BLOCK_BITS = 62  # indices are int64 arithmetic


class LatticeError(ValueError):
    """An unsupported lattice, range or head dimension."""


class CodecRangeError(ValueError):
    """K/V values a codec cannot store: a scale past fp16's largest finite value (65504) would be stored clamped
    (the vector decoded shrunk) or as inf (decoded as NaN). Raised, never stored wrong."""


FP16_MAX = torch.finfo(torch.float16).max


def check_scale_range(scales: Tensor, what: str) -> None:
    """Refuse scales fp16 cannot hold (one reduction per encode: little beside a lattice search or a quantisation)."""
    too_large = scales.abs() > FP16_MAX  # (NaN compares false: a NaN K/V decodes as NaN, as it came)
    if bool(too_large.any()):
        worst = float(scales.abs()[too_large].max())
        raise CodecRangeError(f"a K/V vector's {what} ({worst:.4g}) is past what the codec stores (fp16, at most "
                              f"{FP16_MAX:g}); this model's K/V do not fit a packed codec: use codec identity")


def block_bits(kind: str, q: int) -> int:
    """Bits per lattice block (the reference's accounting)."""
    if kind == "d4":
        return int(math.ceil(4.0 * math.log2(2 * q + 1) - 1.0))
    if kind == "e8":
        return int(math.ceil(8.0 * math.log2(2 * q + 1)))
    raise LatticeError(f"unknown lattice {kind!r} (known: {', '.join(LATTICES)})")


def bits_per_vector(kind: str, q: int, head_dim: int) -> int:
    """(D / block) * bits/block + 32 (fp16 norm + fp16 qmax)."""
    return (head_dim // _block_dim(kind)) * block_bits(kind, q) + 32


def check_lattice(kind: str, q: int, head_dim: int | None = None) -> None:
    if kind not in LATTICES:
        raise LatticeError(f"unknown lattice {kind!r} (known: {', '.join(LATTICES)})")
    if not isinstance(q, int) or q < 1:
        raise LatticeError(f"lattice range q must be an integer >= 1, got {q!r}")
    if block_bits(kind, q) > MAX_BLOCK_BITS:
        raise LatticeError(f"{kind} q={q} needs {block_bits(kind, q)} bits per block; at most {MAX_BLOCK_BITS}")
    if head_dim is not None:
        bd = _block_dim(kind)
        if head_dim % bd or head_dim & (head_dim - 1):
            raise LatticeError(f"{kind} needs a power-of-two head_dim divisible by {bd}, got {head_dim}")


def _block_dim(kind: str) -> int:
    return 4 if kind == "d4" else 8


def hadamard(d: int, device: torch.device | str = "cpu") -> Tensor:
    """Sylvester Hadamard / sqrt(d), built exactly as the reference builds it (self-inverse)."""
    h = torch.tensor([[1.0]], device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(d)


def nearest_dn_in_box(y: Tensor, lo: int, hi: int) -> Tensor:
    """Closest point of D_n = {x in Z^n : sum x even} to y (..., n) with every coordinate in [lo, hi].

    Conway-Sloane Alg. 4: round; if the sum is odd, move the coordinate that rounded worst one step
    toward y. The in-box version skips coordinates whose step would leave [lo, hi] (the reference
    clamps afterwards instead). Ties break like the reference (first index; diff >= 0 steps up).
    """
    f = torch.round(y).clamp_(lo, hi)
    odd = (f.sum(-1) % 2) != 0  # exact: small integers in fp32
    if not bool(odd.any()):
        return f
    diff = y - f
    step = torch.where(diff >= 0, 1.0, -1.0)
    target = f + step
    ok = (target >= lo) & (target <= hi)
    score = torch.where(ok, diff.abs(), torch.full_like(diff, -1.0))
    idx = score.argmax(-1, keepdim=True)
    # If no coordinate can step toward y (all at the wall), step away from it instead.
    s = torch.where(ok.gather(-1, idx), step.gather(-1, idx), -step.gather(-1, idx))
    flipped = f.scatter_add(-1, idx, s)
    return torch.where(odd.unsqueeze(-1), flipped, f)


class LatticeCodec:
    """Encode (..., D) float vectors to (code uint8 (..., code_bytes), scales fp16 (..., 2)) and back."""

    def __init__(self, kind: str, q: int, head_dim: int, device: torch.device | str = "cpu") -> None:
        check_lattice(kind, q, head_dim)
        self.kind, self.q, self.head_dim = kind, q, head_dim
        self.block = _block_dim(kind)
        self.num_blocks = head_dim // self.block
        self.bits = block_bits(kind, q)
        self.code_bytes = packed_nbytes(self.num_blocks, self.bits)
        self.bits_per_vector = self.num_blocks * self.bits + 32
        self.bytes_per_vector = self.code_bytes + 4  # + fp16 norm + fp16 qmax
        self.h = hadamard(head_dim, device)
        m = 2 * q + 1
        self._m = m
        self._int_count = (m**self.block + 1) // 2  # D_n points in [-Q, Q]^n (E8: integer coset)

    def __repr__(self) -> str:
        return f"LatticeCodec({self.kind}, q={self.q}, D={self.head_dim}, {self.bits_per_vector} bits/vector)"

    # -- the reference's preprocessing, then the lattice search --------------------------------

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(..., D) -> lattice points (N, K, b) fp32 (integers, or half-integers for the E8 coset),
        norms fp16 (N,), qmax fp16 (N,)."""
        flat = x.reshape(-1, self.head_dim).float()
        eps = torch.finfo(torch.float32).eps
        norms = flat.norm(dim=1, keepdim=True).clamp(min=eps)
        check_scale_range(norms, "norm")
        norms16 = norms.to(torch.float16)
        y = _rotate(flat / norms, self.h)
        qmax16 = y.abs().amax(dim=1, keepdim=True).clamp(min=eps).to(torch.float16)
        scale = qmax16.float() / float(self.q)
        blocks = (y / scale).reshape(-1, self.num_blocks, self.block)  # (N, K, b)
        q = self.q
        if self.kind == "d4":
            pts = nearest_dn_in_box(blocks, -q, q)
        else:
            a = nearest_dn_in_box(blocks, -q, q)
            b = nearest_dn_in_box(blocks - 0.5, -q, q - 1) + 0.5  # half-integer coset, inside the box
            da = ((blocks - a) ** 2).sum(-1, keepdim=True)
            db = ((blocks - b) ** 2).sum(-1, keepdim=True)
            pts = torch.where(da <= db, a, b)
        return pts, norms16.squeeze(1), qmax16.squeeze(1)

    def dequantize(self, pts: Tensor, norms16: Tensor, qmax16: Tensor) -> Tensor:
        """Lattice points (N, K, b) -> (N, D) fp32, the reference's decode arithmetic."""
        scale = qmax16.float().unsqueeze(1) / float(self.q)  # (N, 1)
        y_hat = (pts * scale.unsqueeze(-1)).reshape(-1, self.head_dim)
        return _rotate(y_hat, self.h) * norms16.float().unsqueeze(1)

    # -- lattice point <-> index -----------------------------------------------------------------

    def index(self, pts: Tensor) -> Tensor:
        """(N, K, b) lattice points -> (N, K) int64 indices in [0, 2**bits)."""
        q, m = self.q, self._m
        if self.kind == "d4":
            u = (pts + q).long()  # digits in [0, 2Q], radix m (odd): N is even iff the sum is even
            return _horner(u, m) >> 1
        half = pts.frac().abs().amax(-1) > 0.25  # (N, K) half-integer coset
        u = (pts.round() + q).long()  # integer coset digits (ignored where half)
        idx_int = _horner(u, m) >> 1
        w = (pts - 0.5 + q).round().long()  # half coset digits in [0, 2Q-1]
        idx_half = self._int_count + _horner(w[..., :-1], 2 * q) * q + (w[..., -1] >> 1)
        return torch.where(half, idx_half, idx_int)

    def point(self, idx: Tensor) -> Tensor:
        """(N, K) int64 indices -> (N, K, b) fp32 lattice points."""
        q, m, b = self.q, self._m, self.block
        if self.kind == "d4":
            return (_digits(idx << 1, m, b) - q).float()
        half = idx >= self._int_count
        x_int = (_digits(idx.clamp(max=self._int_count - 1) << 1, m, b) - q).float()
        r = (idx - self._int_count).clamp(min=0)
        lead = _digits(r // q, 2 * q, b - 1)  # (N, K, b-1)
        last = 2 * (r % q) + lead.sum(-1) % 2  # parity makes the coset's sum even
        w = torch.cat((lead, last.unsqueeze(-1)), dim=-1)
        x_half = w.float() - q + 0.5
        return torch.where(half.unsqueeze(-1), x_half, x_int)

    # -- packed storage ---------------------------------------------------------------------------

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(..., D) -> code (..., code_bytes) uint8, scales (..., 2) fp16 = (norm, qmax)."""
        lead = x.shape[:-1]
        pts, norms16, qmax16 = self.quantize(x)
        code = pack_bits(self.index(pts), self.bits).reshape(*lead, self.code_bytes)
        scales = torch.stack((norms16, qmax16), dim=-1).reshape(*lead, 2)
        return code, scales

    def decode(self, code: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        lead = code.shape[:-1]
        if self.kind == "d4" and code.is_cpu and native.enabled():  # the points in one native call: the same bits
            s = scales.reshape(-1, 2)
            y_hat = native.d4_points(code.reshape(-1, self.code_bytes).contiguous(), s.contiguous(), q=self.q,
                                     bits=self.bits, codes=self.num_blocks)
            out = _rotate(y_hat, self.h) * s[:, 0].float().unsqueeze(1)
            return out.reshape(*lead, self.head_dim).to(dtype)
        idx = unpack_bits(code.reshape(-1, self.code_bytes), self.num_blocks, self.bits)
        s = scales.reshape(-1, 2)
        return self.dequantize(self.point(idx), s[:, 0], s[:, 1]).reshape(*lead, self.head_dim).to(dtype)

    def roundtrip(self, x: Tensor) -> Tensor:
        """Encode then decode, fp32 (the packed counterpart of the reference's `roundtrip`)."""
        code, scales = self.encode(x)
        return self.decode(code, scales)


def _rotate(x: Tensor, h: Tensor) -> Tensor:
    """x @ H for the symmetric Hadamard H, by the models' linear (with our kernels: each vector's result is the
    same bits whatever else is encoded in the call, so a position's code does not depend on the step)."""
    return linear(x, h.to(x.device))


def _horner(digits: Tensor, radix: int) -> Tensor:
    """(..., n) digits, most significant first -> (...) int64."""
    out = digits[..., 0]
    for i in range(1, digits.shape[-1]):
        out = out * radix + digits[..., i]
    return out


def _digits(value: Tensor, radix: int, n: int) -> Tensor:
    """Inverse of _horner: (...) int64 -> (..., n) digits, most significant first."""
    out = []
    for _ in range(n):
        out.append(value % radix)
        value = value // radix
    return torch.stack(out[::-1], dim=-1)
