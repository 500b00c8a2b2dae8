"""The engine on tiny random models: cached == recomputed greedy decoding, tracing, stops, caps, validation."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerationError,
    generate_greedy_cached,
    generate_greedy_full,
)
from kakeya_runtime.engine.sampling import SamplingParams
from kakeya_runtime.kv.cache import CacheError, make_cache
from kakeya_runtime.models.base import DecoderModel, ForwardOutput, Logits

# Tiny models: per-op work is far too small to split across threads, and on a shared 2-core machine a
# second OpenMP thread mostly waits on a busy core (see conftest.single_thread).
pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ("llama", "gemma3")


def _prompt(n: int, vocab: int, seed: int = 11) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_cached_equals_full_recompute(make_tiny_model, family):
    """>= 64 new tokens, no stops: the tiny Gemma's 8-token window wraps its ring many times."""
    # Untied head: with a tied one a random model mostly repeats its input token (the scaled embedding
    # dominates the residual), and a constant continuation would prove little.
    engine = Engine(make_tiny_model(family, tie_word_embeddings=False), prefill_chunk=5)
    prompt = _prompt(13, engine.config.vocab_size)
    cached = generate_greedy_cached(engine, prompt, max_new_tokens=72)
    full = generate_greedy_full(engine, prompt, max_new_tokens=72)
    assert len(cached) == 13 + 72
    assert cached == full
    assert len(set(cached[13:])) > 10  # a non-degenerate continuation


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_unchunked_forward(make_tiny_model, family):
    model = make_tiny_model(family)
    ids = torch.tensor([_prompt(37, model.config.vocab_size)])
    with torch.inference_mode():
        full = model(ids, torch.arange(37), None, logits=Logits.ALL).logits  # (1, 37, V)
    for chunk in (1, 4, 16, 512):
        engine = Engine(model, prefill_chunk=chunk)
        last = engine.prefill(engine.new_cache(capacity=64), ids).logits
        assert last.shape == (1, 1, model.config.vocab_size)
        torch.testing.assert_close(last, full[:, -1:], rtol=1e-4, atol=1e-4)
        every = engine.prefill(engine.new_cache(capacity=64), ids, logits=Logits.ALL).logits
        torch.testing.assert_close(every, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_row_tracing(make_tiny_model, family):
    model = make_tiny_model(family)
    cfg = model.config
    full_layer = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_window(i) is None)
    engine = Engine(model, prefill_chunk=4)
    b, t = 2, 6  # prompt shorter than Gemma's window, so every traced layer sees all t keys
    ids = torch.tensor([_prompt(t, cfg.vocab_size, s) for s in (1, 2)])
    for layer in range(cfg.num_hidden_layers):
        cache = engine.new_cache(batch=b, capacity=32)
        rows = [engine.prefill(cache, ids, trace_layer=layer).attn_row]
        nxt = torch.tensor([[3], [4]])
        rows.append(engine.decode_step(cache, nxt, trace_layer=layer).attn_row)
        for row, keys in zip(rows, (t, t + 1), strict=True):
            assert row.shape == (b, cfg.num_attention_heads, keys)
            assert torch.isfinite(row).all()
            assert ((row >= 0) & (row <= 1)).all()
            torch.testing.assert_close(row.sum(-1), torch.ones(b, cfg.num_attention_heads), atol=1e-4, rtol=0)
        assert not torch.allclose(rows[0][0], rows[0][1])  # rows differ per batch element
    # Tracing does not change the result.
    plain = engine.prefill(engine.new_cache(batch=b, capacity=32), ids).logits
    traced = engine.prefill(engine.new_cache(batch=b, capacity=32), ids, trace_layer=full_layer).logits
    torch.testing.assert_close(plain, traced, rtol=1e-4, atol=1e-4)


def test_attention_rows_through_the_stream(make_tiny_model):
    engine = Engine(make_tiny_model("llama"))
    stream = engine.stream(engine.new_cache(capacity=32), torch.tensor([[1, 2, 3]]),
                           GenerateRequest(4, trace_layer=1))
    list(stream)
    assert [r.shape[-1] for r in stream.attn_rows] == [3, 4, 5, 6]


def test_kept_step_logits_are_the_ones_sampled(make_tiny_model):
    engine = Engine(make_tiny_model("llama"))
    stream = engine.stream(engine.new_cache(capacity=32), torch.tensor([[1, 2, 3]]),
                           GenerateRequest(5, keep_logits=True))
    tokens = [ids[0] for ids in stream]
    assert [int(lg.argmax(-1)) for lg in stream.step_logits] == tokens  # greedy: each step's argmax
    assert all(lg.dtype == torch.float32 and lg.shape == (1, engine.config.vocab_size) for lg in stream.step_logits)
    plain = engine.stream(engine.new_cache(capacity=32), torch.tensor([[1, 2, 3]]), GenerateRequest(5))
    assert [ids[0] for ids in plain] == tokens and plain.step_logits == []


