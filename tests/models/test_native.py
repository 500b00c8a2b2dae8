"""Our attention kernel (kakeya::cached_attention) against an fp64 reference, its invariance (a query's result
depends only on the keys it sees), and its routing in attend."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kakeya_runtime.models import native
from kakeya_runtime.models.layers import attend, attention_mask


def reference(q, k, v, q_pos, k_pos, scale, window=None, sink=0):
    """q (B, Hk, R, D) rows ordered (group, token); the window rule of the kernel, in fp64."""
    s = torch.einsum("bhrd,bhsd->bhrs", q.double(), k.double()) * scale
    token_pos = q_pos[torch.arange(q.shape[2]) % q_pos.shape[0]]
    visible = attention_mask(token_pos, k_pos, window, sink)
    return torch.einsum("bhrs,bhsd->bhrd", s.masked_fill(~visible, float("-inf")).softmax(-1), v.double())


def cache_views(b, hk, s, d, dtype, gen, spare=37):
    """K/V as the cache hands them back: the filled prefix of a larger preallocated buffer (strided)."""
    k = torch.randn(b, hk, s + spare, d, generator=gen).to(dtype)[:, :, :s]
    v = torch.randn(b, hk, s + spare, d, generator=gen).to(dtype)[:, :, :s]
    return k, v


def grouped(q_all, t0, t1):
    """Rows of tokens t0..t1-1 from per-token queries (B, Hk, G, T, D), ordered (group, token)."""
    b, hk, g, _, d = q_all.shape
    return q_all[:, :, :, t0:t1].reshape(b, hk, g * (t1 - t0), d).contiguous()


SHAPES = [  # (B, Hk, groups, new tokens, keys, head_dim)
    (1, 3, 3, 1, 7129, 64),  # SmolLM2 decode over a long cache: many superblocks
    (1, 3, 3, 21, 1500, 64),  # an agent turn's append
    (2, 2, 2, 5, 300, 32),  # batch, a causal chunk
    (1, 1, 4, 1, 40, 256),  # Gemma 3's global layers: one K/V head, head_dim 256
    (1, 1, 4, 7, 1001, 256),  # odd key count: a missing key in the last pair
    (1, 3, 3, 1, 5, 64),  # fewer keys than a block
    (1, 4, 1, 3, 3, 128),  # the chunk is the whole cache
    (1, 2, 4, 70, 97, 64),  # more tokens than a row tile
    (1, 2, 2, 9, 50, 16),  # the tiny test models' head size
]


@pytest.mark.parametrize(("b", "hk", "g", "t", "s", "d"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_reference(b, hk, g, t, s, d, dtype):
    gen = torch.Generator().manual_seed(b * 7 + t * 131 + s)
    q = torch.randn(b, hk, g * t, d, generator=gen).to(dtype)
    k, v = cache_views(b, hk, s, d, dtype, gen)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    out = native.cached_attention(q, k, v, q_pos, k_pos, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    # fp32 accumulates in fp32; bf16 rounds inputs, probabilities and the output.
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(q, k, v, q_pos, k_pos, d**-0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize(("window", "sink"), [(100, 0), (100, 4), (512, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_rule_matches_reference(window, sink, dtype):
    gen = torch.Generator().manual_seed(window + sink)
    s, t = 900, 40
    q = torch.randn(1, 2, 3 * t, 64, generator=gen).to(dtype)
    k, v = cache_views(1, 2, s, 64, dtype, gen)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    out = native.cached_attention(q, k, v, q_pos, k_pos, 0.125, window=window, sink=sink)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    want = reference(q, k, v, q_pos, k_pos, 0.125, window, sink)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_in_any_call(dtype, d, threads):
    """A fresh prompt, chunks over a cache and single decode rows: every token's output is bit-identical,
    whichever call it ran in and however many threads ran it."""
    gen = torch.Generator().manual_seed(d)
    s, hk, g = 1300, 2, 3
    k, v = cache_views(1, hk, s, d, dtype, gen)
    q_all = torch.randn(1, hk, g, s, d, generator=gen).to(dtype)
    pos = torch.arange(s)
    whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, d**-0.5).reshape(1, hk, g, s, d)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t0, t1 in [(0, 1), (5, 6), (511, 513), (700, 721), (1000, 1300), (s - 1, s)]:
            part = native.cached_attention(grouped(q_all, t0, t1), k[:, :, :t1], v[:, :, :t1], pos[t0:t1].clone(),
                                           pos[:t1], d**-0.5)
            assert torch.equal(part.reshape(1, hk, g, t1 - t0, d), whole[:, :, :, t0:t1]), (t0, t1)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_query_gets_the_same_bits_in_any_call(dtype):
    """With a window and sinks, the rows of a call that see a block are any subset of a row tile's (the window drops
    a block for later tokens, causality for earlier ones): each token's output is the bits it gets alone."""
    gen = torch.Generator().manual_seed(3)
    s, hk, g, d, window, sink = 700, 2, 3, 64, 45, 4
    k, v = cache_views(1, hk, s, d, dtype, gen)
    q_all = torch.randn(1, hk, g, s, d, generator=gen).to(dtype)
    pos = torch.arange(s)
    whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, 0.125, window=window, sink=sink)
    whole = whole.reshape(1, hk, g, s, d)
    for t0, t1 in [(0, 1), (3, 4), (40, 90), (47, 48), (300, 333), (s - 1, s)]:
        part = native.cached_attention(grouped(q_all, t0, t1), k[:, :, :t1], v[:, :, :t1], pos[t0:t1].clone(),
                                       pos[:t1], 0.125, window=window, sink=sink)
        assert torch.equal(part.reshape(1, hk, g, t1 - t0, d), whole[:, :, :, t0:t1]), (t0, t1)


