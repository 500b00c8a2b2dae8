"""What a session's KV cache may come to hold, known before it is built: the KV byte budget's unit.

`kv_worst_case_bytes` is the most K/V storage a session's cache reaches over its whole life at its context
length: resident buffers at their largest plus what a step holds transiently. It reads the sizes from the
spec and the model config and follows how kv/ allocates (kv.policy, kv.cache, kv.sink_window, kv.restore,
kv.sparse); tests/sessions/test_session_budget.py fills real caches to their context and checks it is never
exceeded, so a change in kv/'s layout that outgrows it fails there. Per policy, for every governed layer:

| policy | resident | transient (during a step) |
|---|---|---|
| full | context positions (buffers double up to it) | - |
| sink_window | sink + window + spare slots, in the codec's bytes | with a lossy codec, those slots decoded and a buffer as large for the exact K/V written |
| restore | sink + window slots + the token history (int32, doubles up to the context) | as sink_window, plus every governed layer's overlay (the whole context) and the proposer's rings on native sliding layers |
| sparse | sink + window + block + spare hot slots, cold blocks (doubling from 16) with their key min/max; with lattice codes, up to 2 × max(topk, budget × blocks) blocks per KV head kept decoded | one layer's cold blocks, decoded |

Gemma 3's native sliding layers keep a ring of their window under every policy. Bookkeeping tensors (slot
positions, key positions) are not K/V and are not counted, as `nbytes` does not count them; nor is the moment a
growing buffer is copied into its doubled successor, nor activations.

`default_kv_budget` sizes the server's budget to the machine: half of what the weights leave of the device's
memory (physical RAM on CPU), so activations, the process and the OS keep the other half.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from kakeya_runtime.kv.cache import sliding_spare
from kakeya_runtime.kv.compress import make_codec
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.kv.spec import PolicySpec
from kakeya_runtime.models.config import ModelConfig

DEFAULT_BUDGET_FRACTION = 0.5  # of the device memory the weights leave free
_INITIAL_SPARSE_BLOCKS = 16  # kv.sparse.SparseLayerKV's initial_blocks


def kv_worst_case_bytes(config: ModelConfig, spec: PolicySpec, context: int, dtype: torch.dtype) -> int:
    """The most K/V bytes a session with this policy and context length holds at once (batch 1)."""
    hk, d, elt = config.num_key_value_heads, config.head_dim, dtype.itemsize
    per_position = 2 * hk * d * elt  # K and V of one position, uncompressed
    lossy = spec.name != "full" and spec.codec.kind != "identity"
    resident = transient = 0
    for i in range(config.num_hidden_layers):
        window = config.layer_window(i)
        if window is not None:  # native sliding layer: its own ring (or a full layer when it covers the context)
            ring = min(window + sliding_spare(window, context), context)  # kv.cache: window + spare slots
            resident += per_position * ring
            if spec.name == "restore":
                transient += per_position * min(window, context)  # the proposer's own ring for the layer
            continue
        if spec.name == "full":
            resident += per_position * context
            continue
        coded = 2 * hk * _bytes_per_vector(spec.codec.kind, spec.codec.q, d, dtype)  # K and V, in the codec
        if spec.name in ("sink_window", "restore"):
            slots = spec.sink + spec.window + spec.spare
            resident += coded * slots
            if lossy:
                transient += 2 * per_position * slots  # a step decodes the resident slots once, + exact writes
            if spec.name == "restore":
                transient += per_position * context  # the overlay: every position 0..T-1
        elif spec.name == "sparse":
            resident += per_position * (spec.sink + spec.window + spec.block + spec.spare)
            needed = max(0, context - spec.sink) // spec.block
            resident += _allocated_blocks(needed) * (coded * spec.block + 2 * hk * d * elt)  # K/V + key min, max
            if lossy and spec.codec.kind != "int8":  # lattice codes: decoded blocks kept across steps (kv.sparse)
                # per KV head: its own slots (per_position counts every head)
                keep = max(spec.topk, math.ceil(spec.budget * needed))  # blocks a query keeps at the context
                resident += per_position * spec.block * min(needed, int(SparseLayerKV.decoded_per_topk * keep))
            transient = max(transient, per_position * needed * spec.block)  # one layer's cold blocks, decoded
        else:
            raise ValueError(f"no byte estimate for KV policy {spec.name!r}")
    if spec.name == "restore":
        resident += 4 * max(256, context)  # the token history the proposer replays (int32, 256 at first)
    return resident + transient


def _allocated_blocks(needed: int) -> int:
    """Cold blocks a sparse layer has allocated once it holds `needed`: 16, doubled until enough."""
    have = _INITIAL_SPARSE_BLOCKS
    while have < needed:
        have *= 2
    return have


@functools.cache
def _bytes_per_vector(kind: str, q: int, head_dim: int, dtype: torch.dtype) -> int:
    return make_codec(kind, q, head_dim).bytes_per_vector(head_dim, dtype)


def device_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Total memory of the device the caches live on: physical RAM for the CPU, the GPU's own otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (the weights the budget leaves room for)."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def default_kv_budget(model: torch.nn.Module, device: torch.device | str = "cpu",
                      fraction: float = DEFAULT_BUDGET_FRACTION) -> int:
    """`fraction` of the device memory the weights leave free (at least 1 byte, so the budget stays a budget)."""
    return max(1, int((device_memory_bytes(device) - model_bytes(model)) * fraction))
