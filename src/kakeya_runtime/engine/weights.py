"""Weight formats for the projection matmuls: bf16, fp32, and weight-only int8 / int4 (CPU).

`quantize_model(model, fmt)` converts a loaded model in place. The int formats replace every
projection `nn.Linear` (fused qkv, o, fused gate/up, down, and the LM head) with a module that runs
PyTorch's weight-only CPU kernels on bf16 activations:

- INT8: per-output-channel symmetric int8, `aten._weight_int8pack_mm`.
- INT4: group-wise affine int4 (group 32), `aten._weight_int4pack_mm_for_cpu`. A GGUF Q4_1 block
  (32 values, w = d*q + m) is exactly such a group: scale = d, zero = m + 8d (the kernel computes
  (q - 8) * scale + zero); Q4_K sub-blocks are the same form. The loader does not expose GGUF blocks,
  so we quantize from its dequantized weights (best loaded in fp32, where they are exact): a group
  whose values lie on a 16-level grid gets that grid, which recovers the GGUF codes exactly, up to
  the bf16 rounding of scale and zero that the kernel requires. Finer tensors (Q5_0, Q6_K, Q8_0)
  are rounded to 4 bits; INT4_MIXED keeps those in int8 instead, except Q5_0 ones (with our kernels).
- INT5 (inside INT4_MIXED, with our kernels): a GGUF Q5_0 block, (q - 16) * d for 5-bit codes q and an fp16 d per
  group of 32, kept exactly (`Int5Linear`): 5.5 bits a weight instead of int8's 8, and no rounding at all.
- The LM head defaults to int8 (a tied head also serves the embedding lookup: `QuantEmbedding`). With our kernels,
  an int8 tensor that is exactly GGUF Q8_0 blocks (both bundled models' tied head) keeps them: int8 codes with an
  fp16 d per group of 32 (`int8_grid`), multiplied as the bf16 weight they dequantize to.
- BF16 / FP32: the weights as loaded, with one-row matmuls as matrix-vector products (`DenseLinear`).

With our kernels (the native backend), int4 runs on ours instead (`kakeya::quant_linear`, csrc/quant_linear.cpp):
the weights dequantized to bf16 inside the kernel, tile by tile, by one routine, and multiplied as our bf16
projections are, so every row count runs at about bf16 matmul speed and a row's bits do not depend on the rows
beside it; its weights are `dequantize()`'s, exactly.

PyTorch's int kernels are fast for one row (decode) but slow for many (prefill: ~600 tok/s against
thousands with bf16 AMX matmuls), so a quantized linear switches on the number of rows: at or above
`prefill_rows` it runs a bf16 matmul on weights it dequantizes for that call (`Prefill.DEQUANT`, no
extra resident memory, the same numbers as the int kernel up to accumulation order) or on a bf16 copy
it keeps (`Prefill.COPY`, +2 bytes/weight resident).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import DecodeArgs, linear

INT4_GROUP = 32  # one GGUF Q4_0/Q4_1 block, one Q4_K sub-block
# Below this many rows the int kernel runs (decode, speculative verification); at or above it, a bf16
# matmul on dequantized weights. Measured on SmolLM2 int4 (2 threads): the kernel costs ~2.7 ms per row
# for the whole model; dequantizing every layer once ~0.24 s plus ~0.8 ms per row: crossover ~125 rows.
PREFILL_ROWS = 128
PACKED_ROWS = 32  # calls of this many rows or more take the kernel's many-row path, which uses packed tiles


class WeightFormat(enum.Enum):
    BF16 = "bf16"
    FP32 = "fp32"
    INT8 = "int8"  # weight-only, per output channel
    INT4 = "int4"  # weight-only, group-wise affine, group 32
    # int4 where the weights already are 4-bit (GGUF Q4_1/Q4_K blocks, reproduced exactly), int5 where they are
    # Q5_0 blocks (reproduced exactly, with our kernels), int8 where they are finer (Q6_K, Q8_0): GGUF's own "_M"
    # mixes, without rounding 5-6 bit tensors to 4.
    INT4_MIXED = "int4-mixed"

    @property
    def quantized(self) -> bool:
        return self in (WeightFormat.INT8, WeightFormat.INT4, WeightFormat.INT4_MIXED)


class Prefill(enum.Enum):
    """How a quantized linear runs many-row (prefill) inputs."""

    DEQUANT = "dequant"  # dequantize to bf16 for the call, then a bf16 (AMX) matmul; no extra memory
    COPY = "copy"  # keep a bf16 copy of the original weights for prefill (+2 bytes per weight)
    KERNEL = "kernel"  # always the int kernel (slow prefill; for measurement)


class DenseLinear(nn.Module):
    """bf16/fp32 weights as loaded, computed by `layers.linear` (with the native backend, our kernel: a row's
    result does not depend on how many rows share the call).

    On PyTorch's kernels (the sdpa backend, not invariant) a one-row input runs as a matrix-vector product, as
    it did before our kernels: `torch.mv` streams bf16 weights ~1.6x faster than `F.linear`'s GEMM path for
    one row here (13.5 against 8.3 GB/s), so the bench's peer is that path at its best.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, *, pack: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # `pack` (and KAKEYA_PACK_WEIGHTS=1): with our kernels on AMX, W's tiles for calls of many rows (prefill
        # chunks) laid out once here instead of per call (a second copy of W, counted in weight_bytes; same bits).
        self.register_buffer("packed", None, persistent=False)
        self._packed_version = -1
        if pack and self.weight.dtype == torch.bfloat16 and native.enabled() and native.pack_weights():
            self._pack()

    def _pack(self) -> None:
        packed = native.linear_pack(self.weight.detach())
        self.packed = packed if packed.numel() else None
        self._packed_version = self.weight._version

    def _packed_for(self, x: Tensor) -> Tensor | None:
        """The packed tiles if they are current (re-laid out if W changed in place since), else None."""
        if self.packed is None or x.numel() < PACKED_ROWS * self.in_features:
            return None
        if self._packed_version != self.weight._version:
            self._pack()
        return self.packed

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() == self.in_features and not native.enabled():
            # engine.compiled keeps aten.mv whole: Inductor's own lowering of it streams ~4x slower here.
            y = torch.mv(self.weight, x.reshape(-1).to(self.weight.dtype))
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return linear(x.to(self.weight.dtype), self.weight, self.bias, packed=self._packed_for(x)).to(x.dtype)

    def forward_fp32(self, x: Tensor) -> Tensor:
        return linear(x.to(self.weight.dtype), self.weight, self.bias, out_fp32=True, packed=self._packed_for(x))

    def decode_args(self) -> DecodeArgs | None:
        """`forward` with our kernels, for kakeya::decoder_layer (packed tiles or not: the same bits)."""
        return DecodeArgs(0, self.weight, None, self.bias, self.weight.dtype, None) if native.enabled() else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W stored quantized; bf16 in, bf16 out (other dtypes are cast)."""

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None, *, prefill: Prefill,
                 prefill_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.prefill, self.prefill_rows = prefill, prefill_rows
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())
        self.register_buffer("bf16_copy", None)  # set only for Prefill.COPY

    def kernel_mm(self, x: Tensor) -> Tensor:
        """(R, K) bf16 -> (R, N) bf16 through the int kernel."""
        raise NotImplementedError

    def decode_args(self) -> DecodeArgs | None:
        """`forward`'s kernel path (below `prefill_rows` rows) on our int kernel, for kakeya::decoder_layer."""
        if not getattr(self, "native", False):
            return None
        max_rows = None if self.prefill is Prefill.KERNEL else self.prefill_rows
        if isinstance(self, Int4Linear):
            return DecodeArgs(4, self.packed, self.scales_zeros.view(torch.float32), self.bias, torch.bfloat16,
                              max_rows)
        if isinstance(self, Int5Linear):
            return DecodeArgs(5, self.packed, self.scales.view(torch.float16), self.bias, torch.bfloat16, max_rows)
        return DecodeArgs(8, self.qweight, self.kernel_sz(), self.bias, torch.bfloat16, max_rows)

    def dequantize(self) -> Tensor:
        """The weight this module computes with, (N, K) bf16."""
        raise NotImplementedError

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        """Rows `rows` (R,) of `dequantize()`, (R, K) bf16 (the embedding lookup of a tied head)."""
        return self.dequantize()[rows]

    @property
    def weight(self) -> Tensor:  # for callers that read `.weight` (e.g. a tied head); costs a dequant
        return self.dequantize()

    def forward(self, x: Tensor) -> Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (R, K)
        if x2.shape[0] >= self.prefill_rows and self.prefill is not Prefill.KERNEL:
            w = self.bf16_copy if self.bf16_copy is not None else self.dequantize()
            y = F.linear(x2, w, self.bias)
        else:
            y = self.kernel_mm(x2)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, prefill={self.prefill.value}, "
                f"kernel={'native' if getattr(self, 'native', False) else 'torch'}")