@pytest.mark.parametrize("attention_amx", [False, True])
@pytest.mark.parametrize("g", [1, 2, 5, 7, 8, 15, 16])
def test_few_rows_on_narrow_tiles_keep_the_bits(g, attention_amx):
    """A call of fewer than 16 query rows runs on tiles as narrow as its rows (AMX): every row count from 1 to 16
    (a decode step of g query heads, one or two tokens) gives each row the bits it gets among a 40-token prompt's
    40 * g rows."""
    kept = native.routes()
    try:
        native.set_routes(attention_amx, kept.linear_amx)
        gen = torch.Generator().manual_seed(100 + g)
        s, hk, d = 700, 1, 64
        k, v = cache_views(1, hk, s, d, torch.bfloat16, gen)
        q_all = torch.randn(1, hk, g, s, d, generator=gen).to(torch.bfloat16)
        pos = torch.arange(s)
        t0 = s - 40
        whole = native.cached_attention(grouped(q_all, t0, s), k, v, pos[t0:].clone(), pos, 0.125)
        whole = whole.reshape(1, hk, g, 40, d)
        for t in (t0, s - 2):  # one token (g rows), two tokens (2g rows)
            n = 1 if t == t0 else 2
            part = native.cached_attention(grouped(q_all, t, t + n), k[:, :, : t + n], v[:, :, : t + n],
                                           pos[t : t + n].clone(), pos[: t + n], 0.125)
            assert torch.equal(part.reshape(1, hk, g, n, d), whole[:, :, :, t - t0 : t - t0 + n]), (g, n)
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