class _EOSFirst(DecoderModel):
    """Wraps a real model (its cache is used as usual) but makes `eos` the argmax everywhere."""

    def __init__(self, inner: DecoderModel, eos: int) -> None:
        super().__init__()
        self.inner, self.eos, self.config = inner, eos, inner.config

    def forward(self, input_ids, positions, cache=None, **kwargs) -> ForwardOutput:
        out = self.inner(input_ids, positions, cache, **kwargs)
        if out.logits is not None:
            out.logits[..., self.eos] = out.logits.max() + 10.0
        return out


def test_stop_on_eos_at_the_first_step(make_tiny_model):
    eos = 7
    engine = Engine(_EOSFirst(make_tiny_model("llama"), eos))
    prompt = [1, 2, 3, 4]
    assert generate_greedy_cached(engine, prompt, max_new_tokens=20, stop_ids=[eos]) == prompt + [eos]
    assert generate_greedy_full(engine, prompt, max_new_tokens=20, stop_ids=[eos]) == prompt + [eos]
    result = engine.generate(engine.new_cache(capacity=32), torch.tensor([prompt]),
                             GenerateRequest(20, stop_ids=(eos,)))
    assert result.finish_reason is FinishReason.STOP and result.token_ids == [[eos]]
    # Without the stop id, generation runs to the cap.
    assert len(generate_greedy_cached(engine, prompt, max_new_tokens=5)) == len(prompt) + 5


def test_hard_cap_and_result_fields(make_tiny_model):
    engine = Engine(make_tiny_model("gemma3"))
    cache = engine.new_cache(capacity=15)
    result = engine.generate(cache, torch.tensor([[1, 2, 3, 4, 5]]), GenerateRequest(10))
    assert result.finish_reason is FinishReason.LENGTH and len(result.token_ids[0]) == 10
    assert result.prefill_tokens == 5 and result.decode_tokens == 10
    assert cache.length == 5 + 9  # the last sampled token is not fed back
    with pytest.raises(GenerationError, match="exceeds the context capacity"):
        engine.generate(engine.new_cache(capacity=15), torch.tensor([[1, 2, 3, 4, 5]]), GenerateRequest(11))


