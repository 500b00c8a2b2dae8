"""The native attention kernel (kakeya::cached_attention) against an fp64 reference, and its routing in attend."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import attend, attention_mask


def reference(q, k, v, num_new, scale):
    """q (B, Hk, R, D) rows ordered (group, token); token t sees keys 0..S - num_new + t."""
    s = torch.einsum("bhrd,bhsd->bhrs", q.double(), k.double()) * scale
    limit = k.shape[2] - num_new + torch.arange(q.shape[2]) % num_new
    visible = torch.arange(k.shape[2])[None, :] <= limit[:, None]
    return torch.einsum("bhrs,bhsd->bhrd", s.masked_fill(~visible, float("-inf")).softmax(-1), v.double())


def cache_views(b, hk, s, d, dtype, gen, spare=37):
    """K/V as the cache hands them back: the filled prefix of a larger preallocated buffer (strided)."""
    k = torch.randn(b, hk, s + spare, d, generator=gen).to(dtype)[:, :, :s]
    v = torch.randn(b, hk, s + spare, d, generator=gen).to(dtype)[:, :, :s]
    return k, v


SHAPES = [  # (B, Hk, groups, new tokens, keys, head_dim)
    (1, 3, 3, 1, 7129, 64),  # SmolLM2 decode over a long cache: split across threads
    (1, 3, 3, 21, 1500, 64),  # an agent turn's append: tiled scores, causal tail
    (2, 2, 2, 5, 300, 32),  # batch, few rows (dot-product path) with a causal chunk
    (1, 1, 4, 1, 40, 256),  # Gemma 3's global layers: one K/V head, head_dim 256
    (1, 1, 4, 7, 1001, 256),  # odd key count: a missing key in the last pair
    (1, 3, 3, 1, 5, 64),  # fewer keys than a block
    (1, 4, 1, 3, 3, 128),  # the chunk is the whole cache
    (1, 2, 4, 33, 97, 64),  # rows not a multiple of the row tile
]


@pytest.mark.parametrize(("b", "hk", "g", "t", "s", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_reference(b, hk, g, t, s, d, dtype):
    gen = torch.Generator().manual_seed(b * 7 + t * 131 + s)
    q = torch.randn(b, hk, g * t, d, generator=gen).to(dtype)
    k, v = cache_views(b, hk, s, d, dtype, gen)
    out = native.cached_attention(q, k, v, t, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    want = reference(q, k, v, t, d**-0.5)
    # fp32 accumulates in fp32; bf16 rounds inputs, probabilities (in the bf16 dot path) and the output.
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_causal_rows_ignore_later_keys():
    """Token t of a chunk must not see keys after itself: changing those keys leaves its row unchanged."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 6, 64, generator=gen)  # 2 groups x 3 tokens
    k, v = torch.randn(1, 1, 50, 64, generator=gen), torch.randn(1, 1, 50, 64, generator=gen)
    base = native.cached_attention(q, k, v, 3, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0  # the last token's own key: only rows of token 2 see it
    v2[:, :, -1] -= 5.0
    moved = native.cached_attention(q, k2, v2, 3, 0.125)
    token = torch.arange(6) % 3
    assert torch.equal(moved[0, 0, token < 2], base[0, 0, token < 2])
    assert not torch.allclose(moved[0, 0, token == 2], base[0, 0, token == 2])


@pytest.mark.parametrize("threads", [1, 2])
def test_result_does_not_depend_on_the_batch_neighbour(threads):
    """Each (batch, head) is computed alone: a row's output is identical whatever the other batch row holds."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        q = torch.randn(2, 3, 3, 64, generator=gen)
        k, v = torch.randn(2, 3, 900, 64, generator=gen), torch.randn(2, 3, 900, 64, generator=gen)
        out = native.cached_attention(q, k, v, 1, 0.125)
        q2, k2 = q.clone(), k.clone()
        q2[1], k2[1] = torch.randn(3, 3, 64, generator=gen), torch.randn(3, 900, 64, generator=gen)
        assert torch.equal(native.cached_attention(q2, k2, v, 1, 0.125)[0], out[0])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("q_shape", "k_shape", "num_new", "message"), [
    ((1, 3, 3, 64), (1, 2, 10, 64), 1, "disagree"),  # K/V heads differ
    ((1, 3, 3, 48), (1, 3, 10, 48), 1, "head_dim 48"),  # no compiled head size
    ((1, 3, 4, 64), (1, 3, 10, 64), 3, "num_new"),  # rows not a multiple of the new tokens
    ((1, 3, 3, 64), (1, 3, 2, 64), 3, "num_new"),  # more new tokens than keys
])
def test_bad_shapes_raise(q_shape, k_shape, num_new, message):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(RuntimeError, match=message):
        native.cached_attention(q, k, k.clone(), num_new, 0.1)


def test_bad_dtypes_raise():
    q, k = torch.randn(1, 1, 2, 64, dtype=torch.float16), torch.randn(1, 1, 5, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="not supported"):
        native.cached_attention(q, k, k, 1, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.cached_attention(q.float(), k, k, 1, 0.1)


def _ran_native(fn) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key == "kakeya::cached_attention" for e in prof.key_averages())


@pytest.mark.parametrize(("t", "dtype", "routed"), [
    (1, torch.float32, True),  # decode: the kernel in both dtypes
    (1, torch.bfloat16, True),
    (9, torch.float32, False),  # an fp32 chunk: SDPA's GEMMs
    (9, torch.bfloat16, None),  # a bf16 chunk: the kernel where the CPU has bf16 dot products
])
def test_attend_routes_to_the_kernel(t, dtype, routed):
    """attend takes the kernel where it is faster and gives the reference result either way."""
    gen = torch.Generator().manual_seed(5)
    s = 400
    q = torch.randn(1, t, 9, 64, generator=gen).transpose(1, 2).to(dtype)  # (B, H, T, D) strided like the model's
    k, v = cache_views(1, 3, s, 64, dtype, gen)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    out = None

    def call():
        nonlocal out
        out, _ = attend(q, k, v, q_pos, k_pos, scale=0.125, window=None)

    expected = native.bf16_dot() if routed is None else routed
    assert _ran_native(call) is expected
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    scores = (q.double() @ kr.transpose(-1, -2) * 0.125).masked_fill(~attention_mask(q_pos, k_pos, None), float("-inf"))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ vr, atol=tol, rtol=tol)


def test_sdpa_backend_turns_the_kernel_off():
    q, k = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 100, 64)
    pos = torch.arange(100)
    try:
        native.set_backend("sdpa")
        assert not native.enabled()
        assert not _ran_native(lambda: attend(q, k, k, pos[-1:], pos, scale=0.125, window=None))
    finally:
        native.set_backend("native")
    assert native.enabled()
    assert _ran_native(lambda: attend(q, k, k, pos[-1:], pos, scale=0.125, window=None))


def test_unknown_backend_is_refused():
    with pytest.raises(native.NativeKernelError, match="expected one of"):
        native.set_backend("fast")


def test_build_is_keyed_by_source_and_machine():
    """The library sits under the kakeya cache dir in a folder named by its build key, and exists once loaded."""
    path = native.load()
    assert path == native.library_path() and path.exists()
    assert path.parent.parent.name == "kernels" and len(path.parent.name) == 16


def test_compiles_under_torch_compile():
    """engine.compiled traces attend: the op has a fake implementation and runs inside the compiled graph."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 3, 3, 64, generator=gen)
    k, v = torch.randn(1, 3, 200, 64, generator=gen), torch.randn(1, 3, 200, 64, generator=gen)
    fn = torch.compile(lambda q, k, v: native.cached_attention(q, k, v, 1, 0.125) * 2.0, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), native.cached_attention(q, k, v, 1, 0.125) * 2.0)