@pytest.mark.parametrize("attention_amx", [False, True])
@pytest.mark.parametrize("layout", ["heads_major", "tokens_major", "rotated"])
@pytest.mark.parametrize("d", [64, 256])
def test_decode_rows_read_keys_in_place_with_the_prompts_bits(d, layout, attention_amx):
    """A decode step's few rows take their scores with the keys read where the cache keeps them (AMX: K as the tile
    that the prompt's rows take as Q): keys a row apart or heads apart, whole 16-key tiles in order, a partial last
    one, and a rotated ring's tiles out of order (copied); an infinite and a -0 query value, a huge key. Every row
    keeps the bits it gets among the prompt's rows."""
    kept = native.routes()
    try:
        native.set_routes(attention_amx, kept.linear_amx)
        gen = torch.Generator().manual_seed(d + len(layout))
        s, hk, g = 333, 2, 3
        if layout == "tokens_major":  # (B, S, Hk, D) storage seen as (B, Hk, S, D): rows Hk * D apart
            k = torch.randn(1, s + 5, hk, d, generator=gen).bfloat16().transpose(1, 2)[:, :, :s]
            v = torch.randn(1, s + 5, hk, d, generator=gen).bfloat16().transpose(1, 2)[:, :, :s]
        else:
            k, v = cache_views(1, hk, s, d, torch.bfloat16, gen)
        k[0, 1, 100, 3] = 3e38
        q_all = torch.randn(1, hk, g, s, d, generator=gen).bfloat16()
        q_all[0, 0, 1, s - 1, 7] = float("inf")
        q_all[0, 1, 2, s - 1, 0] = -0.0
        pos = torch.arange(s)
        whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, d**-0.5).reshape(1, hk, g, s, d)
        if layout == "rotated":  # a ring's slots: the keys stored from position 117 on first
            order = torch.cat((torch.arange(117, s), torch.arange(117)))
            k, v, pos = k[:, :, order].contiguous(), v[:, :, order].contiguous(), pos[order].contiguous()
        for t in (s - 1, 250, 143, 16, 0):
            n = s if layout == "rotated" else t + 1  # a ring holds every key; a prefix cache the ones up to t
            part = native.cached_attention(grouped(q_all, t, t + 1), k[:, :, :n], v[:, :, :n], torch.tensor([t]),
                                           pos[:n], d**-0.5)
            got, want = part.reshape(1, hk, g, 1, d), whole[:, :, :, t : t + 1]
            assert torch.equal(got.isnan(), want.isnan()), t
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), t
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_rows_that_see_different_lanes_keep_the_prompts_bits(dtype, d):
    """A call of at most 4 rows (a decode step's query heads, one or two tokens) runs each block for all its rows at
    once; rows that see different lanes (two tokens at a window's edge), rows whose probabilities underflow to 0
    where the others' do not (one head's sharp key), non-finite values and a -0 query keep the bits each row gets
    among a prompt's rows."""
    gen = torch.Generator().manual_seed(d + 7)
    s, hk, g, window, sink = 420, 1, 2, 70, 3
    k, v = cache_views(1, hk, s, d, dtype, gen)
    q_all = torch.randn(1, hk, g, s, d, generator=gen).to(dtype)
    q_all[0, 0, 0, :, :] = k[0, 0, 380] * 40  # head 0 attends one key sharply: the others' p underflow to 0 there
    q_all[0, 0, 1, s - 1, 0] = -0.0
    v = v.clone()
    v[0, 0, 390, 5], v[0, 0, 200, 1] = float("nan"), float("inf")  # 390 is seen by the last tokens, 200 by none
    pos = torch.arange(s)
    whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, d**-0.5, window=window, sink=sink)
    whole = whole.reshape(1, hk, g, s, d)
    for t0, n in [(s - 1, 1), (s - 2, 2), (380, 2), (71, 2), (3, 1)]:
        part = native.cached_attention(grouped(q_all, t0, t0 + n), k[:, :, : t0 + n], v[:, :, : t0 + n],
                                       pos[t0 : t0 + n].clone(), pos[: t0 + n], d**-0.5, window=window, sink=sink)
        got, want = part.reshape(1, hk, g, n, d), whole[:, :, :, t0 : t0 + n]
        assert torch.equal(got.isnan(), want.isnan()), (t0, n)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (t0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_order_and_unseen_keys_do_not_matter(dtype):
    """A ring cache hands keys back rotated, a sink + window cache with gaps: the same keys seen give the same
    bits as the whole causal prefix under the window rule."""
    gen = torch.Generator().manual_seed(4)
    s, window, sink = 1000, 100, 4
    k, v = cache_views(1, 2, s, 64, dtype, gen)
    q_all = torch.randn(1, 2, 3, s, 64, generator=gen).to(dtype)
    pos = torch.arange(s)
    whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, 0.125, window=window, sink=sink)
    whole = whole.reshape(1, 2, 3, s, 64)
    t = 900
    held = torch.cat((torch.arange(sink), torch.arange(t - window + 1, t + 1)))
    held = held[torch.randperm(held.shape[0], generator=gen)]
    out = native.cached_attention(grouped(q_all, t, t + 1), k[:, :, held].contiguous(), v[:, :, held].contiguous(),
                                  pos[t : t + 1].clone(), held, 0.125, window=window, sink=sink)
    assert torch.equal(out.reshape(1, 2, 3, 1, 64), whole[:, :, :, t : t + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [0, 37, 511])
def test_consecutive_keys_cut_like_any_order(dtype, first):
    """Keys at consecutive positions in order (a cache's usual keys, cut into blocks by arithmetic) give the bits
    of the same keys handed in shuffled (cut key by key), for chunk rows and decode rows, from a start on or off a
    block boundary, with and without a window."""
    gen = torch.Generator().manual_seed(first)
    s, hk, g, d = 1300, 2, 3, 64
    k, v = cache_views(1, hk, s, d, dtype, gen)
    pos = torch.arange(first, first + s)
    shuffle = torch.randperm(s, generator=gen)
    ks, vs, ps = k[:, :, shuffle].contiguous(), v[:, :, shuffle].contiguous(), pos[shuffle].contiguous()
    for t0, t1, window, sink in [(s - 21, s, 0, 0), (s - 1, s, 0, 0), (s - 1, s, 300, 4), (700, 720, 200, 0)]:
        q = torch.randn(1, hk, g * (t1 - t0), d, generator=gen).to(dtype)
        q_pos = pos[t0:t1].clone()
        ordered = native.cached_attention(q, k, v, q_pos, pos, d**-0.5, window=window, sink=sink)
        shuffled = native.cached_attention(q, ks, vs, q_pos, ps, d**-0.5, window=window, sink=sink)
        assert torch.equal(ordered, shuffled), (t0, t1, window)
    q = torch.randn(1, hk, g, d, generator=gen).to(dtype)
    last = pos[-1:].clone()
    rows = native.cached_attention_rows(q, [k], [v], [pos], last, d**-0.5, window=[0], sink=[0])
    assert torch.equal(rows, native.cached_attention_rows(q, [ks], [vs], [ps], last, d**-0.5, window=[0], sink=[0]))


def test_causal_rows_ignore_later_keys():
    """Token t of a chunk must not see keys after itself: changing those keys leaves its row unchanged."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 6, 64, generator=gen)  # 2 groups x 3 tokens
    k, v = torch.randn(1, 1, 50, 64, generator=gen), torch.randn(1, 1, 50, 64, generator=gen)
    q_pos, k_pos = torch.arange(47, 50), torch.arange(50)
    base = native.cached_attention(q, k, v, q_pos, k_pos, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0  # the last token's own key: only rows of token 2 see it
    v2[:, :, -1] -= 5.0
    moved = native.cached_attention(q, k2, v2, q_pos, k_pos, 0.125)
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
        q_pos, k_pos = torch.tensor([899]), torch.arange(900)
        out = native.cached_attention(q, k, v, q_pos, k_pos, 0.125)
        q2, k2 = q.clone(), k.clone()
        q2[1], k2[1] = torch.randn(3, 3, 64, generator=gen), torch.randn(3, 900, 64, generator=gen)
        assert torch.equal(native.cached_attention(q2, k2, v, q_pos, k_pos, 0.125)[0], out[0])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(("q_shape", "k_shape", "q_pos", "k_pos", "message"), [
    ((1, 3, 3, 64), (1, 2, 10, 64), [9], list(range(10)), "disagree"),  # K/V heads differ
    ((1, 3, 3, 48), (1, 3, 10, 48), [9], list(range(10)), "head_dim 48"),  # no compiled head size
    ((1, 3, 4, 64), (1, 3, 10, 64), [7, 8, 9], list(range(10)), "multiple of the new tokens"),
    ((1, 3, 3, 64), (1, 3, 10, 64), [9], list(range(9)), "k_pos has 9 positions"),
    ((1, 3, 3, 64), (1, 3, 3, 64), [2], [0, 1, 1], "given twice"),  # a position twice
    ((1, 3, 3, 64), (1, 3, 3, 64), [2], [-1, 1, 2], "negative key position"),
])
def test_bad_shapes_raise(q_shape, k_shape, q_pos, k_pos, message):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(RuntimeError, match=message):
        native.cached_attention(q, k, k.clone(), torch.tensor(q_pos), torch.tensor(k_pos), 0.1)


def test_bad_dtypes_raise():
    q, k = torch.randn(1, 1, 2, 64, dtype=torch.float16), torch.randn(1, 1, 5, 64, dtype=torch.float16)
    pos, k_pos = torch.tensor([3, 4]), torch.arange(5)
    with pytest.raises(RuntimeError, match="not supported"):
        native.cached_attention(q, k, k, pos, k_pos, 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.cached_attention(q.float(), k, k, pos, k_pos, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        native.cached_attention(q.float(), k.float(), k.float(), pos.int(), k_pos, 0.1)



def test_negative_windows_and_sinks_raise():
    """window -3 ran as no window and sink -5 as 0 (the batched rows' call refused both already)."""
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 5, 64)
    pos, k_pos = torch.tensor([4]), torch.arange(5)
    for window, sink in ((-3, 0), (4, -5)):
        with pytest.raises(RuntimeError, match="window and sink must be >= 0"):
            native.cached_attention(q, k, k, pos, k_pos, 0.1, window=window, sink=sink)


def _ran_native(fn) -> bool:
    """Whether fn's attention ran on our kernel: the op itself, or the native layer stack that calls it inside."""
    ours = {"kakeya::cached_attention", "kakeya::DecoderStack.step", "kakeya::DecoderStack.step_chunk"}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key in ours for e in prof.key_averages())


