"""sparse: an exact hot set, a packed cold tier and an indexer; chunk-invariant, tripwired, bounded hot bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerateRequest, GenerationError
from kakeya_runtime.kv.cache import CacheError
from kakeya_runtime.kv.idle import compress_idle, decompress
from kakeya_runtime.kv.policy import PolicyError, PolicySpec, PositionLimitError, make_policy_cache
from kakeya_runtime.kv.sparse import SparseIndexError, SparseKV, SparseLayerKV
from kakeya_runtime.models import native
from kakeya_runtime.models.base import Logits

SMALL = {"sink": 3, "window": 8, "block": 4, "topk": 3}


def _ids(n: int, seed: int = 0, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(model, params, ids, chunk, policy="sparse"):
    cache = make_policy_cache(model.config, PolicySpec.parse(policy, params))
    logits = Engine(model, prefill_chunk=chunk).prefill(cache, ids, logits=Logits.ALL).logits
    return logits, cache


@pytest.mark.parametrize("codec", ["identity", "d4", "int8"])
def test_chunked_prefill_is_bit_identical_to_token_by_token(tiny_model, codec):
    """A position's result does not depend on the step it ran in: blocks are encoded once, the indexer and the
    attention compute each query alone (INV-3 under the sparse policy)."""
    ids = _ids(90)
    ref, cache = _prefill(tiny_model, {**SMALL, "codec": codec}, ids, 90)
    assert isinstance(cache, SparseKV) and cache.layer_lengths() == [90] * len(cache)
    for chunk in (1, 7, 16):
        got, _ = _prefill(tiny_model, {**SMALL, "codec": codec}, ids, chunk)
        assert torch.equal(got, ref), chunk


def test_every_block_selected_matches_full_attention(tiny_model):
    """With top-k covering every block and lossless cold storage, the sparse set is the whole prefix."""
    ids = _ids(90, seed=1)
    full, _ = _prefill(tiny_model, {}, ids, 16, policy="full")
    every, _ = _prefill(tiny_model, {**SMALL, "topk": 100, "codec": "identity"}, ids, 16)
    torch.testing.assert_close(every, full, atol=1e-5, rtol=1e-5)
    few, cache = _prefill(tiny_model, {**SMALL, "codec": "identity"}, ids, 16)
    assert (few[:, 40:] - full[:, 40:]).abs().max() > 1e-3  # top-3 of up to 20 blocks does drop keys
    c = cache.counters()
    assert c.blocks_selected < c.blocks_scored and c.positions_attended < c.positions_visible


def test_counters_and_fraction(tiny_llama):
    _, cache = _prefill(tiny_llama, SMALL, _ids(90), 90)
    c = cache.counters()
    # 90 queries x 2 KV heads x 3 layers; the query at p scores (p + 1 - 8 - 3) // 4 blocks and keeps <= 3
    scored = sum(max(0, p + 1 - 11) // 4 for p in range(90))
    assert c.queries == 90 * 2 * 3 and c.blocks_scored == scored * 2 * 3
    assert c.blocks_selected == sum(min(3, max(0, p + 1 - 11) // 4) for p in range(90)) * 2 * 3
    assert c.positions_visible == sum(range(1, 91)) * 2 * 3
    # the newest query (p = 89): 3 sinks + hot range from 3 + (79 // 4) * 4 = 79 (11 keys) + 3 blocks of 4
    assert cache.effective_attention_fraction == pytest.approx((3 + 11 + 12) / 90)
    assert len(cache.layer_counters()) == 3


def test_tripwire_zero_blocks_selected(tiny_llama, monkeypatch):
    # the indexer as its own call (the fused calls run the same selection and the same sparse_check inside)
    monkeypatch.setattr(SparseLayerKV, "fused", False)
    real = native.block_select

    def none_selected(*args, **kwargs):
        select, scored = real(*args, **kwargs)
        return torch.zeros_like(select), scored

    monkeypatch.setattr(native, "block_select", none_selected)
    with pytest.raises(SparseIndexError, match="indexer's blocks were not attended"):
        _prefill(tiny_llama, SMALL, _ids(60), 16)


@pytest.mark.parametrize("codec", ["d4", "identity"])  # three calls per step, or the fused one
def test_tripwire_missing_summaries(tiny_llama, monkeypatch, codec):
    """Blocks that never reach the cold tier cannot be scored: the kernel refuses, nothing falls back."""
    monkeypatch.setattr(SparseLayerKV, "_complete_blocks", lambda self, *a: None)
    with pytest.raises(SparseIndexError, match="have summaries"):
        _prefill(tiny_llama, {**SMALL, "codec": codec}, _ids(60), 16)


@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_fused_step_equals_three_calls(tiny_model, monkeypatch, codec):
    """kakeya::sparse_step (indexer, attention and tripwire in one call, for a cold tier read in place) gives the
    bits and the counters of the three separate calls, in a prompt and token by token."""
    ids = _ids(90)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(SparseLayerKV, "fused", fused)
        runs.append([_prefill(tiny_model, {**SMALL, "codec": codec}, ids, chunk) for chunk in (90, 1)])
    for (a, ca), (b, cb) in zip(*runs, strict=True):
        assert torch.equal(a, b)
        assert ca.layer_counters() == cb.layer_counters() and ca.counters().blocks_selected > 0
        assert ca.effective_attention_fraction == cb.effective_attention_fraction
    assert torch.equal(runs[0][0][0], runs[0][1][0])


def test_tripwire_blocks_lost_before_attention(tiny_llama, monkeypatch):
    monkeypatch.setattr(SparseLayerKV, "fused", False)  # the blocks decoded in Python, then handed to the kernel
    real = SparseLayerKV._decode_blocks

    def drop_one(self, select):  # the block in slot 0 goes missing on its way to the kernel
        k, v, slot = real(self, select)
        slot = torch.where(slot == 0, -1, slot - 1)
        return k[:, :, self.block :], v[:, :, self.block :], slot

    monkeypatch.setattr(SparseLayerKV, "_decode_blocks", drop_one)
    with pytest.raises(SparseIndexError, match="was not provided"):
        _prefill(tiny_llama, SMALL, _ids(60), 16)


@pytest.mark.parametrize("codec", ["d4", "identity"])
def test_tripwire_hot_range_lost(tiny_llama, monkeypatch, codec):
    real = SparseLayerKV._write_hot

    def forget(self, k, v, positions, start):
        real(self, k, v, positions, start)
        self.hot_pos[self.sink] = 10_000  # one ring slot no longer holds its position

    monkeypatch.setattr(SparseLayerKV, "_write_hot", forget)
    with pytest.raises(SparseIndexError, match="hot range|hot ring"):
        _prefill(tiny_llama, {**SMALL, "codec": codec}, _ids(60), 1)


def test_hot_bytes_flat_cold_bytes_packed(tiny_llama):
    eng = Engine(tiny_llama, prefill_chunk=16)
    hot, cold = [], {}
    for codec in ("identity", "d4"):
        for n in (40, 120, 300):
            cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", {**SMALL, "codec": codec}),
                                      dtype=torch.bfloat16)
            eng_b = Engine(tiny_llama.to(torch.bfloat16), prefill_chunk=16)
            eng_b.prefill(cache, _ids(n))
            stats = cache.memory_stats()
            hot.append(stats["hot_bytes"])
            cold[(codec, n)] = stats["cold_bytes"]
            assert stats["resident_bytes"] == (stats["hot_bytes"] + stats["cold_bytes"] + stats["index_bytes"]
                                               + stats["decoded_bytes"])
            assert (stats["decoded_bytes"] > 0) == (codec == "d4")  # lattice blocks kept decoded between steps
    tiny_llama.float()
    del eng
    assert len(set(hot)) == 1
    blocks = (300 - 3) // 4
    assert cold[("identity", 300)] == blocks * 4 * 2 * 2 * 16 * 2 * 3  # positions x K,V x Hk x D x bf16 x layers
    assert cold[("d4", 300)] < 0.6 * cold[("identity", 300)]  # D4 at head_dim 16: 14 bytes vs 32 per vector


def test_trim_within_the_ring_then_continue(tiny_llama):
    params = {**SMALL, "spare": 4}
    ids = _ids(70)
    ref, _ = _prefill(tiny_llama, params, ids, 16)
    cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", params))
    eng = Engine(tiny_llama, prefill_chunk=16)
    eng.prefill(cache, ids[:, :66])
    eng.prefill(cache, _ids(3, seed=9))  # a draft that is rolled back
    cache.trim(66)
    got = eng.prefill(cache, ids[:, 66:], logits=Logits.ALL).logits
    assert torch.equal(got, ref[:, 66:])
    with pytest.raises(CacheError, match="hot ring"):
        cache.trim(20)


def test_rolled_back_drafts_that_completed_a_block_leave_nothing_pending(tiny_llama):
    """A speculative verify step whose drafts complete a block defers its encode to the end of the step; rolled
    back into that block, nothing may stay pending (a stale count read positions the ring no longer held:
    SparseIndexError mid-Generate). After every rollback the next step gives the one-shot prefill's logits."""
    params = {**SMALL, "spare": 4}
    ids = _ids(60)
    ref, _ = _prefill(tiny_llama, params, ids, 16)
    cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", params))
    eng = Engine(tiny_llama, prefill_chunk=16)
    eng.prefill(cache, ids[:, :30])
    for t in range(30, 50):
        eng.prefill(cache, _ids(4, seed=t))  # 4 drafts: each crosses a block boundary (block 4), all rejected
        cache.trim(t)
        got = eng.decode_step(cache, ids[:, t : t + 1]).logits
        assert torch.equal(got[:, -1], ref[:, t]), t
        assert all(x.pending_blocks() is None for x in cache.layers if isinstance(x, SparseLayerKV))


