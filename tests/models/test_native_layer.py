"""kakeya::decoder_layer (models/native_layer.py): one native call per decoder layer for decode rows gives the bits
of the layer's Python path (logits and every cache), on tiny Llama and Gemma 3 models and on SmolLM2, in each weight
format, one row (Engine.decode_step) and several rows of different cache lengths (Engine.decode_rows), at 1 and 2
threads; over every KV policy too (the layer in two native calls around the policy's own attention); and it serves
exactly the layers it should."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.weights import DenseLinear, Int5Linear, quantize_int5, quantize_model
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.kv.sparse import SparseIndexError
from kakeya_runtime.models import native, native_layer
from kakeya_runtime.models.base import Logits
from kakeya_runtime.sessions.policy import PolicyRegistry

pytestmark = pytest.mark.skipif(not native.enabled(), reason="needs the native kernels")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _caches(engine: Engine, histories: list[torch.Tensor], policies: list | None = None) -> list[ModelKV]:
    out = []
    registry = PolicyRegistry()
    for i, ids in enumerate(histories):
        if policies is None:
            cache = engine.new_cache(capacity=ids.shape[1] + 8)
        else:
            capacity = min(512, engine.config.max_position_embeddings)
            cache = registry.build(engine, registry.resolve(*policies[i], engine.config, capacity), capacity)
        engine.prefill(cache, ids)
        out.append(cache)
    return out


def _steps(engine: Engine, histories: list[torch.Tensor], tokens: list[int], *, on: bool,
           policies: list | None = None) -> tuple[list, list]:
    """Two decode steps of rows over caches holding `histories`, then two single-row steps on the first cache, with
    the native layer path on or off: (logits of each step, final cache states)."""
    before = native_layer.set_enabled(on)
    try:
        caches = _caches(engine, histories, policies)
        logits = [engine.decode_rows(caches, tokens), engine.decode_rows(caches, tokens[::-1])]
        for t in tokens[:2]:
            logits.append(engine.decode_step(caches[0], torch.tensor([[t]])).logits)
        return logits, [c.state() for c in caches]
    finally:
        native_layer.set_enabled(before)


def assert_same_steps(got: tuple[list, list], ref: tuple[list, list]) -> None:
    """Two `_steps` results: every step's logits and every row's final cache, bit for bit."""
    for i, (a, b) in enumerate(zip(got[0], ref[0], strict=True)):
        assert torch.equal(a, b), f"step {i}: logits differ"
    for r, (sa, sb) in enumerate(zip(got[1], ref[1], strict=True)):
        for layer, (x, y) in enumerate(zip(sa, sb, strict=True)):
            for name in x:
                assert torch.equal(x[name], y[name]), f"row {r} layer {layer} {name}"


def check_same_bits(model, histories: list[torch.Tensor], tokens: list[int], policies: list | None = None) -> None:
    engine = Engine(model)
    ref = _steps(engine, histories, tokens, on=False, policies=policies)
    model.__dict__.pop("_native_layers", None)
    got = _steps(engine, histories, tokens, on=True, policies=policies)
    served = model.native_layers().args
    assert all(a not in (None, False) for a in served), "every layer should have run natively"
    assert_same_steps(got, ref)


def spy_run_all_chunk(monkeypatch) -> list[tuple[int | tuple[int, ...], bool]]:
    """Every NativeLayers.run_all_chunk call from now on, as (its chunk's tokens, or its chunks' when several, and
    whether the stack served it)."""
    calls: list[tuple[int | tuple[int, ...], bool]] = []
    real = native_layer.NativeLayers.run_all_chunk

    def counted(self, *a, **k):
        out = real(self, *a, **k)
        sizes = (a[-1],) if isinstance(a[-1], int) else tuple(a[-1])
        calls.append((sizes[0] if len(sizes) == 1 else sizes, out is not None))
        return out

    monkeypatch.setattr(native_layer.NativeLayers, "run_all_chunk", counted)
    return calls


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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_native_layer_same_bits_on_int5(family, make_tiny_model, threads):
    """Projections whose weights are Q5_0 blocks (snapped onto them here) serve as int5 under int4-mixed, and the
    one-call layer runs them as the op-by-op path does."""
    model = make_tiny_model(family, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear) and m.out_features % 16 == 0 and m.in_features % 32 == 0:
                    codes, d = quantize_int5(m.weight)
                    n, k = m.weight.shape
                    m.weight.copy_(((codes.view(n, k // 32, 32).float() - 16) * d.float()[..., None]).view(n, k))
    quantize_model(model, "int4-mixed")
    assert any(isinstance(m, Int5Linear) for m in model.modules())
    gen = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in [5, 40, 17, 1]]
    check_same_bits(model, histories, [7, 11, 13, 2])


@pytest.fixture(scope="module")
def smollm2_in():
    """SmolLM2 in a weight format, loaded and quantized once for the module (int4 takes seconds): a function of it."""
    from kakeya_runtime.models.loader import load_model

    made = {}

    def get(fmt: str):
        if fmt not in made:
            made[fmt] = load_model("smollm2", dtype=torch.bfloat16 if fmt == "bf16" else torch.float32)
            quantize_model(made[fmt].model, fmt)
        return made[fmt]

    return get


@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_smollm2_native_layer_same_bits(fmt, english_text, threads, smollm2_in):
    loaded = smollm2_in(fmt)
    ids = loaded.tokenizer.encode(english_text).ids
    histories = [torch.tensor([ids[i : i + n]]) for i, n in enumerate([300, 5, 120])]
    check_same_bits(loaded.model, histories, [ids[1], ids[2], ids[3]])


POLICIES = [
    ("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2}),  # attends itself (owns_attention)
    ("full", {}),
    ("sink_window", {"sink": 4, "window": 16}),  # update_and_fetch, no append_slot
    ("sink_window", {"sink": 4, "window": 16, "codec": "d4"}),  # packed lattice resident codec
    ("restore", {"sink": 4, "window": 16, "granularity": "per_step"}),  # a proposer forward inside the step
    ("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "d4"}),
]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int4"])
def test_tiny_native_layer_over_policies_same_bits(family, fmt, make_tiny_model, threads):
    """Rows over every policy in one step (and single-row steps on a sparse cache): the split native layer gives the
    Python path's logits and leaves every cache as the Python path does."""
    model = make_tiny_model(family, dtype=torch.float32)
    if fmt != "fp32":
        quantize_model(model, fmt)
    gen = torch.Generator().manual_seed(5)
    lengths = [70, 7, 90, 33, 64, 41]  # past the windows: evicted, cold blocks, ring wraps
    histories = [torch.randint(3, model.config.vocab_size, (1, n), generator=gen) for n in lengths]
    check_same_bits(model, histories, [7, 11, 13, 2, 5, 9], POLICIES)


