"""KV policies behind one factory: `make_policy_cache(config, PolicySpec.parse(name, params), ...)`.

| policy | sustained K/V (governed layers) | queries see | params |
|---|---|---|---|
| full | every position (grows with T) | everything | idle_codec, idle_q |
| sink_window | sink + window (+ spare) slots, fixed | sinks + last window | sink, window, spare, codec, q |
| restore | sink + window slots, fixed (+ O(T) int32 token ids) | everything (evicted K/V recomputed) | sink, window, granularity, chunk, codec, q |
| sparse | sink + window + block hot slots, fixed; every older block packed (codec, d4 by default) + its key min/max | sinks + hot range + the top max(topk, budget x blocks) cold blocks by the indexer | sink, window, block, topk, budget, spare, codec, q |

`codec` (identity | d4 | e8, range `q`) is the resident store's codec; `idle_codec` names what
`compress_idle` should use for the session. Gemma 3's native sliding layers keep their native ring under
every policy: the policies govern the global (full-attention) layers.

Every cache returned is a ModelKV (per-layer update_and_fetch, length, capacity, trim, nbytes,
state/load_state) with the PolicyKV hooks (begin_step/end_step/end_turn, effective_attention_fraction,
memory_stats). Errors: PolicyError (INVALID_ARGUMENT) for bad specs, PositionLimitError
(RESOURCE_EXHAUSTED) past the model's position limit, CacheError for contract violations.
"""

from __future__ import annotations

import dataclasses

import torch

from kakeya_runtime.kv.cache import CacheError, FullLayerKV, SlidingLayerKV, make_cache, sliding_spare
from kakeya_runtime.kv.compress import make_codec
from kakeya_runtime.kv.heads import (
    SIZES,
    HeadProfile,
    HeadProfileError,
    keep_bound,
    load_bound,
    load_profile,
    user_dir,
)
from kakeya_runtime.kv.idle import IdleStats, compress_idle, decompress, is_compressed
from kakeya_runtime.kv.restore import RestoreKV, RestoreLayerKV
from kakeya_runtime.kv.sink_window import PositionLimitError, SinkWindowKV, SinkWindowLayerKV
from kakeya_runtime.kv.sparse import SparseIndexError, SparseKV, SparseLayerKV
from kakeya_runtime.kv.spec import CodecSpec, PolicyError, PolicyKV, PolicySpec, check_codec
from kakeya_runtime.models.config import ModelConfig

__all__ = [
    "CacheError", "CodecSpec", "IdleStats", "PolicyError", "PolicyKV", "PolicySpec", "PositionLimitError",
    "SparseIndexError", "SparseKV",
    "check_fits", "check_head_profile", "compress_idle", "decompress", "is_compressed", "make_policy_cache", "governed_layers",
]


def check_fits(spec: PolicySpec, context: int) -> None:
    """PolicyError when a sparse spec's sizes exceed the session's context (a window past the context would
    allocate slots no position can fill)."""
    if spec.name != "sparse":
        return
    too_big = [f"{k} = {v}" for k, v in (("sink + window", spec.sink + spec.window), ("block", spec.block),
                                         ("spare", spec.spare)) if v > context]
    if too_big:
        raise PolicyError(f"{', '.join(too_big)} exceeds the context of {context} positions")


def check_head_profile(config: ModelConfig, spec: PolicySpec) -> PolicySpec:
    """`spec` bound to this model's head profile (heads=profile -> profile:<digest>, so a restart, an import or a
    rebuilt cache use the same modes or refuse); PolicyError unless the profile is found and covers every governed
    layer (what building its cache needs: checked when the session is created, not at its first Generate), or when
    a bound spec's profile has changed since (another calibration)."""
    if spec.name != "sparse" or not spec.heads.startswith("profile"):
        return spec
    profile = _profile_for(config, spec)
    keep_bound(config, profile)  # so a recalibration leaves this session's modes where a rebuild finds them
    return dataclasses.replace(spec, heads=f"profile:{profile.digest}")


def _profile_for(config: ModelConfig, spec: PolicySpec) -> HeadProfile:
    """The profile `spec` names: the model's current one for heads=profile; for a bound profile:<digest>, the copy
    kept when a session bound it, else the current one, whichever has that digest and fits (a damaged or mismatched
    candidate is passed over, so neither a damaged kept copy nor a damaged current file refuses a session the other
    serves). Checked against the model's governed layers and the spec's sizes."""
    bound = spec.heads.partition(":")[2]
    if not bound:
        try:
            return _fitted(config, spec, load_profile(config))
        except HeadProfileError as e:
            raise PolicyError(str(e)) from None
    unreadable: list[str] = []
    misfit: PolicyError | None = None
    for load in (lambda: load_bound(config, bound), lambda: load_profile(config)):
        try:
            profile = load()
        except HeadProfileError as e:
            unreadable.append(str(e))
            continue
        if profile is None or bound not in (profile.digest, profile.legacy_digest):
            continue
        try:
            return _fitted(config, spec, profile)
        except HeadProfileError as e:
            misfit = misfit or PolicyError(str(e))
        except PolicyError as e:
            misfit = misfit or e
    if misfit is not None:
        raise misfit
    detail = f" ({'; '.join(unreadable)})" if unreadable else ""
    raise PolicyError(f"this session was built with the head profile {bound}, which is neither the model's profile "
                      f"now nor kept in {user_dir() / 'bound'}{detail}: put that profile back or start a new session")


