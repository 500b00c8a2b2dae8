"""Tiny random-config models of each family: shapes, cache consistency, batching, sliding windows, config."""

from __future__ import annotations

import json

import pytest
import torch

from kakeya_runtime.kv.cache import SLIDING_SPARE, SlidingLayerKV, make_cache
from kakeya_runtime.models.base import Logits
from kakeya_runtime.models.config import SLIDING_ATTENTION, ConfigError, ModelConfig
from kakeya_runtime.models.registry import UnsupportedModelError, build_model

# Tiny models: per-op work is far too small to split across threads, and on a shared 2-core machine a
# second OpenMP thread mostly waits on a busy core (see conftest.single_thread).
pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ("llama", "gemma3")


def _ids(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(ids.shape[1]), None, logits=Logits.ALL).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_output_shapes(make_tiny_model, family):
    model = make_tiny_model(family)
    cfg = model.config
    ids = _ids(2, 11, cfg.vocab_size)
    pos = torch.arange(11)
    with torch.inference_mode():
        out_all = model(ids, pos, None, logits=Logits.ALL)
        out_last = model(ids, pos, None, logits=Logits.LAST)
        out_none = model(ids, pos, None, logits=Logits.NONE)
        out_hidden = model(ids, pos, None, logits=Logits.LAST, return_hidden=True)
    assert out_all.logits.shape == (2, 11, cfg.vocab_size) and out_all.logits.dtype == torch.float32
    assert out_last.logits.shape == (2, 1, cfg.vocab_size)
    torch.testing.assert_close(out_last.logits[:, 0], out_all.logits[:, -1])
    assert out_none.logits is None
    assert out_hidden.hidden.shape == (2, 11, cfg.hidden_size)
    assert torch.isfinite(out_all.logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_rejects_bad_shapes(make_tiny_model, family):
    model = make_tiny_model(family)
    with pytest.raises(ValueError, match="input_ids must be"):
        model(torch.zeros(5, dtype=torch.long), torch.arange(5))
    with pytest.raises(ValueError, match="positions must be"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(4))


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_chunks_and_decode_match_one_full_forward(make_tiny_model, family):
    """Prefill in uneven chunks, then decode one token at a time: every position's logits equal those of
    one uncached forward over the whole sequence. 30 positions > Gemma's window of 8, so its ring wraps."""
    model = make_tiny_model(family)
    cfg = model.config
    ids = _ids(1, 30, cfg.vocab_size)
    expected = _full_logits(model, ids)
    cache = make_cache(cfg, capacity=64)
    got = []
    with torch.inference_mode():
        for c0, c1 in ((0, 5), (5, 12), (12, 15)):
            out = model(ids[:, c0:c1], torch.arange(c0, c1), cache, logits=Logits.ALL)
            got.append(out.logits)
        for t in range(15, 30):
            got.append(model(ids[:, t:t + 1], torch.arange(t, t + 1), cache, logits=Logits.LAST).logits)
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_rows_equal_single_row_results(make_tiny_model, family):
    model = make_tiny_model(family)
    cfg = model.config
    ids = _ids(3, 20, cfg.vocab_size, seed=7)
    batched = _full_logits(model, ids)
    for b in range(3):
        torch.testing.assert_close(batched[b:b + 1], _full_logits(model, ids[b:b + 1]), rtol=1e-4, atol=1e-4)
    # The same through a B=3 cache: prefill then decode.
    cache = make_cache(cfg, batch=3, capacity=32)
    with torch.inference_mode():
        model(ids[:, :12], torch.arange(12), cache, logits=Logits.NONE)
        steps = [model(ids[:, t:t + 1], torch.arange(t, t + 1), cache).logits for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), batched[:, 12:], rtol=1e-4, atol=1e-4)


def test_gemma_sliding_ring_beyond_the_window(make_tiny_model):
    """Decode 4x the window through the ring cache: the sliding layers keep only `window` slots, yet the
    logits equal a full forward with the window mask. A model without the window gives different logits,
    so the mask (and the ring) are really exercised."""
    model = make_tiny_model("gemma3")
    cfg = model.config
    window = cfg.sliding_window
    length = 4 * window + 3
    ids = _ids(1, length, cfg.vocab_size, seed=3)
    expected = _full_logits(model, ids)
    cache = make_cache(cfg, capacity=64)
    sliding = [layer for i, layer in enumerate(cache) if cfg.layer_type(i) == SLIDING_ATTENTION]
    assert sliding and all(isinstance(layer, SlidingLayerKV) for layer in sliding)
    with torch.inference_mode():
        out = [model(ids[:, :3], torch.arange(3), cache, logits=Logits.ALL).logits]
        for t in range(3, length):
            out.append(model(ids[:, t:t + 1], torch.arange(t, t + 1), cache).logits)
    torch.testing.assert_close(torch.cat(out, dim=1), expected, rtol=1e-4, atol=1e-4)
    # Memory bounded by the window plus the spare slots a speculative draft's rollback needs.
    assert all(layer.k.shape[2] == window + layer.spare and layer.spare <= SLIDING_SPARE for layer in sliding)

    unwindowed = build_model(ModelConfig.from_hf({**cfg.to_hf(), "layer_types": ["full_attention"] * 4}))
    unwindowed.load_state_dict(model.state_dict())
    assert not torch.allclose(_full_logits(unwindowed.eval(), ids)[:, window + 1:], expected[:, window + 1:],
                              atol=1e-3)


def test_gemma_sliding_chunk_larger_than_window(make_tiny_model):
    """A prefill chunk longer than the window (the ring keeps only its tail) followed by decode."""
    model = make_tiny_model("gemma3")
    cfg = model.config
    ids = _ids(2, 3 * cfg.sliding_window, cfg.vocab_size, seed=5)
    expected = _full_logits(model, ids)
    cache = make_cache(cfg, batch=2, capacity=64)
    n = 2 * cfg.sliding_window + 1
    with torch.inference_mode():
        got = [model(ids[:, :n], torch.arange(n), cache, logits=Logits.ALL).logits]
        got += [model(ids[:, t:t + 1], torch.arange(t, t + 1), cache).logits for t in range(n, ids.shape[1])]
    torch.testing.assert_close(torch.cat(got, dim=1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(make_tiny_config, family, tmp_path):
    cfg = make_tiny_config(family, bos_token_id=2, eos_token_ids=(1, 5))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_hf()))
    again = ModelConfig.from_file(path)
    assert again == cfg and again.layer_types == cfg.layer_types and again.eos_token_ids == (1, 5)


def test_config_errors(make_tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="not a multiple"):
        make_tiny_config("llama", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="lacks"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10})
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_registry_rejects_unknown_model_type(make_tiny_config):
    cfg = make_tiny_config("llama", model_type="mamba")
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported") as info:
        build_model(cfg)
    assert isinstance(info.value, ValueError) and "llama" in str(info.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_state_dict_loads_with_fusion(make_tiny_config, make_hf_state, family):
    """HF names (separate q/k/v and gate/up, `model.` prefix) load into our fused modules exactly."""
    cfg = make_tiny_config(family)
    sd = make_hf_state(cfg)
    model = build_model(cfg)
    model.load_state_dict(dict(sd), strict=True)
    attn = model.layers[1].self_attn
    expected = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight.data, expected, rtol=0, atol=0)
