"""Our CPU kernels (csrc/): built once per machine, loaded as torch ops.

- `kakeya::cached_attention(q, k, v, q_pos, k_pos, window, sink, scale)`: every attention call of the models
  (fresh prompts, chunks over a cache, decode steps, windows), one fixed order of operations per query.
- `kakeya::linear(x, w, bias, out_fp32)`: every projection and the LM head, one fixed order per output element.
- `kakeya::quant_linear(x, q, sz, bits, bias)`: weight-only int4 / int8 projections, the weights dequantized to
  bf16 inside the kernel and multiplied as `linear` multiplies them (so just as invariant).
- `kakeya::gated_act(x, act)`: the gated MLP's act(gate) * up in one elementwise pass.
- `kakeya::rms_norm` / `kakeya::add_rms_norm` / `kakeya::qkv_rope`: RMSNorm (after the residual add) and RoPE on
  q and k (after Gemma's q/k norms), each row in fp32 and rounded once (csrc/rowwise.cpp).
- `kakeya::decoder_layer`: one decoder layer's decode rows (the ops above, in the Python path's order) in one call,
  or in two around a policy cache's own attention (`decoder_layer_attention_inputs`, `decoder_layer_output`)
  (models/native_layer.py); `kakeya::decoder_layer_sparse`: a decode row's layer over a sparse cache, the sparse
  step between the halves, in one call; `kakeya.DecoderStack` (a class built once per model): every layer's
  decoder_layer of a step in one call.
- `kakeya::sparse_attention` / `kakeya::block_select`: the sparse KV policy's attention over an exact hot set and
  selected cold blocks, and its indexer (kv.sparse), with the same per-query invariance; `kakeya::sparse_step`
  runs both and the step's tripwire in one call.

So a position's K/V and logits do not depend on the shape of the step they ran in (see layers.attend and
layers.linear). The library is compiled with g++ against the installed torch for this CPU (-march=native) on
first use, under the kakeya cache dir, keyed by the sources, the flags, torch's version, the compiler and the
CPU's feature flags; later processes load it in milliseconds. A build takes ~16 s.

Routes: on a CPU with AMX tiles, attention and projections each have two invariant paths (AMX tiles, or
AVX-512 BF16 dot products). Which one serves is measured, not assumed: the first process after a build times
both on a prefill chunk over a cache plus decode steps (about a second, `calibrate`) and keeps the faster,
preferring AMX unless the other wins by ROUTE_MARGIN; the choice is cached beside the library (routes.json,
so keyed like the build: sources, flags, torch, compiler, CPU flags) and every later process loads it. One
route serves every shape in a process (decode, chunk, fresh prompt), so a position computes alike in any step.

`KAKEYA_ATTENTION=sdpa` switches to PyTorch's SDPA and GEMMs (faster on long fresh prompts, not invariant);
with the default `native`, kernels that cannot be built raise NativeKernelError instead of quietly running the
other path. `KAKEYA_AMX=0` keeps the kernels off AMX tiles (the AVX-512 paths CPUs without AMX take).
`KAKEYA_PACK_WEIGHTS=1` packs the projections' AMX tiles once at load (a second copy) instead of per prefill call.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("cached_attention.cpp", "invariant_linear.cpp", "block_index.cpp",
                             "lattice_points.cpp", "threads.cpp", "rowwise.cpp", "quant_linear.cpp", "q8_linear.cpp",
                             "decoder_layer.cpp", "argmax.cpp", "sampling.cpp"))
BACKEND_ENV = "KAKEYA_ATTENTION"
BACKENDS = ("native", "sdpa")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the attention kernel's compiled head sizes
CXXFLAGS = ("-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fopenmp")


ROUTE_MARGIN = 0.85  # the AVX-512 path replaces AMX only when it takes less than this fraction of AMX's time
ROUTES_FILE = "routes.json"


class NativeKernelError(RuntimeError):
    """The native attention kernel could not be built or loaded (the message has the compiler's output)."""


@dataclass(slots=True)
class Routes:
    """Which invariant path serves bf16 attention and projections in this process, and the timings (seconds per
    calibration workload, AMX vs AVX-512) it was chosen from; `source`: "calibrated", "cached" or "no-amx"."""

    attention_amx: bool
    linear_amx: bool
    timings: dict[str, float]
    source: str


_lock = threading.Lock()
_loaded: Path | None = None
_backend: str | None = None
_bf16_dot = False
_routes: Routes | None = None


def backend() -> str:
    """The attention backend in force: $KAKEYA_ATTENTION, else "native" (read once per process)."""
    global _backend
    if _backend is None:
        value = os.environ.get(BACKEND_ENV, "native").strip().lower() or "native"
        if value not in BACKENDS:
            raise NativeKernelError(f"{BACKEND_ENV}={value!r}: expected one of {BACKENDS}")
        _backend = value
    return _backend


def set_backend(value: str) -> None:
    """Choose the backend for this process ("native" builds/loads the kernel now)."""
    global _backend
    if value not in BACKENDS:
        raise NativeKernelError(f"attention backend {value!r}: expected one of {BACKENDS}")
    _backend = value
    if value == "native":
        load()


def enabled() -> bool:
    """Whether `layers.attend` uses the kernel: the backend is native (the kernel is built and loaded on the
    first call). Cheap after that."""
    if (_backend or backend()) != "native":
        return False
    if _loaded is None:
        load()
    return True


def bf16_amx() -> bool:
    """Whether bf16 attention and projections run on AMX tiles here (CPUs with AMX-BF16)."""
    load()
    return bool(torch.ops.kakeya.bf16_amx())


def bf16_dot() -> bool:
    """Whether the kernel was built with AVX512-BF16 dot products (its bf16 chunk path beats SDPA's then)."""
    load()
    return _bf16_dot


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the kernel has code for (anything else stays on SDPA)."""
    return head_dim in HEAD_DIMS and dtype in (torch.float32, torch.bfloat16)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     scale: float, *, window: int | None = None, sink: int = 0) -> torch.Tensor:
    """q (B, Hk, R, D) rows ordered (group, token), T = len(q_pos) tokens; k, v (B, Hk, S, D) at positions
    k_pos (S,). Token t sees key j iff k_pos[j] <= q_pos[t] and, with a window, q_pos[t] - k_pos[j] < window
    or k_pos[j] < sink. Each query's result depends only on the keys it sees. Returns (B, Hk, R, D)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.cached_attention(q, k, v, q_pos, k_pos, window or 0, sink, scale)


def cached_attention_rows(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], k_pos: list[torch.Tensor],
                          q_pos: torch.Tensor, scale: float, *, window: list[int], sink: list[int]) -> torch.Tensor:
    """The decode rows of a batched step, each one token of its own sequence over its own cache, in one call:
    q (N, Hk, G, D) contiguous, row i's G query rows per K/V head; k[i], v[i] (1, Hk, S_i, D) at positions
    k_pos[i] (S_i,); q_pos (N,); window[i] (0: none) and sink[i] as in `cached_attention`. Returns (N, Hk, G, D),
    row i the bits `cached_attention(q[i:i+1], k[i], v[i], q_pos[i:i+1], k_pos[i], ...)` gives it alone."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.cached_attention_rows(q, k, v, k_pos, q_pos, window, sink, scale)


def cached_attention_rows_append(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k: list[torch.Tensor],
                                 v: list[torch.Tensor], k_pos: list[torch.Tensor], slot: list[int], count: list[int],
                                 write_pos: list[bool], q_pos: torch.Tensor, scale: float, *, window: list[int],
                                 sink: list[int]) -> torch.Tensor:
    """`cached_attention_rows` with each row's cache write in the same call (decode rows over preallocated caches):
    row i with slot[i] >= 0 stores k_new[i], v_new[i] (Hk, 1, D) at slot[i] of its buffers k[i], v[i]
    (1, Hk, A_i, D) (and, with write_pos[i], its position q_pos[i] at k_pos[i][slot[i]]), then attends their first
    count[i] slots; a row with slot[i] < 0 attends k[i], v[i], k_pos[i] as given. Returns (N, Hk, G, D), each row
    the bits of the same write then `cached_attention` alone."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.cached_attention_rows_append(q, k_new, v_new, k, v, k_pos, slot, count, write_pos, q_pos,
                                                         window, sink, scale)