@pytest.mark.parametrize(("t", "s", "window"), [
    (1, 400, None),  # decode
    (9, 400, None),  # a chunk over a cache
    (40, 40, None),  # a fresh prompt
    (9, 400, 64),  # a windowed chunk (Gemma's sliding layers, sink_window)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_routes_every_case_to_the_kernel(t, s, window, dtype):
    """With the native backend every attention call runs on the kernel (one computation for every shape) and
    gives the reference result."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, t, 9, 64, generator=gen).transpose(1, 2).to(dtype)  # (B, H, T, D) strided like the model's
    k, v = cache_views(1, 3, s, 64, dtype, gen)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    out = None

    def call():
        nonlocal out
        out, _ = attend(q, k, v, q_pos, k_pos, scale=0.125, window=window)

    assert _ran_native(call)
    kr, vr = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    mask = attention_mask(q_pos, k_pos, window)
    scores = (q.double() @ kr.transpose(-1, -2) * 0.125).masked_fill(~mask, float("-inf"))
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ vr, atol=tol, rtol=tol)


def test_unsupported_head_size_is_an_error_not_a_fallback():
    q, k = torch.randn(1, 2, 1, 48), torch.randn(1, 2, 10, 48)
    pos = torch.arange(10)
    with pytest.raises(native.NativeKernelError, match="head_dim 48"):
        attend(q, k, k, pos[-1:], pos, scale=0.1, window=None)


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


def test_a_failed_build_says_why_and_leaves_no_library(tmp_path, monkeypatch):
    """Every source compiles as its own job; a compiler that is missing or fails answers with a typed error naming
    the way around it, and nothing is left where the library would be."""
    target = tmp_path / "kernels" / "cached_attention.so"
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native.NativeKernelError, match="no C\\+\\+ compiler"):
        native.build(target)
    monkeypatch.setenv("CXX", "false")  # runs, compiles nothing, exits 1
    with pytest.raises(native.NativeKernelError, match=r"building the kernels failed \(exit 1\).*KAKEYA_ATTENTION=sdpa"):
        native.build(target)
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == ["build.lock"]


def test_routes_are_measured_once_per_build_and_cached(tmp_path):
    """The real calibration: both invariant paths timed on this machine (AMX where usable), the faster kept per
    kernel, written once beside the library and read back by later processes without measuring again."""
    found = native.calibrate(repeats=1)
    if not bool(torch.ops.kakeya.amx_available()):
        assert found.source == "no-amx" and not found.attention_amx and not found.linear_amx
        return
    assert found.source == "calibrated"
    assert set(found.timings) == {"attention_amx", "attention_avx512", "linear_amx", "linear_avx512"}
    assert all(t > 0 for t in found.timings.values())
    t = found.timings
    assert found.attention_amx == (t["attention_avx512"] >= native.ROUTE_MARGIN * t["attention_amx"])
    assert found.linear_amx == (t["linear_avx512"] >= native.ROUTE_MARGIN * t["linear_amx"])
    assert native.routes().attention_amx == native.bf16_amx()  # calibrate() left the routes in force alone
    file = tmp_path / native.ROUTES_FILE
    first = native._cached_routes(file)
    assert first.source == "calibrated" and file.exists()
    again = native._cached_routes(file)
    assert again.source == "cached"
    assert (again.attention_amx, again.linear_amx, again.timings) == (first.attention_amx, first.linear_amx,
                                                                       first.timings)
    assert (native.library_path().parent / native.ROUTES_FILE).exists()  # this build's own choice


@pytest.mark.parametrize(("attention_amx", "linear_amx"), [(False, False), (True, True)])
def test_every_route_is_invariant(attention_amx, linear_amx):
    """Whichever route the calibration picks, a token's attention output and projection are the same bits in a
    decode row, a chunk over the cache and a whole prompt."""
    kept = native.routes()
    try:
        native.set_routes(attention_amx, linear_amx)
        gen = torch.Generator().manual_seed(3)
        s, hk, g, d = 700, 3, 3, 64
        k, v = cache_views(1, hk, s, d, torch.bfloat16, gen)
        q_all = torch.randn(1, hk, g, s, d, generator=gen).bfloat16()
        pos = torch.arange(s)
        whole = native.cached_attention(grouped(q_all, 0, s), k, v, pos, pos, 0.125).reshape(1, hk, g, s, d)
        for t0, t1 in [(s - 1, s), (300, 557)]:
            part = native.cached_attention(grouped(q_all, t0, t1), k[:, :, :t1], v[:, :, :t1], pos[t0:t1].clone(),
                                           pos[:t1], 0.125)
            assert torch.equal(part.reshape(1, hk, g, t1 - t0, d), whole[:, :, :, t0:t1])
        x, w = torch.randn(300, 576, generator=gen).bfloat16(), torch.randn(960, 576, generator=gen).bfloat16()
        y = native.linear(x, w)
        assert torch.equal(native.linear(x[7:8], w), y[7:8]) and torch.equal(native.linear(x[:37], w), y[:37])
        if bool(torch.ops.kakeya.amx_available()):
            assert native.bf16_amx() == attention_amx
            assert (native.linear_path(torch.bfloat16, 576, 960) == "amx") == linear_amx
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


def test_compiles_under_torch_compile():
    """engine.compiled traces attend and the projections: both ops have fake implementations."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 3, 3, 64, generator=gen)
    k, v = torch.randn(1, 3, 200, 64, generator=gen), torch.randn(1, 3, 200, 64, generator=gen)
    q_pos, k_pos = torch.tensor([199]), torch.arange(200)
    w = torch.randn(32, 64, generator=gen)

    def fn(q, k, v):
        out = native.cached_attention(q, k, v, q_pos, k_pos, 0.125)
        return native.linear(out.reshape(-1, 64), w) * 2.0

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v))


