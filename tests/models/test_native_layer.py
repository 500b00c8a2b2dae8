"""kakeya::decoder_layer (models/native_layer.py): one native call per decoder layer for decode rows gives the bits
of the layer's Python path (logits and every cache), on tiny Llama and Gemma 3 models and on SmolLM2, in each weight
format, one row (Engine.decode_step) and several rows of different cache lengths (Engine.decode_rows), at 1 and 2
threads; and it serves exactly the layers it should."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.weights import quantize_model
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.models import native, native_layer

pytestmark = pytest.mark.skipif(not native.enabled(), reason="needs the native kernels")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _caches(engine: Engine, histories: list[torch.Tensor]) -> list[ModelKV]:
    out = []
    for ids in histories:
        cache = engine.new_cache(capacity=ids.shape[1] + 8)
        engine.prefill(cache, ids)
        out.append(cache)
    return out


def _steps(engine: Engine, histories: list[torch.Tensor], tokens: list[int], *, on: bool) -> tuple[list, list]:
    """Two decode steps of rows over caches holding `histories`, then two single-row steps on the first cache, with
    the native layer path on or off: (logits of each step, final cache states)."""
    before = native_layer.set_enabled(on)
    try:
        caches = _caches(engine, histories)
        logits = [engine.decode_rows(caches, tokens), engine.decode_rows(caches, tokens[::-1])]
        for t in tokens[:2]:
            logits.append(engine.decode_step(caches[0], torch.tensor([[t]])).logits)
        return logits, [c.state() for c in caches]
    finally:
        native_layer.set_enabled(before)


def check_same_bits(model, histories: list[torch.Tensor], tokens: list[int]) -> None:
    engine = Engine(model)
    ref_logits, ref_states = _steps(engine, histories, tokens, on=False)
    model.__dict__.pop("_native_layers", None)
    logits, states = _steps(engine, histories, tokens, on=True)
    served = model.native_layers().args
    assert all(a not in (None, False) for a in served), "every layer should have run natively"
    for i, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert torch.equal(a, b), f"step {i}: logits differ"
    for r, (sa, sb) in enumerate(zip(states, ref_states, strict=True)):
        for layer, (x, y) in enumerate(zip(sa, sb, strict=True)):
            for name in x:
                assert torch.equal(x[name], y[name]), f"row {r} layer {layer} {name}"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int4", "int8"])
def test_tiny_native_layer_same_bits(family, fmt, make_tiny_model, threads):
    model = make_tiny_model(family, dtype=torch.float32)
    if fmt != "fp32":
        quantize_model(model, fmt)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 40, 17, 1]  # Gemma's sliding layers (window 8) wrap their rings
    histories = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in lengths]
    check_same_bits(model, histories, [7, 11, 13, 2])


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_smollm2_native_layer_same_bits(fmt, english_text, threads):
    from kakeya_runtime.models.loader import load_model

    loaded = load_model("smollm2", dtype=torch.bfloat16 if fmt == "bf16" else torch.float32)
    quantize_model(loaded.model, fmt)
    ids = loaded.tokenizer.encode(english_text).ids
    histories = [torch.tensor([ids[i : i + n]]) for i, n in enumerate([300, 5, 120])]
    check_same_bits(loaded.model, histories, [ids[1], ids[2], ids[3]])


def test_policy_and_traced_layers_keep_the_python_path(make_tiny_model):
    """A cache that writes itself (no append_slot), a traced layer or a prefill chunk runs the layer's forward."""
    from kakeya_runtime.kv.cache import FullLayerKV

    class OwnWrites(FullLayerKV):
        def update_and_fetch(self, k, v, positions):
            return super().update_and_fetch(k, v, positions)

    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model)
    cache = engine.new_cache(capacity=32)
    engine.prefill(cache, torch.tensor([[1, 2, 3, 4]]))
    fused = model.native_layers()
    block = model.layers[0]
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = model.rotary.cos_sin(torch.tensor([4]), torch.bfloat16)
    own = OwnWrites(1, model.config.num_key_value_heads, model.config.head_dim, 32, dtype=torch.bfloat16)
    assert fused.run(0, block, h, torch.tensor([4]), cos, sin, [own]) is None and own.length == 0
    assert fused.run(0, block, h.float(), torch.tensor([4]), cos, sin, [cache[0]]) is None  # a cast the path lacks
    assert cache[0].length == 4
    out = engine.decode_step(cache, torch.tensor([[5]]), trace_layer=1)
    assert out.attn_row is not None  # layer 1 traced: its forward ran
