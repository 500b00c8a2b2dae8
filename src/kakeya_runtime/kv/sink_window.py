"""StreamingLLM sink + window retention for one layer: constant memory, whatever the sequence length.

Slots are preallocated once: `sink` slots for positions 0..sink-1, and a ring of `window + spare`
slots for later positions (slot of p >= sink: sink + (p - sink) % ring). A query at position q sees
the sinks and the last `window` positions (q - window < k <= q). A prefill chunk gets the held keys
plus its own, and the same rule comes out of the attention mask (`attention_rule`), so chunked prefill
and token-by-token decode see exactly the same keys.

`spare` ring slots keep positions the window no longer needs, so the cache can roll back (trim) by up
to `spare` positions once it has started evicting; with spare=0 a trim below the eviction horizon is
refused (CacheError) rather than silently changing what earlier positions saw.

Positions are never reassigned: past `max_positions` (the model's limit) update_and_fetch raises
PositionLimitError, the RESOURCE_EXHAUSTED case. Rotating positions would let a session run forever but
changes what the model computes, which this runtime does not do behind the caller's back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kakeya_runtime.kv.cache import CacheError, _check_new, _keep_writes_overridable
from kakeya_runtime.kv.compress import IdentityCodec, KVCodec, SlotStore
from kakeya_runtime.kv.spec import PolicyKV


class PositionLimitError(CacheError):
    """A position at or past the model's limit (maps to RESOURCE_EXHAUSTED)."""

    code = "RESOURCE_EXHAUSTED"


