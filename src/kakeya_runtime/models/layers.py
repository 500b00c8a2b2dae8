"""Layers shared by every model family: norms, RoPE, the one attention computation, gated MLP.

Shapes: B batch, T new tokens, S keys attended, H query heads, Hk key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kakeya_runtime.models import native


class LayerKV(Protocol):
    """What a decoder layer needs from its caller-owned cache (implemented in kakeya_runtime.kv). A cache with
    preallocated storage may also offer `append_slot()` (kv.cache's full and ring layers, sink_window's identity ring): the batched decode rows
    then write its token in their native attention call instead of calling update_and_fetch."""

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store the new post-RoPE K/V (B, Hk, T, D) at `positions` (T,); return the keys and values
        the new queries may attend to, (B, Hk, S, D) each, and their positions (S,)."""
        ...


@dataclass(slots=True)
class RowKV:
    """The per-row cache arguments of one batched attention call (native.cached_attention_rows_append, and
    kakeya::decoder_layer through models.native_layer): each row's keys, values, positions, its write slot and the
    window rule it attends under; or, through `add_chunk`, one prefill chunk's per layer."""

    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    k_pos: list[Tensor] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    writes: list[bool] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    sinks: list[int] = field(default_factory=list)

    def add(self, kv: LayerKV, window: int | None, new: tuple[Tensor, Tensor, Tensor] | None = None) -> None:
        """Row `kv`: a cache with preallocated storage (`append_slot`) has the row's K/V written by the call; any
        other is given `new` (k, v, positions) through update_and_fetch now. `window`: the layer's own, unless
        the cache narrows what queries see (`attention_rule`)."""
        append_slot = getattr(kv, "append_slot", None)
        if append_slot is not None:
            self._add(kv, window, *append_slot())
            return
        k_all, v_all, kp = kv.update_and_fetch(*new)
        if k_all.stride(-1) != 1 or v_all.stride(-1) != 1:
            k_all, v_all = k_all.contiguous(), v_all.contiguous()
        self._add(kv, window, k_all, v_all, kp.contiguous(), -1, k_all.shape[2], False)

    def add_chunk(self, kv: LayerKV, window: int | None, n: int) -> None:
        """A prefill chunk's entry for one layer (kakeya.DecoderStack's step_chunk): n consecutive tokens of the
        sequence in `kv` (its `append_run`), all written before any attends, then the keys up to the last one's count,
        each token seeing by position. One entry a layer, with its n write slots in `slots`."""
        rooms = kv.append_run(n)
        k_all, v_all, kp, _, count, write = rooms[-1]
        self._add(kv, window, k_all, v_all, kp, rooms[0][3], count, write)
        self.slots.extend(room[3] for room in rooms[1:])

    def _add(self, kv: LayerKV, window: int | None, k_all: Tensor, v_all: Tensor, kp: Tensor, slot: int, count: int,
             write: bool) -> None:
        sink, window = getattr(kv, "attention_rule", None) or (0, window)
        self.k.append(k_all)
        self.v.append(v_all)
        self.k_pos.append(kp)
        self.slots.append(slot)
        self.counts.append(count)
        self.writes.append(write)
        self.windows.append(window or 0)
        self.sinks.append(sink)


