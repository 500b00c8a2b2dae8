"""Restoration (seed 000 §11.5): a sink + window resident cache, and the K/V of every evicted position
recomputed by a cache-less proposer forward, consumed by attention as if cached, then dropped.

Per step (engine hook `begin_step`), for each governed layer the cache builds a transient *overlay*:
positions [0, E) from the proposer (E = one past the last evicted position), the resident sink and
window positions decoded from the resident store on top, then the step's own new K/V appended as the
forward computes them. With a lossy resident codec every position is read through it (the restored ones,
whose proposer forward attends through it too, and the step's own), so a history gives the same K/V however
its turns and chunks fell. Attention sees every position 0..q, so with the same checkpoint and the
identity projection the output equals the full-attention oracle (fp32 greedy tokens identical).

Granularity:
- per_step: the overlay lives for one engine call (a whole chunked prefill, or one decode step) and is
  dropped in `end_step`. Sustained K/V = sink + window slots; every decode step re-runs the proposer.
- per_turn: the overlay is built at the first step of a turn and kept until `end_turn` (the Engine's
  generation loop ends the turn): the proposer runs once per turn; between turns memory is sink + window.

Memory, precisely. Sustained (between steps / turns): the resident slots (constant in T) plus the token
history (O(T) int32, 4 bytes per token; the proposer needs it). Per step, transiently: the overlay, which
is O(T) K/V (the restored K/V themselves, B*Hk*T*D per governed layer), plus the proposer's activations,
bounded by its chunk (its attention over the overlay is O(chunk * T) scores per layer at most). The
cache accounts the K/V it holds (`transient_nbytes`, `peak_transient_bytes`); activations are not
tensors it sees (the NIAH bench measures them as a process RSS delta).

Within one engine call the K/V the verifier computes itself stay in the overlay (a prefill chunk
attends to earlier chunks of the same call); the proposer restores only positions evicted before the
call. Trim is always allowed: positions a trim exposes again are simply restored at the next step.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from kakeya_runtime.kv.cache import CacheError, _check_new
from kakeya_runtime.kv.sink_window import (
    PositionLimitError,
    SinkWindowKV,
    SinkWindowLayerKV,
    flush_views,
    stage_views,
)


class _Overlay:
    """A step's full view of one layer: (B, Hk, cap, D) K/V for positions 0..length-1, grows by doubling."""

    def __init__(self, like: Tensor, capacity: int, max_capacity: int) -> None:
        b, hk, _, d = like.shape
        self.max_capacity = max_capacity
        self.k = like.new_empty(b, hk, capacity, d)
        self.v = like.new_empty(b, hk, capacity, d)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        start, end = self.length, self.length + k.shape[2]
        if end > self.k.shape[2]:
            size = min(self.max_capacity, max(end, 2 * self.k.shape[2]))
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:2], size, old.shape[3])
                new[:, :, :start] = old[:, :, :start]
                setattr(self, name, new)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        positions = torch.arange(end, device=k.device)
        return self.k[:, :, :end], self.v[:, :, :end], positions


