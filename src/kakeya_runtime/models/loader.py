"""Load a model for the runtime: a bundled name, a GGUF file, or a Hugging Face-style directory.

A GGUF is converted once into a Hugging Face-style directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json with the EOS
ids) under the user cache dir; later loads read that directory, which takes about a second instead of
the ~10-25 s that reading, dequantising and rebuilding the tokenizer of a GGUF costs. The cache entry is
keyed by the GGUF's path, size and mtime, so a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch.overrides import TorchFunctionMode

from kakeya_runtime.models import bundled
from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigError, ModelConfig
from kakeya_runtime.models.registry import UnsupportedModelError, model_class
from kakeya_runtime.models.tokenizer import (
    TOKEN_CONTROL,
    TokenizerBuildError,
    build_tokenizer,
    tokenizer_to_json,
)

if TYPE_CHECKING:
    from gguf import GGUFReader

# Bump when the conversion's output changes, so old cache entries are not reused.
CONVERTER_VERSION = 2
# Dequantised GGUF weights are d * q + m with fp16 scales: exact in fp32, not in bf16 (8-bit mantissa).
# Measured with fp32 compute over ~470 tokens of English against transformers on the same GGUF
# (tests/models/test_parity_real.py; ~600 tokens there give the same fp32 numbers):
#   fp32 cache:            max |dlogit| 8.7e-5 (SmolLM2) / 2.1e-4 (Gemma 3), top-1 agrees everywhere;
#   bf16 cache, upcast:    max |dlogit| 0.21 / 1.28, 3 top-1 flips each, KL mean 5e-5 / 2.6e-4.
# So the cache keeps the exact fp32 values (540 MB / 1.07 GB). A bf16 (or fp16) load uses a rounded copy
# written beside it on the first such load, so later loads do not pay a cast of every weight.
STORAGE_DTYPE = torch.float32
CACHE_ENV = "KAKEYA_CACHE_DIR"
SUPPORTED_GGUF_ARCHS = ("llama", "gemma3")
# Tokens llama.cpp also treats as end-of-generation when the file names a different EOS (chat turns end).
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|eom_id|>")


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and what is wrong with it."""


@dataclass(slots=True)
class LoadedModel:
    model: DecoderModel  # eval mode, parameters in `dtype`, requires_grad off
    config: ModelConfig
    tokenizer_json: str  # tokenizer.json text, shipped to clients so they can tokenize/render locally
    chat_template: str | None  # Jinja source as the model ships it; data only, never rendered by the runtime
    eos_ids: tuple[int, ...]  # every id that ends generation (first: the file's EOS)
    bos_id: int | None
    source: Path  # what was asked for: the GGUF file or the model directory
    weights_dir: Path  # the safetensors directory actually read (the conversion cache for a GGUF)
    dtype: torch.dtype
    load_s: float  # wall time of this load_model call (the tokenizer is parsed later, on first use)
    _tokenizer: Tokenizer | None = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """Parsed on first use: the server only ships tokenizer_json to clients and never needs it, and
        parsing Gemma's (262k tokens, 515k merges) takes ~1 s."""
        if self._tokenizer is None:
            self._tokenizer = parse_tokenizer_json(self.tokenizer_json, self.weights_dir / "tokenizer.json")
        return self._tokenizer

    @property
    def name(self) -> str:
        return self.source.stem if self.source.is_file() else self.source.name


