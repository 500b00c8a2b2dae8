"""sparse with a lattice cold tier: the decoded-block cache gives the bits of a fresh decode every step, evicts,
and forgets blocks that a trim or a restore rewrites."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.kv.lattice import LatticeCodec
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import SparseIndexError, SparseLayerKV
from kakeya_runtime.models.base import Logits

D4 = {"sink": 3, "window": 8, "block": 4, "topk": 3, "codec": "d4"}


def _ids(n: int, seed: int = 0, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, params=D4, *, cached: bool = True):
    cache = make_policy_cache(model.config, PolicySpec.parse("sparse", params))
    if not cached:
        for layer in cache.layers:
            layer.decoded_blocks = 0  # every step decodes its blocks afresh
    return cache


def _layers(cache) -> list[SparseLayerKV]:
    return [x for x in cache.layers if isinstance(x, SparseLayerKV)]


def test_decode_is_per_vector():
    """A vector decodes to the same bits whatever else is in the call (what makes a cached block exact)."""
    codec = LatticeCodec("d4", 38, 64)
    code, scales = codec.encode(torch.randn(300, 64, generator=torch.Generator().manual_seed(3)))
    whole = codec.decode(code, scales, torch.bfloat16)
    for rows in (slice(0, 1), slice(17, 49), slice(5, 300, 7)):
        assert torch.equal(codec.decode(code[rows], scales[rows], torch.bfloat16), whole[rows])


@pytest.mark.parametrize("per_topk", [4, 1])  # roomy; tight (steps whose blocks do not fit decode afresh)
def test_cached_equals_fresh_turn_by_turn_and_one_shot(tiny_model, monkeypatch, per_topk):
    monkeypatch.setattr(SparseLayerKV, "decoded_per_topk", per_topk)
    ids = _ids(120)
    eng = Engine(tiny_model, prefill_chunk=16)
    fresh = _cache(tiny_model, cached=False)
    ref = eng.prefill(fresh, ids, logits=Logits.ALL).logits
    for chunk in (1, 5):
        cache = _cache(tiny_model)
        got = Engine(tiny_model, prefill_chunk=chunk).prefill(cache, ids, logits=Logits.ALL).logits
        assert torch.equal(got, ref), chunk
        layers = _layers(cache)
        hits, misses = sum(x.decoded_hits for x in layers), sum(x.decoded_misses for x in layers)
        assert hits > 0 and misses > 0
        if per_topk == 4:
            assert hits > misses  # the cache served most blocks
        oversize = sum(x.oversize_steps for x in layers)
        if per_topk == 1 and chunk == 5:  # a chunk's blocks outgrow the cache: a scratch cache, native decode
            assert oversize > 0
            assert sum(x.oversize_reused for x in layers) > 0  # the blocks the cache held were copied, not decoded
        if chunk == 1:  # one token keeps at most topk blocks, which the cache always holds
            assert oversize == 0
        if per_topk == 4 and chunk == 1:
            # more blocks decoded than it can hold: slots were reused
            assert misses > len(layers) * layers[0].decoded_blocks
            assert cache.memory_stats()["decoded_bytes"] == sum(x.decoded_nbytes for x in layers) > 0
    assert all(x.decoded_hits == 0 for x in _layers(fresh))


def test_decoded_slots_are_per_head(tiny_model):
    """Each cold KV head caches only blocks it selected, in slots of its own: the cache holds decoded_blocks
    blocks per head (not per block with every head), and the bytes are what memory_stats reports."""
    cache = _cache(tiny_model)
    Engine(tiny_model, prefill_chunk=1).prefill(cache, _ids(120))
    for layer in _layers(cache):
        hc, c = layer._slot_block.shape
        assert hc == len(layer.cold_heads) and c == min(layer.decoded_blocks, layer.n_blocks)
        b, _, _, d = layer.k_hot.shape
        assert layer.decoded_nbytes == 2 * b * hc * c * layer.block * d * layer.k_hot.element_size()
        for h in range(hc):  # the two maps agree, head by head
            held = layer._slot_block[h] >= 0
            blocks = layer._slot_block[h][held]
            assert torch.equal(layer._block_slot[h][blocks], held.nonzero().squeeze(1))
            assert int((layer._block_slot[h] >= 0).sum()) == int(held.sum())


def test_trim_forgets_rewritten_blocks(tiny_llama, monkeypatch):
    """A rolled-back draft long enough for its own blocks to be selected (and decoded) leaves no stale copy:
    the continuation gets the bits of a session that never drafted."""
    monkeypatch.setattr(SparseLayerKV, "decoded_per_topk", 100)  # nothing is evicted: a stale copy would be read
    params = {**D4, "spare": 24}
    ids = _ids(110)
    ref = Engine(tiny_llama, prefill_chunk=16).prefill(_cache(tiny_llama, params, cached=False), ids,
                                                       logits=Logits.ALL).logits
    eng = Engine(tiny_llama, prefill_chunk=1)
    cache = _cache(tiny_llama, params)
    eng.prefill(cache, ids[:, :70])
    eng.prefill(cache, _ids(24, seed=9))  # a draft, token by token: its blocks are selected and decoded
    layers = _layers(cache)
    drafted = [int(x._slot_block.max()) for x in layers]
    assert min(drafted) >= (70 - 3) // 4  # a block written by the draft is held decoded
    cache.trim(70)
    got = eng.prefill(cache, ids[:, 70:], logits=Logits.ALL).logits
    assert torch.equal(got, ref[:, 70:])


def test_restore_forgets_decoded_blocks(tiny_llama):
    """load_state over a cache whose decoded copies are of another session's blocks."""
    ids, other = _ids(90), _ids(90, seed=5)
    ref = Engine(tiny_llama, prefill_chunk=16).prefill(_cache(tiny_llama, cached=False), ids,
                                                       logits=Logits.ALL).logits
    eng = Engine(tiny_llama, prefill_chunk=1)
    source = _cache(tiny_llama)
    eng.prefill(source, ids[:, :60])
    cache = _cache(tiny_llama)
    eng.prefill(cache, other[:, :60])  # its decoded copies are of `other`'s blocks, at the same block numbers
    assert all(x.decoded_misses > 0 for x in _layers(cache))
    cache.load_state(source.state())
    got = eng.prefill(cache, ids[:, 60:], logits=Logits.ALL).logits
    assert torch.equal(got, ref[:, 60:])