class Int8Linear(QuantLinear):
    """Symmetric int8: per output channel, W ~= q * s[:, None], q in [-127, 127]; or, given `grid` (int8_grid's: the
    weight is exactly GGUF Q8_0 blocks) and our kernels, per group of 32, W = q * d with an fp16 d per group, kept
    exactly (8.5 bits a weight; re-rounding Q8_0 blocks to per-row scales cost SmolLM2 int4 most of its logit error,
    in its tied head)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, prefill: Prefill = Prefill.DEQUANT,
                 prefill_rows: int = PREFILL_ROWS, grid: tuple[Tensor, Tensor] | None = None) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias, prefill=prefill, prefill_rows=prefill_rows)
        self.grouped = grid is not None
        if self.grouped:
            if not native_quant(n, k):
                raise ValueError(f"grouped int8 weights need our kernels and a ({n}, {k}) shape in 16 x 32 tiles")
            q, d = grid
            self.native = True
            self.register_buffer("qweight", pack_q8_tiles(q))  # (N, K) in q8_linear's 16 x 32 tiles
            # (N/16, K/32, 16) fp16, kept as its bits so a model-wide .to(bfloat16) leaves it whole
            self.register_buffer("scales", pack_group_scales(d).view(torch.int16))
            return
        q, scales = quantize_int8(weight)
        # With our kernels, our int kernel (as Int4Linear); else PyTorch's
        self.native = native_quant(n, k)
        self.register_buffer("qweight", pack_tiles(q, 8) if self.native else q)  # (N, K): 16 x 32 tiles, or int8
        self.register_buffer("scales", scales)  # (N,) bf16
        # What the kernel multiplies by: the same scales widened to fp32 once (it would widen them every call), kept
        # as their bits so a model-wide .to(bfloat16) leaves them whole; derived, so not in the state dict.
        self.register_buffer("kernel_scales", scales.float().view(torch.int32), persistent=False)

    def kernel_sz(self) -> Tensor:
        """The scales as our kernel takes them: per group fp16 (N/16, K/32, 16), or per row fp32 (N,)."""
        return self.scales.view(torch.float16) if self.grouped else self.kernel_scales.view(torch.float32)

    def _dequant_sz(self) -> Tensor:
        return self.scales.view(torch.float16) if self.grouped else self.scales

    def kernel_mm(self, x: Tensor) -> Tensor:
        if self.grouped:
            return native.q8_linear(x, self.qweight, self.kernel_sz())
        if self.native:
            return native.quant_linear(x, self.qweight, self.kernel_sz(), 8)
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def forward_fp32(self, x: Tensor) -> Tensor:
        """The fp32 sums, unrounded (Model.project's logits), on the kernel whatever the row count: a grouped weight
        (a Q8_0 head) only; others round to bf16 (`forward`)."""
        if not self.grouped:
            return self(x).float()
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = native.q8_linear(x2, self.qweight, self.kernel_sz(), self.bias, out_fp32=True)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:
        if self.grouped:
            return native.q8_dequant(self.qweight, self.kernel_sz())
        if self.native:
            return native.quant_dequant(self.qweight, self._dequant_sz(), 8)
        return (self.qweight * self.scales.float()[:, None]).to(torch.bfloat16)

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        if self.grouped:
            return native.q8_dequant(self.qweight, self.kernel_sz(), rows)
        if self.native:
            return native.quant_dequant(self.qweight, self._dequant_sz(), 8, rows)
        return (self.qweight[rows] * self.scales[rows, None].float()).to(torch.bfloat16)


class Int4Linear(QuantLinear):
    """Group-wise affine int4 in the CPU kernel's packed layout: W ~= (q - 8) * s + z per group of 32."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, group_size: int = INT4_GROUP,
                 prefill: Prefill = Prefill.DEQUANT, prefill_rows: int = PREFILL_ROWS) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias, prefill=prefill, prefill_rows=prefill_rows)
        self.group_size = group_size
        # With our kernels, our int kernel (kakeya::quant_linear: every row count at bf16 matmul speed, invariant),
        # with fp32 scales and zeros (a GGUF block's own, nearly: W' is then its weights rounded once to bf16); else
        # PyTorch's, in its packed layout, with bf16 ones (what it takes).
        self.native = native_quant(n, k, group_size)
        codes, scales_zeros = quantize_int4(weight, group_size, dtype=torch.float32 if self.native else torch.bfloat16)
        if self.native:
            # (N/16, K/G, 16, 2) fp32 kept as its bits (int32), so a model-wide .to(bfloat16) leaves it whole
            self.register_buffer("scales_zeros", pack_scales(scales_zeros).view(torch.int32))
            # state_dict() shows them as quantize_int4 gives them, (K/G, N, 2): the kernel's layout is not part of
            # the weights' identity (sessions.snapshot.model_fingerprint samples the state dict)
            self.register_state_dict_post_hook(_logical_scales)
            self.register_buffer("packed", pack_tiles(codes, 4))  # (N, K/2) uint8 in 16 x 32 tiles
            self._unpack_ok = True
            return
        self.register_buffer("scales_zeros", scales_zeros)  # (K/G, N, 2) bf16: scale, zero
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))  # (N, K/2)
        if not torch.equal(_unpack_int4(self.packed, n, k), codes.to(torch.uint8)):
            # The kernel's packing differs from the layout _unpack_int4 reads: keep DEQUANT honest by
            # falling back to a bf16 copy rather than dequantizing wrong numbers.
            if prefill is Prefill.DEQUANT:
                self.prefill = Prefill.COPY
            self._unpack_ok = False
        else:
            self._unpack_ok = True

    def scale_zero(self) -> Tensor:
        """(K/G, N, 2) fp32: each group's scale and zero as the kernel uses them."""
        if self.native:  # from the kernel's (N/16, K/G, 16, 2)
            return self.scales_zeros.view(torch.float32).permute(1, 0, 2, 3).reshape(-1, self.out_features, 2)
        return self.scales_zeros.float()

    def kernel_mm(self, x: Tensor) -> Tensor:
        if self.native:
            return native.quant_linear(x, self.packed, self.scales_zeros.view(torch.float32), 4)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)

    def dequantize(self) -> Tensor:
        if self.native:  # the kernel's own dequantization: the weights it multiplies by, bit for bit
            return native.quant_dequant(self.packed, self.scales_zeros.view(torch.float32), 4)
        if not self._unpack_ok:  # exact but slow: run the kernel on the identity
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            return self.kernel_mm(eye).t().contiguous()
        n, k, g = self.out_features, self.in_features, self.group_size
        q = _unpack_int4(self.packed, n, k).view(n, k // g, g).float()  # (N, K/G, G)
        sz = self.scales_zeros.transpose(0, 1).float()  # (N, K/G, 2)
        # fp32 like the kernel, then one rounding to bf16
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, k).to(torch.bfloat16)

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        return _int4_rows(self, rows) if self._unpack_ok else self.dequantize()[rows]


