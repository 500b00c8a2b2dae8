"""One native call per decoder layer for decode rows (kakeya::decoder_layer, csrc/decoder_layer.cpp).

An eager decode step runs ~9 kernels per layer, each reached from Python through module calls, views and the
dispatcher: ~8 ms of a 25 ms SmolLM2 step at 1k context (results/engine/eager_step_profile.json). For layers whose
caches are preallocated buffers (`append_slot`: kv.cache's full and ring layers, sink_window's identity-codec ring)
the C++ op runs the same kernels in the same order on the same inputs, so the bits are the Python path's. Where a
row's cache is another policy (restore, a lossy sink_window: no `append_slot`; sparse: it attends itself) the layer
runs as two native calls around the Python path's own attention of the rows; a single row over a sparse cache in its
steady state runs as one (`decoder_layer_step`: kakeya::decoder_layer_sparse, the same kernels in the same order).
Prefill chunks riding a batched step (`run_mixed`, where the whole stack declines them) and a run of one sequence's
new tokens (`run_sequence`: a turn's message, a speculative verify, a prompt's prefill chunk) take the two halves
around the Python path's own attention too, the tokens as rows. A trace, many rows on a quantized layer's
dequantizing path, the sdpa backend and torch.compile keep the Python path. The per-layer arguments are gathered
once (`LayerArgs`) and reused while the layer's projection modules stay the same objects. `KAKEYA_NATIVE_LAYER=0`
turns it off (A/B runs).

When every row's cache of every layer takes its writes in the kernel, the whole stack runs in one call
(`run_all`: kakeya.DecoderStack, built once from all layers' arguments, running decoder_layer layer after layer):
a step then crosses Python and the dispatcher once instead of once per layer, while the second thread waited
(results/engine/decode_v10_ab). So does a single row whose sparse layers are in their steady state
(DecoderStack.step_sparse: those layers as decoder_layer_sparse, the others as decoder_layer). So do decode rows with
prefill chunks of other sequences riding them, and a run of one sequence's new tokens alone (a speculative verify, a
turn's message, a prompt's prefill chunk) (`run_all_chunk`: DecoderStack.step_chunk, each chunk's tokens written to
its cache first, then attended as one query over it, each token by position), where every row's cache takes its
writes and each chunk's has room (two or more chunks in a step took the halves until 2026-12-04: 7 decode rows and
two 16-token chunks 30.4 -> 24.2 ms, results/engine/chunks_stack_2026-12-04; runs of 32 tokens and more took the
Python path until 2026-12-03: ~4.5 ms more a call at every length, a 75-token message 27 -> 22.5 ms,
results/engine/sequence_stack_2026-12-03): with
the halves, a step carrying a one-token chunk over a 2,000-token cache cost 1.74x the 4 decode rows alone, 1.40x so
(results/concurrent/v20_chunk_step, results/concurrent/v21_chunk_stack); a 23-token message 17.5 -> 14.6 ms at 1k
tokens of history and 38.3 -> 34.6 ms at 7k (results/session/message_stack_2026-12-03). It replaced a run's tokens
as rows over the one cache (each a decode row reading the whole cache: a verify of 5 tokens at 2k tokens cost 16.5 ms
so, 12.5 ms as one chunk; results/spec/verify_chunk_ab_2026-12-03).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import LayerKV, RowCaches, RowKV
from kakeya_runtime.models.native import GATED_ACTS

ENV = "KAKEYA_NATIVE_LAYER"
_enabled = os.environ.get(ENV, "1").strip() != "0"


def set_enabled(value: bool) -> bool:
    """Turn the native layer path on or off for this process (tests, A/B); returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, value
    return before


def enabled() -> bool:
    return _enabled and native.enabled() and not torch.compiler.is_compiling()


@dataclass(slots=True)
class LayerArgs:
    """kakeya::decoder_layer's per-layer arguments (weights, config, params as csrc/decoder_layer.cpp reads them),
    the activation dtype they take, the row count from which a projection leaves its kernel, and the projection
    modules they were read from (`key`: rebuilt if any is replaced, e.g. by engine.weights.quantize_model)."""

    weights: list[Tensor]
    config: list[int]
    params: list[float]
    dtype: torch.dtype
    max_rows: int
    window: int | None
    key: tuple[nn.Module, ...]


def _projections(block: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = block.self_attn._modules, block.mlp._modules
    return attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]


# Bumped whenever any module anywhere is given a submodule (setattr, add_module): a projection can only be replaced
# so, so a stack built at the current count is current without looking. Comparing all 30 layers' projections each
# decode step took ~0.15 ms of a ~7 ms SmolLM2 int4 step (the weights' stream evicts those objects between steps).
_assignments = 0


