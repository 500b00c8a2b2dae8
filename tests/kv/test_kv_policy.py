"""PolicySpec parsing (typed errors) and the make_policy_cache factory."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.proposers import same_checkpoint_proposer
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.kv.policy import CodecSpec, PolicyError, PolicyKV, PolicySpec, make_policy_cache


def test_defaults_and_normalised_params():
    assert PolicySpec.parse("") == PolicySpec("full")
    assert PolicySpec.parse("full").params == {}
    sw = PolicySpec.parse("sink_window", {"sink": 4.0, "window": " 64 "})  # Struct numbers are floats
    assert (sw.sink, sw.window, sw.codec) == (4, 64, CodecSpec("identity"))
    assert sw.params == {"sink": 4, "window": 64, "codec": "identity", "spare": 0}
    r = PolicySpec.parse("restore", {"window": 64, "granularity": "PER_TURN", "codec": "e8", "q": 19})
    assert r.params == {"sink": 4, "window": 64, "codec": "e8", "q": 19, "granularity": "per_turn", "chunk": 512}
    assert r.label == "restore(4+64, per_turn, e8/q19)"
    assert PolicySpec.parse(r.name, r.params) == r
    idle = PolicySpec.parse("full", {"idle_codec": "d4"})
    assert idle.idle_codec == CodecSpec("d4", 38) and idle.params == {"idle_codec": "d4", "idle_q": 38}
    never = PolicySpec.parse("full", {"idle_codec": "none"})  # asked for: never compressed (not the server's default)
    assert never.idle_codec == CodecSpec("none") and never.params == {"idle_codec": "none"}
    assert PolicySpec.parse("full", never.params) == never and never.label == "full() idle:none"
    assert PolicySpec.parse("full").idle_codec is None
    int8 = PolicySpec.parse("sink_window", {"window": 64, "codec": "int8", "idle_codec": "int8"})
    assert "q" not in int8.params and "idle_q" not in int8.params  # int8 has no q: not echoed back as if it had


@pytest.mark.parametrize("name,params,match", [
    ("streaming", {}, "unknown KV policy"),
    ("full", {"sink": 4}, "no parameter"),
    ("sink_window", {"window": 0}, ">= 1"),
    ("sink_window", {"sink": -1}, ">= 0"),
    ("sink_window", {"sink": 1.5}, "integer"),
    ("sink_window", {"sink": True}, "integer"),
    ("sink_window", {"codec": "zip"}, "one of"),
    ("restore", {"granularity": "sometimes"}, "one of"),
    ("restore", {"codec": "e8", "q": 500}, "bits per block"),
    ("restore", {"chunk": 0}, ">= 1"),
    ("full", {"idle_codec": "d4", "idle_q": 0}, ">= 1"),
    # strings are ASCII integers: other digits and doubled signs are refused, not an internal error or a 3
    ("sink_window", {"sink": "\u00b2"}, "integer"),
    ("sink_window", {"sink": "--5"}, "integer"),
    ("sink_window", {"window": "\u0663"}, "integer"),
    ("sparse", {"topk": "1_0"}, "integer"),
    # idle_q checked whether or not an idle codec is set, and refused where it would change nothing
    ("full", {"idle_q": "garbage"}, "integer"),
    ("sparse", {"idle_q": -5}, ">= 1"),
    ("full", {"idle_q": 38}, "none is set"),
    # a range for a codec that takes none is refused, not dropped (the session would not be what was asked)
    ("sink_window", {"codec": "int8", "q": 5}, "'int8' takes none"),
    ("sparse", {"codec": "identity", "q": 20}, "'identity' takes none"),
    ("restore", {"q": 20}, "'identity' takes none"),  # the default codec
    ("full", {"idle_codec": "int8", "idle_q": 7}, "idle_codec 'int8' takes none"),
    ("sparse", {"idle_codec": "identity", "idle_q": 7}, "idle_codec 'identity' takes none"),
])
def test_invalid_specs_raise_policy_error(name, params, match):
    with pytest.raises(PolicyError, match=match):
        PolicySpec.parse(name, params)
    assert issubclass(PolicyError, ValueError)


def test_factory_builds_model_kv_compatible_caches(tiny_llama):
    cfg = tiny_llama.config
    prop = same_checkpoint_proposer(tiny_llama)
    for name in ("full", "sink_window", "restore"):
        cache = make_policy_cache(cfg, PolicySpec.parse(name, {}), capacity=256, proposer=prop)
        assert isinstance(cache, ModelKV) and isinstance(cache, PolicyKV)
        assert (len(cache), cache.length, cache.capacity, cache.batch) == (3, 0, 256, 1)
        assert cache.effective_attention_fraction == 1.0
        assert set(cache.memory_stats()) == {"resident_bytes", "transient_bytes", "peak_transient_bytes",
                                              "history_bytes"}


def test_factory_errors_are_typed(tiny_llama):
    cfg = tiny_llama.config
    with pytest.raises(PolicyError, match="proposer"):
        make_policy_cache(cfg, PolicySpec.parse("restore"))
    with pytest.raises(PolicyError, match="head_dim"):
        # head_dim 16 is fine for D4 but not divisible into E8 blocks of a 12-dim head; fake one:
        make_policy_cache(cfg.__class__(**{**_fields(cfg), "head_dim": 12, "num_attention_heads": 4}),
                          PolicySpec.parse("sink_window", {"codec": "d4"}))
    with pytest.raises(PolicyError, match="capacity"):
        make_policy_cache(cfg, PolicySpec.parse("full"), capacity=10_000)


def test_lattice_resident_store_bytes(tiny_llama):
    cfg = tiny_llama.config  # head_dim 16: D4 q38 = 4 blocks * 25 bits + 32 = 132 bits -> 17 bytes
    cache = make_policy_cache(cfg, PolicySpec.parse("sink_window", {"sink": 4, "window": 28, "codec": "d4"}),
                              dtype=torch.bfloat16)
    vectors = 3 * 2 * 1 * 2 * 32  # layers * (K, V) * B * Hk * slots
    assert cache.nbytes == vectors * 17


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
