"""The sparse policy: an exact hot set, every older position in a packed cold tier, and an indexer that picks
the cold blocks each query attends to (seed 003's design; the indexer is Quest's per-block key bound).

Per governed layer:
- hot: `sink` slots for positions 0..sink-1 and a ring of `window + block + spare` slots, in the cache dtype;
- cold: every complete block of `block` positions after the sinks, packed with the codec (d4 by default),
  appended as it completes (so a block is encoded once, whatever the step), plus per block and KV head the
  per-channel min and max of its (decoded) keys: the indexer's summary.

A query at position p attends, in one softmax (kakeya::sparse_attention), to the sinks, its hot range
hot_lo(p)..p (the last `window` positions extended down to a block boundary) and the max(topk, ceil(budget x
blocks)) cold blocks below hot_lo(p) with the largest estimated attention share: per query head a softmax over
the blocks of its logit bound over the block's key min/max box, shrunk about its centre and whole, summed over
the query heads sharing the KV head, the larger of the two (kakeya::block_select). Both kernels compute each query alone, so a position's result is the same bits
in a decode step, a chunk or a prompt: sessions stay reproducible turn by turn (INV-3).

Tripwires: a sparse step never falls back to dense or window-only attention. The kernel counts the keys each
query saw from each side; the step raises SparseIndexError unless every query saw exactly its hot range and
min(topk, blocks below it) whole cold blocks, and block_select raises when a selectable block has no summary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kakeya_runtime.kv.cache import CacheError, _check_new
from kakeya_runtime.kv.compress import KVCodec, PackedLatticeCodec, stored_nbytes
from kakeya_runtime.kv.sink_window import PositionLimitError
from kakeya_runtime.kv.spec import PolicyKV
from kakeya_runtime.models import native


class SparseIndexError(CacheError):
    """The indexer or the sparse attention did not do what the step requires (never silently degraded)."""


@dataclass(slots=True)
class SparseCounters:
    """What the sparse layers did, summed over steps, query tokens and KV heads (one query head per group)."""

    steps: int = 0
    queries: int = 0  # query tokens x KV heads
    blocks_scored: int = 0  # cold blocks each query could select, summed
    blocks_selected: int = 0  # cold blocks attended, summed
    positions_attended: int = 0  # hot + cold keys attended, summed
    positions_visible: int = 0  # causally visible positions (what full attention reads), summed

    def add(self, other: SparseCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class OracleProbe:
    """Evidence only (kakeya bench sparse): the layer keeps every exact key it is given and, while `active`, measures
    for the newest query of each step the share of its full fp32 attention (every position, exact keys) that falls
    on the set the policy attended. Off (None) in serving."""

    keys: list[Tensor]
    active: bool = False
    masses: list[list[float]] | None = None  # per measured step: one mass per query head
    window_masses: list[list[float]] | None = None  # the same on the sinks and hot range alone (a streaming head)
    # The ceiling of any indexer keeping as many blocks: the mass with each KV head's cold blocks picked by their
    # true attention (summed over the query heads sharing it), as many as the indexer kept
    best_masses: list[list[float]] | None = None
    # per measured step and KV head: the fewest blocks so picked that bring its query heads' mean mass to 0.99
    # (every selectable block when none do), and how many it could select
    blocks_for_99: list[list[int]] | None = None
    selectable: list[int] | None = None
    # per measured step: (Hk, n + 1), a KV head's query heads' mean mass with its k = 0..n blocks so picked
    curves: list[Tensor] | None = None
    # the same with the blocks taken in the indexer's order (what a head keeping k blocks gets; a streaming head:
    # its ceiling curve), that order recomputed in fp32 from block_select's score (so a near-tie may order
    # differently from the kernel's)
    index_curves: list[Tensor] | None = None
    # evidence tools' own measure, called per measured step with (the newest query (Hk, G, D) fp32, every exact key
    # (Hk, P, D), the attention probabilities (Hk, G, P), its cold selection (Hk, blocks it could select) bool, the
    # attention's scale)
    on_step: Callable[[Tensor, Tensor, Tensor, Tensor, float], None] | None = None

    @classmethod
    def new(cls) -> OracleProbe:
        return cls(keys=[], masses=[], window_masses=[], best_masses=[], blocks_for_99=[], selectable=[], curves=[],
                   index_curves=[])


class SparseLayerKV:
    """One governed layer's hot ring, packed cold blocks and block summaries; it runs its own attention."""

    owns_attention = True  # models.layers.Attention hands it the queries (the indexer needs them)
    # A cold tier the kernel reads as stored takes one fused call per step (kakeya::sparse_step); lattice codes
    # are decoded between the indexer and the attention. False: every codec takes the three calls (tests).
    fused = True
    # the decoded-block cache holds this many times the blocks a query keeps (topk, or its budget's share), per
    # cold KV head, by default
    decoded_per_topk = 2

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, *, sink: int, window: int, block: int,
                 topk: int, max_positions: int, codec: KVCodec, spare: int = 0, dtype: torch.dtype,
                 device: torch.device | str = "cpu", initial_blocks: int = 16,
                 head_topk: tuple[int, ...] | None = None, decoded_blocks: int | None = None,
                 budget: float = 0.0, defer_encode: bool = False) -> None:
        if sink < 0 or window < 1 or block < 1 or topk < 1 or spare < 0 or not 0.0 <= budget <= 1.0:
            raise CacheError(f"need sink >= 0, window, block, topk >= 1, spare >= 0, 0 <= budget <= 1; got {sink}, "
                             f"{window}, {block}, {topk}, {spare}, {budget}")
        head_topk = (topk,) * num_kv_heads if head_topk is None else tuple(head_topk)
        if len(head_topk) != num_kv_heads or min(head_topk) < 0:
            raise CacheError(f"head_topk needs {num_kv_heads} counts >= 0, got {head_topk}")
        self._init = dict(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, sink=sink, window=window,
                          block=block, topk=topk, max_positions=max_positions, codec=codec, spare=spare, dtype=dtype,
                          device=device, head_topk=head_topk, decoded_blocks=decoded_blocks, budget=budget,
                          defer_encode=defer_encode)
        # Per KV head: blocks kept (0: streaming, no cold tier), and its index among the heads with a cold tier.
        self.head_topk = head_topk
        self._topk_t = torch.tensor(head_topk, dtype=torch.long)
        self.cold_heads = [h for h, k in enumerate(head_topk) if k > 0]
        self._cold_head_t = torch.tensor([self.cold_heads.index(h) if k > 0 else -1 for h, k in enumerate(head_topk)],
                                         dtype=torch.long)
        self._cold_pick = (None if len(self.cold_heads) == num_kv_heads
                           else torch.tensor(self.cold_heads, dtype=torch.long, device=device))
        self.sink, self.window, self.block, self.topk, self.spare = sink, window, block, topk, spare
        self.budget = budget  # a sparse head keeps max(topk, ceil(budget * n)) of the n blocks it may select
        # Blocks no query of a step may select yet wait for the model's end of step, which encodes every layer's in
        # one batch (SparseKV.end_step; for lattice codecs, whose encode is many small ops). A layer stepped on its
        # own (without SparseKV) must leave it off: nothing would encode them.
        self.defer_encode = defer_encode
        self._deferred = 0  # blocks complete up to here wait for flush_blocks (above n_blocks)
        self._stack_deferred = 0  # _deferred before a whole-stack step (stack_step), for stack_abort
        self.ring = window + block + spare
        self.max_positions = max_positions
        self.codec, self.dtype = codec, dtype
        n = sink + self.ring
        self.k_hot = torch.zeros(batch, num_kv_heads, n, head_dim, dtype=dtype, device=device)
        self.v_hot = torch.zeros_like(self.k_hot)
        self.hot_pos = torch.full((n,), -1, dtype=torch.long, device=device)
        self.n_blocks = 0  # complete blocks in the cold tier
        self._alloc_cold(initial_blocks)
        self.length = 0
        # SparseCounters' fields, then the newest query's attended and visible keys (kept by the kernels' tripwire)
        self._counts = torch.zeros(8, dtype=torch.long)
        self.peak_decoded_bytes = 0  # decoded cold K/V held during a step, at its largest
        # Lattice codes: decoded blocks kept across steps (a step's selection changes little), `decoded_blocks`
        # slots per cold KV head, each holding a block that head selected (by default decoded_per_topk times the
        # blocks a query keeps, which grows with the history under a budget); 0 decodes every step's blocks afresh.
        # Allocated on first use.
        self._decoded_fixed = decoded_blocks
        if decoded_blocks is not None and decoded_blocks < 0:
            raise CacheError(f"decoded_blocks must be >= 0, got {decoded_blocks}")
        # K, V (B, Hc, slots * block, D); slots grow with the cold tier up to decoded_blocks
        self._dec: tuple[Tensor, Tensor] | None = None
        hc = len(self.cold_heads)
        self._block_slot = torch.full((hc, 0), -1, dtype=torch.long)  # (Hc, N) block -> its slot (-1: not held)
        self._slot_block = torch.full((hc, 0), -1, dtype=torch.long)  # (Hc, slots) slot -> block (-1: free)
        self._slot_used = torch.full((hc, 0), -1, dtype=torch.long)  # (Hc, slots) the step a slot was last read
        self._dec_step = 0
        self.decoded_hits = self.decoded_misses = 0  # blocks found decoded / decoded, summed over steps
        self.oversize_steps = 0  # steps whose blocks did not fit the decoded-block cache (_step_oversize)
        self.oversize_reused = 0  # (head, block) pairs such steps copied from the cache instead of decoding
        self.probe: OracleProbe | None = None
        # D4 codes on the CPU: the step, the decoded-block cache and its decode in one native call
        self._fused_decoded = (isinstance(codec, PackedLatticeCodec) and codec.lattice.kind == "d4"
                               and dtype in (torch.float32, torch.bfloat16) and self.k_hot.is_cpu)
        self._ring_full = False  # every hot slot holds a position (known without a tensor read once true)
        # a slot below `length` emptied by a trim after the ring wrapped (until the ring is full again): the first
        # `length` slots are then not what a step reads
        self._holes = False
        self._hot_all = (self.k_hot, self.v_hot, self.hot_pos)

    def _alloc_cold(self, blocks: int) -> None:
        b, _, _, d = self.k_hot.shape
        hk = len(self.cold_heads)
        lead = (b, hk, blocks, self.block)
        self.cold_k = self.codec.alloc(lead, d, self.dtype, self.k_hot.device)
        self.cold_v = self.codec.alloc(lead, d, self.dtype, self.k_hot.device)
        self.kmin = torch.zeros(b, hk, blocks, d, dtype=self.dtype, device=self.k_hot.device)
        self.kmax = torch.zeros_like(self.kmin)
        self._direct = None  # the cold tier as the kernel reads it in place (direct codecs), built on first use

    def _reserve_blocks(self, needed: int) -> None:
        have = self.kmin.shape[2]
        if needed <= have:
            return
        old = (self.cold_k, self.cold_v, self.kmin, self.kmax)
        self._alloc_cold(max(needed, 2 * have))
        n = self.n_blocks
        for new, prev in ((self.cold_k, old[0]), (self.cold_v, old[1])):
            for name, t in new.items():
                t[:, :, :n] = prev[name][:, :, :n]
        self.kmin[:, :, :n], self.kmax[:, :, :n] = old[2][:, :, :n], old[3][:, :, :n]

    def clone_empty(self) -> SparseLayerKV:
        return type(self)(**self._init)

    def kept(self, n: int, topk: int | None = None) -> int:
        """Blocks a query keeps of the n it may select (kakeya::block_select's kept()), for a head keeping `topk`
        (default the policy's; 0 a streaming head): the budget's share of n grows a head's count in proportion to
        its topk, so per-head counts keep their proportions as the history grows."""
        k = self.topk if topk is None else topk
        if k == 0:
            return 0
        want = self.budget * n if k == self.topk else self.budget * n * k / self.topk
        share = math.ceil(want) if self.budget > 0 else 0
        return min(n, max(k, share))

    def most_kept(self, n: int) -> int:
        """The most blocks any head's query keeps of n."""
        return max(self.kept(n, k) for k in self.head_topk)

    @property
    def decoded_blocks(self) -> int:
        """Slots of the decoded-block cache at the current history."""
        if self._decoded_fixed is not None:
            return self._decoded_fixed
        return int(self.decoded_per_topk * self.most_kept(self.n_blocks))

    @decoded_blocks.setter
    def decoded_blocks(self, n: int) -> None:
        if n < 0:
            raise CacheError(f"decoded_blocks must be >= 0, got {n}")
        self._decoded_fixed = n

    # -- bytes ---------------------------------------------------------------------------------------------

    @property
    def hot_nbytes(self) -> int:
        return self.k_hot.nbytes + self.v_hot.nbytes

    @property
    def cold_nbytes(self) -> int:
        """Packed bytes of the complete blocks (allocated spare blocks not counted)."""
        per_block = (stored_nbytes(self.cold_k) + stored_nbytes(self.cold_v)) // max(1, self.kmin.shape[2])
        return per_block * self.n_blocks

    @property
    def index_nbytes(self) -> int:
        return 2 * self.kmin[:, :, : self.n_blocks].nbytes

    @property
    def decoded_nbytes(self) -> int:
        """The decoded-block cache (kept between steps, so resident), 0 until a step uses it."""
        return 0 if self._dec is None else self._dec[0].nbytes + self._dec[1].nbytes

    @property
    def nbytes(self) -> int:
        return self.hot_nbytes + self.cold_nbytes + self.index_nbytes + self.decoded_nbytes

    # -- positions -----------------------------------------------------------------------------------------

    def slot(self, p: int) -> int:
        return p if p < self.sink else self.sink + (p - self.sink) % self.ring

    def _slots(self, lo: int, hi: int) -> Tensor:
        """Ring slots of positions lo..hi-1 (all >= sink)."""
        return self.sink + (torch.arange(lo, hi, device=self.hot_pos.device) - self.sink) % self.ring

    def hot_lo(self, p: Tensor | int):
        out = p + 1 - self.window - self.sink
        if isinstance(out, Tensor):
            return self.sink + out.clamp(min=0) // self.block * self.block
        return self.sink + max(0, out) // self.block * self.block

    def _write_hot(self, k: Tensor, v: Tensor, positions: Tensor, start: int) -> None:
        """Keep the chunk's sink positions and its last `ring` positions."""
        end = start + k.shape[2]
        if end == start + 1 and start >= self.sink and self.k_hot.is_cpu:  # a decode step: one slot, one call
            native.ring_write(self.k_hot, self.v_hot, self.hot_pos, k, v, positions, self.slot(start))
            return
        if start < self.sink:
            n = min(end, self.sink) - start
            self.k_hot[:, :, start : start + n], self.v_hot[:, :, start : start + n] = k[:, :, :n], v[:, :, :n]
            self.hot_pos[start : start + n] = positions[:n]
        lo = max(self.sink, end - self.ring, start)
        if lo >= end:
            return
        off, first = lo - start, self.slot(lo)
        if first + (end - lo) <= self.hot_pos.shape[0]:
            sl = slice(first, first + end - lo)
            self.k_hot[:, :, sl], self.v_hot[:, :, sl] = k[:, :, off:], v[:, :, off:]
            self.hot_pos[sl] = positions[off:]
        else:
            slots = self._slots(lo, end)
            self.k_hot.index_copy_(2, slots, k[:, :, off:])
            self.v_hot.index_copy_(2, slots, v[:, :, off:])
            self.hot_pos.index_copy_(0, slots, positions[off:])

    def _ring_kv(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """Exact K/V of positions lo..hi-1 from the ring (they must be held there)."""
        slots = self._slots(lo, hi)
        if not torch.equal(self.hot_pos[slots], torch.arange(lo, hi, device=slots.device)):
            raise SparseIndexError(f"positions {lo}..{hi - 1} are no longer in the hot ring")
        return self.k_hot.index_select(2, slots), self.v_hot.index_select(2, slots)

    # -- the cold tier -------------------------------------------------------------------------------------

    def _complete_blocks(self, k_new: Tensor, v_new: Tensor, start: int, end: int) -> None:
        """Encode every block that is complete at `end` and not in the cold tier yet; its K/V come from the
        ring (positions before `start`) and the step's own K/V (from `start`). With `defer_encode`, blocks no
        query of the step may select yet (they still lie in the newest query's window) wait for the model's
        end of step, which encodes every layer's in one batch (flush_blocks): the same codes, fewer calls."""
        target = max(0, end - self.sink) // self.block
        if target <= self.n_blocks:
            return
        if self.defer_encode and self.cold_heads and max(0, end - self.window - self.sink) // self.block <= self.n_blocks:
            self._deferred = target  # the ring still holds them at the end of the step (within the last window + block)
            return
        lo, hi = self.sink + self.n_blocks * self.block, self.sink + target * self.block
        parts_k, parts_v = [], []
        if lo < start:
            k_old, v_old = self._ring_kv(lo, min(hi, start))
            parts_k.append(k_old)
            parts_v.append(v_old)
        if hi > start:
            parts_k.append(k_new[:, :, max(lo, start) - start : hi - start])
            parts_v.append(v_new[:, :, max(lo, start) - start : hi - start])
        kb = torch.cat(parts_k, dim=2) if len(parts_k) > 1 else parts_k[0]
        vb = torch.cat(parts_v, dim=2) if len(parts_v) > 1 else parts_v[0]
        kb, vb = self._cold_side(kb), self._cold_side(vb)
        if kb.shape[1] == 0:  # every head streams: no cold tier
            self._reserve_blocks(target)
            self._forget_decoded(self.n_blocks)
            self.n_blocks = target
            return
        enc_k, enc_v = self.codec.encode(kb), self.codec.encode(vb)
        self._put_blocks(target, enc_k, enc_v, kb if self.codec.lossless else self.codec.decode(enc_k, self.dtype))

    def _cold_side(self, x: Tensor) -> Tensor:
        """(B, Hk, n * block, D) -> (B, Hc, n, block, D): the heads with a cold tier, by block."""
        if self._cold_pick is not None:  # streaming heads keep no cold tier
            x = x.index_select(1, self._cold_pick)
        b, hc, n, d = x.shape
        return x.reshape(b, hc, n // self.block, self.block, d)

    def _put_blocks(self, target: int, enc_k: dict[str, Tensor], enc_v: dict[str, Tensor], seen: Tensor) -> None:
        """Store blocks n_blocks..target-1, encoded (B, Hc, n, block, ...), and their summaries from `seen`, the
        keys as queries will read them."""
        self._reserve_blocks(target)
        self._forget_decoded(self.n_blocks)  # blocks written from here on are new: a decoded copy would be stale
        sl = slice(self.n_blocks, target)
        for store, enc in ((self.cold_k, enc_k), (self.cold_v, enc_v)):
            for name, t in store.items():
                t[:, :, sl] = enc[name]
        self.kmin[:, :, sl], self.kmax[:, :, sl] = seen.amin(3), seen.amax(3)
        self.n_blocks = target

    def pending_blocks(self) -> tuple[Tensor, Tensor] | None:
        """The complete blocks `defer_encode` left for the end of the step, (B, Hc, n, block, D) K and V from the
        ring, or None."""
        if self._deferred <= self.n_blocks:
            return None
        k, v = self._ring_kv(self.sink + self.n_blocks * self.block, self.sink + self._deferred * self.block)
        return self._cold_side(k), self._cold_side(v)

    def flush_blocks(self) -> None:
        flush_blocks([self])

    @property
    def counters(self) -> SparseCounters:
        return SparseCounters(*self._counts[:6].tolist())

    @property
    def last_fraction(self) -> float:
        """The newest query's attended share of its prefix (1.0 before any step)."""
        attended, visible = self._counts[6:].tolist()
        return attended / visible if visible else 1.0

    def _direct_cold(self) -> tuple[Tensor, ...]:
        """A direct codec's cold tier in place, every allocated block (the kernel reads only the selected ones):
        K/V (B, Hc, blocks * block, D) (int8: codes and their scales, k, v, k_scale, v_scale) and the slots (block j
        at slot j). Views, made once per allocation."""
        if self._direct is None:
            blocks = self.kmin.shape[2]
            n = blocks * self.block
            flat = [t.reshape(*t.shape[:2], n, *t.shape[4:]) for store in (self.cold_k, self.cold_v)
                    for t in store.values()]
            if len(flat) == 4:  # codes and scales: k, v, k_scale, v_scale
                flat = [flat[0], flat[2], flat[1], flat[3]]
            self._direct = (*flat, torch.arange(blocks))
        return self._direct

    def _decode_blocks(self, select: Tensor | None) -> tuple[Tensor, ...]:
        """The cold side as the kernel takes it: K/V (B, Hk, U * block, D) (or int8 codes and their scales) and
        where block j lies in them (slot (N,), -1: absent). A codec the kernel reads as stored (identity, int8) is
        handed over in place, whole (the kernel reads only the selected blocks); lattice codes are decoded for
        the blocks some token selected."""
        if not self.cold_heads:  # every head streams: no cold tier to read
            empty = self.k_hot[:, :0, :0]
            return empty, empty, torch.full((self.n_blocks,), -1, dtype=torch.long)
        if self.codec.direct:
            return self._direct_cold()
        bits = self._selected(select)
        per_head = bits.sum(1)
        if bits.shape[0] and 0 < int(per_head.max()) <= self.decoded_blocks:
            return self._decode_cached(bits)
        return self._decode_fresh(bits)

    def _selected(self, select: Tensor) -> Tensor:
        """(Hc, N) bool: the blocks each cold head's queries selected (any token of the step), from the indexer's
        bitsets (B, Hk, T, words)."""
        b, h, t, words = select.shape
        shifts = torch.arange(64, device=select.device)
        sel = select.transpose(0, 1).reshape(h, b * t, words, 1)
        bits = ((sel >> shifts) & 1).any(1).reshape(h, -1)[:, : self.n_blocks]  # (Hk, N)
        return bits if self._cold_pick is None else bits.index_select(0, self._cold_pick)

    def _decode_fresh(self, bits: Tensor) -> tuple[Tensor, ...]:
        """The blocks each cold head selected (bits (Hc, N)) decoded afresh, per head (a head decodes only the
        blocks it selected, not the union over heads): K/V (B, Hc, U * block, D), U the most any head selected,
        and the per-head slot map (Hc, N) (-1: not selected). Slots past a head's count are never read."""
        b, _, _, d = self.k_hot.shape
        hc, blk = bits.shape[0], self.block
        heads, ids = bits.nonzero(as_tuple=True)  # (head, block) pairs, head-major
        counts = bits.sum(1)
        u = int(counts.max())
        rank = _rank_in_head(counts)
        slot = torch.full((hc, self.n_blocks), -1, dtype=torch.long)
        slot[heads, ids] = rank
        flat = heads * u + rank
        out = []
        for store in (self.cold_k, self.cold_v):
            x = self.codec.decode({name: t[:, heads, ids] for name, t in store.items()}, self.dtype)  # (B, m, blk, D)
            buf = torch.empty(b, hc * u, blk, d, dtype=self.dtype, device=self.k_hot.device)
            buf.index_copy_(1, flat, x)
            out.append(buf.view(b, hc, u * blk, d))
        self.peak_decoded_bytes = max(self.peak_decoded_bytes, out[0].nbytes + out[1].nbytes)
        return out[0], out[1], slot

    def _decode_cached(self, bits: Tensor) -> tuple[Tensor, ...]:
        """The blocks each cold head selected (bits (Hc, N)) from the decoded-block cache, where every head keeps
        its own slots (so a head holds only blocks it selected): decode only the (head, block) pairs it lacks (one
        call), into that head's slots read least recently. A vector decodes to the same bits whatever else is in
        the call, so the kernel reads what a fresh decode would give."""
        b, _, _, d = self.k_hot.shape
        hk, blk = len(self.cold_heads), self.block
        c = self._grow_decoded()
        self._dec_step += 1
        heads, ids = bits.nonzero(as_tuple=True)  # (head, block) pairs, head-major
        slots = self._block_slot[heads, ids]
        held = slots >= 0
        self._slot_used[heads[held], slots[held]] = self._dec_step
        mh, mj = heads[~held], ids[~held]
        m = mj.numel()
        self.decoded_hits += ids.numel() - m
        self.decoded_misses += m
        if m:
            counts = torch.bincount(mh, minlength=hk).tolist()
            free = torch.cat([torch.topk(self._slot_used[h], n, largest=False).indices  # never a slot read this step
                              for h, n in enumerate(counts) if n])  # head-major, as the misses
            old = self._slot_block[mh, free]
            was = old >= 0
            self._block_slot[mh[was], old[was]] = -1
            self._slot_block[mh, free], self._block_slot[mh, mj], self._slot_used[mh, free] = mj, free, self._dec_step
            flat = mh * c + free  # (head, slot) in the cache seen as (B, Hc * slots, block, D)
            for cache, store in zip(self._dec, (self.cold_k, self.cold_v), strict=True):
                x = self.codec.decode({name: t[:, mh, mj] for name, t in store.items()}, self.dtype)  # (B, m, blk, D)
                cache.view(b, hk * c, blk, d).index_copy_(1, flat, x)
            self.peak_decoded_bytes = max(self.peak_decoded_bytes, 2 * x.nbytes)
        return (*self._dec, self._block_slot[:, : self.n_blocks].contiguous())

    def _grow_decoded(self) -> int:
        """Grow the decoded-block cache to its slots at the current history (no more than the blocks to hold) and
        the block -> slot map to every block; returns the slots per cold head."""
        c = self._slot_block.shape[1]
        if c < min(self.decoded_blocks, self.n_blocks):
            b, _, _, d = self.k_hot.shape
            c = min(self.decoded_blocks, self.n_blocks)
            shape = (b, len(self.cold_heads), c * self.block, d)
            dec = tuple(torch.zeros(shape, dtype=self.dtype, device=self.k_hot.device) for _ in range(2))
            if self._dec is not None:
                for new, old in zip(dec, self._dec, strict=True):
                    new[:, :, : old.shape[2]] = old
            self._dec = dec
            self._slot_block, self._slot_used = _grown(self._slot_block, c), _grown(self._slot_used, c)
        if self._block_slot.shape[1] < self.n_blocks:
            self._block_slot = _grown(self._block_slot, max(self.n_blocks, 2 * self._block_slot.shape[1]))
        return c

    def _step_decoded(self, qg: Tensor, hot: tuple[Tensor, Tensor, Tensor], positions: Tensor,
                      scale: float) -> tuple[Tensor, Tensor] | None:
        """A D4 cold tier's step in one native call (kakeya::sparse_step_decoded): the indexer, the decoded-block
        cache's bookkeeping and the decode of the blocks it lacks, the attention and the tripwire. None when the
        cache has no slots yet (the caller decodes afresh). When some head selected more blocks than the cache
        holds (a turn's chunk: each token keeps its own top-k), the step runs again over a scratch cache of the
        chunk's size (`_step_oversize`)."""
        if self._grow_decoded() == 0 or self._dec is None:
            return None
        self._dec_step += 1
        out, select, hits, misses = self._fused_decoded_call(
            qg, hot, positions, scale, (self._block_slot, self._slot_block, self._slot_used), self._dec_step,
            self._dec)
        if misses < 0:
            return self._step_oversize(qg, hot, positions, scale, select)
        self._count_decoded(hits, misses)
        return out, select

    def _count_decoded(self, hits: int, misses: int) -> None:
        """A fused D4 step's decoded-block cache use: blocks found, blocks decoded and the bytes they took."""
        self.decoded_hits += hits
        self.decoded_misses += misses
        if misses:
            b, _, _, d = self.k_hot.shape
            self.peak_decoded_bytes = max(self.peak_decoded_bytes,
                                          2 * b * misses * self.block * d * self._dec[0].element_size())

    def _fused_decoded_call(self, qg: Tensor, hot: tuple[Tensor, Tensor, Tensor], positions: Tensor, scale: float,
                            maps: tuple[Tensor, Tensor, Tensor], step: int, decoded: tuple[Tensor, Tensor],
                            selected: Tensor | None = None) -> tuple[Tensor, Tensor, int, int]:
        lat = self.codec.lattice
        return native.sparse_step_decoded(
            qg, hot, self._cold_head_t, self.kmin, self.kmax, self.n_blocks, positions, scale, window=self.window,
            sink=self.sink, block=self.block, topk=self._topk_t, counters=self._counts, budget=self.budget,
            budget_topk=self.topk, maps=maps, step=step,
            codes=(self.cold_k["code"], self.cold_k["scale"], self.cold_v["code"], self.cold_v["scale"]),
            rot=lat.h, decoded=decoded, lattice_q=lat.q, bits=lat.bits, lattice_codes=lat.num_blocks,
            selected=selected)

    def _step_oversize(self, qg: Tensor, hot: tuple[Tensor, Tensor, Tensor], positions: Tensor, scale: float,
                       select: Tensor) -> tuple[Tensor, Tensor]:
        """The step whose selection (`select`, from the refused call, which changed nothing) has more blocks for
        some head than the decoded-block cache holds: the same native call, given that selection (no second
        indexer run), over a scratch cache with a slot for every block some token selected, then dropped; the kept
        cache is left as it was. The blocks the kept cache holds are copied into the scratch (a cached block has the
        bits of a fresh decode), the others decoded natively: the bits of the fresh decode (`_decode_fresh`, in
        Python: ~50 ms a turn's chunk at 6k on SmolLM2)."""
        bits = self._selected(select)  # (Hc, N)
        heads, ids = bits.nonzero(as_tuple=True)  # head-major
        counts = bits.sum(1)
        u = int(counts.max())
        b, hc, blk, d = select.shape[0], len(self.cold_heads), self.block, self.k_hot.shape[3]
        decoded = tuple(torch.empty(b, hc, u * blk, d, dtype=self.dtype, device=self.k_hot.device)
                        for _ in range(2))
        maps = (torch.full((hc, self.n_blocks), -1, dtype=torch.long), torch.full((hc, u), -1, dtype=torch.long),
                torch.full((hc, u), -1, dtype=torch.long))
        held_slot = self._block_slot[heads, ids]
        held = held_slot >= 0
        if bool(held.any()):  # into slots 0.. of each head, marked read at the call's step (1): never evicted by it
            rank = _rank_in_head(counts)
            hh, jj, rr, ss = heads[held], ids[held], rank[held], held_slot[held]
            maps[0][hh, jj], maps[1][hh, rr], maps[2][hh, rr] = rr, jj, 1
            c = self._slot_block.shape[1]
            for scratch, cache in zip(decoded, self._dec, strict=True):
                scratch.view(b, hc * u, blk, d)[:, hh * u + rr] = cache.view(b, hc * c, blk, d)[:, hh * c + ss]
            self.oversize_reused += int(hh.numel())
        out, select, _, misses = self._fused_decoded_call(qg, hot, positions, scale, maps, 1, decoded, select)
        if misses < 0:  # the refused call's selection: a scratch cache of its count holds it
            raise SparseIndexError(f"the decoded scratch cache of {u} slots did not hold the step's blocks")
        self.oversize_steps += 1
        self.peak_decoded_bytes = max(self.peak_decoded_bytes, decoded[0].nbytes + decoded[1].nbytes)
        return out, select

    def _forget_decoded(self, first: int) -> None:
        """Drop the decoded copies of cold blocks `first` and up (rewritten, trimmed or restored)."""
        # out of place: the maps may have been made under inference mode, a trim or a restore runs outside it
        bs = self._block_slot
        self._block_slot = torch.where(torch.arange(bs.shape[1]) >= first, -1, bs)
        gone = self._slot_block >= first
        self._slot_block = self._slot_block.masked_fill(gone, -1)
        self._slot_used = self._slot_used.masked_fill(gone, -1)

    # -- the step ------------------------------------------------------------------------------------------

    def attend(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, *, scale: float) -> Tensor:
        """Store the new post-RoPE K/V (B, Hk, T, D) at `positions` (T,) and attend the queries q (B, H, T, D)
        over sinks, hot ranges and selected cold blocks. Returns (B, H, T, D)."""
        _check_new(self.k_hot, k, v)
        b, h, t, d = q.shape
        start, end = self.length, self.length + t
        if end > self.max_positions:
            raise PositionLimitError(f"position {end - 1} is past the model's limit of {self.max_positions} positions")
        if t == 1:  # in place: the ring now holds everything the token sees
            self._write_hot(k, v, positions, start)
            self._complete_blocks(k, v, end, end)
            n = self.hot_pos.shape[0]
            if not self._ring_full and end >= n:  # after a trim the ring has holes until it wraps once more
                self._ring_full = bool((self.hot_pos >= 0).all())
                self._holes = self._holes and not self._ring_full
            hot = self._hot_all if self._ring_full else self._hot_held(end)
        else:
            held = (self.hot_pos >= 0).nonzero()[:, 0]
            hot = (torch.cat((self.k_hot.index_select(2, held), k), dim=2),
                   torch.cat((self.v_hot.index_select(2, held), v), dim=2),
                   torch.cat((self.hot_pos.index_select(0, held), positions)))
            self._complete_blocks(k, v, start, end)
            self._write_hot(k, v, positions, start)
        self.length = end
        qg = q.reshape(b, k.shape[1], (h // k.shape[1]) * t, d)  # (B, Hk, G*T, D): rows (group, token)
        if not qg.is_contiguous():
            qg = qg.contiguous()
        try:
            if self.fused and (self.codec.direct or not self.cold_heads):
                cold = self._decode_blocks(None)  # in place: no selection needed
                out, select = native.sparse_step(qg, hot, cold, self.kmin, self.kmax, self.n_blocks, positions, scale,
                                                 window=self.window, sink=self.sink, block=self.block,
                                                 topk=self._topk_t, cold_head=self._cold_head_t,
                                                 counters=self._counts, budget=self.budget, budget_topk=self.topk)
            elif self.fused and self._fused_decoded and (got := self._step_decoded(qg, hot, positions, scale)) is not None:
                out, select = got
            else:
                select, scored = native.block_select(qg, self.kmin[:, :, : self.n_blocks],
                                                     self.kmax[:, :, : self.n_blocks], positions, window=self.window,
                                                     sink=self.sink, block=self.block, topk=self._topk_t, scale=scale,
                                                     budget=self.budget, budget_topk=self.topk)
                cold = self._decode_blocks(select)
                out, seen = native.sparse_attention(qg, hot, cold, select, positions, scale, window=self.window,
                                                    sink=self.sink, block=self.block, cold_head=self._cold_head_t)
                native.sparse_check(seen, scored, positions, window=self.window, sink=self.sink, block=self.block,
                                    topk=self._topk_t, counters=self._counts, budget=self.budget,
                                    budget_topk=self.topk)
        except RuntimeError as e:  # the kernels' checks: a selectable block without a summary, a selected block
            # that was not provided, a query that did not see its hot range or its blocks
            raise SparseIndexError(str(e).split("\n")[0]) from None
        if self.probe is not None:
            self._measure(q, k, select, positions, scale)
        return out.reshape(b, h, t, d)

    def decoder_layer_step(self, h: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, weights: list[Tensor],
                           config: list[int], params: list[float]) -> Tensor | None:
        """One decode row's whole decoder layer in one native call (kakeya::decoder_layer_sparse: the layer's first
        half, the ring write, the fused sparse step, the second half), in the steady state only: the fused path,
        the ring full or not yet wrapped, no block to encode before the step's attention, no probe. None, with
        nothing touched, otherwise: models.native_layer then runs the layer split around `attend`. The same kernels
        on the same inputs in `attend`'s order, so the same bits and cache writes, without the Python between them
        (~80 µs a layer at 7.7k on SmolLM2). A single row's whole stack takes these steps in one call
        (`stack_kind`, `stack_step`: models/native_layer.py's run_all)."""
        kind = self._steady(h, fits=False)
        if kind is None:
            return None
        state, cold, index, geometry, budget, decoded, lattice = self.stack_step(kind)
        try:
            out, select, hits, misses, qg = native.decoder_layer_sparse(
                h, cos, sin, positions, weights, config, params, state, cold, index, geometry, budget, decoded,
                lattice)
            if misses < 0:  # more blocks than the decoded cache holds: attend's oversize step, then the second half
                att, _ = self._step_oversize(qg, tuple(state[:3]), positions, params[2], select)
                return native.decoder_layer_output(att.reshape(1, -1), h, weights, config, params)
        except RuntimeError as e:  # the kernels' checks, as attend reports them
            raise SparseIndexError(str(e).split("\n")[0]) from None
        if decoded:
            self._count_decoded(hits, misses)
        return out

    def stack_kind(self, h: Tensor) -> int | None:
        """This layer's part in a whole-stack decode call (kakeya.DecoderStack.step_sparse): 1 (a cold tier read as
        stored) or 2 (a D4 tier) in the steady state `decoder_layer_step` runs, when the step's selection fits the
        decoded-block cache (so the call never has to stop for `_step_oversize`); None otherwise. Changes nothing
        but the decoded-block cache's size (`_grow_decoded`, as the step itself would)."""
        kind = self._steady(h, fits=True)
        return None if kind is None else 1 if kind == "direct" else 2

    def _steady(self, h: Tensor, *, fits: bool) -> str | None:
        """"direct" or "decoded" where the next decode row's step can run in one native call, else None."""
        end = self.length + 1
        # a ring not yet full is read as its first `end` slots, as attend reads it (positions 0.. in slots 0..)
        if (not self.fused or (not self._ring_full and (end >= self.hot_pos.shape[0] or self._holes))
                or self.probe is not None
                or end > self.max_positions or h.shape[0] != 1 or self.k_hot.shape[0] != 1 or not self.k_hot.is_cpu
                or h.dtype != self.dtype):
            return None
        target = max(0, end - self.sink) // self.block
        if target > self.n_blocks and not (self.defer_encode and self.cold_heads
                                           and max(0, end - self.window - self.sink) // self.block <= self.n_blocks):
            return None  # a block to encode from the ring before the attention: attend's path
        if self.codec.direct or not self.cold_heads:
            return "direct"
        if self._fused_decoded and (slots := self._grow_decoded()) > 0 and self._dec is not None:
            # one token keeps at most most_kept(n_blocks) blocks per head (kept grows with n)
            return "decoded" if not fits or slots >= self.most_kept(self.n_blocks) else None
        return None

    def stack_step(self, kind: str | int) -> tuple:
        """Begin the steady decode step `_steady` allowed (kind "direct"/1 or "decoded"/2): the position taken,
        a block to encode deferred to the end of the step; returns kakeya::decoder_layer_sparse's cache arguments
        (state, cold, index, geometry, budget, decoded, lattice)."""
        start, end = self.length, self.length + 1
        target = max(0, end - self.sink) // self.block
        self._stack_deferred = self._deferred
        if target > self.n_blocks:
            self._deferred = target  # encoded at the model's end of step (flush_blocks), as attend defers it
        if kind in ("direct", 1):
            cold, decoded, lattice = self._decode_blocks(None), (), ()
        else:
            lat = self.codec.lattice
            cold = (self.cold_k["code"], self.cold_k["scale"], self.cold_v["code"], self.cold_v["scale"], lat.h)
            decoded = (self._block_slot, self._slot_block, self._slot_used, *self._dec)
            self._dec_step += 1
            lattice = (self._dec_step, lat.q, lat.bits, lat.num_blocks)
        self.length = end
        # (the ring itself: the kernel writes the step's K/V into it and skips slots whose position is -1)
        hot = self._hot_all if self._ring_full else (self.k_hot[:, :, :end], self.v_hot[:, :, :end],
                                                     self.hot_pos[:end])
        return ((*hot, self._counts), cold, (self.kmin, self.kmax, self._topk_t, self._cold_head_t),
                (self.slot(start), self.n_blocks, self.window, self.sink, self.block, self.topk), self.budget, decoded,
                lattice)

    def stack_done(self, hits: int, misses: int) -> None:
        """A D4 layer's decoded-block counts from a whole-stack call."""
        self._count_decoded(hits, misses)

    def stack_abort(self) -> None:
        """The whole-stack call failed: no block is left for the end of the step to encode (a later layer's ring
        never got the step's K/V), so the error reaching the caller is the call's own; the rollback trims the rest."""
        self._deferred = self._stack_deferred

    @staticmethod
    def stack_error(error: RuntimeError) -> SparseIndexError:
        """A whole-stack call's kernel check, as the sparse step reports it."""
        return SparseIndexError(str(error).split("\n")[0])

    def _measure(self, q: Tensor, k: Tensor, select: Tensor, positions: Tensor, scale: float) -> None:
        """OracleProbe: the full fp32 attention of the step's newest query, its mass on the attended set."""
        probe = self.probe
        probe.keys.append(k.float())
        if not probe.active:
            return
        keys = torch.cat(probe.keys, dim=2)[0]  # (Hk, P, D): every position so far, exact
        p = int(positions[-1])
        if keys.shape[1] != p + 1:
            raise SparseIndexError(f"oracle probe holds {keys.shape[1]} keys for a query at position {p}")
        hk, g = keys.shape[0], q.shape[1] // keys.shape[0]
        probs = torch.softmax(torch.einsum("hgd,hpd->hgp", q[0, :, -1].float().view(hk, g, -1), keys) * scale, -1)
        pos = torch.arange(p + 1)
        word = select[0, :, -1]  # (Hk, words)
        blk = ((pos - self.sink).clamp(min=0) // self.block).clamp(max=select.shape[-1] * 64 - 1)
        chosen = ((word[:, blk // 64] >> (blk % 64)) & 1).bool()  # (Hk, P)
        hot = (pos < self.sink) | (pos >= self.hot_lo(p))
        attended = hot | (chosen & (pos < self.hot_lo(p)))
        probe.masses.append((probs * attended[:, None, :]).sum(-1).flatten().tolist())
        hot_mass = (probs * hot[None, None, :]).sum(-1)  # (Hk, G)
        probe.window_masses.append(hot_mass.flatten().tolist())
        # the ceiling: the same number of whole blocks per KV head, the ones holding the most of its heads' mass
        n = (self.hot_lo(p) - self.sink) // self.block  # blocks this query could select
        cold = probs[:, :, self.sink: self.sink + n * self.block].reshape(hk, g, n, self.block).sum(-1)  # (Hk, G, n)
        kept = chosen[:, self.sink: self.sink + n * self.block].sum(-1) // self.block  # (Hk,)
        order = cold.sum(1).argsort(-1, descending=True)
        ranked = torch.cat((torch.zeros(hk, g, 1), cold.gather(2, order[:, None, :].expand(hk, g, n)).cumsum(-1)), -1)
        probe.best_masses.append((hot_mass + ranked.gather(2, kept[:, None, None].expand(hk, g, 1))[..., 0])
                                 .flatten().tolist())
        curve = hot_mass.mean(1, keepdim=True) + ranked.mean(1)  # (Hk, n + 1)
        probe.curves.append(curve)
        probe.index_curves.append(self._index_curve(q[0, :, -1].float().view(hk, g, -1), cold, curve, scale))
        reach = curve >= 0.99  # k blocks reach it
        probe.blocks_for_99.append([int(r.nonzero()[0]) if r.any() else n for r in reach])
        probe.selectable.append(n)
        if probe.on_step is not None:
            picked = chosen[:, self.sink: self.sink + n * self.block].reshape(hk, n, self.block)[:, :, 0]
            probe.on_step(q[0, :, -1].float().view(hk, g, -1), keys, probs, picked, scale)

    def _index_curve(self, q: Tensor, cold: Tensor, ceiling: Tensor, scale: float) -> Tensor:
        """(Hk, n + 1): each cold head's query heads' mean mass with its k = 0..n blocks taken in block_select's
        order (per query head a softmax over the blocks of q . mid + |q| . half from the box shrunk by 0.5 and from
        the whole box, summed over the heads, the larger of the two; ties to the lower block). q (Hk, G, D), cold
        (Hk, G, n) the true mass per block; a streaming head's row is its `ceiling` row."""
        out = ceiling.clone()
        n = cold.shape[2]
        for h, c in enumerate(self._cold_head_t.tolist()):
            if c < 0 or n == 0:
                continue
            mn, mx = self.kmin[0, c, :n].float(), self.kmax[0, c, :n].float()  # (n, D)
            centre, spread = q[h] @ ((mn + mx) / 2).T, q[h].abs() @ (mx - mn).T  # (G, n)
            shares = [torch.softmax(scale * (centre + box * spread), -1).sum(0) for box in (0.25, 0.5)]
            order = torch.argsort(-torch.maximum(*shares), stable=True)
            out[h, 1:] = ceiling[h, 0] + cold[h].mean(0)[order].cumsum(0)
        return out

    def update_and_fetch(self, k: Tensor, v: Tensor, positions: Tensor):
        raise CacheError("a sparse layer attends itself (models.layers.Attention calls attend with the queries)")

    # -- rollback and state --------------------------------------------------------------------------------

    def _hot_held(self, end: int) -> tuple[Tensor, Tensor, Tensor]:
        """The ring's slots holding a position, the cache `end` long and the ring not full: its first `end` slots,
        unless a ring that wrapped was trimmed back to at most its slots (a speculative verify's rollback), which
        leaves an evicted, emptied slot (position -1, refused by the kernel) among them."""
        if end <= self.hot_pos.shape[0] and not self._holes:
            return self.k_hot[:, :, :end], self.v_hot[:, :, :end], self.hot_pos[:end]
        held = (self.hot_pos >= 0).nonzero()[:, 0]
        return self.k_hot[:, :, held], self.v_hot[:, :, held], self.hot_pos[held]

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"cannot trim a cache of length {self.length} to {length}")
        if length == self.length:
            return
        self.flush_blocks()
        lo = max(self.sink, min(self.hot_lo(length), self.sink + max(0, length - self.sink) // self.block * self.block))
        if lo < length:
            slots = self._slots(lo, length)
            if not torch.equal(self.hot_pos[slots], torch.arange(lo, length, device=slots.device)):
                raise CacheError(f"sparse has moved positions below {max(self.sink, self.length - self.ring)} out of "
                                 f"its hot ring; trimming to {length} needs them (roll back at most {self.spare} "
                                 "positions with the `spare` parameter)")
        self.hot_pos[self.hot_pos >= length] = -1
        self._ring_full = False
        self._holes = not bool((self.hot_pos[: min(length, self.hot_pos.shape[0])] >= 0).all())
        self.n_blocks = min(self.n_blocks, max(0, length - self.sink) // self.block)
        self._deferred = min(self._deferred, self.n_blocks)  # flushed above: nothing the ring lost stays pending
        self._forget_decoded(self.n_blocks)
        self.length = length

    def counts_state(self) -> Tensor:
        """The running counters (SparseCounters' and the newest query's), apart from the K/V state."""
        return self._counts.clone()

    def load_counts(self, counts: Tensor) -> None:
        self._counts.copy_(counts)

    def state(self) -> dict[str, Tensor]:
        self.flush_blocks()
        n = self.n_blocks
        out = {"k": self.k_hot.clone(), "v": self.v_hot.clone(), "hot_pos": self.hot_pos.clone(),
               "kmin": self.kmin[:, :, :n].clone(), "kmax": self.kmax[:, :, :n].clone(),
               "length": torch.tensor(self.length)}
        for prefix, store in (("cold_k", self.cold_k), ("cold_v", self.cold_v)):
            out.update({f"{prefix}.{name}": t[:, :, :n].clone() for name, t in store.items()})
        return out

    def load_state(self, state: dict[str, Tensor]) -> None:
        n = state["kmin"].shape[2]
        self.n_blocks = self._deferred = 0
        self._forget_decoded(0)
        self._reserve_blocks(n)
        self.k_hot.copy_(state["k"])
        self.v_hot.copy_(state["v"])
        self.hot_pos.copy_(state["hot_pos"])
        self._ring_full = False
        self._holes = not bool((self.hot_pos[: min(int(state["length"]), self.hot_pos.shape[0])] >= 0).all())
        self.kmin[:, :, :n], self.kmax[:, :, :n] = state["kmin"], state["kmax"]
        for prefix, store in (("cold_k", self.cold_k), ("cold_v", self.cold_v)):
            for name, t in store.items():
                src = state.get(f"{prefix}.{name}")
                if src is None or src.shape[:3] != t[:, :, :n].shape[:3]:
                    raise CacheError(f"sparse state lacks {prefix}.{name} for {n} blocks (codec {self.codec.name})")
                t[:, :, :n] = src
        self.n_blocks = n
        self.length = int(state["length"])


def _rank_in_head(counts: Tensor) -> Tensor:
    """Each (head, block) pair's place among its head's, for pairs listed head-major with `counts` per head."""
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)


def _grown(t: Tensor, n: int) -> Tensor:
    """Int64 maps (rows, entries) extended to n entries with -1 (as is when they have them)."""
    if t.shape[1] >= n:
        return t
    return torch.cat((t, torch.full((t.shape[0], n - t.shape[1]), -1, dtype=t.dtype)), dim=1)


def flush_blocks(layers: list[SparseLayerKV]) -> None:
    """Encode the blocks `defer_encode` left in these layers (one codec call for K and one for V over all of
    them: the codecs work row by row, so the codes are the ones each block gets alone) and store them."""
    work = [(layer, kv) for layer in layers if (kv := layer.pending_blocks()) is not None]
    if not work:
        return
    codec, dtype, d = work[0][0].codec, work[0][0].dtype, work[0][1][0].shape[-1]
    enc = [codec.encode(torch.cat([kv[i].reshape(-1, d) for _, kv in work])) for i in (0, 1)]
    seen = torch.cat([kv[0].reshape(-1, d) for _, kv in work]) if codec.lossless else codec.decode(enc[0], dtype)
    offset = 0
    for layer, (k, _) in work:
        n = k.numel() // d
        take = [{key: t[offset : offset + n].reshape(*k.shape[:-1], *t.shape[1:]) for key, t in e.items()}
                for e in enc]
        layer._put_blocks(layer.n_blocks + k.shape[2], take[0], take[1], seen[offset : offset + n].reshape(k.shape))
        offset += n


class SparseKV(PolicyKV):
    """The sparse policy for a whole model: governed layers are SparseLayerKV, Gemma 3's native sliding layers
    keep their ring. Hot bytes are fixed; cold bytes grow with the history, packed."""

    def _sparse(self) -> list[SparseLayerKV]:
        return [layer for layer in self.layers if isinstance(layer, SparseLayerKV)]

    @property
    def effective_attention_fraction(self) -> float:
        layers = self._sparse()
        if self.length == 0 or not layers:
            return 1.0
        return sum(layer.last_fraction for layer in layers) / len(layers)

    def counters(self) -> SparseCounters:
        total = SparseCounters()
        for layer in self._sparse():
            total.add(layer.counters)
        return total

    def decoded_counts(self) -> tuple[int, int]:
        """Cold blocks the steps found in their layer's decoded-block cache, and those they decoded (summed)."""
        layers = self._sparse()
        return sum(x.decoded_hits for x in layers), sum(x.decoded_misses for x in layers)

    def layer_counters(self) -> list[dict[str, int]]:
        return [layer.counters.as_dict() for layer in self._sparse()]

    def end_step(self) -> None:
        """The step's deferred blocks, every layer's in one batch; decoded blocks live while their layer attends:
        the step's peak is its largest layer's."""
        flush_blocks(self._sparse())
        peak = max((layer.peak_decoded_bytes for layer in self._sparse()), default=0)
        self.peak_transient_bytes = max(self.peak_transient_bytes, peak)

    def reset_stats(self) -> None:
        super().reset_stats()
        for layer in self._sparse():
            layer.peak_decoded_bytes = 0

    def memory_stats(self) -> dict[str, int]:
        layers = self._sparse()
        out = super().memory_stats()
        out.update(hot_bytes=sum(x.hot_nbytes for x in layers), cold_bytes=sum(x.cold_nbytes for x in layers),
                   index_bytes=sum(x.index_nbytes for x in layers),
                   decoded_bytes=sum(x.decoded_nbytes for x in layers))
        return out