@pytest.mark.real_model
def test_real_model_turn_matches_sdpa(smollm2_bf16, english_text):
    """SmolLM2 in bf16, an agent-shaped turn (a long prefill, a 21-token append, decode steps) on our kernels
    and on PyTorch's: the same greedy tokens and next-token distributions within bf16 noise."""
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


@pytest.mark.parametrize("attention_amx", [False, True])
@pytest.mark.parametrize(("dtype", "d", "g"), [(torch.bfloat16, 64, 3), (torch.float32, 64, 3),
                                               (torch.bfloat16, 256, 4), (torch.float32, 32, 2)])
def test_rows_in_one_call_equal_each_row_alone(attention_amx, dtype, d, g):
    """kakeya::cached_attention_rows (the decode rows of a batched step, one call) gives every row the bits of its
    own cached_attention call: its own cache length (1 key to several superblocks), window, sinks, a ring's
    wrapped key order, a strided cache view, and whoever shares the call."""
    kept = native.routes()
    try:
        native.set_routes(attention_amx, kept.linear_amx)
        gen = torch.Generator().manual_seed(17 + d)
        hk = 2
        rows = [  # (keys, window, sink, ring: the keys as a wrapped ring hands them)
            (1, 0, 0, False), (300, 0, 0, False), (1537, 0, 0, False), (90, 16, 4, False), (700, 64, 0, True),
            (33, 0, 0, True), (2049, 128, 4, True), (5, 3, 1, False),
        ]
        q = torch.randn(len(rows), hk, g, d, generator=gen).to(dtype)
        ks, vs, kps, q_pos, windows, sinks = [], [], [], [], [], []
        for s, window, sink, ring in rows:
            k, v = cache_views(1, hk, s, d, dtype, gen)
            pos = torch.arange(s) + (3 * s if ring else 0)  # a ring: later positions, stored from a slot on
            if ring and s > 1:
                cut = s // 3
                pos = torch.cat((pos[cut:], pos[:cut]))
            ks.append(k), vs.append(v), kps.append(pos), windows.append(window), sinks.append(sink)
            q_pos.append(int(pos.max()))
        q_pos = torch.tensor(q_pos)
        got = native.cached_attention_rows(q, ks, vs, kps, q_pos, 0.125, window=windows, sink=sinks)
        for i in range(len(rows)):
            alone = native.cached_attention(q[i : i + 1], ks[i], vs[i], q_pos[i : i + 1], kps[i], 0.125,
                                            window=windows[i] or None, sink=sinks[i])
            assert torch.equal(got[i : i + 1], alone), rows[i]
            ref = reference(q[i : i + 1], ks[i], vs[i], q_pos[i : i + 1], kps[i], 0.125, windows[i] or None, sinks[i])
            torch.testing.assert_close(alone.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
        order = [5, 2, 0]  # a subset in another order: still each row's own bits
        sub = native.cached_attention_rows(q[order].contiguous(), [ks[i] for i in order], [vs[i] for i in order],
                                           [kps[i] for i in order], q_pos[order], 0.125,
                                           window=[windows[i] for i in order], sink=[sinks[i] for i in order])
        assert torch.equal(sub, got[order])
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


@pytest.mark.parametrize("attention_amx", [False, True])
@pytest.mark.parametrize(("dtype", "d", "g"), [(torch.bfloat16, 64, 3), (torch.float32, 32, 2)])
def test_rows_append_equals_each_cache_write_then_its_call_alone(attention_amx, dtype, d, g):
    """kakeya::cached_attention_rows_append (decode rows whose cache write runs in the call) leaves every cache as
    its update_and_fetch of the token does and gives every row the bits of cached_attention alone over what that
    returns: full layers (an empty one, room to spare, a wrapped ring), a ring before and after it wraps, and a row
    whose keys came from update_and_fetch (slot -1) in the same call."""
    from kakeya_runtime.kv.cache import FullLayerKV, SlidingLayerKV

    kept = native.routes()
    try:
        native.set_routes(attention_amx, kept.linear_amx)
        gen = torch.Generator().manual_seed(5 + d)
        hk = 2

        def filled(kind: str, length: int):
            layer = (FullLayerKV(1, hk, d, 4096, dtype=dtype, initial=64) if kind == "full"
                     else SlidingLayerKV(1, hk, d, 48, dtype=dtype, spare=5))
            for start in range(0, length, 100):  # chunks, as prefills write them
                t = min(100, length - start)
                kv = torch.randn(2, 1, hk, t, d, generator=gen).to(dtype)
                layer.update_and_fetch(kv[0], kv[1], torch.arange(start, start + t))
            return layer

        rows = [("full", 0, 0, 0), ("full", 300, 0, 0), ("full", 1100, 64, 4), ("ring", 20, 48, 0),
                ("ring", 53, 48, 0), ("ring", 250, 48, 2), ("given", 77, 0, 0)]  # (kind, length, window, sink)
        n = len(rows)
        q = torch.randn(n, hk, g, d, generator=gen).to(dtype)
        qkv = torch.randn(n, 1, 3 * hk * d, generator=gen).to(dtype)  # new K/V as strided views, as the model's
        k_new = qkv[..., : hk * d].view(n, 1, hk, d).transpose(1, 2)
        v_new = qkv[..., hk * d : 2 * hk * d].view(n, 1, hk, d).transpose(1, 2)
        q_pos = torch.tensor([length for _, length, _, _ in rows])
        ours = [filled("full" if kind == "given" else kind, length) for kind, length, _, _ in rows]
        theirs = [filled("full" if kind == "given" else kind, length) for kind, length, _, _ in rows]
        for a, b in zip(ours, theirs, strict=True):  # the same random contents in both copies
            b.load_state(a.state())
        ks, vs, kps, slots, counts, writes = [], [], [], [], [], []
        for i, (kind, *_rest) in enumerate(rows):
            if kind == "given":
                k, v, kp = ours[i].update_and_fetch(k_new[i : i + 1], v_new[i : i + 1], q_pos[i : i + 1])
                slot, count, write = -1, k.shape[2], False
            else:
                k, v, kp, slot, count, write = ours[i].append_slot()
            ks.append(k), vs.append(v), kps.append(kp), slots.append(slot), counts.append(count), writes.append(write)
        windows, sinks = [r[2] for r in rows], [r[3] for r in rows]
        got = native.cached_attention_rows_append(q, k_new, v_new, ks, vs, kps, slots, counts, writes, q_pos, 0.125,
                                                  window=windows, sink=sinks)
        for i in range(n):
            k, v, kp = theirs[i].update_and_fetch(k_new[i : i + 1], v_new[i : i + 1], q_pos[i : i + 1])
            alone = native.cached_attention(q[i : i + 1], k, v, q_pos[i : i + 1], kp.contiguous(), 0.125,
                                            window=windows[i] or None, sink=sinks[i])
            assert torch.equal(got[i : i + 1], alone), rows[i]
            assert ours[i].length == theirs[i].length
            for key, value in theirs[i].state().items():
                assert torch.equal(ours[i].state()[key], value), (rows[i], key)
    finally:
        native.set_routes(kept.attention_amx, kept.linear_amx)


def test_rows_append_refuses_a_slot_outside_the_buffer():
    q = torch.randn(1, 1, 1, 32)
    k, v = torch.zeros(1, 1, 4, 32), torch.zeros(1, 1, 4, 32)
    new = torch.randn(1, 1, 1, 32)
    with pytest.raises(RuntimeError, match="outside its 4 slots"):
        native.cached_attention_rows_append(q, new, new, [k], [v], [torch.arange(4)], [4], [5], [False],
                                            torch.tensor([4]), 0.1, window=[0], sink=[0])
    with pytest.raises(RuntimeError, match=r"must be \(N, Hk, 1, D\)"):
        native.cached_attention_rows_append(q, torch.randn(1, 1, 2, 32), new, [k], [v], [torch.arange(4)], [0], [1],
                                            [False], torch.tensor([0]), 0.1, window=[0], sink=[0])
    assert torch.equal(k, torch.zeros_like(k))  # refused before anything was written


def test_rows_call_refuses_mismatched_rows():
    q = torch.randn(2, 1, 1, 32)
    k = torch.randn(1, 1, 4, 32)
    with pytest.raises(RuntimeError, match="one k, v, k_pos, window and sink per row"):
        native.cached_attention_rows(q, [k], [k], [torch.arange(4)], torch.tensor([3, 3]), 0.1, window=[0], sink=[0])
    with pytest.raises(RuntimeError, match="disagree"):
        native.cached_attention_rows(q, [k, torch.randn(1, 2, 4, 32)], [k, torch.randn(1, 2, 4, 32)],
                                     [torch.arange(4)] * 2, torch.tensor([3, 3]), 0.1, window=[0, 0], sink=[0, 0])


def test_a_damaged_kernel_library_is_named_before_it_is_loaded(tmp_path):
    """A cut-short library (a full disk, a killed copy) mapped by the loader ended the process with SIGBUS at its
    first call and no message: its ELF section headers must lie inside the file."""
    import os
    import shutil

    built = native.load()
    assert native._elf_problem(built) is None
    cut = tmp_path / "cut.so"
    shutil.copy(built, cut)
    os.truncate(cut, cut.stat().st_size // 2)
    assert "truncated" in native._elf_problem(cut)
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    assert "not a 64-bit ELF" in native._elf_problem(empty)