def parse_tokenizer_json(text: str, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ModelLoadError(f"{path}: invalid tokenizer.json ({e})") from None


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Argument, else $KAKEYA_CACHE_DIR, else the platform's user cache dir for "kakeya"."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kakeya"))


def load_model(source: str | Path = bundled.DEFAULT_MODEL, *, dtype: torch.dtype = torch.bfloat16,
               cache_dir: str | Path | None = None) -> LoadedModel:
    """Load `source` (bundled name, .gguf file, or HF-style directory) with parameters in `dtype`."""
    t0 = time.perf_counter()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {dtype} (use torch.float32, torch.bfloat16 or torch.float16)")
    root = cache_root(cache_dir)
    path = resolve_source(source, root)
    if path.is_dir():
        loaded = load_hf_dir(path, dtype=dtype)
    elif _is_gguf(path):
        converted = convert_gguf_cached(path, root)
        loaded = load_hf_dir(converted, dtype=dtype, weight_files=[_cached_weights(converted, dtype)])
    else:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model directory")
    loaded.source = path
    loaded.load_s = time.perf_counter() - t0
    return loaded


def declared_context(source: str | Path, cache_dir: str | Path | None = None) -> int | None:
    """The positions `source` says it has (a model directory's config.json, a GGUF's cached conversion, else the
    GGUF's header), read without loading weights; None when it cannot be read (the load then checks)."""
    try:
        root = cache_root(cache_dir)
        path = resolve_source(source, root)
        if not path.is_dir():
            converted = _converted_dir(path, root, path.stat())[0]
            if not (converted / "kakeya.json").is_file():
                return gguf_context_length(path)
            path = converted
        raw = json.loads((path / "config.json").read_text())
        return int(raw.get("max_position_embeddings", 2048)) if isinstance(raw, dict) else None
    except Exception:  # any unreadable source: the real load reports it properly
        return None


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_context_length(path: Path) -> int | None:
    """`<architecture>.context_length` read from a GGUF header as a stream, stopping once found (the tokenizer's
    arrays usually come after it), without the reader's parse of the whole header; None where it is absent."""
    def read(fmt: str):
        raw = f.read(struct.calcsize(fmt))
        if len(raw) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, raw)[0]

    def string() -> bytes:
        return f.read(read("<Q"))

    def skip(kind: int, count: int = 1) -> None:
        if kind == _GGUF_STRING:
            for _ in range(count):
                f.seek(read("<Q"), os.SEEK_CUR)
        elif kind in _GGUF_SCALARS:
            f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
        else:
            raise ValueError(f"GGUF value type {kind} inside an array")

    with path.open("rb") as f:
        if f.read(4) != b"GGUF" or read("<I") < 2:
            return None
        read("<Q")  # tensors
        arch = None
        for _ in range(min(read("<Q"), 1 << 16)):
            key, kind = string().decode("utf-8", "replace"), read("<I")
            if kind == _GGUF_STRING and key == "general.architecture":
                arch = string().decode("utf-8", "replace")
            elif kind in _GGUF_SCALARS and arch is not None and key == f"{arch}.context_length":
                return int(read("<" + _GGUF_SCALARS[kind]))
            elif kind == _GGUF_ARRAY:
                inner = read("<I")
                skip(inner, read("<Q"))
            else:
                skip(kind)
    return None


def resolve_source(source: str | Path, cache_dir: Path) -> Path:
    """A bundled name becomes its GGUF path; anything else must be an existing file or directory."""
    if isinstance(source, str) and bundled.is_bundled(source):
        try:
            return bundled.bundled_gguf_path(source, cache_dir)
        except bundled.BundledModelError as e:
            raise ModelLoadError(str(e)) from None
    if not str(source).strip():
        raise ModelLoadError(f"no model given (bundled: {sorted(bundled.BUNDLED)}, or a .gguf file or a model "
                             "directory)")
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (and not a bundled model name; bundled: {sorted(bundled.BUNDLED)})"
        )
    return path.resolve()


# ----------------------------------------------------------------------------------------------
# GGUF -> cached safetensors directory


def _converted_dir(gguf_path: Path, cache_dir: Path, st: os.stat_result) -> tuple[Path, str]:
    """Where this exact GGUF file (as `st` says it is) has its conversion (complete once it holds kakeya.json), and
    its key."""
    key_src = f"{CONVERTER_VERSION}|{STORAGE_DTYPE}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    return cache_dir / "converted" / f"{gguf_path.stem}-{key}", key