class RowCaches:
    """One layer's caches for rows that are independent sequences, one new token each (a decode step of several
    sessions in one forward): projections and MLP run over all rows at once, attention per row over its own
    cache. Every op is row-wise or row-invariant, so a row's result is the one it gets alone.

    With `chunks` (token counts) the last sum(chunks) rows are not decode rows but prefill chunks of len(chunks)
    more sequences (the last caches, in order), each its sequence's consecutive tokens: prefill chunks riding the
    decode step. A chunk's attention is the plain chunk path over its own cache, on the same inputs, so its K/V and
    outputs are the ones it gets in a forward of its own."""

    __slots__ = ("caches", "chunks")

    def __init__(self, caches: Sequence[LayerKV], chunks: Sequence[int] = ()) -> None:
        self.caches = list(caches)
        self.chunks = tuple(chunks)


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32. Gemma stores w as an offset: scale = 1 + w."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if _native_rows(x):
            return native.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps,
                                   unit_offset=self.unit_offset).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(residual + x, this norm of that sum): one pass with the native kernels, else the add then forward."""
        if _native_rows(x) and residual.dtype == x.dtype and residual.shape == x.shape:  # else torch broadcasts
            s, y = native.add_rms_norm(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), self.weight,
                                       self.eps, unit_offset=self.unit_offset)
            return s.view(x.shape), y.view(x.shape)
        s = residual + x
        return s, self(s)


def _native_rows(x: Tensor) -> bool:
    """Whether the row-wise kernels (native.rms_norm, add_rms_norm, qkv_rope) serve activations like x: the
    native backend, float32 or bfloat16. Each row in fp32, rounded once, the same bits in any call shape."""
    return x.dtype in (torch.float32, torch.bfloat16) and native.enabled()


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face convention) with a fixed base.

    cos/sin come from a table built in blocks of TABLE_BLOCK positions, each by the same fixed-shape float64
    computation (small enough to run on one thread), then read by position. A position's angles are therefore
    the same bits in a decode step, a turn or a prompt (a vectorised cos over a tensor whose size varies sends
    some elements through a scalar tail with other rounding), and the same at any thread count.
    """

    TABLE_BLOCK = 256

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[torch.dtype, tuple[Tensor, Tensor]] = {}  # per dtype: cos, sin (positions, D)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self._table(int(positions.max()) + 1 if positions.numel() else 0, dtype)
        return cos[positions], sin[positions]  # (T, D): copies of table rows

    def _table(self, needed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self._tables.get(dtype, (None, None))
        have = 0 if cos is None else cos.shape[0]
        if have >= needed:
            return cos, sin
        new_cos, new_sin = [cos] if cos is not None else [], [sin] if sin is not None else []
        for start in range(have, needed, self.TABLE_BLOCK):
            pos = torch.arange(start, start + self.TABLE_BLOCK, device=self.inv_freq.device)
            freqs = pos.float()[:, None] * self.inv_freq[None, :]  # (block, D/2): fp32, exact products
            half_cos, half_sin = freqs.double().cos().float(), freqs.double().sin().float()
            new_cos.append(torch.cat((half_cos, half_cos), dim=-1).to(dtype))
            new_sin.append(torch.cat((half_sin, half_sin), dim=-1).to(dtype))
        self._tables[dtype] = (torch.cat(new_cos), torch.cat(new_sin))
        return self._tables[dtype]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None, sink: int = 0) -> Tensor:
    """Boolean (T, S) mask, True where query i may attend key j: causal, and inside the window
    (or, with `sink`, one of the first `sink` positions: StreamingLLM's rule)."""
    rel = q_pos[:, None] - k_pos[None, :]  # (T, S)
    allowed = rel >= 0
    if window is not None:
        inside = rel < window
        if sink:
            inside |= k_pos[None, :] < sink
        allowed &= inside
    return allowed


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    scale: float,
    window: int | None,
    trace: bool = False,
    sink: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """The one attention computation used by prefill and decode.

    q: (B, H, T, D); k, v: (B, Hk, S, D) at positions k_pos (S,). Query t sees key j when
    k_pos[j] <= q_pos[t] and, with a window, q_pos[t] - k_pos[j] < window or k_pos[j] < sink. Returns
    (out (B, H, T, D), attn row of the last query (B, H, S) if `trace`).

    With the native backend every case (a fresh prompt, a chunk over a cache, a decode step, any window)
    runs on our kernel, whose result for a query depends only on the keys it sees: the same bits however
    the history was chunked. With `trace`, the probabilities are materialised and the output is computed
    from them, so the traced row is the one that produced the output (evidence only, not invariant).
    """
    num_q = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    if not trace and native.enabled():
        if not native.supports(q.shape[3], q.dtype):
            raise native.NativeKernelError(
                f"head_dim {q.shape[3]} / {q.dtype} has no invariant attention kernel (head sizes "
                f"{native.HEAD_DIMS}, float32 or bfloat16); set {native.BACKEND_ENV}=sdpa for PyTorch's kernels")
        return _attend_native(q, k, v, q_pos, k_pos, scale, groups, window, sink), None
    if not trace and num_q > 1 and k.shape[2] > num_q and window is None and _chunk_follows_cache(q_pos, k_pos):
        return _attend_cached_chunk(q, k, v, scale, groups), None
    mask = None
    if num_q > 1 and not (window is None and k.shape[2] == num_q):  # a fresh prompt: SDPA's causal kernel
        mask = attention_mask(q_pos, k_pos, window, sink)
    if not trace:
        if groups > 1 and (num_q == 1 or mask is not None):
            return _attend_grouped(q, k, v, mask, scale, groups), None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=num_q > 1 and mask is None, scale=scale, enable_gqa=True
        )
        return out, None
    kr = k.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    vr = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), kr.float().transpose(-1, -2)) * scale  # (B, H, T, S)
    if num_q > 1:
        full = mask if mask is not None else attention_mask(q_pos, k_pos, window, sink)
        scores = scores.masked_fill(~full, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), vr)
    return out, probs[:, :, -1, :]


