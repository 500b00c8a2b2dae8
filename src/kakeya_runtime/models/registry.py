"""model_type -> model class. One file per family; new families register here."""

from __future__ import annotations

from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.models.gemma3 import Gemma3Model
from kakeya_runtime.models.llama import LlamaModel

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "mistral": LlamaModel,
    "gemma3_text": Gemma3Model,
    "gemma3": Gemma3Model,
}


class UnsupportedModelError(ValueError):
    pass


def model_class(config: ModelConfig) -> type[DecoderModel]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} is not supported (supported: {sorted(MODEL_CLASSES)})"
        ) from None


def build_model(config: ModelConfig) -> DecoderModel:
    return model_class(config)(config)