class Int5Linear(QuantLinear):
    """Group-wise symmetric int5, a GGUF Q5_0 block's form: W = (q - 16) * d per group of 32, q in 0..31, d fp16.
    Only on our int kernel (kakeya::quant_linear bits 5); `int5_exact` says whether a weight is exactly so."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, prefill: Prefill = Prefill.DEQUANT,
                 prefill_rows: int = PREFILL_ROWS, grid: tuple[Tensor, Tensor] | None = None) -> None:
        n, k = weight.shape
        if not native_quant(n, k):
            raise ValueError(f"int5 weights need our kernels and a ({n}, {k}) shape in 16 x 32 tiles")
        super().__init__(k, n, bias, prefill=prefill, prefill_rows=prefill_rows)
        self.native = True
        codes, d = quantize_int5(weight) if grid is None else grid  # grid: int5_grid's, already computed
        self.register_buffer("packed", pack_int5(codes))  # (N, 5K/8) uint8 in 16 x 32 tiles
        # kept as its bits so a model-wide .to(bfloat16) leaves it whole
        self.register_buffer("scales", pack_group_scales(d).view(torch.int16))

    def kernel_mm(self, x: Tensor) -> Tensor:
        return native.quant_linear(x, self.packed, self.scales.view(torch.float16), 5)

    def dequantize(self) -> Tensor:  # the kernel's own: the weights it multiplies by, bit for bit
        return native.quant_dequant(self.packed, self.scales.view(torch.float16), 5)

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        return native.quant_dequant(self.packed, self.scales.view(torch.float16), 5, rows)


class QuantEmbedding(nn.Module):
    """Embedding lookup served from a (tied) quantized LM head: rows are dequantized on demand."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @property
    def weight(self) -> Tensor:
        return self.head.dequantize()

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        rows = self.head.dequantize_rows(flat)
        return rows.view(*ids.shape, self.embedding_dim)


