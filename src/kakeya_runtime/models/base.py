"""What every model family's forward returns, and the contract it keeps."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kakeya_runtime.models import native_layer
from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.models.layers import LayerKV, RowCaches, linear


class Logits(enum.Enum):
    NONE = "none"  # prefill chunks that are not the last: no vocab projection at all
    LAST = "last"  # generation: only the last position's row (B, 1, V)
    ALL = "all"  # scoring / parity tests: every position (B, T, V)


@dataclass(slots=True)
class ForwardOutput:
    logits: Tensor | None  # fp32, (B, T or 1, V)
    attn_row: Tensor | None  # (B, H, S) probabilities of the last query at the traced layer
    hidden: Tensor | None = None  # (B, T, C) final-norm hidden states, when asked for


class DecoderModel(nn.Module):
    """Stateless decoder: forward(input_ids, positions, cache). Caches are owned by the caller."""

    config: ModelConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def layer_forward(self, layer_idx: int, h: Tensor, positions: Tensor, rope: dict, cache: LayerKV | None,
                      trace: bool) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> dict:
        raise NotImplementedError

    def layer_rope(self, layer_idx: int, rope: dict) -> tuple[Tensor, Tensor]:
        """Layer layer_idx's cos, sin (T or B, D) out of `rope_tables`."""
        raise NotImplementedError

    def native_layers(self) -> native_layer.NativeLayers | None:
        """This model's one-call-per-layer decode path (models.native_layer), or None where it is off."""
        if not native_layer.enabled():
            return None
        fused = self.__dict__.get("_native_layers")
        if fused is None:
            fused = self.__dict__["_native_layers"] = native_layer.NativeLayers(len(self.layers))
        return fused

    def head_weight(self) -> Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def project(self, hidden: Tensor) -> Tensor:
        """Final hidden states (B, T, C) -> fp32 logits (B, T, V), summed in fp32 and never rounded to the
        activation dtype where the head allows it (bf16 logits near 25 are 0.125 apart and tie)."""
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight, out_fp32=True)
        fp32 = getattr(self.lm_head, "forward_fp32", None)
        return fp32(hidden) if fp32 is not None else self.lm_head(hidden).float()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: Sequence[LayerKV] | None = None,
        *,
        logits: Logits = Logits.LAST,
        trace_layer: int | None = None,
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """input_ids: (B, T) int64; positions: (T,) absolute positions of those tokens."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        if positions.shape != (input_ids.shape[1],):
            raise ValueError(f"positions must be ({input_ids.shape[1]},), got {tuple(positions.shape)}")
        num_layers = len(self.layers)
        if cache is not None and len(cache) != num_layers:
            raise ValueError(f"cache has {len(cache)} layers, model has {num_layers}")
        if trace_layer is not None and not 0 <= trace_layer < num_layers:
            raise ValueError(f"trace_layer {trace_layer} outside 0..{num_layers - 1}")
        h = self.embed(input_ids)  # (B, T, C)
        rope = self.rope_tables(positions, h.dtype)
        row = None
        # one decode token: each layer one native call where its cache allows (the same bits as its forward); a
        # run of new tokens of one sequence (a turn's message, a verify, a prefill chunk): the whole stack in one call
        # where every cache takes the run as one chunk, else each layer's halves natively around its own attention
        # (the same bits too)
        native = self.native_layers() if cache is not None and input_ids.shape[0] == 1 else None
        fused = native if input_ids.shape[1] == 1 else None
        short = native if input_ids.shape[1] > 1 else None
        start = 0
        if fused is not None and trace_layer is None:
            ropes = [self.layer_rope(i, rope) for i in range(num_layers)]
            out = fused.run_all(self.layers, h, positions, [c for c, _ in ropes], [s for _, s in ropes],
                                [(kv,) for kv in cache])
            if out is not None:
                h, start = out, num_layers
        elif short is not None and trace_layer is None:
            ropes = [self.layer_rope(i, rope) for i in range(num_layers)]
            t = input_ids.shape[1]  # the tokens as one chunk: written first, attended as one query
            out = short.run_all_chunk(self.layers, h.view(t, 1, -1), positions, [c for c, _ in ropes],
                                      [s for _, s in ropes], [[kv] for kv in cache], t)
            if out is not None:
                h, start = out.view(1, t, -1), num_layers
        for i in range(start, num_layers):
            if fused is not None and i != trace_layer:
                cos, sin = self.layer_rope(i, rope)
                out = fused.run(i, self.layers[i], h, positions, cos, sin, (cache[i],))
                if out is not None:
                    h = out
                    continue
            if short is not None and i != trace_layer:
                cos, sin = self.layer_rope(i, rope)
                out = short.run_sequence(i, self.layers[i], h, positions, cos, sin, cache[i])
                if out is not None:
                    h = out
                    continue
            h, r = self.layer_forward(i, h, positions, rope, None if cache is None else cache[i], i == trace_layer)
            if r is not None:
                row = r
        if logits is Logits.NONE and not return_hidden:
            return ForwardOutput(None, row)
        if logits is Logits.LAST and not return_hidden:
            h = h[:, -1:]
        h = self.norm(h)
        out = None
        if logits is Logits.ALL:
            out = self.project(h)
        elif logits is Logits.LAST:
            out = self.project(h[:, -1:])
        return ForwardOutput(out, row, h if return_hidden else None)

    def forward_rows(self, input_ids: Tensor, positions: Tensor, caches: Sequence[Sequence[LayerKV]],
                     chunks: int | Sequence[int] = ()) -> ForwardOutput:
        """One new token for each of B independent sequences (a batched decode step across sessions):
        input_ids (B, 1), positions (B,), caches[b] row b's per-layer caches. Returns logits (B, 1, V); each row's
        are bit-identical to running that row alone.

        With `chunks` (token counts, each > 0; an int: one chunk, 0 none) the last sum(chunks) rows of input_ids /
        positions are prefill chunks of len(chunks) more sequences (the last caches, in order), each its
        sequence's consecutive tokens: prefill chunks riding the step (len(caches) == B - sum(chunks) +
        len(chunks); no decode rows at all is allowed). A chunk's K/V are the ones a forward of its own writes,
        and the logits gain one row per chunk, in order: its last token's (bit-identical too)."""
        n = input_ids.shape[0]
        chunks = ((chunks,) if chunks else ()) if isinstance(chunks, int) else tuple(chunks)
        total = sum(chunks)
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"input_ids must be (B, 1), got shape {tuple(input_ids.shape)}")
        if (any(c < 1 for c in chunks) or not total <= n or positions.shape != (n,)
                or len(caches) != n - total + len(chunks)):
            raise ValueError(f"need one position per row and one cache per sequence: {n} rows (chunks {chunks}), "
                             f"positions {tuple(positions.shape)}, {len(caches)} caches")
        num_layers = len(self.layers)
        if any(len(c) != num_layers for c in caches):
            raise ValueError(f"every cache needs {num_layers} layers")
        h = self.embed(input_ids)  # (B, 1, C)
        rope = self.rope_tables(positions, h.dtype)  # tables (B, D): one position per row
        fused = self.native_layers()
        start = 0
        if fused is not None:  # decode rows and any prefill chunks riding them: every layer in one call
            ropes = [self.layer_rope(i, rope) for i in range(num_layers)]
            per_layer = [[c[i] for c in caches] for i in range(num_layers)]
            cos, sin = [c for c, _ in ropes], [s for _, s in ropes]
            out = (fused.run_all_chunk(self.layers, h, positions, cos, sin, per_layer, chunks) if chunks
                   else fused.run_all(self.layers, h, positions, cos, sin, per_layer))
            if out is not None:
                h, start = out, num_layers
        for i in range(start, num_layers):
            layer_caches = [c[i] for c in caches]
            if fused is not None:
                cos, sin = self.layer_rope(i, rope)
                if chunks:  # prefill chunks ride the step: the layer's halves natively around its own attention
                    out = fused.run_mixed(i, self.layers[i], h, positions, cos, sin, RowCaches(layer_caches, chunks))
                else:
                    out = fused.run(i, self.layers[i], h, positions, cos, sin, layer_caches)
                if out is not None:
                    h = out
                    continue
            h, _ = self.layer_forward(i, h, positions, rope, RowCaches(layer_caches, chunks), False)
        if chunks:
            r, last = n - total, []
            for c in chunks:  # each chunk's last token
                r += c
                last.append(r - 1)
            h = torch.cat((h[: n - total], h[last]))  # the decode rows and the chunks' last tokens
        return ForwardOutput(self.project(self.norm(h)), None)
