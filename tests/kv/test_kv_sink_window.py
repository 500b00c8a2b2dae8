"""sink_window: eviction bookkeeping, constant memory, chunk masks == decode retention, trim, state."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerateRequest, GenerationError
from kakeya_runtime.kv.cache import CacheError
from kakeya_runtime.kv.policy import PolicySpec, PositionLimitError, make_policy_cache
from kakeya_runtime.kv.sink_window import SinkWindowLayerKV
from kakeya_runtime.models.base import Logits
from kakeya_runtime.models.layers import attention_mask


def _layer(sink=2, window=5, spare=0, max_positions=1000, codec=None):
    return SinkWindowLayerKV(1, 2, 8, sink=sink, window=window, spare=spare, max_positions=max_positions,
                             codec=codec, dtype=torch.float32)


def _kv(start: int, n: int):
    """K/V whose value encodes the position, so fetched keys identify themselves."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    k = pos.view(1, 1, n, 1).expand(1, 2, n, 8).clone()
    return k, -k, torch.arange(start, start + n)


def _visible(q: int, sink: int, window: int) -> set[int]:
    return {p for p in range(q + 1) if p < sink or q - p < window}


@pytest.mark.parametrize("sink,window,spare", [(2, 5, 0), (0, 4, 0), (3, 4, 3), (4, 64, 0)])
def test_decode_returns_exactly_sinks_plus_window(sink, window, spare):
    layer = _layer(sink, window, spare)
    nbytes = layer.nbytes
    for q in range(40):
        k, v, pos = _kv(q, 1)
        k_all, v_all, k_pos = layer.update_and_fetch(k, v, pos)
        assert set(k_pos.tolist()) == _visible(q, sink, window)
        assert torch.equal(k_all[0, 0, :, 0].long(), k_pos)  # each key is the one for its position
        assert torch.equal(v_all, -k_all)
        assert layer.nbytes == nbytes  # preallocated: no growth
        assert layer.visible_count(q) == len(_visible(q, sink, window))
    assert set(layer.held_positions().tolist()) == set(range(sink)) | set(range(max(0, 40 - window - spare), 40))


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 40])
def test_chunks_hand_back_held_keys_and_mask_to_the_rule(chunk):
    sink, window = 2, 5
    layer = _layer(sink, window)
    start = 0
    while start < 40:
        n = min(chunk, 40 - start)
        k, v, pos = _kv(start, n)
        k_all, _, k_pos = layer.update_and_fetch(k, v, pos)
        if n > 1:
            mask = attention_mask(pos, k_pos, window, sink)
            for i, q in enumerate(pos.tolist()):
                assert set(k_pos[mask[i]].tolist()) == _visible(q, sink, window)
        else:
            assert set(k_pos.tolist()) == _visible(start, sink, window)
        start += n
    assert layer.length == 40


def test_trim_before_eviction_and_with_spare_slots():
    layer = _layer(sink=2, window=5)
    for q in range(6):
        layer.update_and_fetch(*_kv(q, 1))
    layer.trim(3)  # nothing evicted yet: fine
    assert layer.length == 3
    k_all, _, k_pos = layer.update_and_fetch(*_kv(3, 1))
    assert k_pos.tolist() == [0, 1, 2, 3]
    for q in range(4, 20):
        layer.update_and_fetch(*_kv(q, 1))
    with pytest.raises(CacheError, match="evicted"):
        layer.trim(18)
    spare = _layer(sink=2, window=5, spare=3)
    for q in range(20):
        spare.update_and_fetch(*_kv(q, 1))
    spare.trim(17)  # roll back 3: the spare slots still hold what position 17 needs
    for q in range(17, 25):
        _, _, k_pos = spare.update_and_fetch(*_kv(q, 1))
        assert set(k_pos.tolist()) == _visible(q, 2, 5)
    with pytest.raises(CacheError):
        spare.trim(20)


def test_state_round_trip_and_position_limit():
    layer = _layer(sink=2, window=5, max_positions=30)
    for q in range(13):
        layer.update_and_fetch(*_kv(q, 1))
    copy = _layer(sink=2, window=5, max_positions=30)
    copy.load_state(layer.state())
    for q in range(13, 30):
        a, b = layer.update_and_fetch(*_kv(q, 1)), copy.update_and_fetch(*_kv(q, 1))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(PositionLimitError) as err:
        layer.update_and_fetch(*_kv(30, 1))
    assert err.value.code == "RESOURCE_EXHAUSTED"


def _logits_by_chunks(model, spec, ids, chunk):
    cache = make_policy_cache(model.config, spec)
    eng = Engine(model, prefill_chunk=chunk)
    return eng.prefill(cache, ids, logits=Logits.ALL).logits, cache


def test_tiny_model_chunked_prefill_equals_token_by_token(tiny_model):
    """The per-query rule is the same whether keys come from the mask (chunks) or the ring (decode)."""
    spec = PolicySpec.parse("sink_window", {"sink": 3, "window": 8})
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(0))
    ref, cache = _logits_by_chunks(tiny_model, spec, ids, 45)
    assert cache.layer_lengths() == [45] * len(cache)  # INV-1 under eviction
    for chunk in (1, 4, 16):
        got, _ = _logits_by_chunks(tiny_model, spec, ids, chunk)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_tiny_model_sink_window_differs_from_full_once_evicting(tiny_llama):
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(1))
    full, _ = _logits_by_chunks(tiny_llama, PolicySpec.parse("full"), ids, 16)
    sw, cache = _logits_by_chunks(tiny_llama, PolicySpec.parse("sink_window", {"sink": 2, "window": 8}), ids, 16)
    torch.testing.assert_close(sw[:, :10], full[:, :10], atol=1e-5, rtol=1e-5)  # nothing evicted yet
    assert (sw[:, 20:] - full[:, 20:]).abs().max() > 1e-3
    assert cache.effective_attention_fraction == pytest.approx(10 / 60)