def native_quant(out_features: int, in_features: int, group_size: int = INT4_GROUP) -> bool:
    """Whether a quantized linear of this shape runs on our int kernel (kakeya::quant_linear): the native backend
    is in force and the shape fits its 16 x 32 tiles (int4 groups of 32)."""
    return (native.enabled() and group_size == INT4_GROUP and out_features % 16 == 0
            and in_features % INT4_GROUP == 0)


_INT4_SLOT_ORDER = sorted(range(32), key=lambda c: 16 * ((c // 4) % 2) + 4 * (c // 8) + c % 4)  # column per slot


def pack_tiles(q: Tensor, bits: int) -> Tensor:
    """Codes (N, K) (int4: 0..15; int8: -127..127) in our kernel's layout: 16 x 32 tiles, row-major by (row block,
    column block), each tile's 16 rows in order; an int4 row's 16 bytes hold column c in nibble slot
    16 * ((c // 4) % 2) + 4 * (c // 8) + c % 4 (csrc/quant_linear.cpp's int4_slot: the order its unpack reads).
    (N, K * bits / 8) uint8."""
    n, k = q.shape
    t = q.view(n // 16, 16, k // 32, 32).transpose(1, 2)  # (N/16, K/32, 16, 32)
    if bits == 4:
        c = t.to(torch.uint8)[..., _INT4_SLOT_ORDER]  # by nibble slot: slot 2j is byte j's low nibble, 2j + 1 its high
        t = c[..., 0::2] | (c[..., 1::2] << 4)
    else:
        t = t.to(torch.int8).view(torch.uint8)
    return t.contiguous().view(n, k * bits // 8)


def pack_int5(codes: Tensor) -> Tensor:
    """int5 codes (N, K) in 0..31 in our kernel's layout: 16 x 32 tiles as pack_tiles lays them, each tile row's 20
    bytes the low nibbles as an int4 row (16 bytes) then a little-endian 32-bit word, bit c = column c's fifth bit.
    (N, 5K/8) uint8."""
    n, k = codes.shape
    c = codes.to(torch.int64)
    low = pack_tiles(c & 15, 4).view(n // 16, k // 32, 16, 16)  # (N/16, K/32, 16 rows, 16 bytes)
    t = (c >> 4).view(n // 16, 16, k // 32, 32).transpose(1, 2)  # (N/16, K/32, 16, 32) fifth bits
    word = (t << torch.arange(32)).sum(-1)  # (N/16, K/32, 16): bit c = column c
    fifth = torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)  # little-endian
    return torch.cat((low, fifth), dim=-1).contiguous().view(n, k * 5 // 8)


def pack_q8_tiles(q: Tensor) -> Tensor:
    """Grouped int8 codes (N, K) in -127..127 in q8_linear's layout (csrc/q8_linear.cpp): 16 x 32 tiles, row-major by
    (row block, column block), tile byte (16 j + n) * 4 + i = row n's column 4 j + i: each 64-byte line one 4-column
    slice of the 16 rows (vpdpbusd's and an AMX int8 B tile's operand layout). (N, K) uint8."""
    n, k = q.shape
    t = q.to(torch.int8).view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # (N/16, K/32, 8, 16, 4)
    return t.contiguous().view(torch.uint8).view(n, k)


def pack_group_scales(d: Tensor) -> Tensor:
    """A per-group d (N, K/32) fp16 (int5, grouped int8) in our kernel's layout, (N/16, K/32, 16): a code tile's 16
    together, in its order."""
    n, groups = d.shape
    return d.view(n // 16, 16, groups).transpose(1, 2).contiguous()


def quantize_int5(weight: Tensor, group_size: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """(N, K) float -> (codes (N, K) uint8 in 0..31, d (N, K/G) fp16): llama.cpp's Q5_0 rule, the group's value of
    largest magnitude m at code 0, d = m / -16 rounded to fp16, then each code the nearest of (v / d) + 16 in 0..31.
    A dequantized Q5_0 block (loaded in fp32, where it is exact) gets its own codes and d back."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]  # the signed value of largest magnitude
    d = (peak / -16.0).to(torch.float16)
    df = d.float()[..., None]
    q = torch.where(df == 0, torch.zeros_like(w), torch.round(w / torch.where(df == 0, 1.0, df))).clamp(-16, 15)
    return (q + 16).to(torch.uint8).view(n, k), d


def int5_grid(weight: Tensor, group_size: int = INT4_GROUP) -> tuple[Tensor, Tensor] | None:
    """`quantize_int5`'s codes and d when they reproduce `weight` exactly (it came from GGUF Q5_0 blocks, loaded in
    fp32), else None."""
    n, k = weight.shape
    if k % group_size:
        return None
    codes, d = quantize_int5(weight, group_size)
    w = weight.detach().float().view(n, k // group_size, group_size)
    return (codes, d) if bool(((codes.view_as(w).float() - 16) * d.float()[..., None] == w).all()) else None


def int8_grid(weight: Tensor, group_size: int = INT4_GROUP) -> tuple[Tensor, Tensor] | None:
    """(codes (N, K) int8, d (N, K/G) fp16) when `weight` is exactly q * d per group with |q| <= 127 and d fp16 (GGUF
    Q8_0 blocks, loaded in fp32: d = the group's largest magnitude / 127), else None. Row chunks: a Gemma 3 head is
    262,144 rows."""
    n, k = weight.shape
    if k % group_size:
        return None
    # written in place, chunk by chunk (chunk lists and a cat left ~200 MB of a Gemma 3 start's heap unreturned)
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group_size, dtype=torch.float16)
    for lo in range(0, n, 4096):
        w = weight[lo : lo + 4096].detach().float()
        w = w.view(w.shape[0], k // group_size, group_size)
        d = (w.abs().amax(-1) / 127.0).to(torch.float16)
        df = d.float()[..., None]
        q = torch.round(w / torch.where(df == 0, 1.0, df))
        if not bool(((q.abs() <= 127) & (q * df == w)).all()):
            return None
        codes[lo : lo + 4096] = q.view(-1, k)
        scales[lo : lo + 4096] = d
    return codes, scales


def int5_exact(weight: Tensor, group_size: int = INT4_GROUP) -> bool:
    """Whether int5 groups reproduce `weight` exactly."""
    return int5_grid(weight, group_size) is not None


def _logical_scales(module: Int4Linear, state_dict: dict[str, Tensor], prefix: str, local_metadata: dict) -> None:
    state_dict[prefix + "scales_zeros"] = module.scale_zero().view(torch.int32)


def pack_scales(scales_zeros: Tensor) -> Tensor:
    """int4 (scale, zero) pairs (K/32, N, 2) in our kernel's layout, (N/16, K/32, 16, 2): a 16 x 32 code tile's
    16 pairs together, in pack_tiles' tile order (csrc/quant_linear.cpp reads them beside the codes)."""
    k32, n, _ = scales_zeros.shape
    return scales_zeros.view(k32, n // 16, 16, 2).transpose(0, 1).contiguous()


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> (q (N, K) int8, scales (N,) bf16), symmetric per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: Tensor, group_size: int = INT4_GROUP, *,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(N, K) float -> (codes (N, K) int32 in 0..15, scales_zeros (K/G, N, 2) in `dtype`: bf16 for PyTorch's kernel,
    fp32 for ours).

    Affine per group: lowest value m, step d; the kernel's zero point is m + 8d. The step is the group's
    grid when its values already lie on one with at most 16 levels (a dequantized GGUF Q4_1 / Q4_K
    block: recovered exactly, whichever codes the block used), else (max - min) / 15 (Q4_1's rule).
    Codes are chosen against the scale/zero the kernel will use (rounded to `dtype`).
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    if n % 16:
        raise ValueError(f"out_features {n} must be a multiple of 16 for the CPU int4 kernel")
    w = weight.detach().float().view(n, k // group_size, group_size)  # (N, K/G, G)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
    step = _grid_step(w, lo, hi)
    scale = torch.where(step > 0, step, (hi - lo) / 15.0)
    scale = scale.clamp(min=1e-8).to(dtype).float()
    zero = (lo + 8.0 * scale).to(dtype).float()
    codes = torch.round((w - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15).to(torch.int32)
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)
    return codes.view(n, k), scales_zeros


def _grid_step(w: Tensor, lo: Tensor, hi: Tensor, tol: float = 0.02) -> Tensor:
    """Per group (..., G): the step d if every value is lo + q*d for integers q in 0..15 (within tol*d),
    else 0. d is the smallest gap between distinct values."""
    span = (hi - lo)[..., None]
    gaps = w.sort(dim=-1).values.diff(dim=-1)
    gaps = torch.where(gaps > 1e-5 * span, gaps, torch.full_like(gaps, float("inf")))
    d = gaps.amin(dim=-1)  # inf for a constant group
    r = (w - lo[..., None]) / d[..., None]
    on_grid = ((r - r.round()).abs() <= tol).all(dim=-1) & ((hi - lo) / d <= 15 + tol) & torch.isfinite(d)
    return torch.where(on_grid, d, torch.zeros_like(d))


def int4_exact(weight: Tensor, group_size: int = INT4_GROUP, tol: float = 0.02) -> bool:
    """Whether int4 groups reproduce `weight` (within tol of a step, e.g. it came from 4-bit GGUF blocks)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    step = _grid_step(w, lo, hi, tol)
    return bool((step > 0).all() | ((hi - lo) == 0).all())


@functools.cache
def int4_block_rows() -> int:
    """Rows per block in torch's CPU int4 packed layout on this machine: 64 with AVX-512, 32 with AVX2 (torch picks
    by the CPU); measured once by packing known codes (see _unpack_int4)."""
    codes = torch.arange(128 * 64, dtype=torch.int32).view(128, 64) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for rows in (64, 32):
        if torch.equal(_unpack_int4(packed, 128, 64, rows), codes.to(torch.uint8)):
            return rows
    return 64  # another layout: Int4Linear's check after packing sees it and keeps its own codes' path


def _unpack_int4(packed: Tensor, n: int, k: int, block: int | None = None) -> Tensor:
    """Codes (N, K) uint8 from the CPU kernel's packed layout (measured on torch 2.13): rows come in blocks of
    `block` (int4_block_rows()), each stored as (K, block/2) bytes whose low nibble holds the block's first half of
    rows and high nibble its second; a shorter tail block is (K, tail/2) bytes holding row pairs (2j, 2j+1).
    Int4Linear checks this against the codes it packed and falls back if a torch build differs."""
    block = block or int4_block_rows()
    flat = packed.reshape(-1)
    full = (n // block) * block
    parts = []
    if full:
        b = flat[: full * k // 2].view(full // block, k, block // 2)  # (NB, K, block/2)
        parts.append(torch.cat((b & 15, b >> 4), dim=-1).transpose(1, 2).reshape(full, k))
    tail = n - full
    if tail:
        b = flat[full * k // 2:].view(k, tail // 2)  # (K, tail/2): byte j holds rows 2j (lo), 2j+1 (hi)
        parts.append(torch.stack((b & 15, b >> 4), dim=-1).view(k, tail).t())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _int4_rows(head: Int4Linear, rows: Tensor) -> Tensor:
    """Dequantized rows (R, K) bf16 of an Int4Linear whose N is a multiple of the packed layout's block."""
    n, k, g = head.out_features, head.in_features, head.group_size
    if head.native:
        return native.quant_dequant(head.packed, head.scales_zeros.view(torch.float32), 4, rows)
    block = int4_block_rows()
    if n % block:
        return head.dequantize()[rows]
    blocks = head.packed.view(n // block, k, block // 2)  # (NB, K, block/2)
    lane = rows % block
    b = blocks[rows // block, :, lane % (block // 2)]  # (R, K)
    q = torch.where((lane < block // 2)[:, None], b & 15, b >> 4).float()
    sz = head.scales_zeros[:, rows].transpose(0, 1).float()  # (R, K/G, 2)
    return ((q.view(-1, k // g, g) - 8) * sz[..., :1] + sz[..., 1:]).view(-1, k).to(torch.bfloat16)


@dataclass(slots=True)
class QuantReport:
    """What quantize_model did: which modules, and the resident bytes before and after."""

    fmt: WeightFormat
    head_fmt: WeightFormat
    modules: int
    weight_bytes_before: int
    weight_bytes_after: int
    kinds: dict[str, int] = field(default_factory=dict)  # module class name -> count


def quantize_model(model: nn.Module, fmt: WeightFormat | str, *, head: WeightFormat | str | None = None,
                   prefill: Prefill | str = Prefill.DEQUANT, prefill_rows: int = PREFILL_ROWS,
                   group_size: int = INT4_GROUP) -> QuantReport:
    """Convert `model` in place to `fmt`. Norms, embeddings and activations stay bf16 for the int formats.

    `head` sets the LM head's format (default: INT8 for the int formats — the head is the one matmul
    whose error reaches the logits directly; INT4 halves its bytes again). A tied head (no `lm_head`)
    becomes a quantized `lm_head`, and the embedding is then served from it (`QuantEmbedding`), so the
    bf16 table is dropped rather than kept alongside.
    """
    fmt, prefill = WeightFormat(fmt), Prefill(prefill)
    before = weight_bytes(model)
    if not fmt.quantized:
        model.to(torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16)
        # the LM head is not packed: one row per prefill (unless all logits are asked for), and often tied
        count = _replace_linears(model, lambda lin: DenseLinear(lin.weight, lin.bias, pack=True), skip=("lm_head",))
        if isinstance(getattr(model, "lm_head", None), nn.Linear):
            model.lm_head = DenseLinear(model.lm_head.weight, model.lm_head.bias)
            count += 1
        if getattr(model, "lm_head", 0) is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
            model.lm_head = DenseLinear(model.embed_tokens.weight, None)  # tied: the same tensor, no copy
            count += 1
        return QuantReport(fmt, fmt, count, before, weight_bytes(model), _kinds(model))
    head_fmt = WeightFormat(head) if head is not None else WeightFormat.INT8

    def make(linear_weight: Tensor, bias: Tensor | None, f: WeightFormat) -> nn.Module:
        grid = grid8 = None
        n, k = linear_weight.shape
        ours = group_size == INT4_GROUP and native_quant(n, k)
        if f is WeightFormat.INT4_MIXED:
            if int4_exact(linear_weight, group_size):
                f = WeightFormat.INT4
            else:  # Q5_0 blocks kept as they are where our kernels run; other finer tensors in int8
                if ours:
                    grid = int5_grid(linear_weight)
                f = WeightFormat.INT8
        if f is WeightFormat.INT8 and grid is None and ours:
            grid8 = int8_grid(linear_weight)  # Q8_0 blocks kept as they are (per group); else per-row int8
        if grid is not None:
            m: QuantLinear = Int5Linear(linear_weight, bias, prefill=prefill, prefill_rows=prefill_rows, grid=grid)
        elif f is WeightFormat.INT8:
            m = Int8Linear(linear_weight, bias, prefill=prefill, prefill_rows=prefill_rows, grid=grid8)
        elif f is WeightFormat.INT4:
            m = Int4Linear(linear_weight, bias, group_size=group_size, prefill=prefill, prefill_rows=prefill_rows)
        else:
            raise ValueError(f"{f} is not a quantized format")
        if m.prefill is Prefill.COPY:
            m.bf16_copy = linear_weight.detach().to(torch.bfloat16).clone()
        return m

    count = _replace_linears(model, lambda lin: make(lin.weight, lin.bias, fmt), skip=("lm_head",))
    if head_fmt.quantized:
        lm_head = getattr(model, "lm_head", None)
        if isinstance(lm_head, nn.Linear):
            model.lm_head = make(lm_head.weight, lm_head.bias, head_fmt)
            count += 1
        elif lm_head is None and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
            model.lm_head = make(model.embed_tokens.weight, None, head_fmt)
            model.embed_tokens = QuantEmbedding(model.lm_head)
            count += 1
    # Quantized from the weights as loaded (fp32 keeps GGUF codes exact); the rest runs in bf16, because
    # the int kernels take bf16 activations (they are 10-40x slower on fp32).
    model.to(torch.bfloat16)
    return QuantReport(fmt, head_fmt, count, before, weight_bytes(model), _kinds(model))


def _kinds(model: nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, DenseLinear | QuantLinear):
            out[type(m).__name__] = out.get(type(m).__name__, 0) + 1
    return out


def _replace_linears(model: nn.Module, make, skip: tuple[str, ...] = ()) -> int:
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in skip:
                setattr(parent, name, make(child))
                count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's parameters and buffers, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
