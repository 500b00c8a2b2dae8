"""Caller-owned, preallocated per-layer K/V storage (post-RoPE keys), written by position.

`FullLayerKV` keeps every position up to its capacity; `SlidingLayerKV` keeps a ring of the last
`window` positions for layers that can never see further back (Gemma 3's sliding layers).
`ModelKV` is the per-model list the decoder consumes, plus the bookkeeping the engine needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from kakeya_runtime.models.config import ModelConfig


class CacheError(ValueError):
    """A cache used against its contract (shape, dtype, device, capacity)."""


def _storage(*shape: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Zeros for a cache's K/V: an ordinary tensor even when made inside inference mode (a prefill growing a layer),
    so every cache tensor is of one kind wherever it was made. A compiled decode step (engine.compiled) guards on
    that kind (inference tensors lack a dispatch key ordinary ones have); mixed kinds recompiled it mid-generation."""
    with torch.inference_mode(False):
        return torch.zeros(*shape, dtype=dtype, device=device)


def _keep_writes_overridable(cls: type) -> None:
    """A subclass that overrides update_and_fetch but not append_slot gets no append_slot: its decode writes go
    through its own update_and_fetch (a caller takes append_slot only where a layer offers it)."""
    if "update_and_fetch" in cls.__dict__ and "append_slot" not in cls.__dict__:
        cls.append_slot = None


