"""Idle compression: pack an idle session's K/V in place with a codec, unpack it before the next step.

`compress_idle(cache, codec)` replaces every layer by an `IdleLayer` holding the layer's state with its
K/V tensors encoded (identity: an exact copy; d4/e8: bit-packed lattice codes) and frees the live
buffers, so `cache.nbytes` drops to the packed bytes. `decompress(cache)` rebuilds each layer from its
constructor arguments and loads the decoded state. Identity round-trips bit for bit; the lattice codecs
are lossy (the NIAH bench reports token agreement with the uncompressed run). Layers whose resident
store is already lattice-coded keep their codes as they are (no second quantisation).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kakeya_runtime.kv.cache import CacheError, FullLayerKV, SlidingLayerKV
from kakeya_runtime.kv.compress import KVCodec, make_codec
from kakeya_runtime.kv.sink_window import SinkWindowLayerKV
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.kv.spec import CodecSpec, PolicyError


@dataclass(slots=True)
class _Encoded:
    codec: KVCodec
    dtype: torch.dtype
    stored: dict[str, Tensor]


@dataclass(slots=True)
class IdleStats:
    bytes_before: int
    bytes_after: int
    seconds: float


_HELD = ("k", "v", "cold_k", "cold_v", "kmin", "kmax")  # state keys that are K/V bytes, packed or not


class IdleLayer:
    """A layer packed while idle. It keeps `length` (INV-1 still holds) but refuses to be used."""

    def __init__(self, layer, packed: dict[str, Tensor | _Encoded]) -> None:
        self.rebuild = _rebuilder(layer)
        self.packed = packed  # state key -> the tensor as it was, or its encoding
        self.length = layer.length
        # what the layer counted so far (the sparse policy's blocks and positions): a session's running totals,
        # not K/V, so they come back with the layer rather than restart from zero
        self.counts = layer.counts_state() if isinstance(layer, SparseLayerKV) else None

    def packed_nbytes(self, prefixes: tuple[str, ...]) -> int:
        """Bytes held for the state keys under `prefixes` ("k": a sparse layer's hot set), packed or as they were."""
        total = 0
        for key, v in self.packed.items():
            if key.split(".")[0] in prefixes:
                total += sum(t.nbytes for t in v.stored.values()) if isinstance(v, _Encoded) else v.nbytes
        return total

    @property
    def nbytes(self) -> int:
        """K/V bytes held (like a live layer's nbytes: bookkeeping such as slot positions not counted), including
        what idle packing leaves as it is: an already-coded resident store ("k.code", "k.scale"), and the sparse
        policy's cold tier (already packed with its own codec) and block index."""
        total = 0
        for key, v in self.packed.items():
            if isinstance(v, _Encoded):
                total += sum(t.nbytes for t in v.stored.values())
            elif key.split(".")[0] in _HELD:
                total += v.nbytes
        return total

    def unpacked_state(self) -> dict[str, Tensor]:
        return {key: v if isinstance(v, Tensor) else v.codec.decode(v.stored, v.dtype)
                for key, v in self.packed.items()}

    def update_and_fetch(self, k, v, positions):
        raise CacheError("this session's KV cache is compressed while idle; decompress(cache) first")

    def trim(self, length: int) -> None:
        raise CacheError("this session's KV cache is compressed while idle; decompress(cache) first")

    def state(self) -> dict[str, Tensor]:
        return self.unpacked_state()

    def load_state(self, state) -> None:
        raise CacheError("this session's KV cache is compressed while idle; decompress(cache) first")


def _rebuilder(layer):
    """A function returning a fresh, empty layer of the same kind and shape."""
    if isinstance(layer, SinkWindowLayerKV | SparseLayerKV):
        return layer.clone_empty
    if isinstance(layer, FullLayerKV):
        b, hk, allocated, d = layer.k.shape  # rebuilt as allocated: from `length`, the next write doubled it
        cap, dtype, device = layer.capacity, layer.k.dtype, layer.k.device
        return lambda: FullLayerKV(b, hk, d, cap, dtype=dtype, device=device, initial=max(allocated, 1))
    if isinstance(layer, SlidingLayerKV):
        b, hk, _, d = layer.k.shape
        w, spare, dtype, device = layer.window, layer.spare, layer.k.dtype, layer.k.device
        return lambda: SlidingLayerKV(b, hk, d, w, dtype=dtype, device=device, spare=spare)
    raise PolicyError(f"idle compression does not support {type(layer).__name__} layers")


def _is_kv(key: str, t: Tensor) -> bool:
    """Raw K/V in a layer state: FullLayerKV/SlidingLayerKV "k"/"v", an identity SlotStore "k.x"/"v.x"."""
    return (key in ("k", "v") or key in ("k.x", "v.x")) and t.dim() == 4 and t.is_floating_point()


def sparse_packed_bytes(cache) -> dict[str, int]:
    """A compressed sparse cache's hot, cold and index bytes as held now (SparseKV.memory_stats' split: the hot set
    packed by the idle codec, the cold tier and its index kept as they were)."""
    layers = [x for x in cache.layers if isinstance(x, IdleLayer) and x.counts is not None]
    return {"hot_bytes": sum(x.packed_nbytes(("k", "v")) for x in layers),
            "cold_bytes": sum(x.packed_nbytes(("cold_k", "cold_v")) for x in layers),
            "index_bytes": sum(x.packed_nbytes(("kmin", "kmax")) for x in layers)}


def is_compressed(cache) -> bool:
    return any(isinstance(layer, IdleLayer) for layer in cache.layers)


@torch.inference_mode()
def compress_idle(cache, codec: CodecSpec | str = "d4", q: int = 38) -> IdleStats:
    """Pack every layer of an idle cache in place (restore caches drop their turn overlay first)."""
    spec = codec if isinstance(codec, CodecSpec) else CodecSpec(codec, q)
    if is_compressed(cache):
        raise CacheError("cache is already compressed")
    t0 = time.perf_counter()
    end_turn = getattr(cache, "end_turn", None)
    if end_turn is not None:
        end_turn()
    before = cache.nbytes
    codecs: dict[int, KVCodec] = {}
    for i, layer in enumerate(cache.layers):
        state = layer.state()
        packed: dict[str, Tensor | _Encoded] = {}
        for key, t in state.items():
            if not _is_kv(key, t):
                packed[key] = t
                continue
            head_dim = t.shape[-1]
            if head_dim not in codecs:
                try:
                    codecs[head_dim] = make_codec(spec.kind, spec.q, head_dim, t.device)
                except ValueError as e:
                    raise PolicyError(f"idle codec {spec.label}: {e}") from None
            packed[key] = _Encoded(codecs[head_dim], t.dtype, codecs[head_dim].encode(t))
        cache.layers[i] = IdleLayer(layer, packed)
    return IdleStats(before, cache.nbytes, time.perf_counter() - t0)


@torch.no_grad()
def decompress(cache) -> IdleStats:
    """Unpack a cache packed by compress_idle, in place; a no-op on an uncompressed cache. Not in inference mode:
    the rebuilt layers' tensors would be inference tensors, which a later in-place update outside it (a verifier's
    trim of a ring's slot positions) refuses."""
    t0 = time.perf_counter()
    before = cache.nbytes
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, IdleLayer):
            live = layer.rebuild()
            live.load_state(layer.unpacked_state())
            if layer.counts is not None:
                live.load_counts(layer.counts)
            cache.layers[i] = live
    return IdleStats(before, cache.nbytes, time.perf_counter() - t0)
