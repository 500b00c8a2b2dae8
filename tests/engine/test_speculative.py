"""Speculative decoding in the engine: exactness (greedy and sampled), rollback, the proposers' contracts.

The sampled-exactness tests compare the distribution of generated tokens with the exact target distribution
(computed by a batched forward over every first token), over DRAWS draws, with a chi-square threshold fixed
here; in every such test a control against a slightly different temperature shows the same counts do reject a
wrong distribution (at 8k draws by z = 11 to 146 against the threshold's 5: the draws' number is not what limits
the tests' power). A deliberately bad proposer (uniformly random drafts) must be exact too, just slow.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kakeya_runtime.engine.drafts import Draft, HistoryLookup, RandomDraft
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.sampling import SamplingParams, probs_from_logits, sample
from kakeya_runtime.engine.speculative import SpeculativeStream, verify_sampled
from kakeya_runtime.models.base import Logits

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny forwards: OpenMP threads only contend here

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repeats, so the history proposer drafts
CHI2_Z = 5.0  # (chi2 - dof) / sqrt(2 dof) above this fails: ~3e-7 one-sided for an exact sampler
DRAWS = 8_000  # per distribution compared


def _chi2_z(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 8.0) -> float:
    """Pearson chi-square over cells with at least `min_expected` expected draws (the rest pooled), as a z-score."""
    n = float(counts.sum())
    exp = expected_p.double().flatten() * n
    obs = counts.double().flatten()
    big = exp >= min_expected
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    keep = e > 0
    assert float(o[~keep].sum()) == 0.0, "a token with probability 0 was generated"
    chi2 = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    return (chi2 - dof) / math.sqrt(2 * dof)


def _exact_two_tokens(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2 | prompt) under plain sampling with `params`: (V, V)."""
    v = model.config.vocab_size
    ids = torch.tensor([prompt] * v, dtype=torch.long)
    ids = torch.cat([ids, torch.arange(v)[:, None]], dim=1)
    with torch.inference_mode():
        logits = model(ids, torch.arange(ids.shape[1]), None, logits=Logits.ALL).logits
    p1 = probs_from_logits(logits[0:1, -2].float(), params)[0].double()
    p2 = probs_from_logits(logits[:, -1].float(), params).double()
    return p1[:, None] * p2


def _stream_pair(engine: Engine, cache, proposer, params: SamplingParams, seed: int, k: int) -> tuple[list[int], object]:
    """One real speculative stream after PROMPT (the cache holds PROMPT[:-1]), seeded with `seed`, read until it
    has emitted two tokens (t1 from the prefill, t2 from a verifier step over the draft), then closed; the cache is
    asserted to hold exactly everything before the last emitted token (a rejected draft was rolled back)."""
    base = cache.length
    req = GenerateRequest(3, SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed))
    stream = SpeculativeStream(engine, cache, torch.tensor([PROMPT[-1:]]), req, proposer, PROMPT, k)
    out: list[int] = []
    steps = iter(stream)
    for step in steps:
        out.extend(step)
        if len(out) >= 2:
            break
    steps.close()
    assert cache.length == base + len(out)
    cache.trim(base)
    return out[:2], stream.stats


def _draw(engine: Engine, proposer, params: SamplingParams, n: int, k: int) -> tuple[torch.Tensor, float]:
    """n real speculative streams of two tokens after PROMPT, each seeded with its index; joint counts of
    (t1, t2), (V, V), and the acceptance rate. Every stream drafts (asserted), so the verifier really is tested."""
    v = engine.config.vocab_size
    cache = engine.new_cache(capacity=32)
    engine.prefill(cache, torch.tensor([PROMPT[:-1]]))
    counts = torch.zeros(v, v, dtype=torch.long)
    drafted = accepted = 0
    for i in range(n):
        (t1, t2), stats = _stream_pair(engine, cache, proposer, params, i, k)
        counts[t1, t2] += 1
        assert stats.drafted >= 1 or proposer.name == "history"  # history drafts only after a match
        drafted += stats.drafted
        accepted += stats.accepted
    assert drafted > n // 20
    return counts, accepted / max(1, drafted)