def _attend_grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, groups: int) -> Tensor:
    """GQA without repeating K/V: the `groups` query heads that share a K/V head become extra query rows
    of that head, (B, Hk, G*T, D), so each K/V head is read once. SDPA's enable_gqa path on CPU copies
    K/V `groups` times per call, a cost that grows with the cache (decode is memory-bound)."""
    b, h, t, d = q.shape
    qg = q.reshape(b, k.shape[1], groups * t, d)  # rows ordered (group, token)
    if mask is not None:
        mask = mask.repeat(groups, 1)  # (G*T, S), same order
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, h, t, d)


def _attend_native(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, groups: int,
                   window: int | None, sink: int) -> Tensor:
    """Our kernel with grouped query rows (B, Hk, G*T, D), as in _attend_grouped."""
    b, h, t, d = q.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    out = native.cached_attention(q.contiguous().reshape(b, k.shape[1], groups * t, d), k, v, q_pos.contiguous(),
                                  k_pos.contiguous(), scale, window=window, sink=sink)
    return out.reshape(b, h, t, d)


def _chunk_follows_cache(q_pos: Tensor, k_pos: Tensor) -> bool:
    """True when the keys are the cached prefix, all before the chunk, then the chunk itself (increasing):
    every query sees the whole prefix, and the chunk causally."""
    t, p = q_pos.shape[0], k_pos.shape[0] - q_pos.shape[0]
    if p < 1 or not torch.equal(k_pos[p:], q_pos):
        return False
    return bool((q_pos[1:] > q_pos[:-1]).all()) and int(k_pos[:p].max()) < int(q_pos[0]) if t > 1 else True


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp (B, H, T) fp32)


def _attend_cached_chunk(q: Tensor, k: Tensor, v: Tensor, scale: float, groups: int) -> Tensor:
    """A chunk appended to a cache: two maskless flash calls, the prefix (grouped query rows, nothing masked)
    and the chunk (causal), merged by their log-sum-exp. The general path builds a (T, S) mask per layer
    that SDPA converts and reads: a third of the time at 7k keys, and O(chunk × T) scratch in a long prefill."""
    b, h, t, d = q.shape
    p = k.shape[2] - t
    o_pre, lse_pre = _flash(q.reshape(b, k.shape[1], groups * t, d), k[:, :, :p], v[:, :, :p], scale=scale)
    k_new, v_new = k[:, :, p:], v[:, :, p:]
    if groups > 1:  # T rows per head: a small copy
        k_new, v_new = k_new.repeat_interleave(groups, dim=1), v_new.repeat_interleave(groups, dim=1)
    o_new, lse_new = _flash(q, k_new, v_new, is_causal=True, scale=scale)
    lse_pre = lse_pre.reshape(b, h, t, 1)
    lse_new = lse_new.reshape(b, h, t, 1)
    lse = torch.logaddexp(lse_pre, lse_new)
    out = o_pre.reshape(b, h, t, d).float() * (lse_pre - lse).exp() + o_new.float() * (lse_new - lse).exp()
    return out.to(q.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, out_fp32: bool = False,
           packed: Tensor | None = None) -> Tensor:
    """x (..., K) -> (..., N). With the native backend, our kernel: each output element is computed by one
    fixed sequence of operations, whatever the number of rows in the call (a decode step, a turn, a batch).
    `out_fp32`: fp32 results (the LM head's logits), without rounding the sums to x's dtype first. `packed`:
    `native.linear_pack(weight)` (the same results, less work per call of many rows)."""
    if not native.enabled():
        y = F.linear(x, weight, bias)
        return y.float() if out_fp32 else y
    y = native.linear(x.reshape(-1, x.shape[-1]), weight, bias, out_fp32=out_fp32, packed=packed)
    return y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state dict) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def forward_fp32(self, x: Tensor) -> Tensor:
        """The same sums, returned in fp32 (logits: no bf16 rounding that could tie the top tokens)."""
        return linear(x, self.weight, self.bias, out_fp32=True)

    def decode_args(self) -> DecodeArgs | None:
        """What kakeya::decoder_layer needs to run this projection as `forward` does (models/native_layer.py)."""
        return DecodeArgs(0, self.weight, None, self.bias, self.weight.dtype, None)