def test_state_round_trip_and_idle_compression(tiny_model):
    ids = _ids(80)
    ref, _ = _prefill(tiny_model, SMALL, ids, 16)
    cache = make_policy_cache(tiny_model.config, PolicySpec.parse("sparse", SMALL))
    eng = Engine(tiny_model, prefill_chunk=16)
    eng.prefill(cache, ids[:, :50])
    copy = make_policy_cache(tiny_model.config, PolicySpec.parse("sparse", SMALL))
    copy.load_state(cache.state())
    live, hot = cache.nbytes, cache.memory_stats()["hot_bytes"]
    held = sum(t.nbytes for layer in cache.state() for key, t in layer.items()
               if key.split(".")[0] in ("k", "v", "cold_k", "cold_v", "kmin", "kmax"))  # what the state keeps of K/V
    stats = compress_idle(cache, "identity")
    # the identity codec packs nothing, and the cold tier and index stay as they are: counted while idle (they
    # once read as saved), only the cold tier's unused reserve is released
    assert stats.bytes_before == live and stats.bytes_after == held and hot < held <= live
    decompress(cache)
    for c in (cache, copy):
        assert torch.equal(eng.prefill(c, ids[:, 50:], logits=Logits.ALL).logits, ref[:, 50:])


def test_position_limit_and_params_past_the_context(tiny_llama):
    cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", SMALL), capacity=40)
    eng = Engine(tiny_llama, prefill_chunk=16)
    eng.prefill(cache, _ids(38))
    with pytest.raises(GenerationError):
        eng.generate(cache, _ids(1), GenerateRequest(4))
    with pytest.raises(PositionLimitError):
        cache[0].attend(*[torch.zeros(1, 4, 3, 16)], *[torch.zeros(1, 2, 3, 16)] * 2, torch.arange(38, 41), scale=1.0)
    for bad in ({"window": 600}, {"block": 1000}, {"sink": 500, "window": 20}):
        with pytest.raises(PolicyError, match="exceeds the context"):
            make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", bad))
    with pytest.raises(PolicyError):
        PolicySpec.parse("sparse", {"topk": 0})
    with pytest.raises(PolicyError):
        PolicySpec.parse("sparse", {"stride": 2})
    spec = PolicySpec.parse("sparse", {"block": 16})
    assert spec.params["block"] == 16 and spec.params["codec"] == "d4" and spec.label.startswith("sparse(4+512")