def _draw_rows(engine: Engine, make_proposer, params: SamplingParams, n: int, *, rows: int = 2500,
               check: int = 150) -> tuple[torch.Tensor, float]:
    """The same n two-token draws as `_draw` (seeds 0..n-1, one-token drafts), `rows` independent draws per
    forward: the prefill of PROMPT[-1] and the verifier forward over [t1, draft] run on a batch of rows (our
    kernels give every row the logits it gets alone, INV-3), and each row goes through the real pieces a stream
    runs, in a stream's order: `sample` for t1, the proposer's propose (after begin/accepted), `verify_sampled`
    for t2, each row's generator seeded like the stream's. The first `check` draws are also run as real
    SpeculativeStreams and must give the very same tokens, so the counts are those of n real streams.

    One proposer from `make_proposer()` serves every row in order (as `_draw` shares one between its streams, so a
    proposer with its own random generator draws the same drafts); a fresh one replays the check streams."""
    v = engine.config.vocab_size
    counts = torch.zeros(v, v, dtype=torch.long)
    drafted = accepted = 0
    pairs: list[tuple[int, int]] = []
    proposer = make_proposer()
    for r0 in range(0, n, rows):
        b = min(rows, n - r0)
        cache = engine.new_cache(batch=b, capacity=32)
        engine.prefill(cache, torch.tensor([PROMPT[:-1]] * b))
        out = engine.verify(cache, torch.tensor([PROMPT[-1:]] * b), logits=Logits.LAST, return_hidden=True)
        gens = [SamplingParams(params.temperature, params.top_k, params.top_p, seed=r0 + i).make_generator()
                for i in range(b)]
        t1s, drafts = [], []
        for i in range(b):
            t1 = int(sample(out.logits[i : i + 1, -1], params, gens[i])[0])
            proposer.begin(PROMPT)
            if proposer.wants_hidden:
                proposer.accepted(PROMPT, 0, out.hidden[i, -1:])
            draft = proposer.propose([*PROMPT, t1], 1, params, gens[i])
            t1s.append(t1)
            drafts.append(draft)
        # A row without a draft (history: t1 matched nothing) gets a pad token the stream would not have fed; its
        # t2 is sampled from the logits at t1, which do not see the pad: what a plain decode step samples from.
        ver = engine.verify(cache, torch.tensor([[t1, *(d.tokens or [0])] for t1, d in zip(t1s, drafts, strict=True)]))
        for i in range(b):
            if drafts[i].tokens:
                emitted = verify_sampled(ver.logits[i], drafts[i], params, gens[i])
                drafted += 1
                accepted += int(len(emitted) == 2)
            else:
                emitted = [int(sample(ver.logits[i, :1], params, gens[i])[0])]
            counts[t1s[i], emitted[0]] += 1
            pairs.append((t1s[i], emitted[0]))
    cache = engine.new_cache(capacity=32)
    engine.prefill(cache, torch.tensor([PROMPT[:-1]]))
    proposer = make_proposer()
    for i in range(min(check, rows, n)):
        got, _ = _stream_pair(engine, cache, proposer, params, i, 1)
        assert tuple(got) == pairs[i], (i, got, pairs[i])
    assert drafted > n // 20  # (history drafts only after a match) the verifier is really being tested
    return counts, accepted / drafted


class _FirstTokenOracle:
    """Drafts the token the target is most likely to emit first, then junk: acceptance is high, rejections real."""

    name = "oracle"
    wants_hidden = False

    def __init__(self, token: int) -> None:
        self.token = token

    def attach(self, cache) -> None:
        pass

    def begin(self, context) -> None:
        pass

    def propose(self, context, max_tokens, sampling, generator) -> Draft:
        return Draft([self.token, 0][:max_tokens])

    def accepted(self, context, n_accepted, hidden) -> None:
        pass