class DecodeArgs(NamedTuple):
    """A projection as kakeya::decoder_layer runs it: fmt 0 (kakeya::linear, bias in the kernel) or 4 / 8
    (kakeya::quant_linear int4 / int8, bias added after), its tensors, the activation dtype it takes without a cast,
    and the row count from which its forward leaves that kernel (None: never)."""

    fmt: int
    weight: Tensor
    scales: Tensor | None
    bias: Tensor | None
    dtype: torch.dtype
    max_rows: int | None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.fused_act: str | None = None  # the native kernels' one-pass act(gate) * up, when they have it
        if act == "silu":
            self.act = F.silu
            self.fused_act = "silu"
        elif act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act = lambda x: F.gelu(x, approximate="tanh")
            self.fused_act = "gelu_tanh"
        elif act == "gelu":
            self.act = F.gelu
        else:
            raise ValueError(f"unsupported activation {act!r}")
        self._register_load_state_dict_pre_hook(_fuse_hook(("gate_proj", "up_proj"), "gate_up_proj"))

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_act is not None and native.enabled():
            h = native.gated_act(gate_up.reshape(-1, gate_up.shape[-1]), self.fused_act)
            return self.down_proj(h.view(*gate_up.shape[:-1], self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _fuse_hook(parts: tuple[str, ...], fused: str):
    """Load HF checkpoints (separate q/k/v or gate/up projections) into one fused Linear."""

    def hook(state_dict, prefix, *args, **kwargs):
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{p}.{suffix}" for p in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)
            elif any(k in state_dict for k in keys):  # else strict loading blames the fused name and the parts
                raise RuntimeError(f"missing tensor {', '.join(k for k in keys if k not in state_dict)} "
                                   f"(beside {', '.join(k for k in keys if k in state_dict)})")

    return hook


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads, fused QKV, optional per-head q/k norms (Gemma 3)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        scale: float,
        window: int | None,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window = scale, window
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=True)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=True)
        else:
            self.q_norm = self.k_norm = None
        self._register_load_state_dict_pre_hook(_fuse_hook(("q_proj", "k_proj", "v_proj"), "qkv_proj"))

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: LayerKV | None,
        trace: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        qkv = self.qkv_proj(x)
        if isinstance(cache, RowCaches):
            return self.o_proj(self._rows(qkv, positions, cos, sin, cache)), None
        out, row = self._sequence(qkv, positions, cos, sin, cache, trace)
        return self.o_proj(out), row

    def _split_rope(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """qkv (B, T, C) -> q (B, H, T, D), k (B, Hk, T, D) normed (Gemma) and rotated, v (B, Hk, T, D). cos, sin:
        (T, D) shared by the batch, or (B, 1, D) one row each (decode rows). With the native kernels q and k come
        from one pass (native.qkv_rope: each head in fp32, rounded once), contiguous."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if _native_rows(qkv) and cos.dtype == qkv.dtype and qkv.stride(-1) == 1:
            cos, sin = cos.expand(b, t, self.head_dim), sin.expand(b, t, self.head_dim)
            norms = {}
            if self.q_norm is not None:
                norms = {"q_norm": self.q_norm.weight, "k_norm": self.k_norm.weight, "eps": self.q_norm.eps,
                         "unit_offset": self.q_norm.unit_offset}
            q, k = native.qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, **norms)
            return q, k, v
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 3:  # one row per batch entry: (B, 1, D) -> (B, 1, 1, D) over (B, H, 1, D)
            cos, sin = cos[:, None], sin[:, None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _rows(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: RowCaches) -> Tensor:
        """Decode rows (one token each, positions[b] row b's position) and optional trailing prefill chunks;
        attention outputs (N, 1, H*D) before o_proj."""
        n = qkv.shape[0]
        r = n - sum(cache.chunks)
        outs = []
        if r:
            q, k, v = self._split_rope(qkv[:r], cos[:r, None, :], sin[:r, None, :])
            out = self._attend_rows(q, k, v, positions[:r], cache.caches[:r])  # (r, H, 1, D)
            outs.append(out.transpose(1, 2).reshape(r, 1, self.q_size))
        a = r
        for j, c in enumerate(cache.chunks):
            b = a + c
            out, _ = self._sequence(qkv[a:b].view(1, c, qkv.shape[-1]), positions[a:b], cos[a:b], sin[a:b],
                                    cache.caches[r + j], False)
            outs.append(out.view(c, 1, self.q_size))
            a = b
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def attend_mixed(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cache: RowCaches) -> Tensor:
        """`_rows` from q (N, H, 1, D), k, v (N, Hk, 1, D) already normed and rotated (models.native_layer's first
        half): decode rows, then the trailing prefill chunks; attention outputs (N, H*D), each row's the bits its
        own path gives it (a chunk's rows are its sequence's tokens, as `_sequence` attends them)."""
        n = q.shape[0]
        r = n - sum(cache.chunks)
        outs = []
        if r:
            outs.append(self._attend_rows(q[:r], k[:r], v[:r], positions[:r], cache.caches[:r]).reshape(r, -1))
        a = r
        for j, c in enumerate(cache.chunks):
            b = a + c
            qc, kc, vc = (x[a:b].transpose(0, 2).contiguous() for x in (q, k, v))  # (1, heads, c, D)
            out, _ = self._attend_sequence(qc, kc, vc, positions[a:b], cache.caches[r + j], False)
            outs.append(out.view(c, self.q_size))
            a = b
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _sequence(self, qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV | None,
                  trace: bool) -> tuple[Tensor, Tensor | None]:
        """New tokens (B, T) of one sequence each: attention outputs (B, T, H*D) before o_proj."""
        q, k, v = self._split_rope(qkv, cos, sin)
        return self._attend_sequence(q, k, v, positions, cache, trace)

    def _attend_sequence(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cache: LayerKV | None,
                         trace: bool) -> tuple[Tensor, Tensor | None]:
        """`_sequence` after the rotation: q (B, H, T, D), k, v (B, Hk, T, D) -> (B, T, H*D)."""
        b, t = q.shape[0], q.shape[2]
        if getattr(cache, "owns_attention", False):  # kv.sparse: the cache picks the keys from the queries
            if trace:
                raise ValueError("attention rows cannot be traced through a cache that attends itself")
            out = cache.attend(q, k, v, positions, scale=self.scale)
            return out.transpose(1, 2).reshape(b, t, self.q_size), None
        if cache is None:
            k_all, v_all, k_pos = k, v, positions
        else:
            k_all, v_all, k_pos = cache.update_and_fetch(k, v, positions)
        # A cache may narrow what queries see (kv.sink_window: sinks + last window); chunk masks follow it.
        sink, window = getattr(cache, "attention_rule", None) or (0, self.window)
        out, row = attend(q, k_all, v_all, positions, k_pos, scale=self.scale, window=window, trace=trace,
                          sink=sink)
        return out.transpose(1, 2).reshape(b, t, self.q_size), row  # (B, T, H*D)

    def _attend_rows(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, caches: Sequence[LayerKV]) -> Tensor:
        """Decode rows q, k, v (N, H or Hk, 1, D), row i one token at positions[i] of the sequence caches[i] holds:
        each row's attention over its own cache, (N, H, 1, D). With the native kernel the rows whose cache hands out
        its keys share ONE call (native.cached_attention_rows_append: each row the bits of its own call); a cache
        with preallocated storage (`append_slot`: kv.cache's full and ring layers, sink_window's identity ring) has its new K/V written in that
        call too, the others (update_and_fetch) before it. A cache that attends itself (kv.sparse) and the other
        backends go row by row."""
        if not (native.enabled() and native.supports(self.head_dim, q.dtype)):
            return torch.cat([self._attend_row(q[i : i + 1], k[i : i + 1], v[i : i + 1], positions[i : i + 1], kv)
                              for i, kv in enumerate(caches)])
        out = None
        rows: list[int] = []
        args = RowKV()
        for i, kv in enumerate(caches):
            if getattr(kv, "owns_attention", False):
                if out is None:
                    out = q.new_empty(q.shape)
                out[i : i + 1] = kv.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], positions[i : i + 1],
                                           scale=self.scale)
                continue
            args.add(kv, self.window, (k[i : i + 1], v[i : i + 1], positions[i : i + 1]))
            rows.append(i)
        if not rows:
            return out
        if out is not None:  # some rows attended themselves: the others only
            q, k, v, positions = q[rows], k[rows], v[rows], positions[rows]
        m, groups = len(rows), self.num_heads // self.num_kv_heads
        got = native.cached_attention_rows_append(
            q.reshape(m, self.num_kv_heads, groups, self.head_dim).contiguous(), k, v, args.k, args.v, args.k_pos,
            args.slots, args.counts, args.writes, positions.contiguous(), self.scale, window=args.windows,
            sink=args.sinks)
        got = got.view(m, self.num_heads, 1, self.head_dim)  # query head h * groups + g: row g of K/V head h
        if out is None:
            return got
        out[rows] = got
        return out

    def _attend_row(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cache: LayerKV) -> Tensor:
        if getattr(cache, "owns_attention", False):
            return cache.attend(q, k, v, positions, scale=self.scale)
        k_all, v_all, k_pos = cache.update_and_fetch(k, v, positions)
        sink, window = getattr(cache, "attention_rule", None) or (0, self.window)
        return attend(q, k_all, v_all, positions, k_pos, scale=self.scale, window=window, sink=sink)[0]