class FullLayerKV:
    """(B, Hk, allocated, D) buffers; `length` positions filled, 0..length-1 in order.

    Storage grows by doubling up to `capacity` (the model's context or less), so an idle short
    session does not hold a context-sized buffer; a copy happens only log2(capacity) times. A caller that knows
    how far a step sequence can reach calls `reserve` first (the engine does at the start of every generation:
    prompt + max_new_tokens), so the copy happens then and never inside the decode steps, whose writes land in
    storage that is already there. `nbytes` counts what is allocated, reserved positions included.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", initial: int = 256) -> None:
        self.capacity = capacity
        self.k = _storage(batch, num_kv_heads, min(initial, capacity), head_dim, dtype=dtype, device=device)
        self.v = _storage(*self.k.shape, dtype=dtype, device=device)
        with torch.inference_mode(False):
            self.key_positions = torch.arange(capacity, device=device)
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V tensors held (allocated storage, filled or not)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def allocated(self) -> int:
        """Positions the storage holds room for (filled or not)."""
        return self.k.shape[2]

    def reserve(self, positions: int) -> None:
        """Make room for `positions` (clamped to the capacity) now, so writes up to there allocate nothing."""
        self._reserve(min(positions, self.capacity))

    def _reserve(self, needed: int) -> None:
        if needed <= self.k.shape[2]:
            return
        size = min(self.capacity, max(needed, 2 * self.k.shape[2]))
        k = _storage(*self.k.shape[:2], size, self.k.shape[3], dtype=self.k.dtype, device=self.k.device)
        v = _storage(*k.shape, dtype=k.dtype, device=k.device)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _check_new(self.k, k, v)
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise CacheError(f"cache overflow: {start} + {k.shape[2]} new positions exceed capacity {self.capacity}")
        self._reserve(end)
        self.k[:, :, start:end] = k  # one assignment for the whole chunk
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], self.key_positions[:end]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _keep_writes_overridable(cls)
        if "append_run" not in cls.__dict__:  # a subclass opts in: its writes or views may differ
            cls.append_run = None

    def run_room(self) -> int:
        """The most tokens `append_run` takes now."""
        return self.capacity - self.length

    def append_run(self, n: int) -> list[tuple[Tensor, Tensor, Tensor, int, int, bool]]:
        """`append_slot` for n consecutive tokens of this sequence in one call whose tokens all write before any
        attends (kakeya.DecoderStack.step_chunk: a prefill chunk, a turn's message, a speculative verify): room for
        all n reserved first, so every token gets the same storage; token i sees the keys at or before its own
        position, so the tokens after it are out of its view, as in a chunk's causal attention."""
        if n > self.run_room():
            raise CacheError(f"cache overflow: {self.length} + {n} new positions exceed capacity {self.capacity}")
        self._reserve(self.length + n)
        return [self.append_slot() for _ in range(n)]

    def append_slot(self) -> tuple[Tensor, Tensor, Tensor, int, int, bool]:
        """One decode token's room, for a caller that writes it itself (native.cached_attention_rows_append):
        (k, v, key positions, the slot to write, the keys to attend after it, whether the slot's position must be
        written). The slot is `length`, whose position is already in key_positions; the length moves on now. The
        same storage and views as update_and_fetch of one token."""
        end = self.length + 1
        if end > self.capacity:
            raise CacheError(f"cache overflow: {self.length} + 1 new positions exceed capacity {self.capacity}")
        self._reserve(end)
        self.length = end
        return self.k, self.v, self.key_positions, end - 1, end, False

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot trim a cache of length {self.length} to {length}")
        self.length = length

    def state(self) -> dict[str, Tensor]:
        return {"k": self.k[:, :, : self.length].clone(), "v": self.v[:, :, : self.length].clone()}

    def load_state(self, state: dict[str, Tensor]) -> None:
        n = state["k"].shape[2]
        if n > self.capacity:
            raise CacheError(f"state of {n} positions exceeds capacity {self.capacity}")
        self.length = 0
        self._reserve(n)
        self.k[:, :, :n] = state["k"]
        self.v[:, :, :n] = state["v"]
        self.length = n


class SlidingLayerKV:
    """Ring of the last `window + spare` positions: memory O(window) however long the sequence grows.

    Queries see the last `window` positions (the attention mask, by position). The `spare` extra slots keep
    positions the window no longer needs, so the cache can roll back (trim) by up to `spare` positions once the
    ring has wrapped, which speculative decoding needs (a rejected draft is trimmed away). Slots left holding
    trimmed positions are skipped until they are overwritten."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, window: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", spare: int = 0) -> None:
        if window < 1 or spare < 0:
            raise CacheError(f"need window >= 1 and spare >= 0, got {window}, {spare}")
        self.window, self.spare = window, spare
        self.slots = window + spare
        self.k = _storage(batch, num_kv_heads, self.slots, head_dim, dtype=dtype, device=device)
        self.v = _storage(*self.k.shape, dtype=dtype, device=device)
        self.slot_positions = _storage(self.slots, dtype=torch.long, device=device)
        self.length = 0
        self._stale_until = 0  # slots may hold trimmed positions (>= length) until length reaches this

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _check_new(self.k, k, v)
        t, w = k.shape[2], self.slots
        held = min(self.length, w)
        if t == 1:
            # Stale slots (trimmed positions above this one) are masked by causality: no filtering needed.
            slot = self.length % w
            self.k[:, :, slot : slot + 1] = k
            self.v[:, :, slot : slot + 1] = v
            self.slot_positions[slot : slot + 1] = positions
            self.length += 1
            n = min(self.length, w)
            return self.k[:, :, :n], self.v[:, :, :n], self.slot_positions[:n]
        # A chunk of queries needs the previous window plus the chunk itself: hand back both,
        # then keep the last `slots` positions in the ring.
        k_old, v_old, pos_old = self.k[:, :, :held], self.v[:, :, :held], self.slot_positions[:held]
        if self.length < self._stale_until:  # drop trimmed positions: the chunk brings them anew
            keep_old = (pos_old < self.length).nonzero().squeeze(1)
            k_old, v_old, pos_old = k_old[:, :, keep_old], v_old[:, :, keep_old], pos_old[keep_old]
        k_all = torch.cat((k_old, k), dim=2)
        v_all = torch.cat((v_old, v), dim=2)
        pos_all = torch.cat((pos_old, positions))
        keep = min(t, w)
        slots = (torch.arange(self.length + t - keep, self.length + t, device=k.device)) % w
        self.k.index_copy_(2, slots, k[:, :, t - keep :])
        self.v.index_copy_(2, slots, v[:, :, t - keep :])
        self.slot_positions.index_copy_(0, slots, positions[t - keep :])
        self.length += t
        return k_all, v_all, pos_all

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _keep_writes_overridable(cls)
        if "append_run" not in cls.__dict__:  # a subclass opts in: its writes or views may differ
            cls.append_run = None

    def run_room(self) -> int:
        """The most tokens `append_run` takes: a run's last row overwrites the slot of the position `slots` before
        it, which its first row still sees unless the spare slots cover the run (and a run must be able to be
        trimmed away again)."""
        return self.spare

    def append_run(self, n: int) -> list[tuple[Tensor, Tensor, Tensor, int, int, bool]]:
        """`append_slot` for n consecutive tokens in one call whose rows all write before any attends (as
        FullLayerKV.append_run): each row sees by position (the kernel's rule: at or before its own, within the
        window), so the run's later keys and slots holding trimmed positions above it are out of its view."""
        if n > self.run_room():
            raise CacheError(f"a run of {n} tokens would overwrite keys its first token sees (spare {self.spare})")
        return [self.append_slot() for _ in range(n)]

    def append_slot(self) -> tuple[Tensor, Tensor, Tensor, int, int, bool]:
        """update_and_fetch of one token for a caller that writes it itself (as FullLayerKV.append_slot): the ring
        slot `length % slots`, its position to be written there too, and the first min(length + 1, slots) slots
        to attend."""
        slot = self.length % self.slots
        self.length += 1
        return self.k, self.v, self.slot_positions, slot, min(self.length, self.slots), True

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot trim a cache of length {self.length} to {length}")
        if length == self.length:
            return
        if self.length > self.slots and length - self.window < self.length - self.slots:
            raise CacheError(
                f"sliding cache has overwritten positions below {self.length - self.slots}; cannot trim to {length} "
                f"(roll back at most {self.spare} positions once the ring wrapped)"
            )
        self._stale_until = max(self._stale_until, self.length)
        self.length = length

    def rollback_room(self) -> int:
        """How many positions `trim` can take back now."""
        return self.length if self.length <= self.slots else self.spare

    def state(self) -> dict[str, Tensor]:
        n = min(self.length, self.slots)
        return {"k": self.k[:, :, :n].clone(), "v": self.v[:, :, :n].clone(),
                "slot_positions": self.slot_positions[:n].clone(), "length": torch.tensor(self.length),
                "stale_until": torch.tensor(self._stale_until)}

    def load_state(self, state: dict[str, Tensor]) -> None:
        n = state["k"].shape[2]
        if n > self.slots:
            raise CacheError(f"state of {n} slots exceeds the ring of {self.slots}")
        self.k[:, :, :n] = state["k"]
        self.v[:, :, :n] = state["v"]
        self.slot_positions[:n] = state["slot_positions"]
        self.length = int(state["length"])
        self._stale_until = int(state.get("stale_until", 0))


def _check_new(buf: Tensor, k: Tensor, v: Tensor) -> None:
    if k.shape != v.shape:
        raise CacheError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.dim() != 4 or k.shape[0] != buf.shape[0] or k.shape[1] != buf.shape[1] or k.shape[3] != buf.shape[3]:
        raise CacheError(
            f"batch size mismatch or bad K/V shape: got {tuple(k.shape)}, cache holds "
            f"(B={buf.shape[0]}, Hk={buf.shape[1]}, *, D={buf.shape[3]})"
        )
    if k.dtype != buf.dtype or v.dtype != buf.dtype:
        raise CacheError(f"dtype mismatch: K/V are {k.dtype}, cache is {buf.dtype}")
    if k.device != buf.device:
        raise CacheError(f"device mismatch: K/V on {k.device}, cache on {buf.device}")


class ModelKV(Sequence):
    """One cache object per decoder layer, plus the sequence length they all share (INV-1)."""

    def __init__(self, layers: list, *, batch: int, capacity: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.batch = batch
        self.capacity = capacity  # max positions this cache accepts (the model's limit or less)
        self.dtype = dtype

    def __getitem__(self, i):  # type: ignore[override]
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator:
        return iter(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def layer_lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def trim(self, length: int) -> None:
        for layer in self.layers:
            layer.trim(length)

    def reserve(self, positions: int) -> None:
        """Room for `positions` in every growing layer (FullLayerKV; rings and policy stores keep their own
        sizes), so the steps up to there never reallocate or copy: called before a generation's prefill."""
        for layer in self.layers:
            grow = getattr(layer, "reserve", None)
            if grow is not None:
                grow(positions)

    def state(self) -> list[dict[str, Tensor]]:
        return [layer.state() for layer in self.layers]

    def load_state(self, state: Sequence[dict[str, Tensor]]) -> None:
        if len(state) != len(self.layers):
            raise CacheError(f"state has {len(state)} layers, cache has {len(self.layers)}")
        for layer, s in zip(self.layers, state, strict=True):
            layer.load_state(s)

    # Policy hooks (no-ops here; kv.policy caches use them). The engine brackets every forward with
    # begin_step/end_step and calls end_turn when a generation ends.
    def begin_step(self, input_ids: Tensor, start: int) -> None:
        """Before a forward over `input_ids` (B, T) at positions start..start+T-1."""

    def end_step(self) -> None:
        """After that forward, also when it raised."""

    def end_turn(self) -> None:
        """A generation is over: drop what only the turn needed."""

    @property
    def effective_attention_fraction(self) -> float:
        """Fraction of the causally visible positions the newest query attends to (1.0: all)."""
        return 1.0


SLIDING_SPARE = 16  # extra ring slots of a native sliding layer: how far a speculative draft can be rolled back


def sliding_spare(window: int, capacity: int) -> int:
    """Spare ring slots for a native sliding layer of `window` in a cache of `capacity` positions (never past it)."""
    return max(0, min(SLIDING_SPARE, capacity - window))


def make_cache(config: ModelConfig, *, batch: int = 1, capacity: int | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> ModelKV:
    """The full-attention cache: FullLayerKV on global layers, a window ring on sliding layers."""
    cap = config.max_position_embeddings if capacity is None else capacity
    if not 0 < cap <= config.max_position_embeddings:
        raise CacheError(f"capacity {cap} outside 1..{config.max_position_embeddings} (the model's context)")
    if batch < 1:
        raise CacheError(f"batch must be >= 1, got {batch}")
    shape = (batch, config.num_key_value_heads, config.head_dim)
    layers: list = []
    for i in range(config.num_hidden_layers):
        window = config.layer_window(i)
        if window is not None and window < cap:
            layers.append(SlidingLayerKV(*shape, window, dtype=dtype, device=device, spare=sliding_spare(window, cap)))
        else:
            layers.append(FullLayerKV(*shape, cap, dtype=dtype, device=device))
    return ModelKV(layers, batch=batch, capacity=cap, dtype=dtype)
