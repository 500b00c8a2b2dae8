"""An optional torch.compile'd decode step (one token per row), warmed up once at load.

Eager decode on this CPU is dispatch-bound (~5,000 small ops per token); Inductor fuses the
elementwise work and removes most of that overhead. Prefill stays eager: its matmuls run on AMX
already, and its graph varies with chunk length, mask and cache state (fusing its elementwise ops,
~40% of a Gemma 3 prefill, is the next prefill lever). Compiled code is cached on disk (Inductor's
FX graph cache) under `kakeya_runtime`'s user cache dir, so later processes reuse it.

Process-wide settings this module changes: dynamo's duck shaping off and a recompile limit of at
least 16 (both when a CompiledDecode is built).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kakeya_runtime.kv.cache import FullLayerKV, ModelKV, SlidingLayerKV, sliding_spare
from kakeya_runtime.kv.spec import PolicyKV
from kakeya_runtime.models.base import DecoderModel, ForwardOutput, Logits


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled kernels; set once per process, before the first compile."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        from platformdirs import user_cache_dir

        path = os.path.join(user_cache_dir("kakeya"), "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


@dataclass(slots=True)
class CompileOptions:
    """Inductor settings for the decode step (measured on a 2-core CPU; see results/engine/README.md)."""

    freezing: bool = False  # weights as constants; measured no gain for mv/int kernels, and may copy weights
    max_autotune: bool = False
    cpp_wrapper: bool = False  # C++ instead of Python glue around the kernels
    # Round fused intermediates to bf16 where eager would: greedy tokens then match eager's (a near-tie
    # otherwise flips now and then), at no measurable cost in a step dominated by weight streaming.
    emulate_precision_casts: bool = True
    extra: dict = field(default_factory=dict)

    def inductor_options(self) -> dict:
        return {"freezing": self.freezing, "max_autotune": self.max_autotune, "cpp_wrapper": self.cpp_wrapper,
                "emulate_precision_casts": self.emulate_precision_casts, **self.extra}


class _FullStep:
    """A FullLayerKV's decode step (one new position at `length`), rebuilt inside the compiled step from the layer's
    tensors: the same writes and the same views as FullLayerKV.update_and_fetch for one token."""

    __slots__ = ("k", "v", "key_positions", "length")

    def __init__(self, k: Tensor, v: Tensor, key_positions: Tensor, length) -> None:
        self.k, self.v, self.key_positions, self.length = k, v, key_positions, length

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        end = self.length + 1
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        return self.k[:, :, :end], self.v[:, :, :end], self.key_positions[:end]


class _RingStep:
    """A SlidingLayerKV's decode step, as SlidingLayerKV.update_and_fetch does it for one token. The slot written
    comes as a tensor (`slot`, (1,): length % slots), not a Python int: a view at an int offset makes Dynamo guard
    on whether the offset is 0, and the step writing a ring's slot 0 then compiled a variant of its own."""

    __slots__ = ("k", "v", "slot_positions", "length", "slots", "slot")

    def __init__(self, k: Tensor, v: Tensor, slot_positions: Tensor, length, slots: int, slot: Tensor) -> None:
        self.k, self.v, self.slot_positions, self.length, self.slots = k, v, slot_positions, length, slots
        self.slot = slot

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.k.index_copy_(2, self.slot, k)
        self.v.index_copy_(2, self.slot, v)
        self.slot_positions.index_copy_(0, self.slot, positions)
        n = min(self.length + 1, self.slots)
        return self.k[:, :, :n], self.v[:, :, :n], self.slot_positions[:n]


def _tensor_layout(cache) -> tuple[tuple[int, ...], list[Tensor], int] | None:
    """For a cache of plain full and sliding layers all at one length: (slots per layer, 0 for a full one; the
    layers' tensors, flat; the length). None for anything else (other KV policies), which takes the object path.
    A session's cache under the full policy (kv.spec.PolicyKV itself: its hooks are no-ops) is such a cache."""
    layers = getattr(cache, "layers", None)
    if type(cache) not in (ModelKV, PolicyKV) or not layers:
        return None
    slots: list[int] = []
    tensors: list[Tensor] = []
    length = layers[0].length
    for layer in layers:
        if layer.length != length:
            return None
        if type(layer) is FullLayerKV:
            slots.append(0)
            tensors += (layer.k, layer.v, layer.key_positions)
        elif type(layer) is SlidingLayerKV:
            slots.append(layer.slots)
            tensors += (layer.k, layer.v, layer.slot_positions)
        else:
            return None
    return tuple(slots), tensors, length