@pytest.mark.parametrize("proposer_kind", ["history", "random", "random_sampled_q"])
def test_sampled_speculation_matches_the_target_distribution(make_tiny_model, proposer_kind: str) -> None:
    """DRAWS streams after the prompt (the second token comes from a verifier step), T=0.8 with top-k and
    top-p: the joint distribution of (t1, t2) matches plain sampling's exactly; the same counts against the
    distribution at T=0.9 are rejected by the same threshold (the test has power)."""
    torch.manual_seed(0)
    model = make_tiny_model("llama")
    engine = Engine(model)
    v = model.config.vocab_size
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    make = {"history": lambda: HistoryLookup(min_match=1),
            "random": lambda: RandomDraft(v, seed=1),
            "random_sampled_q": lambda: RandomDraft(v, seed=2, sampled=True)}[proposer_kind]
    # The first token comes from the prefill, the second from [t1, draft] verified.
    counts, rate = _draw_rows(engine, make, params, DRAWS)
    exact = _exact_two_tokens(model, PROMPT, params)
    z = _chi2_z(counts, exact)
    assert z < CHI2_Z, f"z = {z:.2f}"
    # Marginals too (sharper for the common tokens).
    assert _chi2_z(counts.sum(0), exact.sum(0)) < CHI2_Z
    wrong = _exact_two_tokens(model, PROMPT, SamplingParams(temperature=0.9, top_k=40, top_p=0.95))
    assert _chi2_z(counts, wrong) > CHI2_Z  # power: a slightly different distribution is caught
    if proposer_kind == "random":
        assert 0.0 < rate < 0.2  # mostly rejected (the residual path), sometimes accepted
    elif proposer_kind == "random_sampled_q":
        assert rate > 0.3  # sum of min(p, uniform q)


def test_verify_sampled_is_exact_for_every_transform() -> None:
    """The verifier alone, DRAWS draws per setting and draft, with a draft the target likes, one it does not and a
    sampled q: the first emitted token is distributed as p_0 (after the transform), the second (when the first draft
    was accepted) as p_1; the same counts reject the distributions at a 10% higher temperature (power)."""
    g = torch.Generator().manual_seed(0)
    v = 24
    logits = torch.randn(3, v, generator=g) * 2.0
    settings = [SamplingParams(1.0), SamplingParams(0.6, top_k=6), SamplingParams(1.3, top_p=0.8),
                SamplingParams(0.9, top_k=10, top_p=0.9)]
    for params in settings:
        p = probs_from_logits(logits, params).double()
        wrong = probs_from_logits(logits, dataclasses.replace(params, temperature=params.temperature * 1.1)).double()
        good = int(p[0].argmax())
        q = torch.softmax(torch.randn(2, v, generator=g), dim=-1)
        dg = torch.Generator().manual_seed(2)
        fixed = [Draft([good, int(p[1].argmax())]), Draft([int(p[0].argmin()), 3])]
        # A sampled-q draft must be redrawn from q every time (that is what makes q's correction exact).
        def sampled(q: torch.Tensor = q, dg: torch.Generator = dg) -> Draft:
            return Draft([int(torch.multinomial(q[i], 1, generator=dg)) for i in range(2)], q)

        makers = [lambda d=d: d for d in fixed] + [sampled]
        for make in makers:
            first = torch.zeros(v, dtype=torch.long)
            second = torch.zeros(v, dtype=torch.long)
            gen = torch.Generator().manual_seed(1)
            for _ in range(DRAWS):
                draft = make()
                out = verify_sampled(logits, draft, params, gen)
                first[out[0]] += 1
                if out[0] == draft.tokens[0] and len(out) > 1:
                    second[out[1]] += 1
            assert _chi2_z(first, p[0]) < CHI2_Z < _chi2_z(first, wrong[0]), (params, draft.tokens)
            if int(second.sum()) > 1000 and draft.q is None:  # fixed drafts: the second is drawn from p_1
                assert _chi2_z(second, p[1]) < CHI2_Z < _chi2_z(second, wrong[1]), (params, draft.tokens)


