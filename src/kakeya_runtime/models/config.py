"""Model configuration: one dataclass for every supported family, read from HF-style config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ConfigError(ValueError):
    """A config.json that is missing fields or describes an unsupported model."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str  # registry key: "llama", "qwen2", "mistral", "gemma3_text"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts biases on q/k/v
    mlp_bias: bool = False
    hidden_act: str = "silu"  # Gemma: "gelu_pytorch_tanh"
    # Per-layer attention kind; sliding layers only see the last `sliding_window` positions.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None  # Gemma 3: RoPE base of the sliding layers
    query_pre_attn_scalar: float | None = None  # Gemma 3: softmax scale is this ** -0.5
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers":
                 self.num_hidden_layers, "num_attention_heads": self.num_attention_heads, "num_key_value_heads":
                 self.num_key_value_heads, "head_dim": self.head_dim, "max_position_embeddings":
                 self.max_position_embeddings}
        bad_sizes = [f"{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
        if bad_sizes:
            raise ConfigError(f"sizes must be positive integers: {', '.join(bad_sizes)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = {t for t in self.layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding layers need a sliding_window")

    def layer_type(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else FULL_ATTENTION

    def layer_window(self, layer_idx: int) -> int | None:
        """Number of most recent positions a layer may attend to (None: all)."""
        return self.sliding_window if self.layer_type(layer_idx) == SLIDING_ATTENTION else None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (the fields we use; others go to `extra`); ConfigError for
        anything it cannot serve as written (never a config read some other way than the checkpoint means)."""
        if not isinstance(raw, dict):
            raise ConfigError("config.json is not a JSON object")
        try:
            return cls._from_hf(raw)
        except ConfigError:
            raise
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:  # "nine" heads, null, 0
            raise ConfigError(f"config.json has a value of the wrong kind ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError("config has no model_type")
        needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in needed if k not in raw]
        if missing:
            raise ConfigError(f"config for {model_type!r} lacks {missing}")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta = raw.get("rope_theta")
        rope_params = raw.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = (rope_params.get("full_attention") or rope_params).get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
        kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default", "none"):  # llama3 / linear / yarn ...: other frequencies than ours
            raise ConfigError(f"RoPE scaling ({kind}) is not supported")
        layer_types = tuple(raw.get("layer_types") or ())
        sliding_window = raw.get("sliding_window")
        if model_type in ("gemma3", "gemma3_text") and not layer_types:
            # Older Gemma 3 configs say it by a pattern: every `pattern`-th layer global, the others sliding
            pattern = raw.get("sliding_window_pattern")
            if not pattern:
                raise ConfigError("a Gemma 3 config needs layer_types or sliding_window_pattern (which layers slide)")
            layer_types = tuple(FULL_ATTENTION if (i + 1) % int(pattern) == 0 else SLIDING_ATTENTION
                                for i in range(int(raw["num_hidden_layers"])))
        if model_type in ("llama", "qwen2", "mistral") and not layer_types and sliding_window:
            # Mistral-style: every layer slides.
            layer_types = (SLIDING_ATTENTION,) * int(raw["num_hidden_layers"])
        if not any(t == SLIDING_ATTENTION for t in layer_types):
            sliding_window = None
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
            layer_types=layer_types,
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_local_base_freq=_opt_float(
                raw.get("rope_local_base_freq", (rope_params.get("sliding_attention") or {}).get("rope_theta"))
            ),
            query_pre_attn_scalar=_opt_float(raw.get("query_pre_attn_scalar")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json form (round-trips through from_hf)."""
        out = asdict(self)
        extra = out.pop("extra")
        eos = out.pop("eos_token_ids")
        out["eos_token_id"] = list(eos)
        out["layer_types"] = list(self.layer_types)
        return {**extra, **out}

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_hf(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)