class CompiledDecode:
    """Callable with the model's signature for the (B, 1) decode case; anything else runs eagerly.

    The compiled step takes tensors, not the cache object: Dynamo checks its guards on every call, and guards on a
    cache object cover every layer's attributes, over 6 frames (the RoPE table lookup splits the graph). Measured on
    SmolLM2 at 1k (`kakeya bench compiled-step`, results/engine/compiled_step_smollm2_1k.json): guard time under the
    profiler 0.84 ms/step over 6 lookups (object) against 0.52 ms over 1 (tensors); wall time per step 18.41 against
    18.37 ms, and 17.86 ms with guards skipped altogether, so what guards still cost (~0.5 ms, ~3%) is mostly the
    parameters' and cache tensors' checks, which this does not remove. A cache of plain full / sliding layers (the full policy) is handed over as its
    layers' K/V and position tensors, one shared length and the ring sizes; the step rebuilds each layer's
    one-token update from them (_FullStep, _RingStep: the same writes and views as kv.cache) and the layers'
    lengths advance after it. RoPE rows are gathered eagerly before the call (their table lookup reads a position
    as a Python int, which would split the graph). Other caches (sink_window, restore, sparse) decode eagerly:
    compiled on the cache object, each policy and layer index was a variant compiled at its first request (a
    restore session's first decode took minutes, past Dynamo's recompile limit). `tensor_args=False` compiles
    every cache on its object (the bench's "before").
    """

    def __init__(self, model: DecoderModel, options: CompileOptions | None = None, *,
                 tensor_args: bool = True) -> None:
        self.model = model
        self.options = options or CompileOptions()
        self.tensor_args = tensor_args
        self._act_dtype: torch.dtype | None = None
        self.cache_dir = inductor_cache_dir()
        self.compile_s = 0.0
        # Sizes that happen to be equal (say, a cache's capacity and its allocation) must not become one
        # symbol: that equality is a guard, and breaking it later would recompile.
        torch.fx.experimental._config.use_duck_shape = False
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
        self._fn = torch.compile(self._step, dynamic=True, options=self.options.inductor_options())
        self._tensor_fn = torch.compile(self._tensor_step, dynamic=True, options=self.options.inductor_options())

    def _step(self, token_ids: Tensor, positions: Tensor, cache) -> ForwardOutput:
        return self.model(token_ids, positions, cache, logits=Logits.LAST)

    def _tensor_step(self, token_ids: Tensor, positions: Tensor, rope: dict, slots: tuple[int, ...],
                     tensors: list[Tensor], length: int, ring_slots: Tensor) -> Tensor:
        """DecoderModel.forward for one decode token (Logits.LAST, no trace), over per-layer steps built from
        tensors (ring_slots: (layers,), the slot each ring writes); returns the logits."""
        model = self.model
        steps = [_FullStep(tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], length) if n == 0 else
                 _RingStep(tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], length, n, ring_slots[i : i + 1])
                 for i, n in enumerate(slots)]
        h = model.embed(token_ids)
        for i in range(len(steps)):
            h, _ = model.layer_forward(i, h, positions, rope, steps[i], False)
        return model.project(model.norm(h[:, -1:]))

    def __call__(self, token_ids: Tensor, positions: Tensor, cache, *, logits: Logits = Logits.LAST,
                 trace_layer: int | None = None) -> ForwardOutput:
        if (trace_layer is not None or logits is not Logits.LAST or token_ids.shape[1] != 1
                or _grows(cache)):
            return self.model(token_ids, positions, cache, logits=logits, trace_layer=trace_layer)
        layout = _tensor_layout(cache) if self.tensor_args else None
        if layout is None:
            if self.tensor_args:  # another policy's cache: eager. Compiled on its object, each policy and layer
                # was a variant Dynamo compiled on the request path (minutes, past its recompile limit)
                return self.model(token_ids, positions, cache, logits=logits)
            with _keep_mv():
                return self._fn(token_ids, positions, cache)
        slots, tensors, length = layout
        if self._act_dtype is None:  # the dtype the model's forward builds its RoPE rows in: its embeddings'
            self._act_dtype = self.model.embed(token_ids).dtype
        rope = self.model.rope_tables(positions, self._act_dtype)
        ring_slots = torch.tensor([length % n if n else 0 for n in slots], device=token_ids.device)
        with _keep_mv():
            logits = self._tensor_fn(token_ids, positions, rope, slots, tensors, length, ring_slots)
        for layer in cache:
            layer.length += 1
        return ForwardOutput(logits, None)

    def warmup(self, engine, lengths: tuple[int, ...] = (),
               progress: Callable[[int, int], None] | None = None) -> float:  # engine.decode_forward must be self
        """Compile now rather than on the first real token: decode twice from caches of a few lengths.

        The graph guards on cache state, and each length from warmup_lengths is one compiled variant (a ring before
        and after it fills), from caches made as callers make them: outside inference mode, with room beyond the window. A
        model with sliding layers has one more: a cache of at most `window` positions, whose sliding layers are
        plain full ones (kv.cache.make_cache).
        """
        t0 = time.perf_counter()
        w = engine.config.sliding_window
        limit = engine.config.max_position_embeddings
        runs = [(n, min(limit, max(n + 4, 4 * (w or 0), 512))) for n in lengths or warmup_lengths(w, limit)]
        if w and 4 <= w < limit and not lengths:  # a cache no longer than the window (a short generation): no rings
            runs.append((min(8, w - 2), w))
        for i, (n, capacity) in enumerate(runs):
            if progress is not None:
                progress(i, len(runs))
            cache = engine.new_cache(capacity=capacity)
            engine.prefill(cache, torch.zeros(1, n, dtype=torch.long, device=engine.device))
            tok = torch.zeros(1, 1, dtype=torch.long, device=engine.device)
            for _ in range(2):
                engine.decode_step(cache, tok)
        if progress is not None:
            progress(len(runs), len(runs))
        self.compile_s = time.perf_counter() - t0
        return self.compile_s