def _fitted(config: ModelConfig, spec: PolicySpec, profile: HeadProfile) -> HeadProfile:
    """`profile` if it covers exactly the governed layers and was measured for the spec's sizes."""
    governed = governed_layers(config)
    stray = sorted(set(profile.layers) - set(governed))
    if stray:
        raise HeadProfileError(f"the head profile has entries for layers {stray}, which the policy does not "
                               "govern (a profile of another model?)")
    for i in governed:
        profile.head_topk(i, spec.topk, 1)
    asked = {k: getattr(spec, k) for k in SIZES}
    if profile.sizes != asked:
        measured = ", ".join(f"{k} {v}" for k, v in profile.sizes.items())
        raise PolicyError(f"the head profile {profile.digest} was measured for {measured}; this policy asks for "
                          f"{', '.join(f'{k} {v}' for k, v in asked.items())}: use those sizes, or calibrate for "
                          "these (`kakeya calibrate heads --window ... --block ... --topk ...`)")
    return profile


def governed_layers(config: ModelConfig) -> list[int]:
    """Layers a policy decides: every layer without a native sliding window."""
    return [i for i in range(config.num_hidden_layers) if config.layer_window(i) is None]


def make_policy_cache(config: ModelConfig, spec: PolicySpec, *, batch: int = 1, capacity: int | None = None,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      proposer=None) -> PolicyKV:
    """A fresh cache for one sequence batch. `proposer` (engine.proposers.KVProposer) is required by
    restore, e.g. `same_checkpoint_proposer(model, chunk=spec.chunk)`."""
    cap = config.max_position_embeddings if capacity is None else capacity
    if not 0 < cap <= config.max_position_embeddings:
        raise PolicyError(f"capacity {cap} outside 1..{config.max_position_embeddings} (the model's context)")
    if batch < 1:
        raise PolicyError(f"batch must be >= 1, got {batch}")
    governed = governed_layers(config)
    common = dict(batch=batch, capacity=cap, dtype=dtype, spec=spec, governed=governed)
    if spec.name == "full":
        if spec.idle_codec is not None:
            check_codec(spec.idle_codec, "idle_codec", config.head_dim)
        base = make_cache(config, batch=batch, capacity=cap, dtype=dtype, device=device)
        return PolicyKV(base.layers, **common)
    check_codec(spec.codec, "codec", config.head_dim)
    if spec.idle_codec is not None:
        check_codec(spec.idle_codec, "idle_codec", config.head_dim)
    if spec.name == "restore" and proposer is None:
        raise PolicyError("the restore policy needs a proposer (engine.proposers.same_checkpoint_proposer)")
    codec = make_codec(spec.codec.kind, spec.codec.q, config.head_dim, device)
    shape = (batch, config.num_key_value_heads, config.head_dim)
    if spec.name == "sparse":
        check_fits(spec, cap)
        profile = _profile_for(config, spec) if spec.heads.startswith("profile") else None
        every = cap // spec.block + 1  # a dense head keeps every cold block

        def sparse_layer(i: int) -> SparseLayerKV:
            return SparseLayerKV(*shape, sink=spec.sink, window=spec.window, block=spec.block, topk=spec.topk,
                                 budget=spec.budget, spare=spec.spare, max_positions=cap, codec=codec, dtype=dtype,
                                 device=device, defer_encode=True,  # every codec: one batch a step, not 30 small ones
                                 head_topk=None if profile is None else profile.head_topk(i, spec.topk, every))

        try:
            return SparseKV(_layers(config, cap, shape, dtype, device, sparse_layer), **common)
        except HeadProfileError as e:  # a profile that lacks one of this model's governed layers
            raise PolicyError(str(e)) from None
    layer_cls = RestoreLayerKV if spec.name == "restore" else SinkWindowLayerKV
    layers = _layers(config, cap, shape, dtype, device, lambda i: layer_cls(
        *shape, sink=spec.sink, window=spec.window, max_positions=cap, spare=spec.spare, codec=codec, dtype=dtype,
        device=device))
    if spec.name == "restore":
        return RestoreKV(layers, proposer=proposer, **common)
    return SinkWindowKV(layers, **common)


def _layers(config: ModelConfig, cap: int, shape: tuple[int, int, int], dtype: torch.dtype,
            device: torch.device | str, governed_layer) -> list:
    """`governed_layer(i)` for every layer i without a native window; the native ring (or a full layer, when the
    window covers the context) for the others."""
    layers: list = []
    for i in range(config.num_hidden_layers):
        window = config.layer_window(i)
        if window is None:
            layers.append(governed_layer(i))
        elif window < cap:
            layers.append(SlidingLayerKV(*shape, window, dtype=dtype, device=device, spare=sliding_spare(window, cap)))
        else:
            layers.append(FullLayerKV(*shape, cap, dtype=dtype, device=device))
    return layers
