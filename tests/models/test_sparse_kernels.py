"""The sparse policy's kernels (kakeya::sparse_attention, kakeya::block_select) against fp64 references, and
their invariance: a token's result and choice depend only on what it sees, however the tokens are batched."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.models import native


def hot_lo(p: int, window: int, sink: int, block: int) -> int:
    out = p + 1 - window - sink
    return sink if out <= 0 else sink + out // block * block


def reference(q, hot, cold, select, q_pos, scale, window, sink, block):
    """fp64 softmax over each row's visible keys: the hot rule and the selected cold blocks."""
    (hk, hv, hp), (ck, cv, cp) = hot, cold
    b, h, r, d = q.shape
    t_n = q_pos.shape[0]
    out = torch.zeros(b, h, r, d, dtype=torch.float64)
    seen = torch.zeros(b, h, r, 2, dtype=torch.long)
    for bi in range(b):
        for hi in range(h):
            for ri in range(r):
                t = ri % t_n
                p = int(q_pos[t])
                lo = hot_lo(p, window, sink, block)
                keys, vals = [], []
                for j, kp in enumerate(hp.tolist()):
                    if kp <= p and (kp < sink or kp >= lo):
                        keys.append(hk[bi, hi, j])
                        vals.append(hv[bi, hi, j])
                        seen[bi, hi, ri, 0] += 1
                word = select[bi, hi, t].tolist()
                for j, kp in enumerate(cp.tolist()):
                    blk = (kp - sink) // block
                    if sink <= kp < lo and (word[blk // 64] >> (blk % 64)) & 1:
                        keys.append(ck[bi, hi, j])
                        vals.append(cv[bi, hi, j])
                        seen[bi, hi, ri, 1] += 1
                if not keys:
                    continue
                kk, vv = torch.stack(keys).double(), torch.stack(vals).double()
                w = torch.softmax(kk @ q[bi, hi, ri].double() * scale, dim=0)
                out[bi, hi, ri] = w @ vv
    return out, seen


def slots(blocks: list[int], n_blocks: int) -> torch.Tensor:
    """cold_slot for decoded blocks stacked in the order `blocks` lists them (-1: absent)."""
    out = torch.full((n_blocks,), -1, dtype=torch.long)
    out[torch.tensor(blocks, dtype=torch.long)] = torch.arange(len(blocks))
    return out


def bitsets(chosen: list[list[list[list[int]]]], words: int) -> torch.Tensor:
    """(B, Hk, T, words) int64 bitsets from per-token block lists."""
    out = torch.zeros(len(chosen), len(chosen[0]), len(chosen[0][0]), words, dtype=torch.long)
    for b, heads in enumerate(chosen):
        for h, toks in enumerate(heads):
            for t, blocks in enumerate(toks):
                for j in blocks:
                    w = out[b, h, t, j // 64].item() | (1 << (j % 64))
                    out[b, h, t, j // 64] = w - (1 << 64) if w >= 1 << 63 else w
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 256])
def test_sparse_attention_matches_reference(dtype, d):
    torch.manual_seed(0)
    sink, window, block, hkv, g = 4, 40, 16, 2, 3
    n = 400  # positions 0..399; tokens at the end
    q_pos = torch.tensor([371, 385, 399])
    q = torch.randn(1, hkv, g * 3, d).to(dtype)
    kv = torch.randn(2, 1, hkv, n, d).to(dtype)
    # hot: sinks and the last window + block positions (what the cache holds), in ring order
    hot_p = torch.cat((torch.arange(sink), torch.arange(n - window - block - 5, n).roll(7)))
    n_blocks = (n - sink) // block
    chosen = [[[[0, 3, 7, 19], [1, 20, 21], [2, 5, 8, 13, 22]] for _ in range(hkv)]]
    chosen[0][1][0] = [4, 6]
    sel = bitsets(chosen, 1)
    cold_blocks = sorted({j for heads in chosen[0] for toks in heads for j in toks}, reverse=True)  # any order
    cold_p = torch.cat([torch.arange(sink + j * block, sink + (j + 1) * block) for j in cold_blocks])
    cold_kv = kv[:, :, :, cold_p] + 0.01  # decoded copies differ from the exact ones
    hot = (kv[0][:, :, hot_p].contiguous(), kv[1][:, :, hot_p].contiguous(), hot_p)
    cold = (cold_kv[0].contiguous(), cold_kv[1].contiguous(), cold_p)
    assert n_blocks > 22
    out, seen = native.sparse_attention(q, hot, (*cold[:2], slots(cold_blocks, n_blocks)), sel, q_pos, d**-0.5,
                                        window=window, sink=sink, block=block)
    ref, ref_seen = reference(q, hot, cold, sel, q_pos, d**-0.5, window, sink, block)
    assert torch.equal(seen, ref_seen)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.double() - ref).abs().max() < tol
    # a block above a token's hot boundary is never attended from the cold side, even when selected
    assert seen[0, 0, 2, 1] == 16 * len([j for j in chosen[0][0][2] if sink + (j + 1) * block <= hot_lo(399, window,
                                                                                                       sink, block)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_per_head_slots(dtype):
    """cold_slot (Hc, N): each head holds its own blocks at its own slots; the output is the bits of one shared map
    over the same blocks, and a block a head selected but does not hold raises (even when another head holds it)."""
    torch.manual_seed(4)
    sink, window, block, hkv, g, d = 4, 40, 16, 2, 3, 64
    n = 400
    q_pos = torch.tensor([385, 399])
    q = torch.randn(1, hkv, g * 2, d).to(dtype)
    kv = torch.randn(2, 1, hkv, n, d).to(dtype)
    hot_p = torch.cat((torch.arange(sink), torch.arange(n - window - block - 5, n)))
    hot = (kv[0][:, :, hot_p].contiguous(), kv[1][:, :, hot_p].contiguous(), hot_p)
    n_blocks = (n - sink) // block
    chosen = [[[[0, 3, 7], [1, 3, 20]], [[2, 5], [5, 8, 13, 21]]]]
    sel = bitsets(chosen, 1)
    shared = sorted({j for heads in chosen[0] for toks in heads for j in toks})
    cold_p = torch.cat([torch.arange(sink + j * block, sink + (j + 1) * block) for j in shared])
    ref, ref_seen = native.sparse_attention(q, hot, (kv[0][:, :, cold_p].contiguous(), kv[1][:, :, cold_p].contiguous(),
                                                     slots(shared, n_blocks)), sel, q_pos, 0.125, window=window,
                                            sink=sink, block=block)
    # per head: only the blocks it selected, in its own order, at most 6 slots
    units = 6
    ck, cv = torch.zeros(2, 1, hkv, units * block, d, dtype=dtype)
    slot = torch.full((hkv, n_blocks), -1, dtype=torch.long)
    for h in range(hkv):
        mine = sorted({j for toks in chosen[0][h] for j in toks}, reverse=True)
        for i, j in enumerate(mine):
            ck[:, h, i * block : (i + 1) * block] = kv[0][:, h, sink + j * block : sink + (j + 1) * block]
            cv[:, h, i * block : (i + 1) * block] = kv[1][:, h, sink + j * block : sink + (j + 1) * block]
            slot[h, j] = i
    out, seen = native.sparse_attention(q, hot, (ck, cv, slot), sel, q_pos, 0.125, window=window, sink=sink,
                                        block=block)
    assert torch.equal(seen, ref_seen) and torch.equal(out, ref)
    slot[1, 5] = -1  # head 1 selected block 5; head 0 does not hold it either way
    with pytest.raises(RuntimeError, match="cold block 5 selected"):
        native.sparse_attention(q, hot, (ck, cv, slot), sel, q_pos, 0.125, window=window, sink=sink, block=block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_row_invariant(dtype):
    """A token's output is the same bits alone or among other tokens (a decode step vs a chunk)."""
    torch.manual_seed(1)
    sink, window, block, d = 4, 64, 32, 64
    n = 700
    q_pos = torch.arange(600, 700)
    q = torch.randn(1, 1, 2 * 100, d).to(dtype)
    k, v = torch.randn(2, 1, 1, n, d).to(dtype)
    hot_p = torch.cat((torch.arange(sink), torch.arange(600 - window - block, n)))
    chosen = [[[[j % 17, (3 * j) % 17, 17] for j in range(100)]]]
    sel = bitsets(chosen, 1)
    cold_p = torch.cat([torch.arange(sink + j * block, sink + (j + 1) * block) for j in range(18)])
    hot = (k[:, :, hot_p].contiguous(), v[:, :, hot_p].contiguous(), hot_p)
    cold = (k[:, :, cold_p].contiguous(), v[:, :, cold_p].contiguous(), torch.arange(18))
    whole, _ = native.sparse_attention(q, hot, cold, sel, q_pos, 0.125, window=window, sink=sink, block=block)
    for t in (0, 37, 99):
        qt = q.view(1, 1, 2, 100, d)[:, :, :, t].contiguous().view(1, 1, 2, d)
        held = hot_p <= 600 + t
        one, _ = native.sparse_attention(qt, (hot[0][:, :, held].contiguous(), hot[1][:, :, held].contiguous(),
                                              hot_p[held].contiguous()), cold, sel[:, :, t : t + 1].contiguous(),
                                         q_pos[t : t + 1].contiguous(), 0.125, window=window, sink=sink, block=block)
        assert torch.equal(one[0, 0], whole.view(1, 1, 2, 100, d)[0, 0, :, t])


@pytest.mark.parametrize("block", [32, 16, 48])
def test_sparse_attention_row_invariant_scattered_selections(block):
    """Tokens whose selections are scattered over a long cold tier (many superblocks), differ between batch rows
    and KV heads, and name blocks only their own head holds: each token's rows are the bits of that token alone
    (a decode step), in bf16 K/V and in int8 codes, and match the fp64 reference."""
    torch.manual_seed(6)
    sink, window, hkv, g, d, t_n, n_blocks = 4, 64, 2, 3, 64, 9, 200
    n = sink + n_blocks * block + window + block // 2
    q_pos = torch.arange(n - t_n, n)
    q = torch.randn(2, hkv, g * t_n, d).bfloat16()
    kv = torch.randn(2, 2, hkv, n, d).bfloat16()
    hot_p = torch.cat((torch.arange(sink), torch.arange(sink + n_blocks * block, n)))
    hot = (kv[0][:, :, hot_p].contiguous(), kv[1][:, :, hot_p].contiguous(), hot_p)
    gen = torch.Generator().manual_seed(7)
    chosen = [[[sorted(torch.randperm(n_blocks, generator=gen)[: 10 + 3 * t].tolist()) for t in range(t_n)]
               for _ in range(hkv)] for _ in range(2)]
    sel = bitsets(chosen, (n_blocks + 63) // 64)
    # each head holds only the blocks its tokens (in either batch row) selected, at its own slots
    held = [sorted({j for b in range(2) for toks in chosen[b][h] for j in toks}) for h in range(hkv)]
    units = max(len(x) for x in held)
    ck, cv = torch.zeros(2, 2, hkv, units * block, d, dtype=torch.bfloat16)
    slot = torch.full((hkv, n_blocks), -1, dtype=torch.long)
    for h in range(hkv):
        for i, j in enumerate(reversed(held[h])):
            ck[:, h, i * block : (i + 1) * block] = kv[0][:, h, sink + j * block : sink + (j + 1) * block]
            cv[:, h, i * block : (i + 1) * block] = kv[1][:, h, sink + j * block : sink + (j + 1) * block]
            slot[h, j] = i
    codes = {}
    for name, x in (("k", ck), ("v", cv)):
        sc = (x.float().abs().amax(-1) / 127).clamp_min(1e-3).half()
        codes[name] = ((x.float() / sc.float()[..., None]).round().clamp(-127, 127).to(torch.int8), sc)
    colds = {"bf16": (ck, cv, slot), "int8": (codes["k"][0], codes["v"][0], codes["k"][1], codes["v"][1], slot)}
    for name, cold in colds.items():
        whole, seen = native.sparse_attention(q, hot, cold, sel, q_pos, 0.125, window=window, sink=sink, block=block)
        for t in (0, 4, t_n - 1):
            held_t = hot_p <= int(q_pos[t])
            hot_t = (hot[0][:, :, held_t].contiguous(), hot[1][:, :, held_t].contiguous(), hot_p[held_t].contiguous())
            for b in range(2):
                qt = q[b : b + 1].view(1, hkv, g, t_n, d)[:, :, :, t].contiguous()
                cold_b = tuple(x[b : b + 1].contiguous() for x in cold[:-1]) + (slot,)
                one, one_seen = native.sparse_attention(
                    qt, tuple(x[b : b + 1] for x in hot_t[:2]) + (hot_t[2],), cold_b,
                    sel[b : b + 1, :, t : t + 1].contiguous(), q_pos[t : t + 1].contiguous(), 0.125, window=window,
                    sink=sink, block=block)
                assert torch.equal(one[0], whole[b].view(hkv, g, t_n, d)[:, :, t]), (name, t, b)
                assert torch.equal(one_seen[0], seen[b].view(hkv, g, t_n, 2)[:, :, t])
        if name == "bf16" and block == 32:  # the fp64 reference once (slow)
            cold_p = torch.arange(sink, sink + n_blocks * block)
            ref, ref_seen = reference(q, hot, (kv[0][:, :, cold_p], kv[1][:, :, cold_p], cold_p), sel, q_pos, 0.125,
                                      window, sink, block)
            assert torch.equal(seen, ref_seen)
            torch.testing.assert_close(whole.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_attention_mixed_call_of_600_rows_token_by_token(threads):
    """One call of 600 query rows (200 tokens x 3 heads per KV head): the hot side's superblocks are cut into row
    slices (more than 256 rows) and the cold side runs as AMX items over every token's blocks, in one call; every
    token's rows and counts are the bits of that token alone (its decode step), in bf16 K/V and int8 codes."""
    torch.manual_seed(8)
    sink, window, block, hkv, g, d, t_n, n_blocks = 4, 64, 32, 2, 3, 64, 200, 90
    n = sink + n_blocks * block + window + t_n
    q_pos = torch.arange(n - t_n, n)
    q = torch.randn(1, hkv, g * t_n, d).bfloat16()
    kv = torch.randn(2, 1, hkv, n, d).bfloat16()
    first_hot = hot_lo(int(q_pos[0]), window, sink, block)
    hot_p = torch.cat((torch.arange(sink), torch.arange(first_hot, n)))
    hot = (kv[0][:, :, hot_p].contiguous(), kv[1][:, :, hot_p].contiguous(), hot_p)
    gen = torch.Generator().manual_seed(9)
    below = [(int(p) + 1 - window - sink) // block for p in q_pos]
    chosen = [[[sorted(torch.randperm(below[t], generator=gen)[: 8 + t % 13].tolist()) for t in range(t_n)]
               for _ in range(hkv)]]
    n_cold = max(below)  # the cold tier at the chunk's end (later tokens may select blocks earlier ones see hot)
    sel = bitsets(chosen, (n_cold + 63) // 64)
    cold_p = torch.arange(sink, sink + n_cold * block)
    ck, cv = kv[0][:, :, cold_p].contiguous(), kv[1][:, :, cold_p].contiguous()
    codes = {}
    for name, x in (("k", ck), ("v", cv)):
        sc = (x.float().abs().amax(-1) / 127).clamp_min(1e-3).half()
        codes[name] = ((x.float() / sc.float()[..., None]).round().clamp(-127, 127).to(torch.int8), sc)
    slot = torch.arange(n_cold)
    colds = {"bf16": (ck, cv, slot), "int8": (codes["k"][0], codes["v"][0], codes["k"][1], codes["v"][1], slot)}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, cold in colds.items():
            whole, seen = native.sparse_attention(q, hot, cold, sel, q_pos, 0.125, window=window, sink=sink,
                                                  block=block)
            assert int(seen[..., 1].min()) > 0  # every token attended cold blocks in the same call as its hot keys
            for t in range(t_n):
                held = hot_p <= int(q_pos[t])
                hot_t = (hot[0][:, :, held].contiguous(), hot[1][:, :, held].contiguous(), hot_p[held].contiguous())
                qt = q.view(1, hkv, g, t_n, d)[:, :, :, t].contiguous()
                one, one_seen = native.sparse_attention(qt, hot_t, cold, sel[:, :, t : t + 1].contiguous(),
                                                        q_pos[t : t + 1].contiguous(), 0.125, window=window,
                                                        sink=sink, block=block)
                assert torch.equal(one[0], whole[0].view(hkv, g, t_n, d)[:, :, t]), (name, t)
                assert torch.equal(one_seen[0], seen[0].view(hkv, g, t_n, 2)[:, :, t]), (name, t)
    finally:
        torch.set_num_threads(before)


def test_sparse_attention_refuses_a_selected_block_it_was_not_given():
    """A block the indexer chose but the caller did not decode is an error, never a smaller attention."""
    torch.manual_seed(2)
    sink, window, block, d = 4, 32, 16, 64
    q_pos = torch.tensor([300])
    q = torch.randn(1, 1, 1, d)
    k, v = torch.randn(2, 1, 1, 301, d)
    hot_p = torch.cat((torch.arange(sink), torch.arange(300 - window - block, 301)))
    hot = (k[:, :, hot_p].contiguous(), v[:, :, hot_p].contiguous(), hot_p)
    sel = bitsets([[[[2, 9]]]], 1)
    given = torch.cat([torch.arange(sink + j * block, sink + (j + 1) * block) for j in (2,)])
    cold = (k[:, :, given].contiguous(), v[:, :, given].contiguous(), slots([2], 16))
    with pytest.raises(RuntimeError, match=r"cold block 9 selected by the query at position 300 \(KV head 0\) was not provided"):
        native.sparse_attention(q, hot, cold, sel, q_pos, 0.125, window=window, sink=sink, block=block)
    out, seen = native.sparse_attention(q, hot, cold, bitsets([[[[2]]]], 1), q_pos, 0.125, window=window, sink=sink,
                                        block=block)
    assert int(seen[0, 0, 0, 1]) == block


def quest_reference(q, kmin, kmax, q_pos, window, sink, block, topk, box=0.5):
    """The indexer's choice in float64: each row's bound over the min/max box shrunk about its centre by `box`,
    and over the whole box; per bound each query head's softmax over the blocks the token may select, the shares
    summed over the heads; a block's score is the larger of its two shares."""
    b, h, r, d = q.shape
    t_n = q_pos.shape[0]
    g = r // t_n
    lo_w, hi_w = 0.5 * (1 + box), 0.5 * (1 - box)
    chosen = []
    for bi in range(b):
        for hi in range(h):
            for t in range(t_n):
                n = max(0, int(q_pos[t]) + 1 - window - sink) // block
                qs = q[bi, hi].view(g, t_n, d)[:, t].double()  # (G, D)
                a, c = kmin[bi, hi, :n].double(), kmax[bi, hi, :n].double()
                shares = []
                for lo, up in ((lo_w * a + hi_w * c, hi_w * a + lo_w * c), (a, c)):
                    bound = torch.maximum(qs[:, None] * lo, qs[:, None] * up).sum(-1)  # (G, n)
                    shares.append(torch.softmax(bound / d**0.5, dim=-1).sum(0) if n else bound.sum(0))  # (n,)
                score = torch.maximum(*shares)
                order = sorted(range(n), key=lambda j: (-float(score[j]), j))
                chosen.append(sorted(order[:topk]))
    return chosen


def decode_bits(select: torch.Tensor) -> list[list[int]]:
    out = []
    for row in select.reshape(-1, select.shape[-1]).tolist():
        out.append([w * 64 + i for w, word in enumerate(row) for i in range(64) if (word >> i) & 1])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_select_top_k(dtype):
    torch.manual_seed(2)
    sink, window, block, topk, d, g = 4, 64, 16, 5, 64, 3
    keys = torch.randn(1, 2, 2000, d)
    n_blocks = (2000 - sink) // block
    blocks = keys[:, :, sink : sink + n_blocks * block].reshape(1, 2, n_blocks, block, d)
    kmin, kmax = blocks.amin(3).to(dtype), blocks.amax(3).to(dtype)
    q_pos = torch.tensor([10, 70, 90, 500, 1999])
    q = torch.randn(1, 2, g * 5, d).to(dtype)
    select, scored = native.block_select(q, kmin, kmax, q_pos, window=window, sink=sink, block=block, topk=topk)
    expect_n = [max(0, p + 1 - window - sink) // block for p in q_pos.tolist()]
    assert scored[0, 0].tolist() == expect_n
    got = decode_bits(select)
    want = quest_reference(q.float(), kmin.float(), kmax.float(), q_pos, window, sink, block, topk)
    assert got == want
    assert [len(x) for x in got[:5]] == [min(topk, n) for n in expect_n]


def test_block_select_row_invariant_and_missing_summaries():
    torch.manual_seed(3)
    d = 64
    kmin = torch.randn(1, 1, 60, d).bfloat16()
    kmax = kmin + torch.rand(1, 1, 60, d).bfloat16()
    q_pos = torch.arange(800, 900)
    q = torch.randn(1, 1, 100, d).bfloat16()
    whole, _ = native.block_select(q, kmin, kmax, q_pos, window=64, sink=4, block=16, topk=8)
    for t in (0, 50, 99):
        one, _ = native.block_select(q[:, :, t : t + 1].contiguous(), kmin, kmax, q_pos[t : t + 1].contiguous(),
                                     window=64, sink=4, block=16, topk=8)
        assert torch.equal(one[:, :, 0], whole[:, :, t])
    with pytest.raises(RuntimeError, match="have summaries"):  # a missing summary is an error, not fewer blocks
        native.block_select(q, kmin[:, :, :40].contiguous(), kmax[:, :, :40].contiguous(), q_pos, window=64, sink=4,
                            block=16, topk=8)


def test_block_select_same_blocks_per_token_across_chunks_and_token_groups():
    """A prompt's tokens (several token groups) over several chunks of blocks and KV heads with grouped query
    rows choose what each token alone chooses, whatever the work split (2 threads and 1)."""
    torch.manual_seed(5)
    h, g, d, n, t_n = 3, 3, 64, 170, 130  # up to 160 selectable blocks: three chunks of 64
    kmin = torch.randn(1, h, n, d).bfloat16()
    kmax = kmin + torch.rand(1, h, n, d).bfloat16()
    q_pos = torch.arange(2500, 2500 + t_n)
    q = torch.randn(1, h, g, t_n, d).bfloat16()  # rows ordered (group, token)
    args = dict(window=64, sink=4, block=16, topk=torch.tensor([8, 0, 12]), budget=0.05)
    cold = kmin[:, [0, 2]].contiguous(), kmax[:, [0, 2]].contiguous()  # summaries of the cold heads only
    threads = torch.get_num_threads()
    try:
        for nt in (2, 1):
            torch.set_num_threads(nt)
            whole, scored = native.block_select(q.reshape(1, h, g * t_n, d), *cold, q_pos, **args)
            assert (scored[0, 1] == 0).all() and (scored[0, 0] == (q_pos + 1 - 64 - 4) // 16).all()
            for t in range(0, t_n, 9):
                one, _ = native.block_select(q[:, :, :, t].contiguous(), *cold, q_pos[t : t + 1].contiguous(), **args)
                assert torch.equal(one[:, :, 0], whole[:, :, t])
    finally:
        torch.set_num_threads(threads)
    bits = [[sum(bin(int(w) & (2**64 - 1)).count("1") for w in whole[0, head, t]) for t in (0, t_n - 1)]
            for head in range(h)]
    assert bits == [[8, 8], [0, 0], [12, 12]]  # max(topk, ceil(0.05 n)) of n = 152 .. 160; none for streaming


def test_budget_grows_per_head_counts_in_proportion():
    """With per-head counts (a fitted head profile) each head's budget share is scaled by its count over the
    policy's topk (budget_topk), so a focused head stays small and a spread one grows; a head at the policy's topk,
    or budget_topk 0, keeps ceil(budget * n). sparse_check holds the attention to the same counts."""
    torch.manual_seed(6)
    h, d, n = 4, 64, 220
    kmin = torch.randn(1, h, n, d)
    kmax = kmin + torch.rand(1, h, n, d)
    q_pos = torch.tensor([4 + 64 + 200 * 16 - 1])  # 200 selectable blocks
    q = torch.randn(1, h, 2, d)
    topk = torch.tensor([8, 64, 32, 0])

    def counts(**kw):
        sel, scored = native.block_select(q, kmin[:, :3].contiguous(), kmax[:, :3].contiguous(), q_pos, window=64,
                                          sink=4, block=16, topk=topk, budget=0.25, **kw)
        assert scored[0, :, 0].tolist() == [200, 200, 200, 0]
        return [sum(bin(int(w) & (2**64 - 1)).count("1") for w in sel[0, head, 0]) for head in range(h)]

    # 0.25 x 200 = 50, scaled by 8/32 and 64/32: ceil(12.5) = 13, 100; the head at topk 32 keeps 50
    assert counts(budget_topk=32) == [13, 100, 50, 0]
    assert counts() == [50, 64, 50, 0]  # budget_topk 0: one share for every head, as before
    seen = torch.zeros(1, h, 2, 2, dtype=torch.long)
    hot = min(q_pos.item() + 1, 4) + (q_pos.item() + 1 - (4 + 200 * 16))
    seen[..., 0] = hot
    seen[0, :, :, 1] = torch.tensor([13, 100, 50, 0])[:, None] * 16
    scored = torch.tensor([[[200], [200], [200], [0]]])
    counters = torch.zeros(8, dtype=torch.long)
    native.sparse_check(seen, scored, q_pos, window=64, sink=4, block=16, topk=topk, counters=counters, budget=0.25,
                        budget_topk=32)
    assert int(counters[3]) == 13 + 100 + 50
    with pytest.raises(RuntimeError, match="budget 0.25 of top-0"):  # the unscaled count is not what was attended
        native.sparse_check(seen, scored, q_pos, window=64, sink=4, block=16, topk=topk, counters=counters,
                            budget=0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_reads_int8_codes_as_their_decoded_values(dtype):
    """int8 cold codes read in the kernel give the same bits as the same blocks decoded beforehand."""
    from kakeya_runtime.kv.compress import Int8Codec

    torch.manual_seed(3)
    sink, window, block, d, hkv = 4, 32, 16, 64, 2
    q_pos = torch.tensor([290, 300])
    q = torch.randn(1, hkv, 3 * 2, d).to(dtype)
    k, v = (torch.randn(2, 1, hkv, 301, d) * 3).to(dtype)
    hot_p = torch.cat((torch.arange(sink), torch.arange(290 - window - block, 301)))
    hot = (k[:, :, hot_p].contiguous(), v[:, :, hot_p].contiguous(), hot_p)
    n_blocks = (301 - sink) // block
    cold_p = torch.arange(sink, sink + n_blocks * block)
    codec = Int8Codec()
    enc_k, enc_v = codec.encode(k[:, :, cold_p]), codec.encode(v[:, :, cold_p])
    sel = bitsets([[[[0, 5, 9], [1, 2, 14]], [[3, 4], [15, 7, 6, 0]]]], 1)
    slot = torch.arange(n_blocks)
    packed, seen_p = native.sparse_attention(q, hot, (enc_k["code"], enc_v["code"], enc_k["scale"], enc_v["scale"], slot),
                                             sel, q_pos, 0.125, window=window, sink=sink, block=block)
    decoded = (codec.decode(enc_k, dtype), codec.decode(enc_v, dtype), slot)
    plain, seen_d = native.sparse_attention(q, hot, decoded, sel, q_pos, 0.125, window=window, sink=sink, block=block)
    assert torch.equal(packed, plain) and torch.equal(seen_p, seen_d)
    assert int(seen_p[0, 1, 5, 1]) == 4 * block  # the second token of head 1 saw its four blocks
    assert (codec.decode(enc_k, torch.float32) - k[:, :, cold_p].float()).abs().max() < 3 * 5 / 127