def warmup_lengths(window: int | None, limit: int) -> tuple[int, ...]:
    """The cache lengths CompiledDecode.warmup decodes two steps from: one per compiled variant a generation meets.
    A full layer's step is one variant at any length; a ring's may be two, before it fills (its keys are the first
    length + 1 slots) and after (all of them): Dynamo guards on that when the graph comes from its on-disk cache. A ring holds window + spare slots (kv.cache.sliding_spare).

    What no longer makes a variant of its own (each recompiled inside real generations on Gemma 3, ~7-20 s a step):
    the slot a ring writes (a tensor index now, not a view at an int offset whose being 0 Dynamo guarded on) and
    where the cache's tensors were made (kv.cache makes them ordinary tensors even inside inference mode; inference
    tensors lack a dispatch key, and Dynamo guards on the key set)."""
    lengths = {8}
    if window:
        lengths.add(window + sliding_spare(window, limit) + 8)
    return tuple(n for n in sorted(lengths) if n + 4 <= limit)  # a short-context model never reaches the rest


@contextmanager
def _keep_mv() -> Iterator[None]:
    """While compiling, Inductor keeps aten.mv whole (an ATen call) instead of decomposing it into
    multiply + sum: its generated reduction loop streams weights ~4x slower than ATen's mv on this CPU,
    and every decode matmul is matrix x vector (weights.DenseLinear). Passing a custom decomposition
    table to Inductor instead would bypass its on-disk cache, so the shared table is edited for the
    duration of the call and restored after."""
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    saved = {op: table.pop(op) for op in (torch.ops.aten.mv.default, torch.ops.aten.mv.out) if op in table}
    try:
        yield
    finally:
        table.update(saved)


def compile_decode(engine, options: CompileOptions | None = None, *, warmup: bool = True) -> CompiledDecode:
    """Route `engine.decode_step` through a compiled step, and (by default) compile it now."""
    compiled = CompiledDecode(engine.model, options)
    engine.decode_forward = compiled
    if warmup:
        compiled.warmup(engine)
    return compiled


def _grows(cache) -> bool:
    """Whether this step makes a growable layer reallocate its storage: a rare step (log2(capacity)
    times per cache) that runs eagerly rather than costing a compiled variant of its own."""
    try:
        layers = list(cache)
    except TypeError:  # a cache that is not a sequence of layers: nothing to pre-check
        return False
    for layer in layers:
        k = getattr(layer, "k", None)
        if hasattr(layer, "capacity") and k is not None and layer.length + 1 > k.shape[2]:
            return True
    return False