def test_seeded_speculative_stream_is_reproducible(make_tiny_model) -> None:
    model = make_tiny_model("llama")
    engine = Engine(model)
    req = GenerateRequest(40, SamplingParams(temperature=0.9, top_k=20, seed=1234))
    runs = []
    for _ in range(2):
        cache = engine.new_cache(capacity=128)
        stream = SpeculativeStream(engine, cache, torch.tensor([PROMPT]), req, HistoryLookup(min_match=1), PROMPT, 4)
        runs.append([t for step in stream for t in step])
    assert runs[0] == runs[1] and len(runs[0]) == 40


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_long_prompt_is_read_one_chunk_a_step_with_the_same_tokens(make_tiny_model, family: str) -> None:
    """With `short_prompt`, a longer prompt is read one chunk per step (the budget sent, yielding no tokens) so a
    scheduler can step other rows and check cancellation between chunks; the tokens are those of a whole read."""
    model = make_tiny_model(family)
    engine = Engine(model)
    prompt = (PROMPT * 6)[:70]
    req = GenerateRequest(24, SamplingParams(temperature=0.8, seed=5))

    def stream(**kw) -> SpeculativeStream:
        return SpeculativeStream(engine, engine.new_cache(capacity=128), torch.tensor([prompt]), req,
                                 HistoryLookup(min_match=1), prompt, 4, **kw)

    whole = [t for step in stream() for t in step]
    chunked = stream(short_prompt=16)
    steps = iter(chunked)
    first = next(steps)  # nothing read yet: the first budget comes with the next step
    assert first == [] and chunked.prefill_left == 70
    got = []
    for budget in [16, 16, 16, 16, 16, 16]:
        got.append(steps.send(budget))
    assert got[:4] == [[], [], [], []] and chunked.prefill_left == 0  # 64 read in four chunks, then the rest
    tokens = [t for step in got for t in step] + [t for step in steps for t in step]
    assert tokens == whole

    stop = False
    cancelled = stream(short_prompt=16, should_stop=lambda: stop)
    steps = iter(cancelled)
    next(steps), steps.send(16)
    stop = True
    with pytest.raises(StopIteration):
        steps.send(16)
    assert cancelled.result is None and cancelled.prefill_left == 70 - 32 and cancelled.cache.length == 32


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_seeded_stream_with_deterministic_drafts_is_plain_samplings(make_tiny_model, family: str) -> None:
    """History lookup also drafts from the owner's other sessions, so its drafts depend on more than the session:
    a seeded sampled stream must not. With guesses verified against the target's own samples it is plain
    sampling's stream token for token, whatever is drafted (random guesses, history, a self-quoting prompt)."""
    model = make_tiny_model(family)
    engine = Engine(model)
    v = model.config.vocab_size
    prompt = PROMPT + PROMPT[:20]  # history lookup finds matches
    for params in (SamplingParams(0.9, top_k=20, seed=1234), SamplingParams(1.3, top_p=0.9, seed=7),
                   SamplingParams(0.05, seed=3)):
        req = GenerateRequest(40, params)
        plain = engine.generate(engine.new_cache(capacity=160), torch.tensor([prompt]), req).token_ids[0]
        for proposer in (HistoryLookup(min_match=1), RandomDraft(v, seed=1), RandomDraft(v, seed=2)):
            stream = SpeculativeStream(engine, engine.new_cache(capacity=160), torch.tensor([prompt]), req, proposer,
                                       prompt, 4)
            assert [t for step in stream for t in step] == plain, (params, proposer)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("proposer_kind", ["history", "random", "oracle"])
def test_greedy_rollback_leaves_the_cache_as_plain_decode_does(make_tiny_model, family: str,
                                                               proposer_kind: str) -> None:
    """Greedy tokens identical to plain decode; afterwards every layer holds the same length, the same K/V bits
    (at the same positions, the Gemma sliding rings included, wrapped several times) as after plain decode,
    and the next turn's tokens are identical."""
    model = make_tiny_model(family)
    engine = Engine(model)
    v = model.config.vocab_size
    req = GenerateRequest(60, SamplingParams())
    caches, outs, stats = [], [], None
    for spec in (False, True):
        cache = engine.new_cache(capacity=200)
        ids = torch.tensor([PROMPT])
        if spec:
            proposer = {"history": HistoryLookup(min_match=1), "random": RandomDraft(v, seed=3),
                        "oracle": _FirstTokenOracle(outs[0][1])}[proposer_kind]
            stream = SpeculativeStream(engine, cache, ids, req, proposer, PROMPT, 5)
            out = [t for step in stream for t in step]
            stats = stream.stats
        else:
            out = engine.generate(cache, ids, req).token_ids[0]
        caches.append(cache)
        outs.append(out)
    assert outs[0] == outs[1]
    assert stats.drafted > 0
    if proposer_kind != "history":  # the tiny models loop, so history drafts may all be accepted
        assert stats.drafted > stats.accepted  # rejections happened (so did rollbacks)
    plain, spec = caches
    assert plain.layer_lengths() == spec.layer_lengths() == [len(PROMPT) + 59] * len(plain)
    for a, b in zip(plain.state(), spec.state(), strict=True):
        for key in a:
            if key == "stale_until":
                continue
            if key == "slot_positions":  # same positions held; a trimmed slot may not be rewritten yet
                held_a, held_b = a[key][a[key] < a["length"]], b[key][b[key] < b["length"]]
                assert torch.equal(held_a.sort().values, held_b.sort().values)
                continue
            if key in ("k", "v") and "slot_positions" in a:
                pos_a, pos_b = a["slot_positions"], b["slot_positions"]
                for p in pos_a[pos_a < a["length"]].tolist():
                    ia, ib = int((pos_a == p).nonzero()[0]), int((pos_b == p).nonzero()[0])
                    assert torch.equal(a[key][:, :, ia], b[key][:, :, ib])
                continue
            assert torch.equal(a[key], b[key]), key
    # The next turn: plain decode on both caches gives identical tokens.
    nxt = torch.tensor([[outs[0][-1], 11, 12, 13]])
    assert engine.generate(plain, nxt, GenerateRequest(20)).token_ids == \
        engine.generate(spec, nxt, GenerateRequest(20)).token_ids