def test_gemma_native_sliding_layers_keep_their_ring(tiny_gemma):
    cache = make_policy_cache(tiny_gemma.config, PolicySpec.parse("sink_window", {"sink": 2, "window": 4}))
    kinds = [type(layer).__name__ for layer in cache]
    assert kinds == ["SlidingLayerKV", "SlidingLayerKV", "SinkWindowLayerKV", "SlidingLayerKV"]
    assert cache.governed == [2]


def test_memory_is_flat_in_length(tiny_llama):
    eng = Engine(tiny_llama, prefill_chunk=16)
    sizes = []
    for n in (20, 80, 200):
        cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", {"sink": 4, "window": 16}))
        eng.generate(cache, torch.randint(0, 97, (1, n)), GenerateRequest(4))
        sizes.append(cache.nbytes)
    assert len(set(sizes)) == 1
    assert sizes[0] == 3 * 2 * (1 * 2 * 20 * 16 * 4)  # layers * (K, V) * (B * Hk * slots * D * fp32)


def test_engine_refuses_past_the_position_limit(tiny_llama):
    cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", {"sink": 2, "window": 8}),
                              capacity=40)
    eng = Engine(tiny_llama, prefill_chunk=16)
    eng.prefill(cache, torch.randint(0, 97, (1, 38)))
    with pytest.raises(GenerationError):
        eng.generate(cache, torch.randint(0, 97, (1, 1)), GenerateRequest(4))
    with pytest.raises(PositionLimitError):
        for layer in cache:  # below the engine, the layer refuses too (no position reassignment)
            layer.update_and_fetch(*[torch.zeros(1, 2, 3, 16)] * 2, torch.arange(38, 41))


def test_lattice_resident_holds_codes_of_the_exact_kv(tiny_llama):
    """The store encodes each position's exact K/V once, at the end of its step; queries read every position,
    their own included, through the codec. So layer 0 (whose K/V do not depend on attention) holds exactly the
    codes of the identity store's K/V, the packed store is the same after one prefill as after one token at a
    time, and decode steps through the engine (batched decode/encode per step) match direct per-layer use."""
    params = {"sink": 2, "window": 8}
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    eng = Engine(tiny_llama, prefill_chunk=16)
    ident = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", params))
    packed = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", {**params, "codec": "d4"}))
    eng.prefill(ident, ids)
    eng.prefill(packed, ids)
    a, b = ident[0], packed[0]
    assert torch.equal(a.store.slot_positions, b.store.slot_positions)
    for name in ("k", "v"):
        want = b.codec.encode(getattr(a.store, name)["x"])
        assert all(torch.equal(want[key], getattr(b.store, name)[key]) for key in want)
    stepped = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", {**params, "codec": "d4"}))
    for i in range(ids.shape[1]):
        eng.decode_step(stepped, ids[:, i : i + 1])
    for x, y in zip(packed.state(), stepped.state(), strict=True):
        assert all(torch.equal(x[key], y[key]) for key in x)
    assert all(layer.view is None for layer in packed)  # nothing decoded is held between steps
    direct = make_policy_cache(tiny_llama.config, PolicySpec.parse("sink_window", {**params, "codec": "d4"}))
    direct.load_state(packed.state())
    for i, tok in enumerate([3, 14, 15, 92, 65]):
        pos = torch.arange(40 + i, 41 + i)
        via_engine = eng.decode_step(packed, torch.tensor([[tok]])).logits
        with torch.inference_mode():
            unstaged = tiny_llama(torch.tensor([[tok]]), pos, direct).logits
        torch.testing.assert_close(via_engine, unstaged, atol=1e-5, rtol=1e-5)


def test_a_chunk_after_a_wrapped_ring_is_trimmed_back_reads_no_emptied_slot(tiny_llama):
    """A ring that wrapped (its first slot re-used) and was trimmed back to at most its slots, as a speculative
    verify's rollback does, handed a chunk every slot below its length, the emptied one (position -1) among them:
    the kernel refused it ("negative key position") and the Generate failed. The chunk's logits equal a cache that
    reached the same length without the detour."""
    spec = PolicySpec.parse("sink_window", {"sink": 2, "window": 8, "spare": 4})  # 2 + 12 slots
    eng = Engine(tiny_llama, prefill_chunk=16)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = make_policy_cache(tiny_llama.config, spec, capacity=64)
    eng.prefill(cache, ids[:, :15])  # one past the 14 slots: position 14 took slot 2
    cache.trim(12)  # position 14's slot emptied; 12 <= 14 slots
    got = eng.prefill(cache, ids[:, 12:17], logits=Logits.ALL).logits
    ref = make_policy_cache(tiny_llama.config, spec, capacity=64)
    eng.prefill(ref, ids[:, :12])
    want = eng.prefill(ref, ids[:, 12:17], logits=Logits.ALL).logits
    assert torch.equal(got, want)