def sparse_attention(q: torch.Tensor, hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     cold: tuple[torch.Tensor, ...], select: torch.Tensor, q_pos: torch.Tensor,
                     scale: float, *, window: int, sink: int, block: int,
                     cold_head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two key sources: `hot` (k, v, positions) exact, seen by token t at positions below `sink`
    or in its hot range hot_lo(t)..t (the last `window` positions extended down to a block boundary counted
    from `sink`), and `cold` (k, v (B, Hk, U * block, D) blocks in q's dtype, slot (N,) int64: where block j is,
    -1 if absent, or (Hc, N): per cold head; or k, v int8 codes, k_scale, v_scale fp16 (B, Hk, U * block), slot): token t attends the blocks
    its `select` bitset (B, Hk, T, words) names among those wholly below hot_lo(t) (each token's result its own
    bits, in a chunk or alone); a
    selected block that is absent raises. Cold tensors hold the heads `cold_head` (Hk,) maps to (-1: a head with
    no cold tier; default: every head, in order). Returns the output (B, Hk, R, D) and the keys each row saw,
    (B, Hk, R, 2) int64 (hot, cold)."""
    if _loaded is None:
        load()
    k, v, *scales, slot = cold
    k_scale, v_scale = scales if scales else (None, None)
    if cold_head is None:
        cold_head = torch.arange(q.shape[1])
    return torch.ops.kakeya.sparse_attention(q, *hot, k, v, k_scale, v_scale, slot, cold_head, select, q_pos, window,
                                             sink, block, scale)


def block_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, q_pos: torch.Tensor, *, window: int,
                 sink: int, block: int, topk: int | torch.Tensor, scale: float = 0.0,
                 budget: float = 0.0, budget_topk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse policy's indexer: for each token (rows of q (B, Hk, R, D) ordered (group, token)) the cold
    blocks with the largest estimated attention share (per query head a softmax, at `scale` (0: 1/sqrt(D)), of
    its logit bound over the block's key min/max box (B, Hk, N, D), shrunk about its centre and whole; summed
    over the heads sharing the KV head; the larger of the two shares), among the n(t) blocks wholly outside its
    window; it keeps min(n(t), max(topk,
    ceil(budget * n(t)))). `topk`: one for every head, or (Hk,) int64 per head (0: a streaming head, which has
    no summaries: kmin/kmax then hold only the heads with topk > 0). `budget_topk` (per-head counts): the policy's
    topk; a head with another topk grows to ceil(budget * n(t) * topk / budget_topk) instead. Returns (select (B, Hk, T, words) int64
    bitsets, scored (B, Hk, T) int64 = n(t), 0 for streaming heads); raises when a token could select a block
    that has no summary."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.block_select(q, kmin, kmax, q_pos, window, sink, block, _per_head(topk, q.shape[1]),
                                         scale, budget, budget_topk)


def sparse_check(seen: torch.Tensor, scored: torch.Tensor, q_pos: torch.Tensor, *, window: int, sink: int,
                 block: int, topk: int | torch.Tensor, counters: torch.Tensor, budget: float = 0.0,
                 budget_topk: int = 0) -> None:
    """The sparse step's tripwire on sparse_attention's `seen` counts: raises unless every query row saw exactly
    its sinks and hot range and the whole cold blocks the indexer keeps (block_select's count; 0 for a streaming
    head). Then adds the step to `counters`, int64 (8,):
    steps, query tokens x KV heads, blocks scored, blocks selected, keys attended, keys visible (summed), and
    the newest token's attended and visible keys (summed over batch and KV heads, set each step)."""
    if _loaded is None:
        load()
    torch.ops.kakeya.sparse_check(seen, scored, q_pos, window, sink, block, _per_head(topk, seen.shape[1]), counters,
                                  budget, budget_topk)


def sparse_step(q: torch.Tensor, hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cold: tuple[torch.Tensor, ...],
                kmin: torch.Tensor, kmax: torch.Tensor, n_blocks: int, q_pos: torch.Tensor, scale: float, *,
                window: int, sink: int, block: int, topk: torch.Tensor, cold_head: torch.Tensor,
                counters: torch.Tensor, budget: float = 0.0, budget_topk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """block_select over the first n_blocks summaries, sparse_attention over `hot` and `cold` (a cold tier the
    kernel reads as stored: bf16 blocks or int8 codes with their scales, and the slots) and sparse_check into
    `counters`, in one call. Returns the output (B, Hk, R, D) and the selection bitsets (B, Hk, T, words)."""
    if _loaded is None:
        load()
    k, v, *scales, slot = cold
    k_scale, v_scale = scales if scales else (None, None)
    return torch.ops.kakeya.sparse_step(q, *hot, k, v, k_scale, v_scale, slot, cold_head, kmin, kmax, n_blocks, topk,
                                        q_pos, window, sink, block, scale, counters, budget, budget_topk)


def sparse_step_decoded(q: torch.Tensor, hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cold_head: torch.Tensor,
                        kmin: torch.Tensor, kmax: torch.Tensor, n_blocks: int, q_pos: torch.Tensor, scale: float, *,
                        window: int, sink: int, block: int, topk: torch.Tensor, counters: torch.Tensor,
                        budget: float, maps: tuple[torch.Tensor, torch.Tensor, torch.Tensor], step: int,
                        codes: tuple[torch.Tensor, ...], rot: torch.Tensor, decoded: tuple[torch.Tensor, torch.Tensor],
                        lattice_q: int, bits: int, lattice_codes: int, selected: torch.Tensor | None = None,
                        budget_topk: int = 0) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """sparse_step for a D4 cold tier with a decoded-block cache: block_select, then the cache's bookkeeping
    (`maps`: block -> slot (Hc, >= N), slot -> block and the step each slot was last read (Hc, slots), updated in
    place) and the decode of the (head, block) pairs it lacks (`codes`: k code, k scale, v code, v scale (B, Hc,
    blocks, block, ...); `rot` the codec's Hadamard (D, D) fp32) into `decoded` (K, V (B, Hc, slots * block, D)),
    with d4_points and linear (the bits of kv/lattice.py's decode), then sparse_attention over the cache and
    sparse_check. Returns (out, select, hits, misses); misses -1 (out empty, nothing changed) when some head
    selected more blocks than it has slots. `selected`: the selection a refused call of the same step returned,
    used instead of running the indexer again."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.sparse_step_decoded(q, *hot, cold_head, kmin, kmax, n_blocks, topk, q_pos, window, sink,
                                                block, scale, counters, budget, *maps, step, *codes, rot, *decoded,
                                                lattice_q, bits, lattice_codes, selected, budget_topk)


def decoder_layer_sparse(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor,
                         weights: list[torch.Tensor], config: list[int], params: list[float],
                         state: tuple[torch.Tensor, ...], cold: tuple[torch.Tensor, ...],
                         index: tuple[torch.Tensor, ...], geometry: tuple[int, ...], budget: float,
                         decoded: tuple[torch.Tensor, ...], lattice: tuple[int, ...]):
    """One decode row's decoder layer over a sparse cache in one call (csrc/decoder_layer.cpp): the layer's first half,
    ring_write, sparse_step (`decoded` empty) or sparse_step_decoded, the second half. Returns (output (1, 1, C),
    select, hits, misses, q (1, Hk, G, D)); misses -1: the output is empty (the decoded cache could not hold the
    step's blocks; only the ring was written)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.decoder_layer_sparse(h, cos, sin, q_pos, weights, config, params, list(state), list(cold),
                                                 list(index), list(geometry), budget, list(decoded), list(lattice))


def decoder_layer_output(att: torch.Tensor, h: torch.Tensor, weights: list[torch.Tensor], config: list[int],
                         params: list[float]) -> torch.Tensor:
    """The decoder layer from its attention output (N, H * D) on (o_proj, norms, MLP, residuals): (N, 1, C)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.decoder_layer_output(att, h, weights, config, params)


def ring_write(k_hot: torch.Tensor, v_hot: torch.Tensor, hot_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, slot: int) -> None:
    """A decode step's K/V (B, Hk, 1, D) at `positions` (1,) into slot `slot` of a sparse layer's hot ring."""
    if _loaded is None:
        load()
    torch.ops.kakeya.ring_write(k_hot, v_hot, hot_pos, k, v, positions, slot)


def d4_points(code: torch.Tensor, scales: torch.Tensor, *, q: int, bits: int, codes: int) -> torch.Tensor:
    """The D4 lattice decode before its rotation: packed codes (N, nbytes) uint8 and scales (N, 2) fp16 (norm,
    qmax) -> the scaled lattice points (N, 4 * codes) fp32, the bits of kv/lattice.py's arithmetic."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.d4_points(code, scales, q, bits, codes)


def _per_head(topk: int | torch.Tensor, heads: int) -> torch.Tensor:
    return topk if isinstance(topk, torch.Tensor) else torch.full((heads,), topk, dtype=torch.long)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_fp32: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for x (M, K), W (N, K): each output element by one fixed sequence of operations,
    whatever M is (csrc/invariant_linear.cpp). `out_fp32`: the fp32 sums, not rounded to x's dtype. `packed`:
    `linear_pack(weight)`, W's tiles laid out once for calls of many rows (the same bits, less work per call)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.linear(x, weight, bias, out_fp32, packed)


PACK_ENV = "KAKEYA_PACK_WEIGHTS"


def pack_weights() -> bool:
    """Whether bf16 projections keep their tiles packed once at load (`linear_pack`): $KAKEYA_PACK_WEIGHTS=1. Off by
    default: the second copy of the weights (+212 MB on SmolLM2) bought ~1% of prefill end to end (projections
    0.62 -> ~0.48 s at 4k, inside the run-to-run spread; docs/evidence.md). The same bits either way."""
    return os.environ.get(PACK_ENV, "0").strip() == "1"


def linear_pack(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) laid out once as the tiles `linear` packs per call of many rows (a second copy of W, int32), or an
    empty tensor where W does not take that path here (dtype, shape, no AMX)."""
    load()
    return torch.ops.kakeya.linear_pack(weight)


def quant_linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W'^T (+ b) for x (M, K) bf16 and W' the bf16 weights `quant_dequant(q, sz, bits)` gives: int4 codes
    (bits 4: q (N, K/2) uint8, sz (N/16, K/32, 16, 2) fp32 scale, zero), int5 codes (bits 5: q (N, 5K/8) uint8,
    sz (N/16, K/32, 16) fp16 d) or int8 (bits 8: q (N, K), sz (N,) bf16 scales, or their fp32 widening, read without
    a copy), in 16 x 32 tiles (csrc/quant_linear.cpp;
    engine/weights.py's pack_tiles and pack_scales). The bits of `linear(x, W')`, whatever M is."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.quant_linear(x, q, sz, bits, bias)


def q8_linear(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None = None, *,
              out_fp32: bool = False) -> torch.Tensor:
    """y = x W^T (+ b) for x (M, K) bf16 and W grouped int8 (GGUF Q8_0 blocks: q (N, K) codes in
    engine/weights.py's pack_q8_tiles layout, sz (N/16, K/32, 16) fp16 d per group), multiplied in integers: each group
    of x rounded to int16 on a power-of-two step, exact integer dot products, then one fused multiply-add per group
    (csrc/q8_linear.cpp defines the numbers). bf16 out, or the fp32 sums unrounded (`out_fp32`). A row's bits do
    not depend on M or on the path."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.q8_linear(x, q, sz, bias, out_fp32)


def q8_dequant(q: torch.Tensor, sz: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """W = bf16(q * d) (N, K) of `q8_linear`'s weights, or only its rows `rows` (R,) int64: (R, K)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.q8_dequant(q, sz, rows)


def q8_path(rows: int) -> str:
    """Which code `q8_linear` runs a call of `rows` rows on here: "amx" (int8 tiles), "vnni" (AVX-512 vpdpbusd),
    "avx2" (vpmaddwd on the codes widened) or "rows" (a row at a time). Every path gives the same bits."""
    load()
    return torch.ops.kakeya.q8_path(rows)


def q8_route(name: str) -> str:
    """Force `q8_linear`'s path for this process ("vnni", "avx2", "rows", or "auto", the default), for tests and A/B
    runs; returns the setting before. A path this CPU lacks falls back as "auto" does."""
    load()
    return torch.ops.kakeya.q8_route(name)


def quant_dequant(q: torch.Tensor, sz: torch.Tensor, bits: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """W' (N, K) bf16 of `quant_linear`'s weights, or only its rows `rows` (R,) int64: (R, K)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.quant_dequant(q, sz, bits, rows)


def quant_path(bits: int) -> str:
    """Which code `quant_linear` runs on here: "amx" (tiles dequantized in the kernel), "avx2" (codes multiplied as
    they are unpacked for a few rows, W' dequantized per work item for more) or "panels" (W' dequantized a panel at a
    time, then `linear`'s AVX-512 or at::vec path)."""
    load()
    return torch.ops.kakeya.quant_path(bits)


GATED_ACTS = {"silu": 0, "gelu_tanh": 1}


def gated_act(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for x (M, 2I) = [gate | up] in one pass, each element in fp32 and rounded once (SiLU or
    tanh-GELU); (M, I). Elementwise, so a row's result does not depend on the rows beside it."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.gated_act(x, GATED_ACTS[act])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x (N, V) float32 -> (N,) int64: each row's first highest value, its first NaN if it has one (torch.argmax's
    answer, read VS lanes at a time: csrc/argmax.cpp)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.argmax_rows(x)


def sample_weights(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x (V,) float32 logits -> (V,) float32 exp((x - max x) / temperature) (csrc/sampling.cpp)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.sample_weights(x, temperature)


def sample_support(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (V,) float32 logits -> the tokens top-k (0: off) and top-p (1: off) keep, ids (n,) int64, and their weights:
    float32 e for top-k alone (ids ascending), else float64 probabilities, most likely first (csrc/sampling.cpp)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.sample_support(x, temperature, top_k, top_p)


def sample_draw(w: torch.Tensor, u: float) -> int:
    """The index a uniform u in [0, 1) picks from nonnegative weights w (n,) float32 or float64: the first whose
    running sum passes u * sum (csrc/sampling.cpp)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.sample_draw(w, u)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """x (M, C) / rms(x) * w (or * (1 + w) with `unit_offset`, as Gemma stores it), each row in fp32 and rounded
    once to x's dtype; (M, C). A row's result depends on that row only (csrc/rowwise.cpp)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.rms_norm(x, weight, eps, unit_offset)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """s = residual + x (M, C), rounded to x's dtype as a separate add would, and rms_norm(s) in one pass:
    (s, normed)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.add_rms_norm(x, residual, weight, eps, unit_offset)


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, *,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k heads of the fused projection's qkv (B, T, >= (H + 2 Hk) D), [q | k | v] heads per row, rotated
    (rotate-half RoPE) by cos, sin (B, T, D) (rows may broadcast: stride 0), after an RMSNorm per head with q_norm /
    k_norm (D,) when given; each head in fp32 and rounded once. Returns q (B, H, T, D) and k (B, Hk, T, D),
    contiguous."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.qkv_rope(qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps, unit_offset)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (csrc/threads.cpp). Call it on the thread that loaded the model
    before another thread takes over the steps (the engine thread): with two pools on a two-core machine every
    parallel region's workers wake from sleep instead of spinning (+60% on a decode step). The pool comes back if
    this thread opens a parallel region again; results never depend on which thread ran them. False when the
    runtime refused (inside a parallel region)."""
    if _loaded is None:
        load()
    return bool(torch.ops.kakeya.release_thread_pool())


def linear_path(dtype: torch.dtype, in_features: int, out_features: int) -> str:
    """Which code a weight of this shape runs on here: "amx", "avx512-bf16", "avx512", "avx2" or "generic"."""
    load()
    return torch.ops.kakeya.linear_path(1 if dtype == torch.bfloat16 else 0, in_features, out_features)


def library_path() -> Path:
    """Where this machine's build lives: one file per (source, flags, torch, compiler, CPU features)."""
    from kakeya_runtime.models.loader import cache_root  # loader imports the model code, which imports us

    key = hashlib.sha256()
    for source in sorted(SOURCES[0].parent.iterdir()):  # the sources and the headers they share
        key.update(source.read_bytes())
    key.update(" ".join(CXXFLAGS).encode())
    key.update(torch.__version__.encode())
    key.update(_compiler_version().encode())
    key.update(_cpu_flags().encode())
    return cache_root() / "kernels" / key.hexdigest()[:16] / "cached_attention.so"


def load() -> Path:
    """Build (once per machine) and load the kernel library; idempotent and thread-safe."""
    global _loaded, _bf16_dot
    with _lock:
        if _loaded is not None:
            return _loaded
        path = library_path()
        if not path.exists():
            try:
                build(path)
            except OSError as e:  # a read-only or full cache directory
                raise NativeKernelError(f"cannot build the kernels in {path.parent} ({e.strerror or e}); make it "
                                        "writable, point KAKEYA_CACHE_DIR elsewhere, or set "
                                        f"{BACKEND_ENV}=sdpa") from None
        problem = _elf_problem(path)
        if problem:  # mapping a cut-short library kills the process (SIGBUS) at its first call, with no message
            raise NativeKernelError(f"{path} is damaged ({problem}); delete it to rebuild, or set {BACKEND_ENV}=sdpa")
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise NativeKernelError(f"loading {path} failed: {e}; delete it to rebuild, or set "
                                    f"{BACKEND_ENV}=sdpa") from None
        _register_fake()
        _bf16_dot = bool(torch.ops.kakeya.bf16_dot())
        _apply(_cached_routes(path.parent / ROUTES_FILE))
        _loaded = path
        return path


def _elf_problem(path: Path) -> str | None:
    """Why `path` is not a whole 64-bit ELF file (None when it is): its section headers, which the linker writes
    last, must lie inside it."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        return e.strerror or str(e)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        return "not a 64-bit ELF library"
    order = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
    if shoff + shentsize * shnum > size:
        return f"truncated: {size} bytes, its section headers end at {shoff + shentsize * shnum}"
    return None


def routes() -> Routes:
    """The routes in force (loading the library, and calibrating once per build, if needed)."""
    load()
    assert _routes is not None
    return _routes


def set_routes(attention_amx: bool, linear_amx: bool) -> Routes:
    """Force the routes for this process (tests, experiments); nothing is cached. Call it before any model runs:
    a process that switches mid-session computes positions on two paths."""
    load()
    return _apply(Routes(attention_amx, linear_amx, {}, "set"))


def calibrate(*, repeats: int = 3) -> Routes:
    """Time each invariant path on this machine and return the faster per kernel (does not apply or cache it).

    Workloads (bf16, SmolLM2-like shapes): attention, a 256-token chunk (3 query heads per KV head) over a 1,024
    key cache plus 32 decode rows over 2,048 keys; projections, a 256-row and 8 one-row products on a 576 x 1,536
    weight. Best of `repeats` after a warm-up; about a second in all."""
    load()
    return _measure(repeats)


def _measure(repeats: int) -> Routes:
    ops = torch.ops.kakeya
    if not bool(ops.amx_available()):
        return Routes(False, False, {}, "no-amx")
    before = (_routes.attention_amx, _routes.linear_amx) if _routes is not None else (True, True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    q, k, v = rnd(1, 3, 768, 64), rnd(1, 3, 1024, 64), rnd(1, 3, 1024, 64)
    qd, kd, vd = rnd(1, 3, 3, 64), rnd(1, 3, 2048, 64), rnd(1, 3, 2048, 64)
    q_pos, k_pos, kd_pos, d_pos = torch.arange(768, 1024), torch.arange(1024), torch.arange(2048), torch.tensor([2047])
    x, xd, w = rnd(256, 576), rnd(1, 576), rnd(1536, 576)

    def attention() -> None:
        ops.cached_attention(q, k, v, q_pos, k_pos, 0, 0, 0.125)
        for _ in range(32):
            ops.cached_attention(qd, kd, vd, d_pos, kd_pos, 0, 0, 0.125)

    def projections() -> None:
        ops.linear(x, w, None, False)
        for _ in range(8):
            ops.linear(xd, w, None, False)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    timings: dict[str, float] = {}
    try:
        for amx in (True, False):
            ops.set_amx(amx, amx)
            tag = "amx" if amx else "avx512"
            timings[f"attention_{tag}"] = best(attention)
            timings[f"linear_{tag}"] = best(projections)
    finally:
        ops.set_amx(*before)
    return Routes(timings["attention_avx512"] >= ROUTE_MARGIN * timings["attention_amx"],
                  timings["linear_avx512"] >= ROUTE_MARGIN * timings["linear_amx"],
                  {key: round(t, 6) for key, t in timings.items()}, "calibrated")


def _cached_routes(file: Path) -> Routes:
    """This build's routes: read from `file`, or calibrated now and written there (first process after a build)."""
    if not bool(torch.ops.kakeya.amx_available()):
        return Routes(False, False, {}, "no-amx")
    try:
        data = json.loads(file.read_text())
        return Routes(bool(data["attention_amx"]), bool(data["linear_amx"]), dict(data["timings"]), "cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with open(file.parent / "build.lock", "w") as lock:  # one process measures; the others wait and read
        fcntl.flock(lock, fcntl.LOCK_EX)
        if file.exists():
            return _cached_routes(file)
        found = _measure(3)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**asdict(found), "torch_threads": torch.get_num_threads(),
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
        os.replace(tmp, file)
        return found


def _apply(found: Routes) -> Routes:
    global _routes
    torch.ops.kakeya.set_amx(found.attention_amx, found.linear_amx)
    _routes = found
    return found


def build(path: Path, *, jobs: int | None = None) -> Path:
    """Compile the kernel to `path`: each source to an object, `jobs` compilers at once (default: one per usable
    core; one after another the sources take ~100 s on a 2-core EPYC, the attention kernel ~25 s of it), then one
    link. Concurrent builders wait on a file lock and reuse the first result."""
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        lib_dir = cpp_extension.library_paths()[0]
        cxx = os.environ.get("CXX", "g++")
        compile_cmd = [cxx, *(f for f in CXXFLAGS if f != "-shared"),
                       f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
                       *(f"-I{p}" for p in cpp_extension.include_paths())]
        print(f"kakeya: building the attention kernel for this CPU (once) -> {path}", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix="build.") as work:
            objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]

            def compile_one(i: int) -> tuple[list[str], subprocess.CompletedProcess]:
                cmd = [*compile_cmd, "-c", str(SOURCES[i]), "-o", str(objects[i])]
                return cmd, subprocess.run(cmd, capture_output=True, text=True)

            largest_first = sorted(range(len(SOURCES)), key=lambda i: SOURCES[i].stat().st_size, reverse=True)
            link = [cxx, "-shared", "-fopenmp", *(str(o) for o in objects), "-o", str(tmp), f"-L{lib_dir}", "-lc10",
                    "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
            try:
                with ThreadPoolExecutor(max_workers=min(len(SOURCES), jobs or _usable_cores())) as pool:
                    steps = list(pool.map(compile_one, largest_first))
                failed = [(cmd, done) for cmd, done in steps if done.returncode != 0]
                if not failed:
                    linked = subprocess.run(link, capture_output=True, text=True)
                    failed = [(link, linked)] if linked.returncode != 0 else []
            except FileNotFoundError as e:
                raise NativeKernelError(f"no C++ compiler ({e.filename}); install g++ or set {BACKEND_ENV}=sdpa") from None
            if failed:
                tmp.unlink(missing_ok=True)
                cmd, done = failed[0]
                raise NativeKernelError(f"building the kernels failed (exit {done.returncode}); set "
                                        f"{BACKEND_ENV}=sdpa to run without it.\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
        return path


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _register_fake() -> None:
    """Shapes for torch.compile's tracing (engine.compiled): the op returns a tensor shaped like q."""
    if getattr(_register_fake, "done", False):
        return
    torch.library.register_fake("kakeya::cached_attention")(
        lambda q, k, v, q_pos, k_pos, window, sink, scale: q.new_empty(q.shape))
    torch.library.register_fake("kakeya::cached_attention_rows")(lambda q, *args: q.new_empty(q.shape))
    torch.library.register_fake("kakeya::cached_attention_rows_append")(lambda q, *args: q.new_empty(q.shape))
    torch.library.register_fake("kakeya::sparse_attention")(
        lambda q, *args: (q.new_empty(q.shape), q.new_empty(*q.shape[:3], 2, dtype=torch.long)))
    torch.library.register_fake("kakeya::sparse_step")(
        lambda q, *args: (q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[1], args[13].shape[0], 1,
                                                            dtype=torch.long)))
    torch.library.register_fake("kakeya::gated_act")(lambda x, act: x.new_empty(x.shape[0], x.shape[1] // 2))
    torch.library.register_fake("kakeya::rms_norm")(lambda x, weight, eps, unit_offset: x.new_empty(x.shape))
    torch.library.register_fake("kakeya::add_rms_norm")(
        lambda x, residual, weight, eps, unit_offset: (x.new_empty(x.shape), x.new_empty(x.shape)))
    torch.library.register_fake("kakeya::qkv_rope")(
        lambda qkv, cos, sin, heads, kv_heads, q_norm, k_norm, eps, unit_offset: (
            qkv.new_empty(qkv.shape[0], heads, qkv.shape[1], cos.shape[-1]),
            qkv.new_empty(qkv.shape[0], kv_heads, qkv.shape[1], cos.shape[-1])))
    torch.library.register_fake("kakeya::linear")(
        lambda x, w, bias, out_fp32=False: x.new_empty(x.shape[0], w.shape[0],
                                                       dtype=torch.float32 if out_fp32 else x.dtype))
    torch.library.register_fake("kakeya::decoder_layer")(lambda h, *args: h.new_empty(h.shape))
    torch.library.register_fake("kakeya::decoder_layer_output")(lambda att, h, *args: h.new_empty(h.shape))
    torch.library.register_fake("kakeya::quant_linear")(
        lambda x, q, sz, bits, bias=None: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("kakeya::q8_linear")(
        lambda x, q, sz, bias=None, out_fp32=False: x.new_empty(
            x.shape[0], q.shape[0], dtype=torch.float32 if out_fp32 else x.dtype))
    _register_fake.done = True


def _compiler_version() -> str:
    try:
        return subprocess.run([os.environ.get("CXX", "g++"), "--version"], capture_output=True,
                              text=True).stdout.split("\n", 1)[0]
    except FileNotFoundError:
        return "no compiler"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


if __name__ == "__main__":  # `python -m kakeya_runtime.models.native`: build now (make setup does)
    print(load())
