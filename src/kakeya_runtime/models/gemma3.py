"""Gemma 3 text: sliding/global layer pattern, two RoPE bases, q/k norms, scaled embeddings, sandwich norms."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import SLIDING_ATTENTION, ModelConfig
from kakeya_runtime.models.layers import Attention, GatedMLP, LayerKV, Linear, RMSNorm, Rotary
from kakeya_runtime.models.llama import _strip_hf_prefix


class Gemma3Block(nn.Module):
    sandwich_norms = True  # norms after attention and MLP too (models.native_layer reads it)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = config.layer_type(layer_idx) == SLIDING_ATTENTION
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            bias=config.attention_bias,
            scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
            window=config.layer_window(layer_idx),
            qk_norm_eps=eps,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=True)

    def forward(self, h: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: LayerKV | None,
                trace: bool) -> tuple[Tensor, Tensor | None]:
        a, row = self.self_attn(self.input_layernorm(h), positions, cos, sin, cache, trace)
        h, normed = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(a), h)
        m = self.mlp(normed)
        return h + self.post_feedforward_layernorm(m), row


class Gemma3Model(DecoderModel):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.rotary_global = Rotary(config.head_dim, config.rope_theta)
        self.rotary_local = Rotary(config.head_dim, config.rope_local_base_freq or 10000.0)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self._register_load_state_dict_pre_hook(_strip_hf_prefix)

    def embed(self, input_ids: Tensor) -> Tensor:
        h = self.embed_tokens(input_ids)
        # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype as the reference does.
        return h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> dict:
        return {
            "global": self.rotary_global.cos_sin(positions, dtype),
            "local": self.rotary_local.cos_sin(positions, dtype),
        }

    def layer_forward(self, layer_idx, h, positions, rope, cache, trace):
        block = self.layers[layer_idx]
        cos, sin = rope["local" if block.sliding else "global"]
        return block(h, positions, cos, sin, cache, trace)

    def layer_rope(self, layer_idx, rope):
        return rope["local" if self.layers[layer_idx].sliding else "global"]
