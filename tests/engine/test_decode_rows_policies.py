"""Engine.decode_rows across KV policies: a batched decode step gives every row the logits (and the cache state)
its own decode_step gives it alone, step after step, whatever policy and length the other rows have."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.sessions.policy import PolicyRegistry

POLICIES = [
    ("full", {}),
    ("sink_window", {"sink": 4, "window": 16}),
    ("sink_window", {"sink": 4, "window": 16, "codec": "d4"}),  # packed lattice resident codec
    ("restore", {"sink": 4, "window": 16, "granularity": "per_step"}),
    ("restore", {"sink": 4, "window": 16, "granularity": "per_turn", "codec": "e8"}),
    ("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2}),
]
LENGTHS = [40, 7, 90, 33, 64, 21]
STEPS = 6


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_rows_equal_decode_step_alone_across_policies(family, make_tiny_model):
    engine = Engine(make_tiny_model(family), prefill_chunk=32)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(11)
    vocab = engine.config.vocab_size
    histories = [torch.randint(3, vocab, (1, n), generator=gen) for n in LENGTHS]

    def caches():
        out = []
        for (name, params), h in zip(POLICIES, histories, strict=True):
            spec = registry.resolve(name, params, engine.config, 256)
            c = registry.build(engine, spec, 256)
            engine.prefill(c, h)
            out.append(c)
        return out

    alone, batched = caches(), caches()
    tokens = [int(h[0, -1]) for h in histories]
    for step in range(STEPS):
        logits = engine.decode_rows(batched, tokens)
        for i, c in enumerate(alone):
            ref = engine.decode_step(c, torch.tensor([[tokens[i]]])).logits[0, -1]
            assert torch.equal(logits[i], ref), (POLICIES[i], step)
            assert batched[i].layer_lengths() == c.layer_lengths()
        tokens = [int(x) for x in logits.argmax(dim=-1)]
    for a, b in zip(alone, batched, strict=True):
        a.end_turn()
        b.end_turn()
    # a subset in another order: still each row's own result
    order = [4, 0, 2]
    logits = engine.decode_rows([batched[i] for i in order], [tokens[i] for i in order])
    for j, i in enumerate(order):
        ref = engine.decode_step(alone[i], torch.tensor([[tokens[i]]])).logits[0, -1]
        assert torch.equal(logits[j], ref), POLICIES[i]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("chunked", range(len(POLICIES)))
def test_prefill_chunk_fused_into_decode_rows_is_bit_identical(family, chunked, make_tiny_model):
    """A prompt prefilled chunk by chunk inside the decode forward of other rows (Engine.step_rows) leaves its
    cache as the same chunks prefilled alone do (the last logits and every decode step after are equal), and the decode rows
    still get their decode_step-alone logits."""
    engine = Engine(make_tiny_model(family), prefill_chunk=32)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(5 + chunked)
    vocab = engine.config.vocab_size
    histories = [torch.randint(3, vocab, (1, n), generator=gen) for n in LENGTHS]
    prompt = torch.randint(3, vocab, (1, 45), generator=gen)

    def build(i):
        spec = registry.resolve(*POLICIES[i], engine.config, 256)
        return registry.build(engine, spec, 256)

    def decoders():
        out = [build(i) for i in range(len(POLICIES)) if i != chunked]
        for c, h in zip(out, [h for i, h in enumerate(histories) if i != chunked], strict=True):
            engine.prefill(c, h)
        return out

    alone, batched = decoders(), decoders()
    solo, fused = build(chunked), build(chunked)
    engine.prefill(solo, histories[chunked])
    engine.prefill(fused, histories[chunked])
    for c0 in range(0, prompt.shape[1], 13):  # the same chunks alone (a lossy resident codec sees the cut)
        ref_last = engine.prefill(solo, prompt[:, c0 : c0 + 13]).logits[0, -1]
    tokens = [int(h[0, -1]) for i, h in enumerate(histories) if i != chunked]
    got_last = None
    for c0 in range(0, prompt.shape[1], 13):  # 13, 13, 13, 6 tokens: the last chunk carries the logits
        logits, got_last = engine.step_rows(batched, tokens, fused, prompt[:, c0 : c0 + 13])
        for i, c in enumerate(alone):
            ref = engine.decode_step(c, torch.tensor([[tokens[i]]])).logits[0, -1]
            assert torch.equal(logits[i], ref), (POLICIES[i], c0)
        tokens = [int(x) for x in logits.argmax(dim=-1)]
    assert got_last is not None and torch.equal(got_last[0], ref_last)
    assert fused.layer_lengths() == solo.layer_lengths()
    token = int(ref_last.argmax())
    for _ in range(3):  # the K/V the fused chunks wrote: the decode steps after read them
        a = engine.decode_step(solo, torch.tensor([[token]])).logits[0, -1]
        b = engine.decode_step(fused, torch.tensor([[token]])).logits[0, -1]
        assert torch.equal(a, b)
        token = int(a.argmax())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("decoders", [0, 3])
def test_several_prompts_in_one_step_equal_each_prefilled_alone(family, decoders, make_tiny_model):
    """Engine.step_chunks: several sequences' prompts (every policy, over caches of other lengths) read in ONE forward,
    beside decode rows or none, each get the last logits and leave the cache their own prefill does (the decode steps
    after agree bit for bit), and the decode rows still get their decode_step-alone logits."""
    engine = Engine(make_tiny_model(family), prefill_chunk=64)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(11 + decoders)
    vocab = engine.config.vocab_size

    def build(i):
        spec = registry.resolve(*POLICIES[i], engine.config, 256)
        return registry.build(engine, spec, 256)

    histories = [torch.randint(3, vocab, (1, n), generator=gen) for n in LENGTHS]
    prompts = [torch.randint(3, vocab, (1, n), generator=gen) for n in (9, 1, 30, 17, 5, 22)]
    pairs = []
    for i in range(len(POLICIES)):
        solo, fused = build(i), build(i)
        engine.prefill(solo, histories[i])
        engine.prefill(fused, histories[i])
        pairs.append((solo, fused))
    alone, batched = [], []
    for i in range(decoders):
        a, b = build(0), build(0)
        engine.prefill(a, histories[i][:, :20])
        engine.prefill(b, histories[i][:, :20])
        alone.append(a), batched.append(b)
    tokens = [int(h[0, 0]) for h in histories[:decoders]]
    logits, lasts = engine.step_chunks(batched, tokens, [(f, p) for (_, f), p in zip(pairs, prompts, strict=True)])
    assert len(lasts) == len(prompts)
    for i, c in enumerate(alone):
        assert torch.equal(logits[i], engine.decode_step(c, torch.tensor([[tokens[i]]])).logits[0, -1])
    for (solo, fused), prompt, last in zip(pairs, prompts, lasts, strict=True):
        ref = engine.prefill(solo, prompt).logits[0, -1]
        assert torch.equal(last[0], ref)
        assert fused.layer_lengths() == solo.layer_lengths()
        token = int(ref.argmax())
        for _ in range(2):
            a = engine.decode_step(solo, torch.tensor([[token]])).logits[0, -1]
            assert torch.equal(engine.decode_step(fused, torch.tensor([[token]])).logits[0, -1], a)
            token = int(a.argmax())