class RestoreLayerKV(SinkWindowLayerKV):
    """Resident sink + window (any codec) plus, during a step, the overlay. Queries see every position."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attention_rule = None  # restored positions make the whole causal range visible
        self.overlay: _Overlay | None = None

    def visible_count(self, q: int) -> int:
        return q + 1

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.overlay is None:
            raise CacheError("restore cache used outside a step: the engine must call begin_step first")
        _check_new(self._probe, k, v)
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_positions:
            raise PositionLimitError(f"position {end - 1} is past the model's limit of {self.max_positions}")
        if self.overlay.length != start:
            raise CacheError(f"overlay holds {self.overlay.length} positions, layer {start}")
        seen = self._seen(k, v)
        out = self.overlay.append(*seen)  # what queries read; the store encodes the exact K/V
        self._store((k, v, *seen) if self.view is not None else (k, v), positions, start)
        self.length = end
        return out

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot trim a cache of length {self.length} to {length}")
        self.store.slot_positions[self.store.slot_positions >= length] = -1  # evicted ones get restored
        self.length = length
        if self.overlay is not None:
            self.overlay.length = min(self.overlay.length, length)


class RestoreKV(SinkWindowKV):
    """The model-level restore cache: owns the token history, the proposer and the step overlays."""

    def __init__(self, layers: list, *, proposer, **kwargs) -> None:
        super().__init__(layers, **kwargs)
        if self.spec.granularity not in ("per_step", "per_turn"):
            raise CacheError(f"unknown restore granularity {self.spec.granularity!r}")
        self.proposer = proposer
        self.history = torch.zeros(self.batch, 256, dtype=torch.int32)
        self.active = False  # an overlay exists (inside a step, or a per_turn turn)
        # Counters for the bench / GetSessionInfo.
        self.restored_positions = 0  # positions recomputed by the proposer, summed over calls
        self.proposer_calls = 0
        self.proposer_s = 0.0

    # -- history ----------------------------------------------------------------------------------

    @property
    def history_nbytes(self) -> int:
        return self.history.nbytes

    def _append_history(self, input_ids: Tensor, start: int) -> None:
        end = start + input_ids.shape[1]
        if end > self.history.shape[1]:
            grown = self.history.new_zeros(self.batch, min(self.capacity, max(end, 2 * self.history.shape[1])))
            grown[:, :start] = self.history[:, :start]
            self.history = grown
        self.history[:, start:end] = input_ids.to(device=self.history.device, dtype=torch.int32)

    # -- hooks ------------------------------------------------------------------------------------

    def begin_step(self, input_ids: Tensor, start: int) -> None:
        if start != self.length:
            raise CacheError(f"restore step starts at {start}, cache holds {self.length} positions")
        governed = [self.layers[i] for i in self.governed]
        if not all(isinstance(layer, RestoreLayerKV) for layer in governed):
            raise CacheError("this session's KV cache is compressed while idle; decompress(cache) first")
        self._append_history(input_ids, start)
        staged = stage_views(governed)  # lossy resident codec: decoded once for the step
        if self.active:  # per_turn, mid-turn: the overlay already covers 0..start-1
            self.peak_transient_bytes = max(self.peak_transient_bytes, self.transient_nbytes + staged)
            return
        if not governed:
            self.active = True
            return
        t_new = input_ids.shape[1]
        reserve = start + t_new if self.spec.granularity == "per_step" else max(start + t_new + 64, 2 * start)
        reserve = min(reserve, self.capacity)
        for layer in governed:
            layer.overlay = _Overlay(layer._probe, reserve, self.capacity)
        # Positions [0, start) that no resident slot holds are restored: the proposer forwards [0, E).
        held = governed[0].held_positions()
        resident = torch.zeros(start, dtype=torch.bool)
        resident[held.cpu()] = True
        missing = (~resident).nonzero()
        e = int(missing[-1, 0]) + 1 if missing.numel() else 0
        proposer_bytes = 0
        if e:
            if self.proposer is None:
                raise CacheError("restore cache has no proposer")
            t0 = time.perf_counter()
            ids = self.history[:, :e].to(device=input_ids.device, dtype=torch.long)
            out = {i: (self.layers[i].overlay.k, self.layers[i].overlay.v) for i in self.governed}
            lossy = not governed[0].codec.lossless  # restored K/V computed and read as the verifier's were
            proposer_bytes = self.proposer.restore(ids, out, governed[0]._seen if lossy else None)
            self.proposer_s += time.perf_counter() - t0
            self.proposer_calls += 1
            self.restored_positions += int((~resident[:e]).sum())
        for layer in governed:
            ov = layer.overlay
            if held.numel():
                slots = (layer.store.slot_positions >= 0).nonzero().squeeze(1)
                k_res, v_res = layer._read(slots)
                pos = layer.store.slot_positions[slots]
                ov.k.index_copy_(2, pos, k_res)
                ov.v.index_copy_(2, pos, v_res)
            ov.length = start
        self.active = True
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.transient_nbytes + proposer_bytes + staged)

    def end_step(self) -> None:
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.transient_nbytes)
        flush_views(self._governed())
        if self.spec.granularity == "per_step":
            self._drop()

    def end_turn(self) -> None:
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.transient_nbytes)
        flush_views(self._governed())
        self._drop()

    def _drop(self) -> None:
        for i in self.governed:
            if isinstance(self.layers[i], RestoreLayerKV):
                self.layers[i].overlay = None
        self.active = False

    # -- protocol ---------------------------------------------------------------------------------

    @property
    def transient_nbytes(self) -> int:
        overlays = (getattr(self.layers[i], "overlay", None) for i in self.governed)
        return sum(ov.nbytes for ov in overlays if ov is not None)

    @property
    def effective_attention_fraction(self) -> float:
        return 1.0

    def trim(self, length: int) -> None:
        super().trim(length)
        with torch.inference_mode():  # the history grows inside forwards (an inference tensor); trims come from outside
            self.history[:, length:] = 0

    def state(self) -> list[dict[str, Tensor]]:
        states = super().state()
        states[0] = {**states[0], "restore.history": self.history[:, : self.length].clone()}
        return states

    def load_state(self, state) -> None:
        state = list(state)
        if not state or "restore.history" not in state[0]:
            raise CacheError("restore state lacks the token history")
        first = dict(state[0])
        history = first.pop("restore.history")
        state[0] = first
        self._drop()
        super().load_state(state)
        n = history.shape[1]
        if n != self.length:
            raise CacheError(f"restore state has {n} history tokens for {self.length} cached positions")
        self.history = self.history.new_zeros(self.batch, max(256, n))
        self.history[:, :n] = history
