"""restore: evicted K/V recomputed by a same-checkpoint proposer == the full-attention oracle."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.proposers import LinearProjection, ModelProposer, same_checkpoint_proposer
from kakeya_runtime.kv.cache import CacheError
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.models.base import Logits


def _cache(model, name="restore", proposer_chunk=32, **params):
    spec = PolicySpec.parse(name, params)
    return make_policy_cache(model.config, spec, proposer=same_checkpoint_proposer(model, chunk=proposer_chunk))


def _ids(n, vocab, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _two_turns(eng, cache, ids, new_tokens):
    """A context turn (prefill only), then a generation turn: restoration happens between them."""
    eng.prefill(cache, ids[:, :50])
    cache.end_turn()
    return eng.generate(cache, ids[:, 50:], GenerateRequest(new_tokens)).token_ids[0]


@pytest.mark.parametrize("granularity", ["per_step", "per_turn"])
def test_tiny_restore_equals_full_greedy(tiny_model, granularity):
    eng = Engine(tiny_model, prefill_chunk=16)
    ids = _ids(70, tiny_model.config.vocab_size)
    full = _two_turns(eng, _cache(tiny_model, "full"), ids, 40)
    cache = _cache(tiny_model, sink=2, window=6, granularity=granularity)
    assert _two_turns(eng, cache, ids, 40) == full
    assert cache.transient_nbytes == 0 and cache.active is False  # overlay dropped after the turn
    assert cache.layer_lengths() == [109] * len(cache)  # INV-1 (the last sampled token is not fed back)
    assert cache.restored_positions > 0  # positions 2..43 were evicted and recomputed


def test_tiny_restore_logits_match_full_at_every_step(tiny_llama):
    eng = Engine(tiny_llama, prefill_chunk=16)
    ids = _ids(50, 97, seed=3)
    full, restore = _cache(tiny_llama, "full"), _cache(tiny_llama, sink=2, window=5)
    a = eng.prefill(full, ids, logits=Logits.ALL).logits
    b = eng.prefill(restore, ids, logits=Logits.ALL).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for tok in _ids(20, 97, seed=4)[0]:
        la = eng.decode_step(full, tok.view(1, 1)).logits
        lb = eng.decode_step(restore, tok.view(1, 1)).logits
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_sustained_bytes_flat_peak_grows_with_length(tiny_llama):
    eng = Engine(tiny_llama, prefill_chunk=16)
    sustained, peaks = [], []
    for n in (30, 120, 300):
        cache = _cache(tiny_llama, sink=4, window=16)
        eng.generate(cache, _ids(n, 97), GenerateRequest(3))
        sustained.append(cache.resident_nbytes)
        peaks.append(cache.peak_transient_bytes)
        assert cache.history_nbytes >= 4 * (n + 2)  # the O(T) int32 token history, said out loud
    assert len(set(sustained)) == 1
    assert peaks[0] < peaks[1] < peaks[2]  # restored K/V are O(T), transiently


def test_trim_rollback_then_continue_equals_full(tiny_llama):
    """Restore can roll back past its window (sink_window cannot): exposed positions are restored."""
    eng = Engine(tiny_llama, prefill_chunk=16)
    ids, more = _ids(60, 97, seed=5), _ids(30, 97, seed=6)
    full, restore = _cache(tiny_llama, "full"), _cache(tiny_llama, sink=2, window=6)
    for cache in (full, restore):
        eng.prefill(cache, ids)
        eng.prefill(cache, more)
        cache.trim(62)
    assert restore.layer_lengths() == [62] * len(restore)
    nxt = _ids(5, 97, seed=7)
    a = eng.prefill(full, nxt, logits=Logits.ALL).logits
    b = eng.prefill(restore, nxt, logits=Logits.ALL).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_state_round_trip_keeps_history(tiny_llama):
    eng = Engine(tiny_llama, prefill_chunk=16)
    src = _cache(tiny_llama, sink=2, window=6)
    eng.prefill(src, _ids(40, 97))
    dst = _cache(tiny_llama, sink=2, window=6)
    dst.load_state(src.state())
    assert torch.equal(dst.history[:, :40], src.history[:, :40])
    tok = torch.tensor([[5]])
    torch.testing.assert_close(eng.decode_step(src, tok).logits, eng.decode_step(dst, tok).logits)
    with pytest.raises(CacheError):
        dst.load_state([{k: v for k, v in s.items() if k != "restore.history"} for s in src.state()])


def test_restore_refuses_use_outside_a_step(tiny_llama):
    cache = _cache(tiny_llama, sink=2, window=6)
    with pytest.raises(CacheError, match="begin_step"):
        tiny_llama(torch.tensor([[1, 2]]), torch.arange(2), cache)


def test_non_identity_projection_path(tiny_llama):
    """A learned f_theta initialised to identity reproduces the identity proposer (through a copy)."""
    cfg = tiny_llama.config
    proj = LinearProjection({i: i for i in range(cfg.num_hidden_layers)}, cfg.head_dim, cfg.head_dim,
                            cfg.num_key_value_heads)
    spec = PolicySpec.parse("restore", {"sink": 2, "window": 6})
    a = make_policy_cache(cfg, spec, proposer=ModelProposer(tiny_llama, proj, chunk=8))
    b = _cache(tiny_llama, sink=2, window=6)
    eng = Engine(tiny_llama, prefill_chunk=16)
    ids = _ids(40, 97)
    req = GenerateRequest(10)
    assert eng.generate(a, ids, req).token_ids == eng.generate(b, ids, req).token_ids


def test_smollm2_fp32_restore_equals_full(smollm2_fp32):
    """Real SmolLM2 fp32, sink 4 + window 64, ~300-token prompt: identical greedy tokens. per_turn restores once
    (after a context turn) and generates 32 tokens; per_step re-runs the proposer over the whole evicted history
    at every step (~1 s each here), over 12 tokens."""
    lm = smollm2_fp32
    text = ("In 1887 the lighthouse keeper Ada Lund wrote that the northern channel froze twice. The supply "
            "boat, the Marit, came every ninth day. ") * 12
    ids = torch.tensor([lm.tokenizer.encode(text).ids[:300]])
    eng = Engine(lm.model, prefill_chunk=256)
    req = GenerateRequest(32)
    full = eng.generate(_cache(lm.model, "full"), ids, req).token_ids[0]
    per_turn = _cache(lm.model, sink=4, window=64, granularity="per_turn", proposer_chunk=256)
    eng.prefill(per_turn, ids[:, :280])  # context turn; the question turn restores 4..215
    per_turn.end_turn()
    assert eng.generate(per_turn, ids[:, 280:], req).token_ids[0] == full
    assert per_turn.restored_positions == 280 - 4 - 64
    per_step = _cache(lm.model, sink=4, window=64, granularity="per_step", proposer_chunk=256)
    assert eng.generate(per_step, ids, GenerateRequest(12)).token_ids[0] == full[:12]
    assert per_step.restored_positions == sum(300 + i - 4 - 64 for i in range(11))  # 11 decode steps
