"""Weight formats (engine.weights) and the compiled decode step (engine.compiled) on tiny models."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, generate_greedy_cached
from kakeya_runtime.engine.weights import (
    Int4Linear,
    Int5Linear,
    Int8Linear,
    Prefill,
    QuantEmbedding,
    QuantLinear,
    WeightFormat,
    _unpack_int4,
    int4_exact,
    int5_exact,
    int8_grid,
    quantize_int4,
    quantize_int5,
    quantize_model,
    weight_bytes,
)
from kakeya_runtime.models.config import ModelConfig
from kakeya_runtime.models.registry import build_model

BF16_EPS = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


def _weight_and_input(n: int = 192, k: int = 128, rows: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    return w, x


def _kernel_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel may differ from an fp32 matmul on the same (dequantized) weights: bf16 rounding
    of the output (relative BF16_EPS of |y| <= |x| @ |w|^T), and fp32 accumulation order, with a 2x margin."""
    return 2 * BF16_EPS * (x.float().abs() @ w.float().abs().t()) + 1e-6


def test_int8_weights_within_half_a_step_and_kernel_matches_its_weights():
    w, x = _weight_and_input()
    lin = Int8Linear(w, None)
    deq = lin.dequantize().float()
    step = lin.scales.float()[:, None]  # (N, 1)
    # Rounding to the nearest code moves a weight by at most half a step; the scale itself is rounded to
    # bf16, so the largest |w| may be clamped by up to another 127 * BF16_EPS steps (< half a step);
    # dequantize() rounds to bf16 (half an ulp of |w|).
    assert ((deq - w).abs() <= step * (0.5 + 127 * BF16_EPS) + BF16_EPS * w.abs() + 1e-7).all()
    y, ref = lin(x).float(), x.float() @ deq.t()
    assert ((y - ref).abs() <= _kernel_bound(x, deq)).all()
    # end to end vs the float weights: the weight error above summed over K, plus the kernel's rounding
    bound = (x.float().abs() @ (step * (0.5 + 127 * BF16_EPS)).expand_as(w).t()) + _kernel_bound(x, w)
    assert ((y - x.float() @ w.t()).abs() <= bound).all()


def test_int4_weights_within_half_a_step_and_kernel_matches_its_weights():
    w, x = _weight_and_input()
    lin = Int4Linear(w, None)
    deq = lin.dequantize().float()
    sz = lin.scale_zero().transpose(0, 1)  # (N, K/G, 2)
    step = sz[..., 0].repeat_interleave(32, dim=1)  # (N, K)
    zero = sz[..., 1].repeat_interleave(32, dim=1)
    # Half a step of rounding; at a group's extremes the bf16-rounded scale and zero may clamp by up to
    # BF16_EPS * (|zero| + 8 steps) more; dequantize() rounds once more to bf16 (half an ulp of |w|).
    per_weight = 0.5 * step + BF16_EPS * (zero.abs() + 8 * step + w.abs()) + 1e-7
    assert ((deq - w).abs() <= per_weight).all()
    y = lin(x).float()
    assert ((y - x.float() @ deq.t()).abs() <= _kernel_bound(x, deq)).all()
    bound = x.float().abs() @ per_weight.t() + _kernel_bound(x, w)
    assert ((y - x.float() @ w.t()).abs() <= bound).all()