def test_an_oversize_step_reuses_its_selection_and_the_tripwire_checks_it(tiny_model, monkeypatch):
    """The scratch-cache step attends the selection the refused call made (no second indexer run), and the tripwire
    still checks it: a selection missing one block of a query's count fails loudly."""
    monkeypatch.setattr(SparseLayerKV, "decoded_per_topk", 1)
    original = SparseLayerKV._step_oversize
    tampered = []

    def drop_one_block(self, qg, hot, positions, scale, select):
        select = select.clone()
        row = select[0, 0, -1]  # the chunk's last token, KV head 0: clear its lowest selected block
        words = row.nonzero()
        if words.numel():
            w = int(words[0])
            row[w] = row[w] & (row[w] - 1)
            tampered.append(w)
        return original(self, qg, hot, positions, scale, select)

    cache = _cache(tiny_model)
    Engine(tiny_model, prefill_chunk=5).prefill(cache, _ids(60))  # no tampering: the oversize steps pass
    monkeypatch.setattr(SparseLayerKV, "_step_oversize", drop_one_block)
    with pytest.raises(SparseIndexError, match="blocks were not attended"):  # the tripwire, on the given blocks
        Engine(tiny_model, prefill_chunk=5).prefill(_cache(tiny_model), _ids(120))
    assert tampered