def convert_gguf_cached(gguf_path: Path, cache_dir: Path) -> Path:
    """The converted directory for this GGUF, converting it first if this exact file has not been."""
    st = gguf_path.stat()
    target, key = _converted_dir(gguf_path, cache_dir, st)
    parent = target.parent
    if (target / "kakeya.json").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    # Write into a private temp dir, then rename: readers see a complete directory or none.
    tmp = parent / f".tmp-{gguf_path.stem}-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf_path, tmp)
        stamp = {"converter_version": CONVERTER_VERSION, "source": str(gguf_path.resolve()),
                 "size": st.st_size, "mtime_ns": st.st_mtime_ns, "storage_dtype": str(STORAGE_DTYPE)}
        (tmp / "kakeya.json").write_text(json.dumps(stamp, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "kakeya.json").is_file():  # not a concurrent converter that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale_conversions(parent, target, str(gguf_path.resolve()))
    return target


def _cached_weights(converted: Path, dtype: torch.dtype) -> Path:
    """The exact fp32 weights, or a copy rounded to `dtype` (made once, on the first load in that dtype)."""
    base = converted / "model.safetensors"
    if dtype == STORAGE_DTYPE:
        return base
    variant = converted / "variants" / f"{str(dtype).removeprefix('torch.')}.safetensors"
    if not variant.is_file():
        state = _read_safetensors([base], dtype)
        variant.parent.mkdir(exist_ok=True)
        tmp = variant.with_name(f".{variant.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            save_file(state, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, variant)
        except Exception:  # read-only or full cache dir (safetensors raises its own error type)
            tmp.unlink(missing_ok=True)
            return base  # cast on every load instead
    return variant


def _remove_stale_conversions(parent: Path, keep: Path, source: str) -> None:
    """Drop older conversions of the same source file (the file changed, or the converter did)."""
    for entry in parent.glob(f"{Path(source).stem}-*"):
        if entry == keep:
            continue
        try:
            if json.loads((entry / "kakeya.json").read_text()).get("source") == source:
                shutil.rmtree(entry, ignore_errors=True)
        except (OSError, ValueError):
            continue


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF into an HF-named safetensors directory (`out_dir` is created)."""
    reader = _open_gguf(gguf_path)
    meta = _read_metadata(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelLoadError(
            f"{gguf_path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _config_from_gguf(meta, arch, tensors, gguf_path)
    try:
        tokenizer = build_tokenizer(meta, source=str(gguf_path))
    except TokenizerBuildError as e:
        raise ModelLoadError(str(e)) from None
    state = _state_dict_from_gguf(tensors, arch, config, gguf_path)
    _check_state_dict(config, state, gguf_path)

    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (out_dir / "config.json").write_text(json.dumps({**config.to_hf(), "torch_dtype": "float32"}, indent=1))
    (out_dir / "tokenizer.json").write_text(tokenizer_to_json(tokenizer))
    tokens = meta["tokenizer.ggml.tokens"]
    tok_config = {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": None if config.bos_token_id is None else tokens[config.bos_token_id],
        "eos_token": tokens[config.eos_token_ids[0]] if config.eos_token_ids else None,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    gen_config = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=1))


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None


def _open_gguf(path: Path) -> GGUFReader:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader fails in many ways on damaged files (ValueError, IndexError ...)
        raise ModelLoadError(f"{path}: not a readable GGUF file: truncated or corrupt ({path.stat().st_size} "
                             f"bytes; the reader's error: {type(e).__name__}: {e})") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated or corrupt: tensor {t.name!r} has {t.data.nbytes} of its {t.n_bytes} bytes"
            )
    return reader


def _read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """GGUF key/values as Python values (strings decoded, arrays as lists)."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for key, entry in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            if entry.types and entry.types[0] == GGUFValueType.ARRAY:
                if entry.types[-1] == GGUFValueType.STRING:
                    meta[key] = [bytes(entry.parts[i]).decode("utf-8") for i in entry.data]
                else:
                    meta[key] = [v.item() for i in entry.data for v in entry.parts[i]]
            else:
                value = entry.contents()
                if entry.types[0] == GGUFValueType.FLOAT32:
                    # float32 metadata (eps 1e-5 reads back as 9.99999975e-06): keep the shortest decimal
                    # that rounds to the same float32, as the original config.json spelled it.
                    value = float(str(np.float32(value)))
                meta[key] = value.item() if isinstance(value, np.generic) else value
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt metadata field {key!r} ({e})") from None
    return meta


def _config_from_gguf(meta: Mapping[str, Any], arch: str, tensors: Mapping[str, Any], path: Path) -> ModelConfig:
    def get(key: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{path}: per-layer {arch}.{key} is not supported")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: RoPE scaling ({scaling or 'rope_freqs'}) is not supported")
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    if num_heads < 1 or int(get("attention.head_count_kv", num_heads)) < 1:
        raise ModelLoadError(f"{path}: attention head counts must be >= 1")
    head_dim = int(get("attention.key_length", hidden // num_heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: partial rotary (rope dim {rope_dim} < head dim {head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are (in, out)
    if len(tokens) > vocab_size:
        raise ModelLoadError(f"{path}: tokenizer has {len(tokens)} tokens, embedding only {vocab_size} rows")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = _eos_ids(meta, tokens)
    special = [("bos", bos), *(("eos", i) for i in eos_ids)]
    outside = [f"{what} {v}" for what, v in special if v is not None and not 0 <= int(v) < (len(tokens) or vocab_size)]
    if outside:
        raise ModelLoadError(f"{path}: special token ids outside the vocabulary: {', '.join(outside)}")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": eos_ids,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    try:
        if arch == "llama":
            return ModelConfig(model_type="llama", rope_theta=float(get("rope.freq_base", 10000.0)),
                               hidden_act="silu", **common)
        # Gemma 3: the GGUF omits what llama.cpp hard-codes for the family; these are HF's Gemma3TextConfig
        # values: every 6th layer global (5, 11, 17 ...), the rest sliding; sliding layers use RoPE base 1e4;
        # the softmax scale is query_pre_attn_scalar ** -0.5 with the scalar = head_dim (llama.cpp does the
        # same for every size but 27B, which this loader does not claim to support).
        layer_types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(num_layers))
        return ModelConfig(
            model_type="gemma3_text",
            rope_theta=float(get("rope.freq_base", 1_000_000.0)),
            hidden_act="gelu_pytorch_tanh",
            layer_types=layer_types,
            sliding_window=int(get("attention.sliding_window")),
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=float(head_dim),
            **common,
        )
    except ConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _eos_ids(meta: Mapping[str, Any], tokens: list[str]) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    types = meta.get("tokenizer.ggml.token_type") or []
    index = {t: i for i, t in enumerate(tokens[:1024]) if t in _EOG_TEXTS}  # control tokens sit up front
    for text in _EOG_TEXTS:
        i = index.get(text)
        if i is not None and i not in ids and i < len(types) and types[i] == TOKEN_CONTROL:
            ids.append(i)
    return tuple(ids)


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_name(gguf_name: str, arch: str) -> str | None:
    """GGUF tensor name -> Hugging Face parameter name (None: not a tensor we know)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] not in ("weight", "bias"):
        return None
    kind = parts[2]
    if kind == "ffn_norm":  # Llama: the norm before the MLP; Gemma 3 also has one after it
        name = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    else:
        name = _GGUF_LAYER_NAMES.get(kind)
        if name is None:
            return None
    return f"model.layers.{parts[1]}.{name}.{parts[3]}"


def _state_dict_from_gguf(tensors: Mapping[str, Any], arch: str, config: ModelConfig,
                          path: Path) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        target = hf_name(name, arch)
        if target is None:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} for architecture {arch!r}")
        try:
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if not w.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
                w = w.copy()
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot dequantise {name!r} ({t.tensor_type.name}): {e}") from None
        expected = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if w.shape != expected:
            raise ModelLoadError(f"{path}: tensor {name!r} dequantised to {w.shape}, expected {expected}")
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias")):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            w = _unpermute_rows(w, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's RMSNorm scale as 1 + w; our RMSNorm adds the 1 back
        state[target] = torch.from_numpy(w).to(STORAGE_DTYPE).contiguous()
    return state


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head it interleaves the two RoPE halves (GPT-J style
    rotation); HF's rotate-half RoPE wants them as [first half; second half]. (out, ...) rows."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_state_dict(config: ModelConfig, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Load into a meta-device model: catches missing, extra and mis-shaped tensors before caching."""
    with torch.device("meta"):
        model = model_class(config)(config)
    sd = {k: v.to("meta") for k, v in state.items()}
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: tensors do not fit a {config.model_type} model: {e}") from None


# ----------------------------------------------------------------------------------------------
# HF-style directory -> LoadedModel


def load_hf_dir(directory: Path, *, dtype: torch.dtype = torch.bfloat16,
                weight_files: list[Path] | None = None) -> LoadedModel:
    """Read config.json + *.safetensors (or `weight_files`) + tokenizer.json (+ tokenizer_config.json,
    generation_config.json)."""
    t0 = time.perf_counter()
    directory = Path(directory)
    try:
        config = ModelConfig.from_file(directory / "config.json")
        cls = model_class(config)
    except (ConfigError, UnsupportedModelError) as e:
        ggufs = sorted(p.name for p in directory.glob("*.gguf")) if directory.is_dir() else []
        hint = f" (to serve a GGUF file, pass its path: {directory / ggufs[0]})" if ggufs else ""
        raise ModelLoadError(f"{directory}: {e}{hint}") from None
    files = weight_files if weight_files is not None else sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files")
    state = _read_safetensors(files, dtype)
    # Tensors already in `dtype` are views of the file mapping: lazy, but 16-byte aligned and file-backed,
    # which made bf16 decode ~4x slower here. Parameters must own their memory; remember which to copy.
    mapped = {t.data_ptr() for t in state.values()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some checkpoints save the tied head too
    try:
        with _params_on_meta():
            model = cls(config)
    except ValueError as e:  # e.g. an activation our layers do not have
        raise ModelLoadError(f"{directory}: {e}") from None
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{directory}: weights do not fit a {config.model_type} model: {e}") from None
    for p in model.parameters():
        if p.data_ptr() in mapped:  # not already copied by a fusing load hook (q/k/v, gate/up)
            p.data = p.data.clone()
    del state
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:
        raise ModelLoadError(f"{directory}: no weights for {leftover[:5]}")
    model.eval().requires_grad_(False)

    tok_path = directory / "tokenizer.json"
    try:
        tokenizer_json = tok_path.read_text()
    except OSError as e:
        raise ModelLoadError(f"{tok_path}: cannot read tokenizer ({e})") from None
    if not tokenizer_json.lstrip().startswith("{"):
        raise ModelLoadError(f"{tok_path}: invalid tokenizer.json (not a JSON object)")
    tok_config = _read_json(directory / "tokenizer_config.json")
    gen_config = _read_json(directory / "generation_config.json")
    eos: list[int] = []
    gen_eos = gen_config.get("eos_token_id")
    for i in [*(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]),
              *config.eos_token_ids]:
        if int(i) not in eos:
            eos.append(int(i))
    bos = config.bos_token_id if config.bos_token_id is not None else gen_config.get("bos_token_id")
    outside = [f"{what} {i}" for what, ids in (("eos", eos), ("bos", [] if bos is None else [bos]))
               for i in ids if not 0 <= int(i) < config.vocab_size]
    if outside:  # an id no step can produce (generation would only end at max_tokens), or none to prepend
        raise ModelLoadError(f"{directory}: special token ids outside the vocabulary of {config.vocab_size}: "
                             f"{', '.join(outside)}")
    return LoadedModel(
        model=model, config=config, tokenizer_json=tokenizer_json,
        chat_template=_chat_template(directory, tok_config), eos_ids=tuple(eos),
        bos_id=None if bos is None else int(bos), source=directory, weights_dir=directory, dtype=dtype,
        load_s=time.perf_counter() - t0,
    )


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    t = st.get_tensor(key)
                    # One tensor at a time, so peak memory is the model plus one fp32 tensor.
                    state[key] = t.to(dtype) if t.is_floating_point() else t
        except Exception as e:  # safetensors raises SafetensorError (not a subclass of OSError) on damage
            raise ModelLoadError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from None
    return state


def _chat_template(directory: Path, tok_config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"  # newer HF repos keep it in its own file
    if jinja.is_file():
        return jinja.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


class _EmptyOnMeta(TorchFunctionMode):
    """Parameters are created with torch.empty and then overwritten by the checkpoint: put them on the
    meta device so construction skips allocating and randomly initialising them (seconds for Gemma's
    262k x 640 embedding). Buffers made with other factories (RoPE tables) stay real CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def _params_on_meta() -> Iterator[None]:
    with _EmptyOnMeta():
        yield
