"""The engine on the real bundled models: cached greedy == recomputed greedy, bf16 runs, a real answer."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import (
    Engine,
    GenerateRequest,
    generate_greedy_cached,
    generate_greedy_full,
)

pytestmark = pytest.mark.real_model

NEW_TOKENS = 32


@pytest.mark.parametrize("fixture, prompt", [
    ("smollm2_fp32", "The three most important inventions of the nineteenth century were"),
    ("gemma3_fp32", "The three most important inventions of the nineteenth century were"),
])
def test_greedy_cached_equals_full_recompute_real(request, fixture, prompt):
    """fp32, 32 new tokens, stops disabled so EOS cannot end it early: token-for-token equal."""
    loaded = request.getfixturevalue(fixture)
    engine = Engine(loaded.model)
    ids = loaded.tokenizer.encode(prompt).ids
    cached = generate_greedy_cached(engine, ids, max_new_tokens=NEW_TOKENS)
    full = generate_greedy_full(engine, ids, max_new_tokens=NEW_TOKENS)
    assert len(cached) == len(ids) + NEW_TOKENS
    assert cached == full, loaded.tokenizer.decode(cached[len(ids):])


def _chatml(loaded, question: str) -> list[int]:
    """The client's job: render the model's own chat template (data from LoadedModel) with jinja2."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(loaded.chat_template).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    return loaded.tokenizer.encode(text, add_special_tokens=False).ids


def test_smollm2_knows_the_capital_of_france(smollm2_bf16):
    loaded = smollm2_bf16
    engine = Engine(loaded.model)
    ids = _chatml(loaded, "Name the capital city of France.")
    result = engine.generate(engine.new_cache(capacity=len(ids) + 48), torch.tensor([ids]),
                             GenerateRequest(48, stop_ids=loaded.eos_ids))
    answer = loaded.tokenizer.decode(result.token_ids[0])
    assert "Paris" in answer, answer


@pytest.mark.parametrize("fixture", ["smollm2_bf16", "gemma3_bf16"])
def test_bf16_generation_and_tracing(request, fixture):
    loaded = request.getfixturevalue(fixture)
    engine = Engine(loaded.model)
    ids = torch.tensor([loaded.tokenizer.encode("Once upon a time, in a small village by the sea,").ids])
    cfg = loaded.config
    layer = cfg.num_hidden_layers - 1
    stream = engine.stream(engine.new_cache(capacity=ids.shape[1] + 8), ids, GenerateRequest(8, trace_layer=layer))
    tokens = [step[0] for step in stream]
    assert len(tokens) == 8 and engine.dtype == torch.bfloat16
    assert all(0 <= t < cfg.vocab_size for t in tokens)
    for i, row in enumerate(stream.attn_rows):
        assert row.shape == (1, cfg.num_attention_heads, ids.shape[1] + i)
        assert torch.isfinite(row).all() and ((row >= 0) & (row <= 1)).all()
        torch.testing.assert_close(row.sum(-1), torch.ones(1, cfg.num_attention_heads), atol=1e-4, rtol=0)
    text = loaded.tokenizer.decode(tokens)
    assert text.strip(), "bf16 generation produced no text"