@pytest.mark.real_model
def test_smollm2_native_layer_over_sparse_and_sink_window_same_bits(english_text):
    from kakeya_runtime.models.loader import load_model

    loaded = load_model("smollm2", dtype=torch.bfloat16)
    ids = loaded.tokenizer.encode(english_text).ids
    histories = [torch.tensor([ids[i : i + n]]) for i, n in enumerate([300, 120])]
    policies = [("sparse", {"sink": 4, "window": 64, "block": 16, "topk": 4}), ("sink_window", {"sink": 4, "window": 64})]
    check_same_bits(loaded.model, histories, [ids[1], ids[2]], policies)


def test_split_layer_serves_policy_caches(make_tiny_model):
    """A sparse or sink_window cache's layer runs natively in two calls around the cache's own attention: one
    native_layer.run per layer, the cache written once, the output the layer's forward."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    for name, params in POLICIES[:1] + POLICIES[2:3]:
        cache = registry.build(engine, registry.resolve(name, params, engine.config, 256), 256)
        engine.prefill(cache, torch.randint(3, 50, (1, 40), generator=torch.Generator().manual_seed(1)))
        h = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
        cos, sin = model.rotary.cos_sin(torch.tensor([40]), torch.bfloat16)
        out = model.native_layers().run(0, model.layers[0], h, torch.tensor([40]), cos, sin, [cache[0]])
        assert out is not None and cache.layer_lengths()[0] == 41, name
        before = native_layer.set_enabled(False)
        try:
            other = registry.build(engine, registry.resolve(name, params, engine.config, 256), 256)
            engine.prefill(other, torch.randint(3, 50, (1, 40), generator=torch.Generator().manual_seed(1)))
            ref, _ = model.layer_forward(0, h, torch.tensor([40]), model.rope_tables(torch.tensor([40]), h.dtype),
                                         other[0], False)
        finally:
            native_layer.set_enabled(before)
        assert torch.equal(out, ref), name


def test_policy_and_traced_layers_keep_the_python_path(make_tiny_model):
    """A traced layer, a prefill chunk or a cast the kernels lack runs the layer's forward."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model)
    cache = engine.new_cache(capacity=32)
    engine.prefill(cache, torch.tensor([[1, 2, 3, 4]]))
    fused = model.native_layers()
    block = model.layers[0]
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = model.rotary.cos_sin(torch.tensor([4]), torch.bfloat16)
    assert fused.run(0, block, h.float(), torch.tensor([4]), cos, sin, [cache[0]]) is None  # a cast the path lacks
    assert cache[0].length == 4
    out = engine.decode_step(cache, torch.tensor([[5]]), trace_layer=1)
    assert out.attn_row is not None  # layer 1 traced: its forward ran