def test_validation_errors(make_tiny_model):
    model = make_tiny_model("llama")
    engine = Engine(model)
    one = torch.tensor([[1, 2, 3]])

    with pytest.raises(GenerationError, match="batch size mismatch"):
        engine.prefill(engine.new_cache(batch=1, capacity=16), torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(GenerationError, match="batch size mismatch"):
        engine.decode_step(engine.new_cache(batch=2, capacity=16), torch.tensor([[1]]))

    cache = engine.new_cache(capacity=16)
    engine.prefill(cache, one)
    with pytest.raises(GenerationError, match="cache must be empty before prefill, holds 3"):
        engine.prefill(cache, one, require_empty=True)

    with pytest.raises(GenerationError, match="prompt length 9 exceeds the cache capacity 8"):
        engine.prefill(engine.new_cache(capacity=8), torch.arange(9)[None])

    full = engine.new_cache(capacity=4)
    engine.prefill(full, torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(GenerationError, match="cache overflow: t=4 must be < capacity=4"):
        engine.decode_step(full, torch.tensor([[5]]))
    with pytest.raises(GenerationError, match=r"requires exactly \(B, 1\)"):
        engine.decode_step(engine.new_cache(capacity=8), torch.tensor([[1, 2]]))

    wrong_dtype = make_cache(model.config, capacity=16, dtype=torch.bfloat16)
    with pytest.raises(CacheError, match="dtype mismatch") as info:
        engine.prefill(wrong_dtype, one)
    assert isinstance(info.value, ValueError)

    for bad in (0, -1):
        with pytest.raises(GenerationError, match="max_new_tokens must be >= 1"):
            engine.stream(engine.new_cache(capacity=16), one, GenerateRequest(bad))
        with pytest.raises(GenerationError, match="max_new_tokens must be >= 1"):
            generate_greedy_cached(engine, [1, 2], max_new_tokens=bad)
        with pytest.raises(GenerationError, match="max_new_tokens must be >= 1"):
            generate_greedy_full(engine, [1, 2], max_new_tokens=bad)

    limit = model.config.max_position_embeddings
    with pytest.raises(GenerationError, match=f"prompt length {limit + 1} exceeds T_max {limit}"):
        generate_greedy_cached(engine, [1] * (limit + 1), max_new_tokens=1)
    with pytest.raises(GenerationError, match="exceeds T_max"):
        generate_greedy_full(engine, [1] * limit, max_new_tokens=1)
    with pytest.raises(GenerationError, match="at least one token"):
        generate_greedy_cached(engine, [], max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"must be in \[0, 97\)"):
        engine.prefill(engine.new_cache(capacity=8), torch.tensor([[97]]))
    with pytest.raises(GenerationError, match="prefill needs at least one token"):
        engine.prefill(engine.new_cache(capacity=8), torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(GenerationError, match="prefill_chunk must be >= 1"):
        Engine(model, prefill_chunk=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_runs_in_bf16_and_fp32(make_tiny_model, family, dtype):
    engine = Engine(make_tiny_model(family, dtype=dtype))
    assert engine.dtype == dtype
    cache = engine.new_cache(capacity=48)
    assert cache.dtype == dtype
    out = engine.prefill(cache, torch.tensor([_prompt(20, engine.config.vocab_size)]))
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()
    result = engine.generate(cache, torch.tensor([[1]]), GenerateRequest(16, sampling=SamplingParams(0.8, seed=1)))
    assert len(result.token_ids[0]) == 16


def test_bf16_tracks_fp32(make_tiny_model):
    """bf16 is an approximation of the same model, not a different one."""
    ids = torch.tensor([_prompt(24, 97)])
    with torch.inference_mode():
        a = make_tiny_model("llama")(ids, torch.arange(24), None, logits=Logits.ALL).logits
        b = make_tiny_model("llama", dtype=torch.bfloat16)(ids, torch.arange(24), None, logits=Logits.ALL).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert (a - b).abs().max() < 0.25 * a.abs().max()


def test_batched_generation_rows_match_single_rows(make_tiny_model):
    engine = Engine(make_tiny_model("gemma3"))
    prompts = torch.tensor([_prompt(10, 101, s) for s in (1, 2, 3)])
    batched = engine.generate(engine.new_cache(batch=3, capacity=40), prompts, GenerateRequest(20)).token_ids
    for b in range(3):
        single = generate_greedy_cached(engine, prompts[b].tolist(), max_new_tokens=20)[10:]
        assert batched[b] == single


def _storage(cache) -> list[tuple[int, int]]:
    """Where every growing layer's K/V live (data pointers) and how many positions they hold room for."""
    return [(layer.k.data_ptr(), layer.v.data_ptr(), layer.allocated) for layer in cache if hasattr(layer, "allocated")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("speculative", [False, True])
def test_decode_steps_allocate_nothing_in_the_cache(make_tiny_model, family, speculative):
    """A generation that crosses the full layers' initial 256-position storage: the room for prompt +
    max_new_tokens is made before the prefill, so no decode step reallocates or copies K/V (the storage
    pointers and sizes stay as they were after the first step), and nbytes counts the reservation."""
    from kakeya_runtime.engine.drafts import HistoryLookup
    from kakeya_runtime.engine.speculative import SpeculativeStream

    engine = Engine(make_tiny_model(family, max_position_embeddings=1024), prefill_chunk=64)
    cache = engine.new_cache(capacity=1024)
    before = _storage(cache)
    assert before and all(n == 256 for _, _, n in before)  # the initial storage (doubling beyond it)
    prompt = torch.tensor([_prompt(250, engine.config.vocab_size)])
    request = GenerateRequest(max_new_tokens=40, stop_ids=())
    if speculative:
        stream = SpeculativeStream(engine, cache, prompt, request, HistoryLookup(), prompt[0].tolist(), 4)
    else:
        stream = engine.stream(cache, prompt, request)
    seen = []
    for _ in stream:
        seen.append((_storage(cache), cache.length))
    assert stream.result.decode_tokens == 40
    assert cache.length > 256  # the decode steps wrote past the initial storage...
    first = seen[0][0]
    assert all(s == first for s, _ in seen)  # ...into room that was there before the first decode step
    assert first != before and all(n >= 250 + 40 for _, _, n in first)
    kv_bytes = sum(layer.k.nbytes + layer.v.nbytes for layer in cache)
    assert cache.nbytes == kv_bytes  # the reserved room is counted


def test_reserve_is_clamped_and_keeps_contents(make_tiny_model):
    """reserve() past the capacity stops at it; growing keeps what was written; rings are left alone."""
    engine = Engine(make_tiny_model("gemma3", max_position_embeddings=1024), prefill_chunk=64)
    cache = engine.new_cache(capacity=600)
    engine.prefill(cache, torch.tensor([_prompt(100, engine.config.vocab_size)]))
    full = [layer for layer in cache if hasattr(layer, "allocated")]
    rings = [layer for layer in cache if not hasattr(layer, "allocated")]
    assert full and rings
    keys = [layer.k[:, :, :100].clone() for layer in full]
    ring_ptrs = [layer.k.data_ptr() for layer in rings]
    cache.reserve(5000)
    assert all(layer.allocated == 600 for layer in full)
    assert all(torch.equal(layer.k[:, :, :100], k) for layer, k in zip(full, keys, strict=True))
    assert [layer.k.data_ptr() for layer in rings] == ring_ptrs