def test_stop_token_inside_an_accepted_draft_ends_there(make_tiny_model) -> None:
    model = make_tiny_model("llama")
    engine = Engine(model)
    plain = engine.generate(engine.new_cache(capacity=128), torch.tensor([PROMPT]), GenerateRequest(30)).token_ids[0]
    stop = plain[7]
    want = plain[: plain.index(stop) + 1]
    cache = engine.new_cache(capacity=128)
    req = GenerateRequest(30, stop_ids=(stop,))
    # An oracle proposer that drafts the plain continuation: the stop token arrives inside an accepted draft.
    context = list(PROMPT)

    class Oracle(_FirstTokenOracle):
        def propose(self, ctx, max_tokens, sampling, generator) -> Draft:
            done = len(ctx) - len(context)
            return Draft(plain[done : done + max_tokens])

    stream = SpeculativeStream(engine, cache, torch.tensor([PROMPT]), req, Oracle(0), PROMPT, 8)
    out = [t for step in stream for t in step]
    assert out == want
    assert stream.result.finish_reason.value == "stop"
    assert cache.length == len(PROMPT) + len(want) - 1
    # The stats count what was emitted: drafts verified past the stop token were cut off, not accepted
    stats = stream.stats
    assert stats.accepted == len(out) - 1 and stats.verified_tokens == len(out) - 1  # the bonus token was cut too
    assert stats.tokens_per_verifier_step == (len(out) - 1) / stats.verifier_steps


def test_history_lookup_drafts_follow_the_match() -> None:
    """The longest suffix match (most recent occurrence) drafts what followed it, draft_factor * m tokens for a
    match of m (SuffixDecoding's adaptive length), capped by max_tokens; a cycle continues past the context's end."""
    sp = SamplingParams()
    h = HistoryLookup(draft_factor=1)
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert h.propose(ctx, 4, sp, None).tokens == [4, 5, 6]  # match length 3 -> 3 tokens
    ctx2 = ctx + [4, 5, 6, 7]
    assert h.propose(ctx2, 4, sp, None).tokens == [8, 9, 1, 2]  # longer match, capped at 4
    assert h.propose([10, 11, 12], 4, sp, None).tokens == []  # a new context resets; no match
    cyc = [7, 8, 7, 8, 7, 8]
    assert HistoryLookup(draft_factor=1).propose(cyc, 5, sp, None).tokens == [7, 8, 7, 8]  # period 2 continues
    # The default: 4 tokens per matched token, up to the adaptive cap (15).
    h = HistoryLookup()
    assert HistoryLookup.auto_draft_tokens == 15
    assert h.propose(ctx, 15, sp, None).tokens == [4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]  # m = 3 -> 12 tokens
    assert h.propose(ctx2, 15, sp, None).tokens == [8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]  # m = 7 -> cap
    assert HistoryLookup().propose([10, 11, 12, 11], 15, sp, None).tokens == [12, 11, 12, 11]  # m = 1 -> 4
    assert HistoryLookup(min_match=2).propose([10, 11, 12, 11], 15, sp, None).tokens == []
    # The most recent occurrence wins: 5 was followed by 6, later by 9.
    assert HistoryLookup(draft_factor=1).propose([5, 6, 0, 5, 9, 0, 5], 1, sp, None).tokens == [9]