def test_int4_scales_sit_in_the_kernel_layout_and_the_state_dict_shows_them_plainly():
    """The kernel reads a code tile's 16 (scale, zero) pairs together, (N/16, K/G, 16, 2); state_dict() still gives
    quantize_int4's (K/G, N, 2) bits, so a session snapshot's model fingerprint does not depend on that layout."""
    w, _ = _weight_and_input()
    lin = Int4Linear(w, None)
    if not lin.native:
        pytest.skip("PyTorch's int4 kernel keeps its own layout")
    _, want = quantize_int4(w, dtype=torch.float32)  # (K/G, N, 2)
    stored = lin.scales_zeros.view(torch.float32)
    assert stored.shape == (192 // 16, 128 // 32, 16, 2)
    for n in (0, 15, 16, 191):  # row n, group s at [n // 16, s, n % 16]
        for s in range(128 // 32):
            assert torch.equal(stored[n // 16, s, n % 16], want[s, n])
    assert torch.equal(lin.scale_zero(), want)
    shown = lin.state_dict()["scales_zeros"]
    assert shown.dtype == torch.int32 and torch.equal(shown.view(torch.float32), want)
    assert lin.scales_zeros.shape == stored.shape  # the module's own buffer is untouched


def test_gguf_q4_1_blocks_map_onto_int4_groups_exactly():
    """A Q4_1 block stores w = d * q + m (q in 0..15); as an int4 group it is scale d, zero m + 8d."""
    g = torch.Generator().manual_seed(1)
    n, k = 64, 64
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).to(torch.bfloat16).float()
    m = (torch.randn(n, k // 32, 1, generator=g) * 0.02).to(torch.bfloat16).float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # GGUF's min/max rule puts both extremes in every block
    w = (d * q + m).view(n, k)
    codes, scales_zeros = quantize_int4(w)
    assert torch.equal(codes.view(n, k // 32, 32), q.to(torch.int32))
    assert torch.allclose(scales_zeros[..., 0].t().float(), d.squeeze(-1), rtol=BF16_EPS)


def _q5_0(n: int, k: int, seed: int, size: float = 0.01) -> torch.Tensor:
    """Weights as a dequantized GGUF Q5_0 tensor holds them (fp32, exact): (q - 16) * d per block of 32, d fp16, the
    block's largest magnitude at q = 0 (llama.cpp's rule; d of either sign)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * size + size / 10) * (torch.randint(0, 2, (n, k // 32, 1), generator=g) * 2 - 1)
    q = torch.randint(1, 32, (n, k // 32, 32), generator=g)
    q[..., 7] = 0
    return ((q - 16).float() * d.to(torch.float16).float()).view(n, k)


def test_gguf_q5_0_blocks_map_onto_int5_groups_exactly():
    """Q5_0 blocks come back as their codes and d: the int5 weight is the float weight rounded once to bf16 (our bf16
    reference's own weights), where int8 rounds it to a per-row grid; weights off that grid are not int5."""
    w = _q5_0(64, 128, seed=2)
    assert int5_exact(w) and not int4_exact(w)
    codes, d = quantize_int5(w)
    assert torch.equal(((codes.view(64, 4, 32).float() - 16) * d.float()[..., None]).view(64, 128), w)
    lin = Int5Linear(w, None)
    assert torch.equal(lin.dequantize(), w.to(torch.bfloat16))
    assert not torch.equal(Int8Linear(w, None).dequantize(), w.to(torch.bfloat16))
    assert torch.equal(lin.dequantize_rows(torch.tensor([3, 63, 0])), w[[3, 63, 0]].to(torch.bfloat16))
    off = w.clone()
    off[5, 9] += 1e-4
    assert not int5_exact(off) and not int5_exact(torch.randn(64, 128))


def _q8_0(n: int, k: int, seed: int = 0, size: float = 0.01) -> torch.Tensor:
    """Dequantized GGUF Q8_0 blocks: q * d per group of 32, q in -127..127 with one at 127 (llama.cpp's rule: d is
    the group's largest magnitude / 127), d fp16."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * size + size / 10).to(torch.float16).float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g)
    q[..., 5] = 127
    return (q.float() * d).view(n, k)


def test_gguf_q8_0_blocks_map_onto_grouped_int8_exactly():
    """Q8_0 blocks (both bundled models' tied embedding and LM head) come back as their codes and d: the weight
    rounded once to bf16 is our bf16 reference's own weight, where per-row int8 rounded the head to a coarser grid
    (most of SmolLM2 int4's logit error). The kernel multiplies the codes in integers (kakeya::q8_linear, its own
    tests): a row's logits are the same bits in any call, within fp32 sums of the exact product, and the fp32 logits
    the model projects round to the bf16 ones."""
    from kakeya_runtime.models import native

    w = _q8_0(64, 128, seed=3)
    codes, d = int8_grid(w)
    assert torch.equal((codes.view(64, 4, 32).float() * d.float()[..., None]).view(64, 128), w)
    lin = Int8Linear(w, None, grid=(codes, d))
    assert lin.grouped and torch.equal(lin.dequantize(), w.to(torch.bfloat16))
    assert not torch.equal(Int8Linear(w, None).dequantize(), w.to(torch.bfloat16))
    assert torch.equal(lin.dequantize_rows(torch.tensor([3, 63, 0])), w[[3, 63, 0]].to(torch.bfloat16))
    x = torch.randn(40, 128).to(torch.bfloat16)
    whole = lin.forward_fp32(x)
    exact = x.double() @ w.double().T
    assert ((whole.double() - exact).abs().max() / exact.abs().max()).item() < 1e-4
    for rows in (1, 2, 3, 4, 17, 40):
        assert torch.equal(lin.forward_fp32(x[:rows]), whole[:rows]), rows
        assert torch.equal(lin.kernel_mm(x[:rows]), whole[:rows].bfloat16()), rows
    assert native.q8_path(1) in ("vnni", "avx2", "rows")
    off = w.clone()
    off[5, 9] += 1e-4
    assert int8_grid(off) is None and int8_grid(torch.randn(64, 128)) is None
    model = _tiny_llama()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(_q8_0(256, 64, seed=5, size=0.05))
    report = quantize_model(model, "int4-mixed")
    assert model.lm_head.grouped and report.head_fmt is WeightFormat.INT8  # the tied head, kept exactly
    assert torch.equal(model.embed_tokens(torch.tensor([[7, 200]]))[0], model.lm_head.dequantize()[[7, 200]])


def test_int4_mixed_keeps_each_tensor_in_the_fewest_bits_that_hold_it():
    """int4-mixed: 4-bit blocks in int4, Q5_0 blocks in int5 (exactly), anything finer in int8, module by module
    (a tiny Llama whose layers hold each kind), and the mixed model decodes deterministically."""
    model = _tiny_llama()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            n, k = layer.mlp.gate_up_proj.weight.shape
            layer.mlp.gate_up_proj.weight.copy_(_q5_0(n, k, seed=10 + i, size=0.02))
            n, k = layer.self_attn.o_proj.weight.shape
            dq = (torch.rand(n, k // 32, 1, generator=g) * 0.05 + 0.01).to(torch.bfloat16).float()
            mq = (torch.randn(n, k // 32, 1, generator=g) * 0.1).to(torch.bfloat16).float()
            qq = torch.randint(0, 16, (n, k // 32, 32), generator=g)
            qq[..., 0], qq[..., 1] = 0, 15
            layer.self_attn.o_proj.weight.copy_((dq * qq + mq).view(n, k))
    report = quantize_model(model, "int4-mixed")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert report.kinds == {"Int5Linear": 2, "Int4Linear": 2, "Int8Linear": 5}, report.kinds
    assert kinds["layers.0.mlp.gate_up_proj"] == "Int5Linear" and kinds["layers.1.self_attn.o_proj"] == "Int4Linear"
    engine = Engine(model, prefill_chunk=8)
    prompt = list(range(3, 23))
    first = generate_greedy_cached(engine, prompt, max_new_tokens=12)
    assert first == generate_greedy_cached(engine, prompt, max_new_tokens=12)


@pytest.mark.parametrize("n", [16, 64, 80, 96, 960])
def test_int4_unpack_reads_the_kernel_layout(n):
    codes = torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(_unpack_int4(packed, n, 64), codes.to(torch.uint8))


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, Int5Linear])
def test_prefill_modes_agree_and_embedding_rows_match(cls):
    w, _ = _weight_and_input(n=128, k=64)
    x = torch.randn(2, 20, 64).to(torch.bfloat16)
    outs = {}
    for mode in Prefill:
        lin: QuantLinear = cls(w, None, prefill=mode, prefill_rows=8)
        if mode is Prefill.COPY:
            lin.bf16_copy = w.to(torch.bfloat16)
        outs[mode] = lin(x).float()
    deq = lin.dequantize().float()
    bound = _kernel_bound(x.view(-1, 64), deq).view(2, 20, 128)
    assert ((outs[Prefill.DEQUANT] - outs[Prefill.KERNEL]).abs() <= 2 * bound).all()
    ids = torch.tensor([[0, 5, 63, 64, 127]])
    assert torch.equal(QuantEmbedding(lin)(ids)[0], lin.dequantize()[ids[0]])


def _tiny_llama(seed: int = 0):
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tiny_model_greedy_under_int_formats_is_deterministic(fmt):
    model = _tiny_llama()
    before = weight_bytes(model)
    report = quantize_model(model, fmt, head=fmt)
    assert report.modules == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied head
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert report.weight_bytes_after < before / (3 if fmt == "int8" else 4)
    engine = Engine(model, prefill_chunk=8)
    prompt = list(range(3, 23))
    first = generate_greedy_cached(engine, prompt, max_new_tokens=12)
    assert first == generate_greedy_cached(engine, prompt, max_new_tokens=12)
    assert len(first) == len(prompt) + 12 and all(0 <= t < 256 for t in first)


def test_float_formats_cast_the_model():
    model = _tiny_llama()
    quantize_model(model, WeightFormat.FP32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    quantize_model(model, "bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_compiled_decode_matches_eager_greedy():
    """torch.compile of the decode step produces the eager engine's tokens (one variant: no cache growth)."""
    from kakeya_runtime.engine.compiled import CompiledDecode

    model = _tiny_llama()
    quantize_model(model, "int4")
    engine = Engine(model)
    prompt = list(range(3, 13))
    eager = generate_greedy_cached(engine, prompt, max_new_tokens=16)
    compiled = CompiledDecode(model)
    engine.decode_forward = compiled
    compiled.warmup(engine, lengths=(4,))
    assert generate_greedy_cached(engine, prompt, max_new_tokens=16) == eager


def _compiles() -> int:
    """Frames Dynamo has compiled in this process (a recompile counts one more)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def test_compiled_decode_compiles_nothing_after_warmup(make_tiny_model):
    """After warm-up, real generations compile nothing more: one crossing a ring's slot 0 from a prompt longer than
    the ring, made as the engine bench makes it (the cache reserved before prefill, outside inference mode), one on
    a session's cache (the full policy), a short one whose cache has no rings and one from a one-token prompt (its
    first step at length 1, a value Dynamo could specialise on), and one under another policy (decoded eagerly: on
    its cache object, each policy and layer was a variant compiled at its first request). The window (300) is past the 256
    positions a full layer starts with, as on Gemma 3 (512): a warm-up prefill then grew the full layers inside
    inference mode, and the real generation's step, on tensors of the other kind, compiled anew; so did the step
    writing slot 0. Tokens stay the eager engine's."""
    from kakeya_runtime.engine.compiled import CompiledDecode
    from kakeya_runtime.engine.generate import GenerateRequest
    from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache

    model = make_tiny_model("gemma3", sliding_window=300, max_position_embeddings=1024)
    engine = Engine(model, prefill_chunk=256)
    g = torch.Generator().manual_seed(1)
    long_ids = torch.randint(0, model.config.vocab_size, (1, 600), generator=g)
    slots = engine.new_cache(capacity=641)[0].slots
    assert 600 < 2 * slots < 600 + 40  # the first generation below writes slot 0 of the ring

    def run(cache, ids, steps):
        return engine.generate(cache, ids, GenerateRequest(max_new_tokens=steps)).token_ids[0]

    def runs():
        return [run(engine.new_cache(capacity=600 + 41), long_ids, 40),
                run(make_policy_cache(engine.config, PolicySpec(), capacity=1024), long_ids[:, :400], 8),
                run(engine.new_cache(capacity=40), long_ids[:, :20], 12),
                run(engine.new_cache(capacity=40), long_ids[:, :1], 4),
                # another policy decodes eagerly: compiled on its cache object, it compiled at its first request
                run(make_policy_cache(engine.config, PolicySpec.parse("sink_window", {"window": 64}), capacity=1024),
                    long_ids[:, :200], 6)]

    eager = runs()
    compiled = CompiledDecode(model)
    engine.decode_forward = compiled
    compiled.warmup(engine)
    before = _compiles()
    assert runs() == eager
    assert _compiles() == before


@pytest.mark.real_model
def test_gemma3_int4_mixed_serves_its_q5_0_tensors_exactly():
    """Gemma 3's GGUF holds most of its projections as Q5_0: under int4-mixed they are int5, and what the kernel
    multiplies by is our bf16 reference's weight bit for bit (int8 rounded those tensors to a per-row grid)."""
    from kakeya_runtime.models.loader import load_model

    ref = dict(load_model("gemma3-270m", dtype=torch.bfloat16).model.named_parameters())
    model = load_model("gemma3-270m", dtype=torch.float32).model
    report = quantize_model(model, "int4-mixed")
    assert report.kinds.get("Int5Linear", 0) >= 18, report.kinds
    for name, m in model.named_modules():
        if isinstance(m, Int5Linear):
            assert torch.equal(m.dequantize(), ref[name + ".weight"]), name


@pytest.mark.real_model
def test_smollm2_int4_serves_its_q8_0_head_exactly():
    """SmolLM2's GGUF holds its tied embedding and LM head as Q8_0: under int4 (and int4-mixed) the head is grouped
    int8, and the weight it holds is our bf16 reference's bit for bit."""
    from kakeya_runtime.models.loader import load_model

    ref = load_model("smollm2", dtype=torch.bfloat16).model.embed_tokens.weight
    model = load_model("smollm2", dtype=torch.float32).model
    quantize_model(model, "int4")
    assert model.lm_head.grouped and torch.equal(model.lm_head.dequantize(), ref)