def test_gemma_native_sliding_layers_keep_their_ring(tiny_gemma):
    cache = make_policy_cache(tiny_gemma.config, PolicySpec.parse("sparse", SMALL))
    kinds = [type(layer).__name__ for layer in cache]
    assert kinds == ["SlidingLayerKV", "SlidingLayerKV", "SparseLayerKV", "SlidingLayerKV"]


def test_batched_decode_rows_equal_single(tiny_llama):
    """decode_rows: sparse rows beside full and sink_window rows get the bits they get alone."""
    eng = Engine(tiny_llama, prefill_chunk=16)
    specs = [PolicySpec.parse("sparse", SMALL), PolicySpec.parse("full"), PolicySpec.parse("sparse", {**SMALL,
                                                                                                     "codec": "d4"})]
    lengths = [60, 33, 75]
    caches, alone = [], []
    for spec, n in zip(specs, lengths, strict=True):
        for bucket in (caches, alone):
            c = make_policy_cache(tiny_llama.config, spec)
            eng.prefill(c, _ids(n, seed=n))
            bucket.append(c)
    tokens = torch.tensor([5, 6, 7])
    together = eng.decode_rows(caches, tokens)
    for i, c in enumerate(alone):
        single = eng.decode_rows([c], tokens[i : i + 1])
        assert torch.equal(single[0], together[i])