class SinkWindowLayerKV:
    """One layer's sink + window store (any codec); `length` counts every position seen (INV-1)."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, *, sink: int, window: int,
                 max_positions: int, spare: int = 0, codec: KVCodec | None = None,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if sink < 0 or window < 1 or spare < 0:
            raise CacheError(f"need sink >= 0, window >= 1, spare >= 0; got {sink}, {window}, {spare}")
        self._init = dict(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, sink=sink, window=window,
                          max_positions=max_positions, spare=spare, codec=codec, dtype=dtype, device=device)
        self.sink, self.window, self.spare = sink, window, spare
        self.ring = window + spare
        self.max_positions = max_positions
        self.codec = codec or IdentityCodec()
        self.store = SlotStore(self.codec, batch, num_kv_heads, sink + self.ring, head_dim, dtype=dtype,
                               device=device)
        self.attention_rule = (sink, window)  # read by models.layers.Attention for chunk masks
        self.length = 0
        # Lossy codecs, during a step: every slot decoded once (stage_views); a write puts what queries read
        # (the K/V through the codec) in `view` and the exact K/V in `exact`, encoded in one batch at the end
        # of the step (flush_views). None outside steps.
        self.view: tuple[Tensor, Tensor] | None = None
        self.exact: tuple[Tensor, Tensor] | None = None
        self.dirty: Tensor | None = None  # (slots,) bool: written during the step
        self._probe = torch.empty(batch, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        # A trim empties the slots of the positions it drops; until the history passes them again they are holes
        # below the newest slot, which only update_and_fetch's slot lists skip (append_slot is off until then).
        self._holes_until = 0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _keep_writes_overridable(cls)

    @property
    def append_slot(self):
        """update_and_fetch of one decode token for a caller that writes it itself (as kv.cache's ring layers offer
        it, models.layers.RowKV), where the store is a plain buffer (the identity codec) with no holes: the
        method, else None."""
        if not isinstance(self.codec, IdentityCodec) or self.view is not None or self.length < self._holes_until:
            return None
        return self._append_slot

    def _append_slot(self) -> tuple[Tensor, Tensor, Tensor, int, int, bool]:
        """(k, v, slot positions, the slot to write, the slots to attend, True: the position is written there too).
        The slots to attend hold every kept position (with `spare`, older ones the window rule masks)."""
        start = self.length
        if start + 1 > self.max_positions:
            raise PositionLimitError(
                f"position {start} is past the model's limit of {self.max_positions} positions; "
                "sink_window does not reassign positions"
            )
        self.length = start + 1
        return (self.store.k["x"], self.store.v["x"], self.store.slot_positions, self.slot(start),
                min(start + 1, self.num_slots), True)

    def clone_empty(self) -> SinkWindowLayerKV:
        """A fresh layer of the same kind and shape (idle compression rebuilds layers with it)."""
        return type(self)(**self._init)

    @property
    def num_slots(self) -> int:
        return self.sink + self.ring

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def slot(self, p: int) -> int:
        return p if p < self.sink else self.sink + (p - self.sink) % self.ring

    def visible_count(self, q: int) -> int:
        """Keys a query at position q attends to: the sinks plus the last window (itself included)."""
        return min(q + 1, self.sink) + max(0, q + 1 - max(self.sink, q + 1 - self.window))

    def _visible_slots(self, q: int) -> Tensor | slice:
        """Slots holding what position q may see; a contiguous slice whenever possible."""
        if q + 1 <= self.sink + self.window:  # nothing evicted yet: positions 0..q sit in slots 0..q
            return slice(0, q + 1)
        if self.spare == 0:  # the ring holds exactly the window
            return slice(0, self.num_slots)
        ring_lo = max(self.sink, q + 1 - self.window)
        slots = [*range(min(q + 1, self.sink)), *(self.slot(p) for p in range(ring_lo, q + 1))]
        return torch.tensor(slots, device=self.store.slot_positions.device)

    def _held_slots(self) -> Tensor | slice:
        """Every slot holding a position (for a chunk: the mask picks what each query sees). The first `length`
        slots are not enough: a ring that wrapped and was then trimmed back to at most its slots (a speculative
        verify's rollback) has an evicted, emptied slot among them, whose position -1 the kernel refuses."""
        n = min(self.length, self.num_slots)
        if bool((self.store.slot_positions[:n] >= 0).all()):
            return slice(0, n)
        return (self.store.slot_positions >= 0).nonzero().squeeze(1)

    def _read(self, slots: Tensor | slice) -> tuple[Tensor, Tensor]:
        if self.view is None:
            return self.store.read(slots)
        k, v = self.view
        if isinstance(slots, slice):
            return k[:, :, slots], v[:, :, slots]
        return k.index_select(2, slots), v.index_select(2, slots)

    def _write(self, slots: Tensor | slice, kv: tuple[Tensor, ...], positions: Tensor) -> None:
        """kv = (k, v) exact, then (k, v) as queries read them (the same tensors for a lossless codec)."""
        if self.view is None:
            self.store.write(slots, kv[0], kv[1], positions)
            return
        for dst, x in zip((*self.exact, *self.view), kv, strict=True):
            if isinstance(slots, slice):
                dst[:, :, slots] = x
            else:
                dst.index_copy_(2, slots, x)
        self.store.slot_positions[slots] = positions
        self.dirty[slots] = True

    def _store(self, kv: tuple[Tensor, ...], positions: Tensor, start: int) -> None:
        """Keep the chunk's sink positions and its last `ring` positions (kv as `_write` takes it)."""
        end = start + kv[0].shape[2]
        if start < self.sink:
            n = min(end, self.sink) - start
            self._write(slice(start, start + n), tuple(x[:, :, :n] for x in kv), positions[:n])
        lo = max(self.sink, end - self.ring, start)
        if lo >= end:
            return
        off = lo - start
        part = tuple(x[:, :, off:] for x in kv)
        first = self.slot(lo)
        if first + (end - lo) <= self.num_slots:  # no wrap: a slice write
            self._write(slice(first, first + end - lo), part, positions[off:])
        else:
            slots = self.sink + (torch.arange(lo, end, device=kv[0].device) - self.sink) % self.ring
            self._write(slots, part, positions[off:])

    def _seen(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New K/V as every query reads them: through the codec, as later steps read them from the store. A
        lossy codec is applied on write, never "exact within the step", so a history gives the same K/V and
        logits whether it arrived in one prefill, in chunks, or token by token."""
        if self.codec.lossless:
            return k, v
        dtype = self.store.dtype
        return self.codec.decode(self.codec.encode(k), dtype), self.codec.decode(self.codec.encode(v), dtype)

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _check_new(self._probe, k, v)
        t, start = k.shape[2], self.length
        end = start + t
        if end > self.max_positions:
            raise PositionLimitError(
                f"position {end - 1} is past the model's limit of {self.max_positions} positions; "
                "sink_window does not reassign positions"
            )
        if t == 1:
            self._store((k, v, *self._seen(k, v)) if self.view is not None else (k, v), positions, start)
            self.length = end
            slots = self._visible_slots(start)
            k_all, v_all = self._read(slots)  # the store (or the staged view) gives the newest as seen too
            return k_all, v_all, self.store.slot_positions[slots]
        held = self._held_slots()
        k_old, v_old = self._read(held)
        pos_old = self.store.slot_positions[held]
        k_seen, v_seen = self._seen(k, v)
        k_all = torch.cat((k_old, k_seen), dim=2)  # (B, Hk, held + T, D)
        v_all = torch.cat((v_old, v_seen), dim=2)
        pos_all = torch.cat((pos_old, positions))
        self._store((k, v, k_seen, v_seen), positions, start)
        self.length = end
        return k_all, v_all, pos_all

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot trim a cache of length {self.length} to {length}")
        if length == self.length:
            return
        oldest_held = max(self.sink, self.length - self.ring)
        if max(self.sink, length - self.window) < oldest_held:
            raise CacheError(
                f"sink_window has evicted positions below {oldest_held}; trimming to {length} needs them "
                f"(roll back at most {self.spare} positions once eviction started, or use restore)"
            )
        gone = self.store.slot_positions >= length
        self.store.slot_positions[gone] = -1
        self._holes_until = max(self._holes_until, self.length)
        self.length = length

    def state(self) -> dict[str, Tensor]:
        if self.view is not None:
            flush_views([self])
        out = self.store.state()
        out["length"] = torch.tensor(self.length)
        return out

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.view = self.exact = self.dirty = None
        self.store.load_state(state)
        self.length = int(state["length"])
        held = self.store.slot_positions[: min(self.length, self.num_slots)]
        # a state saved with holes: every slot is rewritten within one pass over the ring
        self._holes_until = self.length + self.num_slots if bool((held < 0).any()) else 0

    def held_positions(self) -> Tensor:
        sp = self.store.slot_positions
        return sp[sp >= 0]


def stage_views(layers: list[SinkWindowLayerKV]) -> int:
    """Decode the stores of lossy-codec layers in one batched call, as each layer's view for a step.
    Returns the bytes held for the step (the decoded views and the buffers of exact writes: transient)."""
    layers = [layer for layer in layers if not layer.codec.lossless and layer.view is None]
    if not layers:
        return 0
    codec, dtype = layers[0].codec, layers[0].store.dtype
    views = []
    for name in ("k", "v"):
        stored = {key: torch.stack([getattr(layer.store, name)[key] for layer in layers])
                  for key in getattr(layers[0].store, name)}
        views.append(codec.decode(stored, dtype))  # (L, B, Hk, slots, D)
    exact = [torch.empty_like(x) for x in views]  # written slots only; the flush encodes these
    for i, layer in enumerate(layers):
        layer.view = (views[0][i], views[1][i])
        layer.exact = (exact[0][i], exact[1][i])
        layer.dirty = torch.zeros(layer.num_slots, dtype=torch.bool, device=views[0].device)
    return 2 * (views[0].nbytes + views[1].nbytes)


def flush_views(layers: list[SinkWindowLayerKV]) -> None:
    """Encode what each staged layer wrote during the step (one batched call) and drop the views."""
    staged = [layer for layer in layers if layer.view is not None]
    parts = []
    for layer in staged:
        slots = layer.dirty.nonzero().squeeze(1)
        if slots.numel():
            parts.append((layer, slots, layer.exact[0].index_select(2, slots), layer.exact[1].index_select(2, slots)))
        layer.view = layer.exact = layer.dirty = None
    if not parts:
        return
    codec = parts[0][0].codec
    d = parts[0][2].shape[-1]
    enc = [codec.encode(torch.cat([p[i].reshape(-1, d) for p in parts])) for i in (2, 3)]
    offset = 0
    for layer, slots, k, _ in parts:
        n = k.numel() // d
        shape = k.shape[:-1]
        take = [{key: t[offset : offset + n].reshape(*shape, *t.shape[1:]) for key, t in e.items()} for e in enc]
        layer.store.write_encoded(slots, take[0], take[1])
        offset += n


class SinkWindowKV(PolicyKV):
    """sink_window for a whole model: governed layers are SinkWindowLayerKV, native sliding layers keep
    their own ring. Sustained bytes are fixed at construction (no growth, whatever the length).

    With a lossy resident codec, each engine step decodes every governed layer's store once (one batched
    call), attends over the decoded K/V plus the step's own K/V passed through the codec (what later steps
    will read), and encodes what it wrote, exact, in one batched call at the end of the step: between steps
    only the packed codes are held."""

    def _governed(self) -> list:
        return [self.layers[i] for i in self.governed if isinstance(self.layers[i], SinkWindowLayerKV)]

    def begin_step(self, input_ids: Tensor, start: int) -> None:
        staged = stage_views(self._governed())
        self.peak_transient_bytes = max(self.peak_transient_bytes, staged)

    def end_step(self) -> None:
        flush_views(self._governed())

    def state(self) -> list[dict[str, Tensor]]:
        flush_views(self._governed())
        return super().state()

    @property
    def effective_attention_fraction(self) -> float:
        n = self.length
        if n == 0 or not self.governed:
            return 1.0
        return self.layers[self.governed[0]].visible_count(n - 1) / n
