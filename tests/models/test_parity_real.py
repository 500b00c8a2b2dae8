"""Logit parity with transformers on the same GGUF files, fp32, ~700 tokens of English.

transformers (a test-only dependency) dequantises the GGUF itself and runs its own Llama / Gemma 3 code in
eager fp32 attention, so it checks everything we do: tensor names, Q/K un-permutation, Gemma's norm
offsets and config defaults, RoPE, GQA, the sliding window (the text is longer than Gemma's 512-token
window), embedding scale and the tied head.

Bounds, from measured numbers (fp32 cache, 1 or 2 CPU threads alike): max |logit difference| 8.7e-5 (SmolLM2) and
2.1e-4 (Gemma 3), KL(ref || ours) at most 7e-7 per position. The nearest real error, rounding the weights
to bf16, moves logits by 0.21 / 1.28 with a mean KL of 5e-5 / 2.6e-4. So max-abs <= 2e-3 and KL <= 1e-5
sit ~10x above summation-order noise and ~100x below any genuine numerical mistake.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kakeya_runtime.models.base import Logits

MAX_ABS = 2e-3
MAX_KL = 1e-5

pytestmark = pytest.mark.real_model


def _transformers_logits(loaded, ids: torch.Tensor, parsed_once) -> torch.Tensor:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = loaded.source
    with parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    assert next(model.parameters()).dtype == torch.float32
    with torch.inference_mode():
        logits = model(ids).logits[0].float()  # (T, V)
    del model
    return logits


@torch.inference_mode()
def _check(loaded, text: str, min_tokens: int, parsed_once) -> dict[str, float]:
    ids = torch.tensor([loaded.tokenizer.encode(text).ids])  # Gemma: <bos> first, as the model expects
    assert ids.shape[1] >= min_tokens
    ours = loaded.model(ids, torch.arange(ids.shape[1]), None, logits=Logits.ALL).logits[0]  # (T, V)
    ref = _transformers_logits(loaded, ids, parsed_once)
    assert ours.shape == ref.shape
    log_ours, log_ref = F.log_softmax(ours, -1), F.log_softmax(ref, -1)
    kl = (log_ref.exp() * (log_ref - log_ours)).sum(-1)  # (T,)
    stats = {"tokens": ids.shape[1], "max_abs": (ours - ref).abs().max().item(), "kl_max": kl.max().item(),
             "kl_mean": kl.mean().item()}
    print(f"\n{loaded.name}: {stats}")
    disagree = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert disagree == [], f"top-1 differs at positions {disagree}"
    assert stats["max_abs"] <= MAX_ABS, stats
    assert stats["kl_max"] <= MAX_KL, stats
    return stats


def test_smollm2_matches_transformers(smollm2_fp32, english_text, gguf_parsed_once):
    _check(smollm2_fp32, english_text, min_tokens=300, parsed_once=gguf_parsed_once)


def test_gemma3_matches_transformers(gemma3_fp32, english_text, gguf_parsed_once):
    _check(gemma3_fp32, english_text, min_tokens=600, parsed_once=gguf_parsed_once)  # > the 512-token sliding window