def _write_profile(config, modes: dict[int, list[str]], folder, sizes: dict[str, int] = SMALL,
                   blocks: dict[int, list[int]] | None = None) -> None:
    import json

    from kakeya_runtime.kv.heads import SCHEMA, SCHEMA_VERSION, fingerprint

    folder.mkdir(parents=True, exist_ok=True)
    fitted = {} if blocks is None else {"blocks": {str(k): v for k, v in blocks.items()}}
    (folder / f"{fingerprint(config)}.json").write_text(json.dumps(
        {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fingerprint": fingerprint(config),
         "modes": {str(k): v for k, v in modes.items()}, "settings": dict(sizes), **fitted}))


@pytest.mark.parametrize("codec", ["identity", "d4"])
def test_head_profile_fitted_block_counts(tiny_llama, tmp_path, monkeypatch, codec):
    """A fitted profile gives each sparse head its own block count; the budget grows each in proportion to its
    count over topk; a prompt gives the same bits in any chunking, and a decode row (the whole-stack call) those of
    the prompt. The digest covers the counts; counts that contradict the modes are a typed error."""
    from kakeya_runtime.kv.heads import load_profile

    native.load()
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    modes = {0: ["streaming", "sparse"], 1: ["sparse", "sparse"], 2: ["sparse", "streaming"]}
    blocks = {0: [0, 1], 1: [5, 2], 2: [4, 0]}
    params = {**SMALL, "codec": codec, "heads": "profile", "budget": 0.5}
    _write_profile(tiny_llama.config, modes, tmp_path / "heads", blocks=blocks)
    ids = _ids(90, seed=6)
    ref, cache = _prefill(tiny_llama, params, ids, 90)
    assert [layer.head_topk for layer in cache] == [tuple(b) for b in blocks.values()]
    for chunk in (1, 16):
        got, _ = _prefill(tiny_llama, params, ids, chunk)
        assert torch.equal(got, ref), chunk
    # the last position's logits from a decode row after the rest
    _, stepped = _prefill(tiny_llama, params, ids[:, :-1], 16)
    row = Engine(tiny_llama, prefill_chunk=16).decode_rows([stepped], [int(ids[0, -1])])
    assert torch.equal(row[0], ref[0, -1].float())

    def kept(k: int, n: int) -> int:
        return min(n, max(k, math.ceil(0.5 * n * k / 3))) if k else 0

    selectable = [max(0, p + 1 - 11) // 4 for p in range(90)]
    per_layer = cache.layer_counters()
    for i, counts in blocks.items():
        assert per_layer[i]["blocks_selected"] == sum(kept(k, n) for k in counts for n in selectable), i
    assert kept(5, 19) == 16 and kept(2, 19) == 7  # grown in proportion: 0.5 x 19 x 5/3 and x 2/3
    fitted = load_profile(tiny_llama.config)
    _write_profile(tiny_llama.config, modes, tmp_path / "heads", blocks={**blocks, 1: [5, 3]})
    assert load_profile(tiny_llama.config).digest != fitted.digest
    _write_profile(tiny_llama.config, modes, tmp_path / "heads")  # the same modes, every sparse head at topk
    assert load_profile(tiny_llama.config).digest != fitted.digest
    for bad in ({**blocks, 1: [5, 0]}, {**blocks, 0: [2, 1]}, {**blocks, 2: [4]}, {0: [0, 1], 1: [5, 2]}):
        _write_profile(tiny_llama.config, modes, tmp_path / "heads", blocks=bad)
        with pytest.raises(PolicyError, match="damaged profile"):
            make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", params))


def test_head_profile_streaming_sparse_dense(tiny_llama, tmp_path, monkeypatch):
    """heads=profile: streaming heads keep no cold tier and score nothing, dense heads attend every cold block,
    and the result is still the same bits in any chunking."""
    native.load()  # before the cache dir moves: the kernels stay where they are built
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    params = {**SMALL, "codec": "identity", "heads": "profile"}
    with pytest.raises(PolicyError, match="no head profile"):
        make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", params))
    _write_profile(tiny_llama.config, {0: ["sparse", "sparse"]}, tmp_path / "heads")  # layers 1 and 2 missing
    with pytest.raises(PolicyError, match="no entry for layer 1"):
        make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", params))
    _write_profile(tiny_llama.config, {0: ["streaming", "dense"], 1: ["sparse", "streaming"], 2: ["dense", "sparse"]},
                   tmp_path / "heads")
    ids = _ids(90, seed=4)
    ref, cache = _prefill(tiny_llama, params, ids, 90)
    for chunk in (1, 16):
        got, _ = _prefill(tiny_llama, params, ids, chunk)
        assert torch.equal(got, ref), chunk
    per_layer = cache.layer_counters()
    scored = sum(max(0, p + 1 - 11) // 4 for p in range(90))
    # one scoring head per layer (layer 2's dense head needs no scores but still counts its blocks as scored)
    assert [c["blocks_scored"] for c in per_layer] == [scored, scored, 2 * scored]
    assert per_layer[0]["blocks_selected"] == scored  # the dense head keeps every block
    assert per_layer[1]["blocks_selected"] == sum(min(3, max(0, p + 1 - 11) // 4) for p in range(90))
    _, every = _prefill(tiny_llama, {**SMALL, "codec": "identity"}, ids, 90)
    assert cache.memory_stats()["cold_bytes"] * 3 == every.memory_stats()["cold_bytes"] * 2  # 2 of 6 heads stream


def test_head_profile_all_dense_is_full_attention(tiny_llama, tmp_path, monkeypatch):
    native.load()
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    _write_profile(tiny_llama.config, {i: ["dense", "dense"] for i in range(3)}, tmp_path / "heads")
    ids = _ids(90, seed=5)
    full, _ = _prefill(tiny_llama, {}, ids, 16, policy="full")
    dense, _ = _prefill(tiny_llama, {**SMALL, "codec": "identity", "heads": "profile"}, ids, 16)
    torch.testing.assert_close(dense, full, atol=1e-5, rtol=1e-5)


def test_budget_grows_the_selection_and_the_tripwire_counts_it(tiny_llama, monkeypatch):
    """With a budget a query keeps max(topk, ceil(budget * n)) of its n blocks; the tripwire expects exactly that,
    so an indexer that keeps only topk under a budget fails loudly."""
    params = {**SMALL, "topk": 1, "budget": 0.5, "codec": "identity"}
    _, cache = _prefill(tiny_llama, params, _ids(90), 16)
    c = cache.counters()
    ns = [max(0, p + 1 - 11) // 4 for p in range(90)]
    assert c.blocks_selected == sum(min(n, max(1, math.ceil(0.5 * n))) for n in ns) * 2 * 3
    assert c.blocks_selected > sum(min(1, n) for n in ns) * 2 * 3
    real = native.block_select

    def topk_only(*args, **kwargs):  # an indexer that ignores the budget: topk blocks, the tripwire wants more
        return real(*args, **{**kwargs, "budget": 0.0})

    monkeypatch.setattr(SparseLayerKV, "fused", False)  # the indexer, the attention and the tripwire as three calls
    monkeypatch.setattr(native, "block_select", topk_only)
    with pytest.raises(SparseIndexError, match="indexer's blocks were not attended"):
        _prefill(tiny_llama, params, _ids(60), 16)


def test_budget_validation():
    for bad in (-0.1, 1.5, "x", True, float("nan")):
        with pytest.raises(PolicyError, match="budget"):
            PolicySpec.parse("sparse", {"budget": bad})
    assert PolicySpec.parse("sparse", {"budget": "0.25"}).budget == 0.25
    assert PolicySpec.parse("sparse").params["budget"] == 0.125


@pytest.mark.parametrize("codec", ["d4", "e8", "identity", "int8"])
def test_deferred_block_encode_leaves_the_state_immediate_encoding_does(tiny_model, codec, monkeypatch):
    """Every codec's blocks that no query of the step may select yet are stored at the end of the step, every
    layer's in one batch: each step's logits, and the cache after it (decode steps, chunks, a trim), are the bits
    that storing each block as it completes gives."""
    spec = PolicySpec.parse("sparse", {**SMALL, "codec": codec, "spare": 4})
    deferred, immediate = make_policy_cache(tiny_model.config, spec), make_policy_cache(tiny_model.config, spec)
    sparse = [x for x in deferred.layers if isinstance(x, SparseLayerKV)]
    assert sparse and all(x.defer_encode for x in sparse)
    for x in immediate.layers:
        if isinstance(x, SparseLayerKV):
            x.defer_encode = False
    flushed = []
    end_step = SparseKV.end_step

    def counting_end_step(self):
        flushed.append(sum(x.pending_blocks() is not None for x in self._sparse()))
        end_step(self)
        assert all(x.pending_blocks() is None for x in self._sparse())

    monkeypatch.setattr(SparseKV, "end_step", counting_end_step)
    engine = Engine(tiny_model, prefill_chunk=16)
    ids = _ids(80, seed=3)

    def same(a, b):
        assert torch.equal(a, b)
        for la, lb in zip(deferred.state(), immediate.state(), strict=True):
            for name in la:
                assert torch.equal(la[name], lb[name]), name

    same(engine.prefill(deferred, ids[:, :45]).logits, engine.prefill(immediate, ids[:, :45]).logits)
    for t in range(45, 60):
        same(engine.decode_step(deferred, ids[:, t : t + 1]).logits,
             engine.decode_step(immediate, ids[:, t : t + 1]).logits)
    deferred.trim(57)
    immediate.trim(57)
    same(engine.prefill(deferred, ids[:, 57:80]).logits, engine.prefill(immediate, ids[:, 57:80]).logits)
    assert sum(flushed) > 0  # some steps did leave blocks for the end of the step


def test_a_session_is_bound_to_the_head_profile_it_was_built_with(tiny_llama, tmp_path, monkeypatch):
    """heads=profile resolves, at the session's creation, to profile:<digest>, which its journal and archive keep: a
    recalibrated profile then refuses to rebuild it (it gave other tokens after a restart or an import, unnoticed),
    and a damaged profile file is a typed error naming the file (it was INTERNAL)."""
    from kakeya_runtime.kv.policy import check_head_profile

    native.load()
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    modes = {0: ["streaming", "dense"], 1: ["sparse", "streaming"], 2: ["dense", "sparse"]}
    _write_profile(tiny_llama.config, modes, tmp_path / "heads")
    params = {**SMALL, "codec": "identity", "heads": "profile"}
    bound = check_head_profile(tiny_llama.config, PolicySpec.parse("sparse", params))
    assert bound.heads.startswith("profile:") and len(bound.heads) == len("profile:") + 12
    again = PolicySpec.parse("sparse", bound.params)  # as a journal or an archive gives it back
    assert again == bound and check_head_profile(tiny_llama.config, again) == bound
    make_policy_cache(tiny_llama.config, again)

    def first_layer_topk(spec):
        return next(x for x in make_policy_cache(tiny_llama.config, spec).layers if isinstance(x, SparseLayerKV))

    before = first_layer_topk(again).head_topk
    current_file = next(p for p in (tmp_path / "heads").iterdir() if p.is_file())
    current_file.rename(tmp_path / "aside.json")  # a bound session needs only its kept copy
    assert check_head_profile(tiny_llama.config, again) == bound and first_layer_topk(again).head_topk == before
    (tmp_path / "aside.json").rename(current_file)
    # a damaged kept copy: the current profile, which has the digest, serves the session (the copy refused it, and
    # every new session of that profile, for good), and binding repairs the copy
    from kakeya_runtime.kv.heads import fingerprint

    copy = tmp_path / "heads" / "bound" / f"{fingerprint(tiny_llama.config)}-{bound.heads[len('profile:'):]}.json"
    text = copy.read_text()
    copy.write_text(text[:20])
    assert first_layer_topk(again).head_topk == before
    assert check_head_profile(tiny_llama.config, again) == bound and copy.read_text() == text
    _write_profile(tiny_llama.config, {**modes, 0: ["dense", "dense"]}, tmp_path / "heads")  # recalibrated
    # the session keeps the modes it was built with: a copy was kept when it bound them (a recalibration left every
    # earlier session unable to generate, and a state dir holding both kinds unable to start)
    assert check_head_profile(tiny_llama.config, again) == bound
    assert first_layer_topk(again).head_topk == before
    recalibrated = check_head_profile(tiny_llama.config, PolicySpec.parse("sparse", params))
    assert recalibrated.heads != bound.heads and first_layer_topk(recalibrated).head_topk != before
    kept = tmp_path / "heads" / "bound"
    assert len(list(kept.iterdir())) == 2
    for copy in kept.iterdir():
        copy.unlink()
    for check in (lambda: check_head_profile(tiny_llama.config, again),
                  lambda: make_policy_cache(tiny_llama.config, again)):
        with pytest.raises(PolicyError, match="built with the head profile"):
            check()
    # the digest covers the sizes a profile was measured for (the same modes at two windows shared one digest and
    # one kept copy, so a rebuild found the other's sizes); a digest from before it covered them still binds
    from kakeya_runtime.kv.heads import HeadProfile, load_profile

    current = load_profile(tiny_llama.config)
    assert HeadProfile(current.fingerprint, current.layers, {**current.sizes, "window": 16}).digest != current.digest
    legacy = PolicySpec.parse("sparse", {**params, "heads": f"profile:{current.legacy_digest}"})
    assert check_head_profile(tiny_llama.config, legacy).heads == f"profile:{current.digest}"  # bound anew
    # a copy kept under a digest from before, its profile since recalibrated away: still found
    kept_dir = tmp_path / "heads" / "bound"
    (kept_dir / f"{fingerprint(tiny_llama.config)}-{current.legacy_digest}.json").write_text(current.text)
    _write_profile(tiny_llama.config, {**modes, 1: ["dense", "dense"]}, tmp_path / "heads")  # recalibrated again
    assert check_head_profile(tiny_llama.config, legacy).heads == f"profile:{current.digest}"
    _write_profile(tiny_llama.config, modes, tmp_path / "heads")
    # a copy under that old digest holding the same modes at other sizes (both shared the old digest): the current
    # profile, with the digest and the sizes, serves the session
    _write_profile(tiny_llama.config, current.layers, tmp_path / "heads", sizes={**SMALL, "window": 16})
    other_sizes = current_file.read_text()
    _write_profile(tiny_llama.config, current.layers, tmp_path / "heads")
    (kept_dir / f"{fingerprint(tiny_llama.config)}-{current.legacy_digest}.json").write_text(other_sizes)
    assert check_head_profile(tiny_llama.config, legacy).heads == f"profile:{current.digest}"
    _write_profile(tiny_llama.config, modes, tmp_path / "heads")
    # measured for other sizes, or for layers the policy does not govern: refused, naming both
    _write_profile(tiny_llama.config, modes, tmp_path / "heads", sizes={**SMALL, "window": 16})
    with pytest.raises(PolicyError, match="measured for sink 3, window 16, block 4, topk 3"):
        check_head_profile(tiny_llama.config, PolicySpec.parse("sparse", params))
    _write_profile(tiny_llama.config, {**modes, 7: ["dense", "dense"]}, tmp_path / "heads")
    with pytest.raises(PolicyError, match=r"layers \[7\]"):
        check_head_profile(tiny_llama.config, PolicySpec.parse("sparse", params))
    path = next(p for p in (tmp_path / "heads").iterdir() if p.is_file())
    good = {"schema": "kakeya.heads", "schema_version": 1, "fingerprint": "x", "settings": SMALL}
    for text in ("{", "[]", '{"schema": "kakeya.heads", "schema_version": 1}',
                 '{"schema": "kakeya.heads", "schema_version": 1, "fingerprint": "x", "modes": ["a"]}',
                 json.dumps({**good, "modes": {"0": [1, "sparse"], "1": [None, "x"]}}),  # a TypeError, untyped
                 json.dumps({**good, "modes": {"0": {"dense": 1, "sparse": 2}}}),  # a dict read as its keys
                 json.dumps({**good, "modes": {"-1": ["dense", "dense"]}}),
                 json.dumps({**good, "settings": {"window": 8}, "modes": {"0": ["dense", "dense"]}})):
        path.write_text(text)
        with pytest.raises(PolicyError, match=str(path)):
            check_head_profile(tiny_llama.config, PolicySpec.parse("sparse", params))
    with pytest.raises(PolicyError, match="12 hex digits"):
        PolicySpec.parse("sparse", {**params, "heads": "profile:xyz"})


@pytest.mark.parametrize("step", ["decode", "chunk"])
def test_a_step_after_a_wrapped_hot_ring_is_trimmed_back_reads_no_emptied_slot(tiny_llama, step):
    """A hot ring that wrapped and was trimmed back to at most its slots (a speculative verify's rollback) handed a
    step its first `length` slots, an emptied one (position -1) among them: the kernel refused it and the session
    failed every later Generate. The step's logits equal a cache that reached the same length without the detour."""
    spec = PolicySpec.parse("sparse", {**SMALL, "spare": 4})
    eng = Engine(tiny_llama, prefill_chunk=16)
    cache = make_policy_cache(tiny_llama.config, spec, capacity=64)
    n = next(x for x in cache.layers if isinstance(x, SparseLayerKV)).hot_pos.shape[0]
    ids = _ids(n + 8, seed=4)
    eng.prefill(cache, ids[:, : n + 1])  # one past the ring: its first ring slot re-used
    cache.trim(n - 2)
    ref = make_policy_cache(tiny_llama.config, spec, capacity=64)
    eng.prefill(ref, ids[:, : n - 2])
    more = ids[:, n - 2 : n - 1] if step == "decode" else ids[:, n - 2 : n + 3]
    got = eng.prefill(cache, more, logits=Logits.ALL).logits
    assert torch.equal(got, eng.prefill(ref, more, logits=Logits.ALL).logits)


def test_probe_index_curve_follows_the_indexer(tiny_llama):
    """The oracle probe's index curve (blocks taken in block_select's order, recomputed in Python) gives, at the
    blocks a head kept, the mass the kernel's own selection kept; it never exceeds the ceiling (the best blocks) and
    grows with the blocks."""
    from kakeya_runtime.kv.sparse import OracleProbe

    native.load()
    cache = make_policy_cache(tiny_llama.config, PolicySpec.parse("sparse", {**SMALL, "codec": "identity",
                                                                            "budget": 0}))
    layers = [layer for layer in cache if isinstance(layer, SparseLayerKV)]
    for layer in layers:
        layer.probe = OracleProbe.new()
    eng = Engine(tiny_llama, prefill_chunk=16)
    ids = _ids(80, seed=8)
    eng.prefill(cache, ids[:, :-1])
    for layer in layers:
        layer.probe.active = True
    list(eng.stream(cache, ids[:, -1:], GenerateRequest(6, stop_ids=())))
    g = tiny_llama.config.num_attention_heads // tiny_llama.config.num_key_value_heads
    for layer in layers:
        probe = layer.probe
        assert len(probe.index_curves) == 6
        for curve, best, masses, n in zip(probe.index_curves, probe.curves, probe.masses, probe.selectable,
                                          strict=True):
            assert curve.shape == best.shape == (2, n + 1) and n > 3
            assert (curve <= best + 1e-6).all() and (curve.diff(dim=1) >= -1e-6).all()
            kept = torch.tensor(masses).view(2, g).mean(1)
            torch.testing.assert_close(curve[:, 3], kept, atol=1e-5, rtol=0)  # topk 3 of n blocks