def test_history_lookup_drafts_from_related_histories() -> None:
    """`related` histories (the same owner's other sessions) are drafted from when the context itself has no
    (or a shorter) match, and only then; they are re-read at each begin()."""
    sp = SamplingParams()
    other = {"s1": [50, 51, 52, 53, 54, 55, 56]}
    h = HistoryLookup(related=lambda: other)
    ctx = [1, 2, 3, 51, 52]
    h.begin(ctx)
    assert h.propose(ctx, 15, sp, None).tokens == [53, 54, 55, 56]  # what followed 51 52 there
    assert HistoryLookup().propose(ctx, 15, sp, None).tokens == []  # without it: nothing to copy
    own = [52, 9, 9, 52]  # its own match: 52 (m = 1); the related history has no longer one (9 52 is not there)
    h2 = HistoryLookup(related=lambda: other)
    h2.begin(own)
    assert h2.propose(own, 15, sp, None).tokens == [9, 9, 52, 9]  # own m = 1 (52), nothing longer elsewhere
    ctx3 = [7, 51, 52, 8, 51, 52]  # own match 51 52 (m = 2) ties the related one: the own history wins
    h3 = HistoryLookup(related=lambda: other)
    h3.begin(ctx3)
    assert h3.propose(ctx3, 15, sp, None).tokens[:2] == [8, 51]
    other["s1"] = other["s1"] + [57, 58]  # it grew: re-read (and indexed incrementally) at the next begin
    h.begin(ctx)
    assert h.propose(ctx, 15, sp, None).tokens == [53, 54, 55, 56, 57, 58]
    other.clear()
    h.begin(ctx)
    assert h.propose(ctx, 15, sp, None).tokens == []  # a session that ended is no longer drafted from


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["self", "draft_head"])
def test_model_based_drafts_are_exact_greedy(make_tiny_model, family: str, kind: str) -> None:
    """Layer-skipping self-speculation (over the session's own cache) and a randomly initialised draft head:
    greedy tokens identical to plain decode, the cache left as plain decode leaves it."""
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft

    model = make_tiny_model(family)
    engine = Engine(model)
    req = GenerateRequest(50, SamplingParams())
    plain_cache = engine.new_cache(capacity=128)
    plain = engine.generate(plain_cache, torch.tensor([PROMPT]), req).token_ids[0]
    proposer = LayerSkipDraft(model, layers=2) if kind == "self" else DraftHeadProposer(DraftHead(model, seed=5))
    cache = engine.new_cache(capacity=128)
    stream = SpeculativeStream(engine, cache, torch.tensor([PROMPT]), req, proposer, PROMPT, 4)
    assert [t for step in stream for t in step] == plain
    assert stream.stats.drafted > 0
    assert cache.layer_lengths() == plain_cache.layer_lengths()
    nxt = torch.tensor([[plain[-1], 20, 21]])
    assert engine.generate(cache, nxt, GenerateRequest(10)).token_ids == \
        engine.generate(plain_cache, nxt, GenerateRequest(10)).token_ids


@pytest.mark.parametrize("kind", ["self", "draft_head", "draft_head_vocab"])
def test_model_based_drafts_sampled_exact(make_tiny_model, kind: str) -> None:
    """Sampled drafts from the draft's own (transformed) distribution q: DRAWS two-token streams match the target
    (and reject it at a 10% higher temperature). draft_head_vocab: a head that drafts only every other token (its
    q zero elsewhere), still the target's distribution."""
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft

    model = make_tiny_model("llama")
    engine = Engine(model)
    params = SamplingParams(temperature=0.7, top_k=30, top_p=0.9)
    if kind == "self":  # it drafts over the stream's own (one-row) cache: real streams
        counts, rate = _draw(engine, LayerSkipDraft(model, layers=2), params, DRAWS, k=1)
    else:
        vocab = torch.arange(0, model.config.vocab_size, 2) if kind == "draft_head_vocab" else None
        head = DraftHead(model, seed=5, vocab=vocab)
        counts, rate = _draw_rows(engine, lambda: DraftHeadProposer(head), params, DRAWS)
    exact = _exact_two_tokens(model, PROMPT, params)
    assert _chi2_z(counts, exact) < CHI2_Z
    assert _chi2_z(counts.sum(0), exact.sum(0)) < CHI2_Z
    assert _chi2_z(counts, _exact_two_tokens(model, PROMPT, dataclasses.replace(params, temperature=0.77))) > CHI2_Z
    assert rate > 0.0


