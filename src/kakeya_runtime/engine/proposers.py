"""K/V proposers for restoration (seed 000 §11.3, §11.5, §11.6): a cache-less forward that recomputes
the K/V of positions a bounded cache has evicted.

A proposer is a model plus a per-layer projection f_theta from its K/V to the verifier's. It runs a
forward over the token history with no persistent cache: every K/V it computes lives only for the call.
The forward is chunked (`chunk` tokens at a time), so its activations are bounded by the chunk size;
what it must hold for the whole call is the K/V of the positions it has processed so far (earlier
chunks are attended to by later ones), which is exactly what it hands back: O(T) transiently, freed
when the caller drops it.

Shipped: `ModelProposer` for any DecoderModel, and `same_checkpoint_proposer(model)` (proposer =
verifier, f_theta = identity). With the identity projection the proposer writes its K/V straight into
the caller's buffers (no copy); a learned projection (`LinearProjection`) maps them per layer instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch import Tensor, nn

from kakeya_runtime.kv.cache import FullLayerKV, SlidingLayerKV
from kakeya_runtime.models.base import DecoderModel, Logits

Seen = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # new K/V -> what attention reads


class ProposerError(ValueError):
    """A proposer that cannot serve the verifier asking it (layers, shapes, dtype)."""


class KVProjection(Protocol):
    """f_theta: proposer K/V -> verifier K/V, per verifier layer."""

    is_identity: bool

    def source_layer(self, layer: int) -> int:
        """The proposer layer whose K/V feed verifier `layer`."""
        ...

    def project(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(B, Hk', T, D') proposer K/V -> (B, Hk, T, D) verifier K/V for verifier `layer`."""
        ...


class IdentityProjection:
    """Same checkpoint: the proposer's layer l K/V are the verifier's layer l K/V."""

    is_identity = True

    def source_layer(self, layer: int) -> int:
        return layer

    def project(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


class LinearProjection(nn.Module):
    """A learned per-layer, per-head linear map of the head dim (initialised to identity), with a
    fixed layer alignment. The cross-model training itself lives elsewhere (train/projection.py)."""

    is_identity = False

    def __init__(self, layer_map: Mapping[int, int], head_dim_in: int, head_dim_out: int, num_kv_heads: int) -> None:
        super().__init__()
        self.layer_map = dict(layer_map)
        eye = torch.eye(head_dim_in, head_dim_out).expand(num_kv_heads, -1, -1)
        self.k_maps = nn.ParameterDict({str(v): nn.Parameter(eye.clone()) for v in self.layer_map})
        self.v_maps = nn.ParameterDict({str(v): nn.Parameter(eye.clone()) for v in self.layer_map})

    def source_layer(self, layer: int) -> int:
        return self.layer_map[layer]

    def project(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        mk, mv = self.k_maps[str(layer)], self.v_maps[str(layer)]  # (Hk, D', D)
        return (torch.einsum("bhtd,hde->bhte", k, mk.to(k.dtype)),
                torch.einsum("bhtd,hde->bhte", v, mv.to(v.dtype)))


class KVProposer(Protocol):
    def restore(self, token_ids: Tensor, out: Mapping[int, tuple[Tensor, Tensor]], seen: Seen | None = None) -> int:
        """Forward `token_ids` (B, E) (positions 0..E-1) with no cache; write the K/V of every
        position into out[layer] = (k_buf, v_buf), each (B, Hk, >= E, D) in the verifier's dtype.
        `seen` maps new K/V to what the verifier's attention reads (its lossy resident codec): the layers
        of `out` write and attend to that, as the verifier did. Returns the peak bytes of K/V the proposer
        itself held on top of `out` during the call."""
        ...


class _WriteThrough:
    """A proposer layer's transient K/V written straight into the caller's buffers."""

    def __init__(self, k: Tensor, v: Tensor, seen: Seen | None = None) -> None:
        self.k, self.v, self.length, self.seen = k, v, 0, seen
        self.key_positions = torch.arange(k.shape[2], device=k.device)

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.seen is not None:
            k, v = self.seen(k, v)
        start, end = self.length, self.length + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], self.key_positions[:end]


class ModelProposer:
    """Any decoder as a proposer: chunked cache-less forward + projection f_theta."""

    def __init__(self, model: DecoderModel, projection: KVProjection | None = None, *, chunk: int = 512) -> None:
        if chunk < 1:
            raise ProposerError(f"proposer chunk must be >= 1, got {chunk}")
        self.model = model.eval()
        self.projection = projection or IdentityProjection()
        self.chunk = chunk
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device

    @torch.inference_mode()
    def restore(self, token_ids: Tensor, out: Mapping[int, tuple[Tensor, Tensor]], seen: Seen | None = None) -> int:
        cfg = self.model.config
        batch, e = token_ids.shape
        if e == 0:
            return 0
        proj = self.projection
        sources = {proj.source_layer(layer): layer for layer in out}
        if proj.is_identity:
            for layer, (k_buf, _) in out.items():
                if k_buf.dtype != self.dtype or k_buf.shape[1] != cfg.num_key_value_heads or k_buf.shape[3] != cfg.head_dim:
                    raise ProposerError(f"identity projection needs matching K/V shape and dtype at layer {layer}")
        shape = (batch, cfg.num_key_value_heads, cfg.head_dim)
        caches: list = []
        held = 0
        for i in range(cfg.num_hidden_layers):
            window = cfg.layer_window(i)
            if i in sources and proj.is_identity:
                k_buf, v_buf = out[sources[i]]
                caches.append(_WriteThrough(k_buf, v_buf, seen))
            elif window is not None and window < e:
                caches.append(SlidingLayerKV(*shape, window, dtype=self.dtype, device=self.device))
            else:
                caches.append(FullLayerKV(*shape, e, dtype=self.dtype, device=self.device, initial=e))
            if not isinstance(caches[-1], _WriteThrough):
                held += caches[-1].nbytes
        for c0 in range(0, e, self.chunk):
            c1 = min(c0 + self.chunk, e)
            positions = torch.arange(c0, c1, device=self.device)
            self.model(token_ids[:, c0:c1], positions, caches, logits=Logits.NONE)
        if not proj.is_identity:
            for src, layer in sources.items():
                k, v = proj.project(layer, caches[src].k[:, :, :e], caches[src].v[:, :, :e])
                if seen is not None:
                    k, v = seen(k, v)
                k_buf, v_buf = out[layer]
                k_buf[:, :, :e] = k
                v_buf[:, :, :e] = v
        return held


def same_checkpoint_proposer(model: DecoderModel, *, chunk: int = 512) -> ModelProposer:
    """Proposer = verifier, f_theta = identity: restored K/V equal the verifier's own (seed §11.6 case 1)."""
    return ModelProposer(model, IdentityProjection(), chunk=chunk)