@pytest.mark.real_model
def test_real_model_turn_matches_sdpa(smollm2_bf16, english_text):
    """SmolLM2 in bf16, an agent-shaped turn (a long prefill, a 21-token append, decode steps) with the kernel
    and with SDPA: the same greedy tokens and next-token distributions within bf16 noise."""
    from kakeya_runtime.engine.generate import Engine

    engine = Engine(smollm2_bf16.model)
    ids = smollm2_bf16.tokenizer.encode(english_text).ids
    prefix, chunk = torch.tensor([ids[:600]]), torch.tensor([ids[600:621]])

    def turn() -> tuple[list[int], list[torch.Tensor]]:
        cache = engine.new_cache(capacity=1024)
        engine.prefill(cache, prefix)
        out = engine.prefill(cache, chunk)
        tokens, logps = [], []
        for _ in range(12):
            logp = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(logp.argmax()))
            logps.append(logp)
            out = engine.decode_step(cache, torch.tensor([[tokens[-1]]]))
        return tokens, logps

    try:
        native.set_backend("sdpa")
        want_tokens, want = turn()
    finally:
        native.set_backend("native")
    assert _ran_native(lambda: turn())
    tokens, got = turn()
    assert tokens == want_tokens
    kl = max(float((w.exp() * (w - g)).sum()) for w, g in zip(want, got, strict=True))
    assert kl < 5e-3, kl