def test_sink_window_ring_written_natively_after_trim_and_load_same_bits(make_tiny_model):
    """sink_window with the identity codec hands its ring to the one-call layer (append_slot): the op-by-op path's
    bits, also after a trim leaves holes (the layer steps aside until the history passes them) and after a state
    with holes is loaded into a fresh cache."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    spec = registry.resolve("sink_window", {"sink": 4, "window": 16, "spare": 4}, engine.config, 256)
    ids = torch.randint(3, model.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(4))

    def run(on: bool) -> tuple[list, list, list]:
        before = native_layer.set_enabled(on)
        try:
            cache = registry.build(engine, spec, 256)
            engine.prefill(cache, ids)
            logits, offered = [], []
            for t in (5, 6, 7):
                logits.append(engine.decode_step(cache, torch.tensor([[t]])).logits)
            cache.trim(cache.length - 3)
            for t in (8, 9, 10, 11, 12):
                offered.append(cache[0].append_slot is not None)
                logits.append(engine.decode_step(cache, torch.tensor([[t]])).logits)
            cache.trim(cache.length - 2)
            loaded = registry.build(engine, spec, 256)
            loaded.load_state(cache.state())
            for t in (13, 14, 15):
                offered.append(loaded[0].append_slot is not None)
                logits.append(engine.decode_step(loaded, torch.tensor([[t]])).logits)
            return logits, offered, loaded.state()
        finally:
            native_layer.set_enabled(before)

    ref, _, ref_state = run(False)
    model.__dict__.pop("_native_layers", None)
    got, offered, state = run(True)
    assert offered == [False, False, False, True, True, False, False, False]
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(a, b), f"step {i}"
    for layer, (x, y) in enumerate(zip(state, ref_state, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {layer} {name}"


def _stack_calls(monkeypatch) -> list[bool]:
    """One entry per whole-stack sparse call (NativeLayers._run_sparse), in order: whether it served its step (False
    for one that declined or raised)."""
    served = []
    real = native_layer.NativeLayers._run_sparse

    def counted(*a, **k):
        served.append(False)
        got = real(*a, **k)
        served[-1] = got is not None
        return got

    monkeypatch.setattr(native_layer.NativeLayers, "_run_sparse", staticmethod(counted))
    return served


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("codec", ["identity", "int8", "d4", "d4-oversize"])
def test_sparse_decode_layer_in_one_call_same_bits(family, codec, make_tiny_model, monkeypatch):
    """A decode row over a sparse cache in its steady state runs its whole stack in one native call
    (kakeya.DecoderStack.step_sparse: each sparse layer as kakeya::decoder_layer_sparse, Gemma's sliding rings as
    kakeya::decoder_layer), or, when its selection may not fit the decoded-block cache, each layer in one call: the
    logits and every cache of the layer's Python path, step after step (blocks completing, the defer to the step's
    end, a D4 tier's decoded cache, and, with one decoded slot, the oversize step); the steps where a block must be
    encoded first step aside to the split layer."""
    model = make_tiny_model(family, dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    params = {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": codec.removesuffix("-oversize")}
    spec = registry.resolve("sparse", params, engine.config, 256)
    ids = torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(6))
    calls = []
    real = native.decoder_layer_sparse

    def counted(*a, **k):
        got = real(*a, **k)
        calls.append(got[3])  # misses: -1 when the oversize step finished the layer
        return got

    monkeypatch.setattr(native, "decoder_layer_sparse", counted)
    stacked = _stack_calls(monkeypatch)

    def run(on: bool) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            cache = registry.build(engine, spec, 256)
            if codec == "d4-oversize":  # one slot per head: a step's two blocks never fit
                for layer in cache.layers:
                    if hasattr(layer, "decoded_blocks"):
                        layer.decoded_blocks = 1
            engine.prefill(cache, ids)
            logits = [engine.decode_step(cache, torch.tensor([[t]])).logits for t in range(5, 25)]
            return logits, cache.state()
        finally:
            native_layer.set_enabled(before)

    ref, ref_state = run(False)
    assert not calls
    model.__dict__.pop("_native_layers", None)
    got, state = run(True)
    governed = sum(hasattr(layer, "decoder_layer_step") for layer in registry.build(engine, spec, 256).layers)
    one_call = sum(stacked) + len(calls) // governed  # steps as one stack call, or one call per sparse layer
    assert governed > 0 and one_call >= 15, (sum(stacked), len(calls), governed)  # most steps
    if codec == "d4-oversize":  # a step's blocks may not fit: never the stack, each layer in its own call
        assert not any(stacked) and min(calls) < 0
    else:
        assert sum(stacked) >= 15 and not calls, (sum(stacked), len(calls))
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(a, b), f"step {i}"
    for layer, (x, y) in enumerate(zip(state, ref_state, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {layer} {name}"


@pytest.mark.parametrize("codec", ["identity", "d4"])
def test_sparse_stack_serves_a_ring_that_is_still_filling_same_bits(codec, make_tiny_model, monkeypatch):
    """From a short prompt, the decode steps before the hot ring first fills take the whole-stack call too (the ring
    read as its first slots, as attend reads it), with the Python path's logits and caches, through the fill."""
    model = make_tiny_model("gemma3", dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    spec = registry.resolve("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": codec},
                            engine.config, 256)
    stacked = _stack_calls(monkeypatch)

    def run(on: bool) -> tuple[list, list, int]:
        before = native_layer.set_enabled(on)
        try:
            cache = registry.build(engine, spec, 256)
            engine.prefill(cache, torch.tensor([[3, 4, 5]]))
            layer = next(kv for kv in cache.layers if hasattr(kv, "stack_kind"))
            ring = layer.hot_pos.shape[0]
            logits = [engine.decode_step(cache, torch.tensor([[t % 50 + 3]])).logits for t in range(ring + 6)]
            return logits, cache.state(), ring
        finally:
            native_layer.set_enabled(before)

    ref, ref_state, ring = run(False)
    assert not stacked
    model.__dict__.pop("_native_layers", None)
    got, state, _ = run(True)
    # the steps while the ring fills (a few encode a block first; a D4 tier joins once it holds a block)
    assert sum(stacked[: ring - 4]) >= (ring - 8 if codec == "identity" else ring // 2), stacked
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert torch.equal(a, b), f"step {i}"
    for layer, (x, y) in enumerate(zip(state, ref_state, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {layer} {name}"


def test_sparse_stack_call_reports_a_broken_step_as_the_sparse_step_does(make_tiny_model, monkeypatch):
    """A kernel check failing inside the whole-stack call (a ring slot no longer holding its position) raises the
    sparse step's own typed error, from that call."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    spec = registry.resolve("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "identity"},
                            engine.config, 256)
    cache = registry.build(engine, spec, 256)
    engine.prefill(cache, torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2)))
    layer = next(kv for kv in cache.layers if hasattr(kv, "stack_kind"))
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    for t in range(3):
        engine.decode_step(cache, torch.tensor([[5 + t]]))
    while layer.stack_kind(h) is None:  # to a step the stack runs (no block to encode first)
        engine.decode_step(cache, torch.tensor([[8]]))
    stacked = _stack_calls(monkeypatch)
    newest = int(layer.hot_pos.max())
    layer.hot_pos[layer.hot_pos == newest - 10] = 10_000  # a ring slot no longer holds its position (in view)
    with pytest.raises(SparseIndexError, match="hot range"):
        engine.decode_step(cache, torch.tensor([[9]]))
    assert stacked == [False]  # the stack call ran, and raised

@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_whole_stack_in_one_call_same_bits(family, fmt, make_tiny_model, monkeypatch):
    """Decode rows whose caches all take their writes in the kernel (full, sliding rings) run every layer in one
    call (kakeya.DecoderStack): no per-layer call at all, and the logits and caches of one call per layer; a row over
    a policy cache sends the step back to the per-layer path."""
    model = make_tiny_model(family, dtype=torch.float32)
    quantize_model(model, fmt)
    engine = Engine(model)
    gen = torch.Generator().manual_seed(8)
    histories = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (30, 3, 12)]
    per_layer = []
    real_run = native_layer.NativeLayers.run

    def counted(self, *a, **k):
        per_layer.append(a[0])
        return real_run(self, *a, **k)

    monkeypatch.setattr(native_layer.NativeLayers, "run", counted)
    got = _steps(engine, histories, [4, 9, 6], on=True)
    assert per_layer == [], "the stack should have served every step"
    model.__dict__.pop("_native_layers", None)
    real_all = native_layer.NativeLayers.run_all
    monkeypatch.setattr(native_layer.NativeLayers, "run_all", lambda *a, **k: None)
    ref = _steps(engine, histories, [4, 9, 6], on=True)
    assert len(per_layer) == 4 * model.config.num_hidden_layers  # two row steps and two single steps, every layer
    assert_same_steps(got, ref)
    monkeypatch.setattr(native_layer.NativeLayers, "run_all", real_all)
    per_layer.clear()
    _steps(engine, histories[:2], [4, 9], on=True, policies=[("full", {}), POLICIES[0]])
    assert len(per_layer) == 2 * model.config.num_hidden_layers  # the two row steps beside a sparse row


def test_whole_stack_follows_a_replaced_projection(make_tiny_model):
    """The stack is rebuilt when a projection is replaced after it was built, and only then: a step with no module
    assigned anywhere since reuses it without comparing the layers."""
    model = make_tiny_model("llama", dtype=torch.float32)
    quantize_model(model, "bf16")
    engine = Engine(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))

    def step() -> torch.Tensor:
        cache = engine.new_cache(capacity=16)
        engine.prefill(cache, ids)
        return engine.decode_step(cache, torch.tensor([[5]])).logits

    step()
    built = model.native_layers().stack
    assert step() is not None and model.native_layers().stack is built
    old = model.layers[1].mlp.down_proj
    model.layers[1].mlp.down_proj = DenseLinear(old.weight.detach() * 2, None)
    got = step()
    rebuilt = model.native_layers().stack
    assert rebuilt is not built and rebuilt.key[1][3] is model.layers[1].mlp.down_proj
    before = native_layer.set_enabled(False)
    try:
        assert torch.equal(got, step()), "the rebuilt stack gives the changed model's Python-path logits"
    finally:
        native_layer.set_enabled(before)
    # a module assigned elsewhere (an unrelated model built) is checked once, found current, and kept
    make_tiny_model("llama", dtype=torch.float32)
    step()
    assert model.native_layers().stack is rebuilt and rebuilt.checked == native_layer._assignments


def _allocations_under(prof, scope: str) -> int:
    """aten::empty and aten::empty_strided calls the profiler saw under the one `scope` event (a stack step), not
    under the copy of its result (an aten::clone)."""
    assert len([e for e in prof.events() if e.name == scope]) == 1

    def in_scope(e) -> bool:
        while e.cpu_parent is not None and e.cpu_parent.name != "aten::clone":
            e = e.cpu_parent
            if e.name == scope:
                return True
        return False

    return sum(e.name in ("aten::empty", "aten::empty_strided") and in_scope(e) for e in prof.events())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8"])
def test_a_warm_stack_step_allocates_nothing_in_its_layers(family, fmt, make_tiny_model):
    """Inside the stack's step each op's small output is kept by its call site and handed out again once nothing
    holds it (common.h's reusable_empty), and an int8 projection reads its fp32 scales as kept: after a few steps, a
    decode step's layers call the allocator not once (the profiler sees every aten::empty and aten::empty_strided
    under the step's scope; the step's one copy of its result is an aten::clone)."""
    from torch.profiler import ProfilerActivity, profile

    model = make_tiny_model(family, dtype=torch.float32)
    quantize_model(model, fmt)
    engine = Engine(model)
    cache = engine.new_cache(capacity=32)
    engine.prefill(cache, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))

    def layer_allocations() -> int:
        token = torch.tensor([[5]])
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.decode_step(cache, token)
        return _allocations_under(prof, "kakeya::DecoderStack.step")

    for _ in range(3):  # a call site's first outputs are allocated (unless an earlier test's step made them)
        engine.decode_step(cache, torch.tensor([[7]]))
    assert layer_allocations() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("codec", ["identity", "int8", "d4"])
def test_a_warm_sparse_stack_step_allocates_nothing_in_its_layers(family, codec, make_tiny_model):
    """A decode step over sparse caches in their steady state (kakeya.DecoderStack.step_sparse) takes no tensor from
    the allocator either: the indexer's bitsets and counts, the sparse attention's output and its per-row key
    counts come from their call sites' kept ones, as the other ops' outputs do, and a D4 tier's slot map from a kept
    buffer (the profiler sees every aten::empty and aten::empty_strided under the step's scope). A D4 step that
    decodes blocks its cache misses: the test below."""
    from torch.profiler import ProfilerActivity, profile

    model = make_tiny_model(family, dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    spec = registry.resolve("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": codec},
                            engine.config, 256)
    cache = registry.build(engine, spec, 256)
    for kv in cache.layers:  # a D4 cache that holds every block: once warm, steps that decode nothing
        if hasattr(kv, "decoded_blocks"):
            kv.decoded_blocks = 32
    engine.prefill(cache, torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(3)))
    layer = next(kv for kv in cache.layers if hasattr(kv, "stack_kind"))
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)

    def steady_step(token: int, profiled: bool) -> tuple[int, int]:
        """A step the stack runs (after the steps that encode a block first): its allocations and decoded misses."""
        while layer.stack_kind(h) is None:
            engine.decode_step(cache, torch.tensor([[8]]))
        misses = cache.decoded_counts()[1]
        if not profiled:
            engine.decode_step(cache, torch.tensor([[token]]))
            return 0, cache.decoded_counts()[1] - misses
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.decode_step(cache, torch.tensor([[token]]))
        misses = cache.decoded_counts()[1] - misses
        return _allocations_under(prof, "kakeya::DecoderStack.step_sparse"), misses

    for t in range(3):  # a call site's first outputs are allocated (unless an earlier test's step made them)
        steady_step(5 + t, profiled=False)
    steps = [steady_step(9 + t, profiled=True) for t in range(10)]
    hit_steps = [allocated for allocated, misses in steps if misses == 0]
    assert hit_steps and set(hit_steps) == {0}, steps
    if codec != "d4":
        assert len(hit_steps) == len(steps)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_warm_d4_stack_step_decodes_its_misses_without_allocating(family, make_tiny_model):
    """A D4 step whose selection misses the decoded-block cache decodes those blocks (their codes gathered, the
    lattice points, the rotation) in buffers its call site keeps at their largest: once a step has decoded as many
    misses, a later step decoding no more takes nothing from the allocator either."""
    from torch.profiler import ProfilerActivity, profile

    model = make_tiny_model(family, dtype=torch.bfloat16)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    spec = registry.resolve("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "d4"},
                            engine.config, 256)
    cache = registry.build(engine, spec, 256)
    gen = torch.Generator().manual_seed(4)
    engine.prefill(cache, torch.randint(3, model.config.vocab_size, (1, 90), generator=gen))
    layer = next(kv for kv in cache.layers if hasattr(kv, "stack_kind"))
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    most, steps = 0, []
    for t in range(40):
        token = int(torch.randint(3, model.config.vocab_size, (1,), generator=gen))
        while layer.stack_kind(h) is None:
            engine.decode_step(cache, torch.tensor([[8]]))
        before = cache.decoded_counts()[1]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.decode_step(cache, torch.tensor([[token]]))
        misses = cache.decoded_counts()[1] - before
        if t >= 3:  # the call sites' other outputs made
            steps.append((misses, most, _allocations_under(prof, "kakeya::DecoderStack.step_sparse")))
        most = max(most, misses)
    repeat = [allocated for misses, seen, allocated in steps if 0 < misses <= seen]
    assert repeat and set(repeat) == {0}, steps


def test_ops_called_from_python_hand_out_fresh_outputs():
    """Outside a stack step an op allocates its output (one handed to Python stays referenced by its Python object):
    an output still held, or a view of it, is never written by a later call."""
    native.load()
    w = torch.ones(64, dtype=torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    y1 = torch.ops.kakeya.rms_norm(x, w, 1e-6, False)
    want1 = y1.clone()
    view = torch.ops.kakeya.rms_norm(x * 2, w, 1e-6, False)[1]  # only a view of this one is held
    want_view = view.clone()
    outs = [torch.ops.kakeya.rms_norm(x * (3 + i), w, 1e-6, False) for i in range(6)]
    ptrs = {y1.untyped_storage().data_ptr(), view.untyped_storage().data_ptr()}
    assert len(ptrs | {o.untyped_storage().data_ptr() for o in outs}) == 2 + len(outs)
    assert torch.equal(y1, want1) and torch.equal(view, want_view)
    for i, o in enumerate(outs):
        assert torch.equal(o, torch.ops.kakeya.rms_norm(x * (3 + i), w, 1e-6, False))


def test_whole_stack_rejects_bad_arguments(make_tiny_model):
    """The stack's own checks: per-layer argument counts at build, one cache entry per layer and row per step, chunk
    sizes that do not add up to the rows (int64 overflow included) and a chunk slot outside the slots it attends,
    refused before any slot is written."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    native.load()
    with pytest.raises(RuntimeError, match="per layer"):
        torch.classes.kakeya.DecoderStack([torch.empty(0)] * 17, [0] * 10, [0.0] * 3)
    engine = Engine(model)
    cache = engine.new_cache(capacity=16)
    engine.prefill(cache, torch.tensor([[1, 2, 3]]))
    engine.decode_step(cache, torch.tensor([[4]]))
    stack = model.native_layers().stack.stack
    h = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one cache entry per layer and row"):
        n = model.config.num_hidden_layers
        cos, sin = model.rotary.cos_sin(torch.tensor([4]), torch.bfloat16)
        stack.step(h, [cos] * n, [sin] * n, torch.tensor([4]), [], [], [], [], [], [], [], [])
    # two chunks of two tokens, the second's last slot past its buffer: refused before any slot is written
    bufs = [(torch.zeros(1, model.config.num_key_value_heads, 8, model.config.head_dim, dtype=torch.bfloat16),
             torch.zeros(1, model.config.num_key_value_heads, 8, model.config.head_dim, dtype=torch.bfloat16),
             torch.full((8,), -1)) for _ in range(2)]
    cos2, sin2 = model.rotary.cos_sin(torch.tensor([0, 1, 0, 1]), torch.bfloat16)
    x4 = torch.ones(4, 1, model.config.hidden_size, dtype=torch.bfloat16)

    def step_chunk(sizes: list[int], slots: list[int]) -> None:
        j = len(sizes)  # chunk i in bufs[i % 2], attending its first 2 slots
        ck, cv, ckpos = ([bufs[c % 2][i] for _ in range(n) for c in range(j)] for i in range(3))
        stack.step_chunk(x4, [cos2] * n, [sin2] * n, torch.tensor([0, 1, 0, 1]), [], [], [], [], [], [], [], [],
                         sizes, ck, cv, ckpos, slots * n, [2] * j * n, [1] * j * n, [0] * j * n, [0] * j * n)

    with pytest.raises(RuntimeError, match="slot 8 outside the chunk's 2 attended slots"):
        step_chunk([2, 2], [0, 1, 0, 8])
    # inside the buffer but past the slots the chunk attends: its key would be written where no query reads it
    with pytest.raises(RuntimeError, match="slot 5 outside the chunk's 2 attended slots"):
        step_chunk([2, 2], [0, 1, 5, 1])
    # sizes that wrap around int64 to the row count, or that overrun it before a later one
    with pytest.raises(RuntimeError, match="sizes summing to the slots"):
        step_chunk([2**63 - 1, 2**63 - 1, 6], [0, 1, 0, 1])
    with pytest.raises(RuntimeError, match="sizes summing to the slots"):
        step_chunk([5, -1], [0, 1, 0, 1])
    assert all(not b[0].any() and (b[2] == -1).all() for b in bufs)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_prefill_chunks_riding_a_step_same_bits(family, fmt, make_tiny_model, monkeypatch):
    """A batched step that carries prefill chunks (Engine.step_chunks) runs each layer's halves natively around the
    Python path's own attention of its decode rows and chunks: the decode rows' and chunks' logits and every cache
    are the Python path's, over full caches and a sparse one."""
    model = make_tiny_model(family, dtype=torch.float32)
    quantize_model(model, fmt)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(9)
    histories = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (30, 3, 40, 12)]
    chunk_ids = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (7, 1)]
    calls = []
    real = native_layer.NativeLayers.run_mixed

    def counted(self, *a, **k):
        if a[2].shape[0] > sum(a[-1].chunks):  # a step with decode rows (short prefills take run_mixed too)
            calls.append(a[0])
        return real(self, *a, **k)

    monkeypatch.setattr(native_layer.NativeLayers, "run_mixed", counted)

    def run(on: bool) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            caches = []
            for i, ids in enumerate(histories):
                if i == 2:  # a sparse row among the decode rows
                    spec = registry.resolve(*POLICIES[0], engine.config, 256)
                    cache = registry.build(engine, spec, 256)
                else:
                    cache = engine.new_cache(capacity=ids.shape[1] + 16)
                engine.prefill(cache, ids)
                caches.append(cache)
            rows, riding = caches[:2] + caches[2:3], caches[3:]
            fresh = engine.new_cache(capacity=16)
            logits, chunk_logits = engine.step_chunks(rows, [4, 9, 6], [(riding[0], chunk_ids[0]), (fresh, chunk_ids[1])])
            out = [logits, *chunk_logits]
            logits, chunk_logits = engine.step_chunks(rows[:1], [5], [(riding[0], chunk_ids[1])])
            out += [logits, *chunk_logits]
            return out, [c.state() for c in [*caches, fresh]]
        finally:
            native_layer.set_enabled(before)

    ref = run(False)
    assert calls == []
    model.__dict__.pop("_native_layers", None)
    got = run(True)
    # the first step's two chunks take each layer's halves; the second's one chunk the whole stack (below)
    assert len(calls) == model.config.num_hidden_layers, "the two-chunk step's layers should have run natively"
    assert_same_steps(got, ref)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int4"])
def test_a_chunk_riding_decode_rows_takes_the_whole_stack_same_bits(family, fmt, make_tiny_model, monkeypatch):
    """Decode rows and prefill chunks riding them run the whole stack in one native call (each chunk's tokens
    written to its cache, then attended as one query, each token by position): the decode rows' and the chunks'
    logits and every cache are the Python path's, for chunks of 1 to 24 tokens over a long cache, a fresh one and
    one that makes its cache grow its storage, beside 0 to 3 decode rows, and three chunks of three sequences in one
    step, beside decode rows or none. Over Gemma 3's sliding layers (rings) too, while the ring's spare slots cover
    the chunk; a longer chunk, or a decode row over a policy cache, keeps the layers' halves."""
    model = make_tiny_model(family, dtype=torch.float32, max_position_embeddings=512)
    quantize_model(model, fmt)
    engine = Engine(model, prefill_chunk=32)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(21)
    vocab = model.config.vocab_size
    histories = [torch.randint(0, vocab, (1, n), generator=gen) for n in (30, 3, 41)]
    prompt = torch.randint(0, vocab, (1, 250), generator=gen)
    chunks = [torch.randint(0, vocab, (1, n), generator=gen) for n in (1, 7, 16, 24, 5, 2)]
    served = spy_run_all_chunk(monkeypatch)

    def run(on: bool) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            rows = []
            for ids in histories:
                cache = engine.new_cache(capacity=ids.shape[1] + 16)
                engine.prefill(cache, ids)
                rows.append(cache)
            long = engine.new_cache(capacity=400)  # storage reserved as it fills: grows past 256 in a chunk
            engine.prefill(long, prompt)
            fresh = engine.new_cache(capacity=64)
            out = []
            served.clear()  # (the prefills above take the stack too: a short prompt's tokens as one chunk)
            for i, ids in enumerate(chunks):
                decode = rows[: i % 4]
                target = fresh if i == 4 else long
                logits, chunk_logits = engine.step_chunks(decode, [3 + i] * len(decode), [(target, ids)])
                out += [logits, *chunk_logits]
            other = engine.new_cache(capacity=64)
            for decode in (rows[:2], []):  # three sequences' chunks in one step
                logits, chunk_logits = engine.step_chunks(
                    decode, [7] * len(decode), [(long, chunks[1]), (fresh, chunks[5]), (other, chunks[2])])
                out += [logits, *chunk_logits]
            policy = registry.build(engine, registry.resolve(*POLICIES[3], engine.config, 256), 256)
            engine.prefill(policy, histories[0])
            logits, chunk_logits = engine.step_chunks([rows[0], policy], [1, 2], [(long, chunks[0])])
            out += [logits, *chunk_logits]
            return out, [c.state() for c in [*rows, long, fresh, other]]
        finally:
            native_layer.set_enabled(before)

    ref = run(False)
    assert served == []
    model.__dict__.pop("_native_layers", None)
    got = run(True)
    ring = model.config.sliding_window is not None  # Gemma 3's rings keep 16 spare slots
    # then the three-chunk steps, the policy cache's prefill (30 tokens) and the step beside its decode row (halves)
    assert served == ([(n, not (ring and n > 16)) for n in (1, 7, 16, 24, 5, 2)] + [((7, 2, 16), True)] * 2
                      + [(30, False), (1, False)]), served
    assert_same_steps(got, ref)


@pytest.mark.real_model
def test_smollm2_chunk_riding_decode_rows_in_one_call_same_bits(english_text, smollm2_in, monkeypatch):
    """SmolLM2 int4: two decode rows and a 12-token chunk of a 300-token prompt in one native call, then the same with
    a second sequence's 40-token chunk beside it, give the Python path's logits and caches."""
    loaded = smollm2_in("int4")
    engine = Engine(loaded.model)
    ids = loaded.tokenizer.encode(english_text).ids
    served = spy_run_all_chunk(monkeypatch)

    def run(on: bool) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            caches = [engine.new_cache(capacity=n + 80) for n in (200, 37, 300, 90)]
            for cache, (i, n) in zip(caches, [(0, 200), (5, 37), (9, 300), (30, 90)], strict=True):
                engine.prefill(cache, torch.tensor([ids[i : i + n]]))
            served.clear()  # the prompts' own runs are counted elsewhere: the steps' calls
            logits, chunk_logits = engine.step_chunks(caches[:2], [ids[1], ids[2]],
                                                      [(caches[2], torch.tensor([ids[320:332]]))])
            out = [logits, *chunk_logits]
            logits, chunk_logits = engine.step_chunks(caches[:2], [ids[3], ids[4]],
                                                      [(caches[2], torch.tensor([ids[332:344]])),
                                                       (caches[3], torch.tensor([ids[400:440]]))])
            return out + [logits, *chunk_logits], [c.state() for c in caches]
        finally:
            native_layer.set_enabled(before)

    ref = run(False)
    loaded.model.__dict__.pop("_native_layers", None)
    got = run(True)
    assert served == [(12, True), ((12, 40), True)]
    assert_same_steps(got, ref)


def test_a_chunk_step_that_fails_in_the_kernel_leaves_every_cache_as_it_was(make_tiny_model, monkeypatch):
    """An error inside the whole-stack call of a step carrying chunks (one, or two of two sequences) is raised, and
    every cache of the step (the decode rows' and the chunks') is back at the length it had."""
    model = make_tiny_model("gemma3", dtype=torch.float32)
    engine = Engine(model, prefill_chunk=32)
    gen = torch.Generator().manual_seed(2)
    row, long, other = engine.new_cache(capacity=100), engine.new_cache(capacity=200), engine.new_cache(capacity=64)
    engine.prefill(row, torch.randint(0, model.config.vocab_size, (1, 40), generator=gen))
    engine.prefill(long, torch.randint(0, model.config.vocab_size, (1, 120), generator=gen))
    before = [[kv.length for kv in c] for c in (row, long, other)]
    stack = model.native_layers()._stack(model.layers)

    class Broken:
        def step_chunk(self, *args):
            raise RuntimeError("decoder_layer_chunk: broken on purpose")

    monkeypatch.setattr(stack, "stack", Broken())
    one, two = (long, torch.tensor([[1, 2, 3]])), (other, torch.tensor([[4, 5]]))
    for chunks in ([one], [one, two]):
        with pytest.raises(RuntimeError, match="broken on purpose"):
            engine.step_chunks([row], [1], chunks)
        assert [[kv.length for kv in c] for c in (row, long, other)] == before
    monkeypatch.undo()
    logits, chunk_logits = engine.step_chunks([row], [1], [one, two])
    assert logits.shape[0] == 1 and len(chunk_logits) == 2


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_short_appends_take_the_native_halves_same_bits(family, fmt, make_tiny_model, monkeypatch):
    """A run of new tokens of one sequence (a turn's message, a prefill chunk: any length) runs the whole stack in
    one native call where every cache takes it (a full cache), else each layer's halves natively around the
    sequence's own attention: the logits at every position and every cache are the Python path's, over a full cache
    and over policies (sparse attends itself, sink_window writes through update_and_fetch)."""
    model = make_tiny_model(family, dtype=torch.float32)
    quantize_model(model, fmt)
    engine = Engine(model, prefill_chunk=64)
    registry = PolicyRegistry()
    gen = torch.Generator().manual_seed(10)
    appends = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (20, 5, 31, 2, 40)]
    calls = []
    real = native_layer.NativeLayers.run_sequence

    def counted(self, *a, **k):
        calls.append(a[2].shape[1])
        return real(self, *a, **k)

    monkeypatch.setattr(native_layer.NativeLayers, "run_sequence", counted)

    def run(on: bool, policy: tuple[str, dict] | None) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            if policy is None:
                cache = engine.new_cache(capacity=128)
            else:
                cache = registry.build(engine, registry.resolve(*policy, engine.config, 256), 256)
            logits = [engine.prefill(cache, ids, logits=Logits.ALL).logits for ids in appends]
            return logits, [cache.state()]
        finally:
            native_layer.set_enabled(before)

    for policy in (None, POLICIES[0], POLICIES[2]):
        calls.clear()
        ref = run(False, policy)
        assert calls == []
        model.__dict__.pop("_native_layers", None)
        got = run(True, policy)
        # over a full cache every run takes the whole stack as one chunk, except on Gemma 3's rings past their 16
        # spare slots; over a policy every run takes the halves
        ring = model.config.sliding_window is not None
        halves = ([20, 31, 40] if ring else []) if policy is None else [2, 5, 20, 31, 40]
        assert sorted(set(calls)) == halves, calls
        assert_same_steps(got, ref)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_a_short_run_takes_the_whole_stack_same_bits(family, fmt, make_tiny_model, monkeypatch):
    """A speculative verify's few tokens over full caches run the whole stack in one native call, the tokens as one
    chunk over the cache (all written first, each attending by position): the logits at every position and the cache
    are the Python path's, through rollbacks (trim) and a run that makes the cache grow its storage. Over Gemma 3's
    sliding layers (rings) too, the later tokens' keys masked by position; a ring whose spare slots do not cover a
    run keeps the layers' halves."""
    model = make_tiny_model(family, dtype=torch.float32, max_position_embeddings=512)  # storage grows past 256
    quantize_model(model, fmt)
    engine = Engine(model)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 250), generator=gen)
    runs = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (2, 5, 8, 3, 8, 9)]
    calls = spy_run_all_chunk(monkeypatch)

    def run(on: bool, rollback: bool = True) -> tuple[list, list]:
        before = native_layer.set_enabled(on)
        try:
            cache = engine.new_cache(capacity=400)
            engine.prefill(cache, prompt)
            calls.clear()  # (the prompt's last chunk takes the stack too)
            logits = []
            for i, ids in enumerate(runs):
                length = cache.length
                logits.append(engine.verify(cache, ids).logits)
                if rollback and i % 2 == 0:  # a rejected draft: back to where the run began, plus one token
                    cache.trim(length + 1)
            return logits, [cache.state()]
        finally:
            native_layer.set_enabled(before)

    ref = run(False)
    assert calls == []
    model.__dict__.pop("_native_layers", None)
    got = run(True)
    assert calls == [(n, True) for n in (2, 5, 8, 3, 8, 9)], calls
    assert_same_steps(got, ref)
    if model.config.sliding_window is not None:  # rings with 2 spare slots: runs of up to 2 tokens
        monkeypatch.setattr("kakeya_runtime.kv.cache.SLIDING_SPARE", 2)
        calls.clear()
        ref = run(False, rollback=False)  # (rolling back 4 of 5 tokens is more than 2 spare slots allow)
        got = run(True, rollback=False)
        assert calls == [(n, n <= 2) for n in (2, 5, 8, 3, 8, 9)], calls
        assert_same_steps(got, ref)


def test_a_short_run_that_fails_in_the_kernel_leaves_every_cache_as_it_was(make_tiny_model, monkeypatch):
    """An error inside the whole-stack call of a short run (here a stand-in for the kernels' checks) is raised, and
    every layer's cache is back at the length it had: the run's rooms are taken back."""
    model = make_tiny_model("gemma3", dtype=torch.float32)
    engine = Engine(model)
    cache = engine.new_cache(capacity=200)
    engine.prefill(cache, torch.randint(0, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(1)))
    before = [kv.length for kv in cache]
    stack = model.native_layers()._stack(model.layers)

    class Broken:
        def step_chunk(self, *args):
            raise RuntimeError("decoder_layer_chunk: broken on purpose")

    monkeypatch.setattr(stack, "stack", Broken())
    with pytest.raises(RuntimeError, match="broken on purpose"):
        engine.verify(cache, torch.tensor([[1, 2, 3]]))
    assert [kv.length for kv in cache] == before
    monkeypatch.undo()
    assert engine.verify(cache, torch.tensor([[1, 2, 3]])).logits.shape[1] == 3