def _module_assigned(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _assignments
    _assignments += 1


torch.nn.modules.module.register_module_module_registration_hook(_module_assigned)


def layer_args(block: nn.Module) -> LayerArgs | None:
    """The arguments for `block` (a LlamaBlock or a Gemma3Block: `sandwich_norms`), or None where its decode step
    cannot run natively as its forward does (a projection without `decode_args`, a norm or activation the kernels
    lack, mixed dtypes)."""
    attn, mlp = block.self_attn, block.mlp
    projections = _projections(block)
    found = [getattr(p, "decode_args", lambda: None)() for p in projections]
    if any(a is None for a in found) or len({a.dtype for a in found}) != 1 or mlp.fused_act is None:
        return None
    if not native.supports(attn.head_dim, found[0].dtype):
        return None
    gemma = bool(getattr(block, "sandwich_norms", False))
    none = torch.empty(0)
    norms = [block.input_layernorm, block.post_attention_layernorm]
    norms += [block.pre_feedforward_layernorm, block.post_feedforward_layernorm] if gemma else [None, None]
    norms += [attn.q_norm, attn.k_norm]
    if len({n.unit_offset for n in norms if n is not None}) > 1 or len({n.eps for n in norms[:4] if n is not None}) > 1:
        return None
    weights = [none if n is None else n.weight for n in norms]
    for a in found:
        weights += [a.weight, none if a.scales is None else a.scales, none if a.bias is None else a.bias]
    config = [int(gemma), attn.num_heads, attn.num_kv_heads, attn.head_dim, int(block.input_layernorm.unit_offset),
              GATED_ACTS[mlp.fused_act], *(a.fmt for a in found)]
    qk_eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
    params = [block.input_layernorm.eps, qk_eps, attn.scale]
    max_rows = min((a.max_rows for a in found if a.max_rows is not None), default=1 << 62)
    return LayerArgs(weights, config, params, found[0].dtype, max_rows, attn.window, projections)


@dataclass(slots=True)
class StackArgs:
    """Every layer's arguments as one kakeya.DecoderStack (csrc/decoder_layer.cpp), with the dtype, row limit and
    layer windows of the layers it was built from (`key`: theirs, so a replaced projection rebuilds it; `checked`:
    the module assignment count at which the key was last found current)."""

    stack: torch.ScriptObject
    dtype: torch.dtype
    max_rows: int
    windows: list[int | None]
    key: tuple[tuple[nn.Module, ...], ...]
    checked: int


class NativeLayers:
    """The per-layer arguments of one model, built on first use; `run` is one layer's decode rows or None, `run_all`
    every layer's in one call or None."""

    __slots__ = ("args", "stack")

    def __init__(self, num_layers: int) -> None:
        self.args: list[LayerArgs | None | bool] = [False] * num_layers  # False: not built yet
        self.stack: StackArgs | None | bool = False

    def _stack(self, blocks: Sequence[nn.Module]) -> StackArgs | None:
        stack = self.stack
        if isinstance(stack, StackArgs) and stack.checked == _assignments:
            return stack
        if isinstance(stack, StackArgs) and stack.key == tuple(_projections(b) for b in blocks):
            stack.checked = _assignments
        elif stack is not None:
            found = [self._args(i, b) for i, b in enumerate(blocks)]
            if any(a is None for a in found) or len({a.dtype for a in found}) != 1:
                stack = None
            else:
                stack = StackArgs(
                    torch.classes.kakeya.DecoderStack([w for a in found for w in a.weights],
                                                      [c for a in found for c in a.config],
                                                      [p for a in found for p in a.params]),
                    found[0].dtype, min(a.max_rows for a in found), [a.window for a in found],
                    tuple(a.key for a in found), _assignments)
            self.stack = stack
        return stack

    def run_all(self, blocks: Sequence[nn.Module], h: Tensor, positions: Tensor, cos: Sequence[Tensor],
                sin: Sequence[Tensor], caches: Sequence[Sequence[LayerKV]]) -> Tensor | None:
        """Every layer over rows h (N, 1, C) in one native call: layer i's rows over caches[i] (cos[i], sin[i] its
        RoPE rows). A single row whose sparse layers are in their steady decode state takes them in the same call
        (`_run_sparse`). None (nothing touched) where any layer must take `run` or the Python path: a row's cache
        is a policy (no `append_slot`, or it attends itself) or a sparse cache outside that state."""
        stack = self._stack(blocks)
        if stack is None or h.dtype != stack.dtype or h.shape[0] >= stack.max_rows or cos[0].dtype != h.dtype:
            return None
        single = len(caches[0]) == 1
        if single and any(getattr(layer[0], "stack_kind", None) is not None for layer in caches):
            return self._run_sparse(stack, h, positions, cos, sin, [layer[0] for layer in caches])
        for layer in caches:
            for kv in layer:
                if (getattr(kv, "append_slot", None) is None or getattr(kv, "owns_attention", False)
                        or (single and getattr(kv, "decoder_layer_step", None) is not None)):
                    return None
        rows = RowKV()
        for layer, window in zip(caches, stack.windows, strict=True):
            for kv in layer:
                rows.add(kv, window)
        return stack.stack.step(h, list(cos), list(sin), positions, rows.k, rows.v, rows.k_pos, rows.slots,
                                rows.counts, [int(w) for w in rows.writes], rows.windows, rows.sinks)

    def run_all_chunk(self, blocks: Sequence[nn.Module], h: Tensor, positions: Tensor, cos: Sequence[Tensor],
                      sin: Sequence[Tensor], caches: Sequence[Sequence[LayerKV]],
                      chunks: int | Sequence[int]) -> Tensor | None:
        """Every layer over decode rows and prefill chunks riding them in one native call (h (N + T, 1, C): the
        decode rows, N >= 0, then each chunk's tokens, `chunks` their counts (an int: one chunk), T in all;
        caches[i] layer i's caches, the chunks' last, in order): the decode rows as `run_all` takes them, each chunk's
        tokens written to its cache first (`append_run`) and attended as one query, each token by position. None
        (nothing touched) where any layer must take `run_mixed` or the Python path: a decode row's cache as `run_all`
        refuses it, or a chunk cache without room for its run (a ring whose spare slots do not cover it)."""
        sizes = (chunks,) if isinstance(chunks, int) else tuple(chunks)
        stack = self._stack(blocks)
        if (stack is None or h.dtype != stack.dtype or h.shape[0] >= stack.max_rows or cos[0].dtype != h.dtype
                or not sizes or min(sizes) < 1 or sum(sizes) > h.shape[0]):
            return None
        for layer in caches:
            decode, runs = layer[: len(layer) - len(sizes)], layer[len(layer) - len(sizes):]
            for kv, n in zip(runs, sizes, strict=True):
                if (getattr(kv, "append_run", None) is None or getattr(kv, "owns_attention", False)
                        or n > kv.run_room() or kv.k.dtype != h.dtype or kv.k.device != h.device):
                    return None
            for row in decode:
                if getattr(row, "append_slot", None) is None or getattr(row, "owns_attention", False):
                    return None
        touched = [kv for layer in caches for kv in layer]
        lengths = [kv.length for kv in touched]
        rows, run = RowKV(), RowKV()
        try:
            for layer, window in zip(caches, stack.windows, strict=True):
                decode, runs = layer[: len(layer) - len(sizes)], layer[len(layer) - len(sizes):]
                for row in decode:
                    rows.add(row, window)
                for kv, n in zip(runs, sizes, strict=True):
                    run.add_chunk(kv, window, n)
            return stack.stack.step_chunk(h, list(cos), list(sin), positions, rows.k, rows.v, rows.k_pos, rows.slots,
                                          rows.counts, [int(w) for w in rows.writes], rows.windows, rows.sinks,
                                          list(sizes), run.k, run.v, run.k_pos, run.slots, run.counts,
                                          [int(w) for w in run.writes], run.windows, run.sinks)
        except BaseException:  # every cache back to where the step began
            for kv, length in zip(touched, lengths, strict=True):
                if kv.length > length:
                    kv.trim(length)
            raise

    @staticmethod
    def _run_sparse(stack: StackArgs, h: Tensor, positions: Tensor, cos: Sequence[Tensor], sin: Sequence[Tensor],
                    caches: Sequence[LayerKV]) -> Tensor | None:
        """One row over layers that are preallocated caches or sparse ones in their steady decode state
        (kv/sparse.py's stack_kind, stack_step), as kakeya.DecoderStack.step_sparse: each layer as
        decoder_layer or decoder_layer_sparse runs it, so the bits and cache writes of one call per layer. None,
        with nothing touched, where any layer is neither."""
        kinds = []
        for kv in caches:
            kind = kv.stack_kind(h) if getattr(kv, "stack_kind", None) is not None else None
            if kind is None and (getattr(kv, "append_slot", None) is None or getattr(kv, "owns_attention", False)
                                 or getattr(kv, "decoder_layer_step", None) is not None):
                return None
            kinds.append(kind or 0)
        rows = RowKV()
        state, cold, cold_n, index, geometry, budget, decoded, lattice = [], [], [], [], [], [], [], []
        sparse = [kv for kv, kind in zip(caches, kinds, strict=True) if kind]
        for kv, kind, window in zip(caches, kinds, stack.windows, strict=True):
            if not kind:
                rows.add(kv, window)
                continue
            st, cd, ix, geo, bud, dec, lat = kv.stack_step(kind)
            state += st
            cold += cd
            cold_n.append(len(cd))
            index += ix
            geometry += geo
            budget.append(bud)
            decoded += dec
            lattice += lat
        try:
            out, hits, misses = stack.stack.step_sparse(
                h, list(cos), list(sin), positions, kinds, rows.k, rows.v, rows.k_pos, rows.slots, rows.counts,
                [int(w) for w in rows.writes], rows.windows, rows.sinks, state, cold, cold_n, index, geometry, budget,
                decoded, lattice)
        except RuntimeError as e:  # the kernels' checks, reported as the sparse step reports them
            for kv in sparse:
                kv.stack_abort()
            raise sparse[0].stack_error(e) from None
        for kv, hit, miss in zip([kv for kv, kind in zip(caches, kinds, strict=True) if kind == 2], hits, misses,
                                 strict=True):
            kv.stack_done(hit, miss)
        return out

    def _args(self, i: int, block: nn.Module) -> LayerArgs | None:
        args = self.args[i]
        if args is False or (args is not None and args.key != _projections(block)):
            args = self.args[i] = layer_args(block)
        return args

    def run(self, i: int, block: nn.Module, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
            caches: Sequence[LayerKV]) -> Tensor | None:
        """Layer i over rows h (N, 1, C) at positions (N,), row r over caches[r] (cos, sin (N, D) their RoPE rows);
        None (nothing touched) where the Python path must run it."""
        args = self._args(i, block)
        if args is None or h.dtype != args.dtype or h.shape[0] >= args.max_rows or cos.dtype != h.dtype:
            return None
        if len(caches) == 1 and (step := getattr(caches[0], "decoder_layer_step", None)) is not None:
            out = step(h, cos, sin, positions, args.weights, args.config, args.params)  # a sparse cache's whole layer
            if out is not None:
                return out
        if not all(getattr(kv, "append_slot", None) is not None and not getattr(kv, "owns_attention", False)
                   for kv in caches):
            return self._run_split(args, block, h, positions, cos, sin, caches)
        rows = RowKV()
        for kv in caches:
            rows.add(kv, args.window)
        return torch.ops.kakeya.decoder_layer(h, cos, sin, positions, args.weights, args.config, args.params, rows.k,
                                              rows.v, rows.k_pos, rows.slots, rows.counts, rows.writes, rows.windows,
                                              rows.sinks)

    def run_mixed(self, i: int, block: nn.Module, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                  caches: RowCaches) -> Tensor | None:
        """Layer i over decode rows and trailing prefill chunks riding the same step (h (N, 1, C), one position and
        RoPE row per row): the layer's halves in one native call each around the Python path's own attention of
        the rows (Attention.attend_mixed), as `_run_split` runs a policy cache's rows; None where the Python path
        must run it."""
        args = self._args(i, block)
        if args is None or h.dtype != args.dtype or h.shape[0] >= args.max_rows or cos.dtype != h.dtype:
            return None
        q, k, v = torch.ops.kakeya.decoder_layer_attention_inputs(h, cos, sin, args.weights, args.config, args.params)
        att = block.self_attn.attend_mixed(q, k, v, positions, caches)  # (N, H * D)
        return torch.ops.kakeya.decoder_layer_output(att, h, args.weights, args.config, args.params)

    def run_sequence(self, i: int, block: nn.Module, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                     cache: LayerKV) -> Tensor | None:
        """Layer i over a run of one sequence's new tokens (h (1, T, C): a session turn's message, a speculative
        verify, a prompt's prefill chunk): `run_mixed` with the run as its one chunk and no decode rows (the tokens as
        rows: every op of the halves is row-wise or row-invariant); None where the Python path must run it."""
        t = h.shape[1]
        out = self.run_mixed(i, block, h.view(t, 1, h.shape[2]), positions, cos, sin, RowCaches([cache], (t,)))
        return None if out is None else out.view(1, t, -1)

    @staticmethod
    def _run_split(args: LayerArgs, block: nn.Module, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                   caches: Sequence[LayerKV]) -> Tensor:
        """A row's cache is a policy (it attends itself, or writes through update_and_fetch): the layer up to
        attention and from its output on are one native call each, and the attention between is the Python
        path's own (Attention._attend_rows), so every cache's writes and bits are those of the layer's forward."""
        q, k, v = torch.ops.kakeya.decoder_layer_attention_inputs(h, cos, sin, args.weights, args.config, args.params)
        att = block.self_attn._attend_rows(q, k, v, positions, caches)  # (N, H, 1, D)
        return torch.ops.kakeya.decoder_layer_output(att.reshape(h.shape[0], -1), h, args.weights, args.config,
                                                     args.params)
