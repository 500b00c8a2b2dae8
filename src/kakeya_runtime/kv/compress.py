"""Resident K/V storage behind one codec boundary (seed 000 §11.11.4: the KVCompressor contract).

A `KVCodec` turns (..., D) vectors into named storage tensors and back; `SlotStore` holds K and V for a
fixed number of slots in that form. The live bytes of a store are the `nbytes` of the tensors it holds:
for the lattice codecs that is bit-packed lattice indices (uint8) plus an fp16 norm and an fp16 range
per vector, nothing else. Three codecs:

- `IdentityCodec`: the K/V in the model dtype, bit-exact (the default; the oracle's storage).
- `PackedLatticeCodec`: D4 / E8 nested-lattice codes with range Q (kakeya_runtime.kv.lattice).
- `Int8Codec`: int8 per element with one fp16 absmax scale per vector: less compact than D4, but cheap enough
  that the attention kernel reads it as stored (the sparse policy's cold tier does, with no decode step).

A codec whose storage the attention kernel reads as stored is `direct`.

`SlotStore` also offers the seed's position-addressed interface (`compress` / `decompress` / `evict` /
`memory_bytes`); the policy caches address slots directly on the hot path.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from kakeya_runtime.kv.lattice import LatticeCodec, check_scale_range

CODECS = ("identity", "d4", "e8", "int8")
_ENCODE_ROWS = 4096  # vectors per encode/decode call: bounds the codec's transient memory


class KVCodec(Protocol):
    name: str
    lossless: bool
    direct: bool  # kakeya::sparse_attention reads the storage as stored

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int: ...

    def alloc(self, lead: tuple[int, ...], head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> dict[str, Tensor]:
        """Zeroed storage for vectors indexed by `lead` (e.g. (B, Hk, slots))."""
        ...

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        """(..., D) -> storage tensors with the same leading shape."""
        ...

    def decode(self, stored: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        """Storage tensors (..., *) -> (..., D) in `dtype`."""
        ...


class IdentityCodec:
    name = "identity"
    lossless = True
    direct = True

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int:
        return head_dim * dtype.itemsize

    def alloc(self, lead, head_dim, dtype, device):
        return {"x": torch.zeros(*lead, head_dim, dtype=dtype, device=device)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        return {"x": x}

    def decode(self, stored: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        return stored["x"] if stored["x"].dtype == dtype else stored["x"].to(dtype)


class PackedLatticeCodec:
    """Bit-packed D4/E8 codes: (D/b)*ceil(bits/block) bits + fp16 norm + fp16 range per vector."""

    lossless = False
    direct = False

    def __init__(self, kind: str, q: int, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.lattice = LatticeCodec(kind, q, head_dim, device)
        self.name = f"{kind}/q{q}"

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int:
        return self.lattice.bytes_per_vector

    def alloc(self, lead, head_dim, dtype, device):
        return {"code": torch.zeros(*lead, self.lattice.code_bytes, dtype=torch.uint8, device=device),
                "scale": torch.zeros(*lead, 2, dtype=torch.float16, device=device)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        parts = [self.lattice.encode(flat[i : i + _ENCODE_ROWS]) for i in range(0, flat.shape[0], _ENCODE_ROWS)]
        code = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return {"code": code.reshape(*lead, -1), "scale": scale.reshape(*lead, 2)}

    def decode(self, stored: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        code, scale = stored["code"], stored["scale"]
        lead = code.shape[:-1]
        flat_c, flat_s = code.reshape(-1, code.shape[-1]), scale.reshape(-1, 2)
        n = flat_c.shape[0]
        if n <= _ENCODE_ROWS:
            return self.lattice.decode(flat_c, flat_s, dtype).reshape(*lead, self.lattice.head_dim)
        out = torch.empty(n, self.lattice.head_dim, dtype=dtype, device=code.device)
        for i in range(0, n, _ENCODE_ROWS):
            out[i : i + _ENCODE_ROWS] = self.lattice.decode(flat_c[i : i + _ENCODE_ROWS], flat_s[i : i + _ENCODE_ROWS],
                                                            dtype)
        return out.reshape(*lead, self.lattice.head_dim)


class Int8Codec:
    """x ~ code * scale: code int8 in [-127, 127] per element, scale = absmax / 127 in fp16 per vector. Each
    vector is encoded alone (elementwise ops only), so its code does not depend on what else is encoded."""

    name = "int8"
    lossless = False
    direct = True

    def bytes_per_vector(self, head_dim: int, dtype: torch.dtype) -> int:
        return head_dim + 2

    def alloc(self, lead, head_dim, dtype, device):
        return {"code": torch.zeros(*lead, head_dim, dtype=torch.int8, device=device),
                "scale": torch.zeros(*lead, dtype=torch.float16, device=device)}

    def encode(self, x: Tensor) -> dict[str, Tensor]:
        xf = x.float()
        scale = xf.abs().amax(-1) / 127.0
        check_scale_range(scale, "int8 scale")
        scale = scale.to(torch.float16)  # the stored scale is the one decode uses
        safe = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(-1)
        code = torch.round(xf / safe).clamp(-127, 127).to(torch.int8)
        return {"code": code, "scale": scale}

    def decode(self, stored: dict[str, Tensor], dtype: torch.dtype) -> Tensor:
        """fp32 product, rounded once to `dtype` (what the kernel computes when it reads the codes)."""
        return (stored["code"].float() * stored["scale"].float().unsqueeze(-1)).to(dtype)


class KVCompressor(Protocol):
    """Seed 000 §11.11.4, position-addressed. `SlotStore` implements it: with IdentityCodec it is the
    IdentityCompressor, with PackedLatticeCodec the KakeyaLattice compressor (real packed bytes)."""

    def compress(self, k: Tensor, v: Tensor, positions: Tensor) -> None: ...

    def decompress(self, positions: Tensor) -> tuple[Tensor, Tensor]: ...

    def evict(self, positions: Tensor) -> None: ...

    def memory_bytes(self) -> int: ...


def make_codec(kind: str, q: int, head_dim: int, device: torch.device | str = "cpu") -> KVCodec:
    if kind == "identity":
        return IdentityCodec()
    if kind in ("d4", "e8"):
        return PackedLatticeCodec(kind, q, head_dim, device)
    if kind == "int8":
        return Int8Codec()
    raise ValueError(f"unknown codec {kind!r} (known: {', '.join(CODECS)})")


def stored_nbytes(stored: dict[str, Tensor]) -> int:
    return sum(t.nbytes for t in stored.values())


def take(stored: dict[str, Tensor], dim: int, index: Tensor | slice) -> dict[str, Tensor]:
    """Select along the slot dimension of every storage tensor (a view for slices)."""
    if isinstance(index, slice):
        return {name: t[(slice(None),) * dim + (index,)] for name, t in stored.items()}
    return {name: t.index_select(dim, index) for name, t in stored.items()}


class SlotStore:
    """K and V for `(batch, num_kv_heads, num_slots)` vectors of head_dim, in a codec's storage.

    The slot dimension is 2, as in (B, Hk, S, D) K/V tensors. `slot_positions[s]` is the position held
    in slot s, or -1 when the slot is empty.
    """

    def __init__(self, codec: KVCodec, batch: int, num_kv_heads: int, num_slots: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.codec, self.dtype, self.head_dim = codec, dtype, head_dim
        self.shape = (batch, num_kv_heads, num_slots)
        self.k = codec.alloc(self.shape, head_dim, dtype, device)
        self.v = codec.alloc(self.shape, head_dim, dtype, device)
        self.slot_positions = torch.full((num_slots,), -1, dtype=torch.long, device=device)

    @property
    def num_slots(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.k) + stored_nbytes(self.v)

    def write(self, slots: Tensor | slice, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v (B, Hk, n, D) in `slots` (n of them) and record their positions."""
        self.write_encoded(slots, self.codec.encode(k), self.codec.encode(v))
        self.slot_positions[slots] = positions

    def write_encoded(self, slots: Tensor | slice, enc_k: dict[str, Tensor], enc_v: dict[str, Tensor]) -> None:
        """Store already-encoded K/V (the codec's storage tensors, slot dimension 2)."""
        for store, enc in ((self.k, enc_k), (self.v, enc_v)):
            for name, t in store.items():
                if isinstance(slots, slice):
                    t[:, :, slots] = enc[name]
                else:
                    t.index_copy_(2, slots, enc[name].to(t.dtype))

    def read(self, slots: Tensor | slice) -> tuple[Tensor, Tensor]:
        """(k, v) (B, Hk, n, D) in the model dtype; a view of storage for the identity codec and slices."""
        return (self.codec.decode(take(self.k, 2, slots), self.dtype),
                self.codec.decode(take(self.v, 2, slots), self.dtype))

    def clear(self, slots: Tensor | slice | None = None) -> None:
        self.slot_positions[slice(None) if slots is None else slots] = -1

    def state(self) -> dict[str, Tensor]:
        out = {f"k.{n}": t.clone() for n, t in self.k.items()}
        out.update({f"v.{n}": t.clone() for n, t in self.v.items()})
        out["slot_positions"] = self.slot_positions.clone()
        return out

    def load_state(self, state: dict[str, Tensor]) -> None:
        for prefix, store in (("k", self.k), ("v", self.v)):
            for name, t in store.items():
                src = state.get(f"{prefix}.{name}")
                if src is None or src.shape != t.shape:
                    raise ValueError(f"state lacks {prefix}.{name} of shape {tuple(t.shape)} (codec {self.codec.name})")
                t.copy_(src)
        self.slot_positions.copy_(state["slot_positions"])

    # -- the seed's KVCompressor interface (position-addressed) ------------------------------

    def compress(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Add (k, v) (B, Hk, n, D) at `positions`; a position already held is overwritten."""
        held = {p: s for s, p in enumerate(self.slot_positions.tolist()) if p >= 0}
        free = iter(s for s, p in enumerate(self.slot_positions.tolist()) if p < 0)
        slots = []
        for p in positions.tolist():
            s = held.get(p)
            if s is None:
                s = next(free, None)
                if s is None:
                    raise ValueError(f"store of {self.num_slots} slots is full")
                held[p] = s
            slots.append(s)
        self.write(torch.tensor(slots, device=self.slot_positions.device), k, v, positions)

    def _slots_of(self, positions: Tensor) -> Tensor:
        match = self.slot_positions[None, :] == positions[:, None]  # (n, S)
        if not bool(match.any(1).all()):
            raise KeyError(f"positions not resident: {positions[~match.any(1)].tolist()}")
        return match.int().argmax(1)

    def decompress(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.read(self._slots_of(positions))

    def evict(self, positions: Tensor) -> None:
        self.clear(self._slots_of(positions))

    def memory_bytes(self) -> int:
        return self.nbytes
