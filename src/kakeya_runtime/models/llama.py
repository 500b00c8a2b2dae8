"""Llama family (SmolLM2; Qwen2 q/k/v biases and Mistral sliding windows through config flags)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.models.layers import Attention, GatedMLP, LayerKV, Linear, RMSNorm, Rotary


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            bias=config.attention_bias,
            scale=config.head_dim**-0.5,
            window=config.layer_window(layer_idx),
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)

    def forward(self, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV | None,
                trace: bool) -> tuple[Tensor, Tensor | None]:
        a, row = self.self_attn(self.input_layernorm(h), positions, cos, sin, cache, trace)
        h, normed = self.post_attention_layernorm.add_forward(a, h)  # h + a, and its norm
        return h + self.mlp(normed), row


class LlamaModel(DecoderModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self._register_load_state_dict_pre_hook(_strip_hf_prefix)

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> dict:
        cos, sin = self.rotary.cos_sin(positions, dtype)
        return {"cos": cos, "sin": sin}

    def layer_forward(self, layer_idx, h, positions, rope, cache, trace):
        return self.layers[layer_idx](h, positions, rope["cos"], rope["sin"], cache, trace)

    def layer_rope(self, layer_idx, rope):
        return rope["cos"], rope["sin"]


def _strip_hf_prefix(state_dict, prefix, *args, **kwargs):
    """HF checkpoints name the trunk `model.*`; we keep the trunk at top level."""
    for key in [k for k in state_dict if k.startswith(prefix + "model.")]:
        state_dict[prefix + key[len(prefix) + len("model."):]] = state_dict.pop(key)