def test_draft_head_weights_round_trip_through_safetensors(make_tiny_model, tmp_path) -> None:
    """A saved head loads back bit-identical and drafts exactly what it drafted before (same tokens, same stats);
    weights that do not fit the model are refused with a typed error naming the problem, the head unchanged."""
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadError, DraftHeadProposer

    model = make_tiny_model("llama")
    engine = Engine(model)
    head = DraftHead(model, intermediate=96, seed=7)
    path = tmp_path / "head.safetensors"
    head.save(path)
    loaded = DraftHead.from_file(model, path)
    assert loaded.up.weight.shape == (96, model.config.hidden_size)  # the file's intermediate size
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(loaded.fc.weight, DraftHead(model, intermediate=96, seed=8).fc.weight)  # not a default
    runs = []
    for h in (head, loaded):
        cache = engine.new_cache(capacity=128)
        stream = SpeculativeStream(engine, cache, torch.tensor([PROMPT]), GenerateRequest(40), DraftHeadProposer(h),
                                   PROMPT, 4)
        runs.append(([t for step in stream for t in step], stream.stats.drafted, stream.stats.accepted))
    assert runs[0] == runs[1] and runs[0][1] > 0
    plain = engine.generate(engine.new_cache(capacity=128), torch.tensor([PROMPT]), GenerateRequest(40))
    assert runs[1][0] == plain.token_ids[0]
    # Another model's head (hidden size 32): shape error.
    from kakeya_runtime.models.registry import build_model
    from kakeya_runtime.server.testing import tiny_config

    other = build_model(dataclasses.replace(tiny_config("llama"), hidden_size=32, intermediate_size=64))
    DraftHead(other).save(tmp_path / "other.safetensors")
    with pytest.raises(DraftHeadError, match="fc.weight has shape"):
        DraftHead.from_file(model, tmp_path / "other.safetensors")
    # Missing or extra tensors, a file that is not safetensors: typed errors.
    from safetensors.torch import save_file

    sd = {k: v.clone() for k, v in head.state_dict().items()}
    save_file({k: v for k, v in sd.items() if k != "down.weight"}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(DraftHeadError, match="missing tensors \\['down.weight'\\]"):
        DraftHead.from_file(model, tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftHeadError, match="cannot read"):
        DraftHead.from_file(model, tmp_path / "junk.safetensors")
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    bad = {**sd, "norm_scale": torch.ones(3)}
    with pytest.raises(DraftHeadError, match="norm_scale has shape"):
        loaded.load_tensors(bad)
    assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())  # nothing changed


def test_the_verify_cost_is_measured_and_prices_history_steps(make_tiny_model) -> None:
    """Decide by measurement: what a verifier step over k drafts costs beyond a decode step is timed on the machine
    (without AMX tiles 4 drafts cost ~1.8 extra decode steps on SmolLM2, with them ~0), and the history proposer's
    off-switch prices its steps by it, so drafts that are rarely accepted pause where they lose."""
    from kakeya_runtime.engine.speculative import Governor, measure_verify_cost

    engine = Engine(make_tiny_model("llama"))
    cost = measure_verify_cost(engine, context=32, repeats=1)
    assert len(cost) == 17 and cost[0] == 0.0 and all(c >= 0.0 for c in cost)
    cheap, dear = Governor.for_proposer(HistoryLookup()), Governor.for_proposer(HistoryLookup(), [0.0] + [1.5] * 16)
    for _ in range(2):
        for g in (cheap, dear):
            g.step(4, 2)  # 4 drafted, one accepted: 2 tokens for the verifier step
    assert cheap.active() and not dear.active()  # 2 / 1.04 pays; 2 / 2.5 does not

    class ModelDraft:  # a proposer whose drafting costs forwards (self, draft_head)
        draft_cost = 0.25

    model_based = Governor.for_proposer(ModelDraft(), [0.0] + [1.5] * 16)  # type: ignore[arg-type]
    assert model_based.verify_cost is None  # its sampled drafts draw from the stream: constants keep it replayable
