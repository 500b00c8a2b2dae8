"""Exact speculative decoding (seed 000 §11.5, Leviathan et al. 2023): a proposer drafts, the model verifies.

One verifier step over a cache holding everything before the last sampled token `x`:

1. the proposer (engine.drafts) guesses d_1..d_k (k <= max_draft_tokens, and never past max_new_tokens);
2. the model runs one forward over [x, d_1..d_k] at positions L..L+k (the chunk path: with our attention kernel a
   chunk's logits are bit-identical to token-by-token decode, INV-3), giving the target logits for every
   position;
3. greedy: d_i is accepted while it equals the argmax at its position, then the argmax after the last accepted
   draft is emitted too (the same `argmax` the plain sampler takes, so the tokens are identical to plain decode);
   sampling with deterministic guesses (history lookup, q one-hot): the target's own sample is drawn at each
   position, exactly as plain decoding draws it (`sample`: the same uniform from the same generator, one per
   emitted token), and d_i is accepted while it equals that sample; at the first mismatch the sample is emitted,
   and when every draft was accepted one more is drawn. The acceptance probability is p_i(d_i), Leviathan's
   min(1, p/q) for a one-hot q, and the stream is plain sampling's token for token, whatever was drafted;
   sampling with sampled guesses (the model-based proposers, a distribution q_i per draft): d_i is accepted with
   probability min(1, p_i(d_i) / q_i(d_i)), where p_i is the target distribution after the sampler's own transform
   (temperature, top-k, top-p: `sampling.support`); at the first rejection a token is drawn from the residual
   norm(max(0, p_i - q_i)), and when every draft was accepted one more from p_{k+1}. Every emitted token is then
   distributed exactly as plain sampling would draw it;
4. the cache is trimmed to L + (emitted tokens): the rejected drafts' K/V are rolled back before anything is
   committed, so the cache again holds everything before the last emitted token.

So a seeded stream with history drafts is the stream without speculation, whatever the drafts were (history
lookup also drafts from the owner's other live sessions: a seeded stream must not depend on them). With a
model-based proposer the random numbers are drawn in a different order than plain sampling's (the proposer draws
its drafts too), so a seeded sampled stream is reproducible for that speculation setting (proposer,
max_draft_tokens) and a different, equally distributed stream than without. Greedy streams are identical with
and without.

Draft length. `max_draft_tokens` caps each step; 0 asks for the proposer's own adaptive cap (`auto_draft_tokens`):
history lookup drafts up to CHEAP_VERIFY_TOKENS - 1 (a verifier chunk of up to 16 rows costs about one decode step
on the CPU kernels: one AMX tile of rows), its draft following the match length; the model-based proposers, whose
every drafted token costs a draft forward, start at one token per step and double it while whole drafts are
accepted (halving it at a rejection), so a draft that is rarely right costs little before the off-switch acts.

Adaptive off-switch (`Governor`): a step's cost in decode steps is 1 + (VERIFY_COST + the proposer's `draft_cost`)
per drafted token; when the tokens it emitted per unit of cost stay below the bar, the stream decodes plainly for
a while and then probes again with a one-token draft (backing off exponentially while it keeps not paying). It
counts tokens, never time, so a seeded stream stays reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kakeya_runtime.engine.drafts import Draft, DraftProposer
from kakeya_runtime.engine.generate import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerationError,
    GenerationResult,
)
from kakeya_runtime.engine.sampling import SamplingParams, draw, greedy, sample, support
from kakeya_runtime.kv.cache import ModelKV
from kakeya_runtime.models.base import Logits

MAX_DRAFT_TOKENS = 16  # the most a verifier step drafts (kv.cache.SLIDING_SPARE keeps that much rollback room)
VERIFY_COST = 0.01  # extra cost of a verifier chunk per drafted token, in decode steps (<= 16 rows), measured on the
# Xeon with AMX: the model-based proposers' price; history lookup is priced by measure_verify_cost on the machine
DEFAULT_AUTO_DRAFT = 4  # the adaptive cap of a proposer that names none


def auto_draft_tokens(proposer: DraftProposer) -> int:
    """The draft cap `max_draft_tokens=0` stands for with this proposer."""
    return int(getattr(proposer, "auto_draft_tokens", DEFAULT_AUTO_DRAFT))


@dataclass(slots=True)
class SpecStats:
    drafted: int = 0  # draft tokens sent to the verifier
    accepted: int = 0  # of those, accepted
    verifier_steps: int = 0  # forwards that checked at least one draft
    plain_steps: int = 0  # single-token decode steps (no draft, or the off-switch was on)
    off_switches: int = 0  # times the governor turned speculation off
    verified_tokens: int = 0  # tokens the verifier forwards emitted (accepted drafts + their own; none cut off)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verifier_step(self) -> float:
        """Tokens emitted per verifier forward (accepted drafts + the one the verifier adds, less what a stop or the
        length cut off)."""
        return self.verified_tokens / self.verifier_steps if self.verifier_steps else 0.0


def verify_greedy(logits: Tensor, draft: Sequence[int]) -> list[int]:
    """logits (k+1, V) fp32 at [x, d_1..d_k]; the emitted tokens: the accepted drafts, then the target's argmax."""
    best = greedy(logits).tolist()
    n = 0
    while n < len(draft) and best[n] == draft[n]:
        n += 1
    return [*draft[:n], best[n]]


def verify_sampled(logits: Tensor, draft: Draft, sampling: SamplingParams,
                   generator: torch.Generator | None) -> list[int]:
    """Exact verification for the sampler's transform of the target distribution (module docstring, step 3).

    Deterministic guesses (q None): the target's own sample at each position, drawn by `sample` as plain decoding
    draws it, until one differs from its guess: the emitted tokens are plain sampling's whatever was guessed.
    Sampled guesses: Leviathan et al.'s rejection sampling. The target distribution of a row is computed only when
    that row is reached (the rows after the first rejection are never needed); the random numbers are drawn in a
    fixed order (k uniforms, then one token), whichever rows are computed. The bonus token after k accepted drafts
    is what plain sampling draws there."""
    k = len(draft.tokens)
    if draft.q is None:
        emitted: list[int] = []
        for i in range(k + 1):
            emitted.append(int(sample(logits[i : i + 1], sampling, generator)[0]))
            if i == k or emitted[i] != draft.tokens[i]:
                return emitted
    u = torch.rand(k, generator=generator, device=logits.device).tolist()
    q = draft.q.to(logits.device)
    for i, d in enumerate(draft.tokens):
        # the distribution plain sampling draws from, over its support (ids None: the whole vocabulary)
        ids, w = support(logits[i], sampling)
        p = w.double() / w.sum(dtype=torch.float64)
        at = d if ids is None else _position(ids, d)  # d's place in p, or -1 outside the support
        p_d = float(p[at]) if at >= 0 else 0.0
        # accept d_i with probability min(1, p/q): u < p/q, written without dividing (q > 0 for a drawn token)
        if u[i] * float(q[i, d]) >= p_d:
            residual = (p - (q[i] if ids is None else q[i, ids]).double()).clamp_min_(0.0)  # 0 outside p's support
            if not float(residual.sum()) > 0.0:  # p == q: a rejection had probability 0 (float edge); p is the answer
                residual = p
            pick = draw(residual, generator)
            return [*draft.tokens[:i], pick if ids is None else int(ids[pick])]
    return [*draft.tokens, int(sample(logits[k : k + 1], sampling, generator)[0])]


def _position(ids: Tensor, token: int) -> int:
    """Where `token` sits in `ids`, or -1."""
    hit = (ids == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else -1


class Governor:
    """The adaptive off-switch and draft-length control, in token counts only (never time: a seeded stream must
    replay the same steps).

    After each verifier step it updates an average (decay `decay`) of the tokens the step emitted per unit of
    cost, a step with k drafts costing 1 + `cost` * k decode steps (`cost`: the verifier's extra per drafted token
    plus the proposer's own drafting). When the average falls below `min_gain`, speculation pauses for `pause`
    plain tokens; the step after a pause is a probe with a one-token draft: a bad one pauses again for twice as
    long (up to `max_pause`), a good one resumes (and resets the pause once the average is clearly above the bar).
    The average starts just above the bar, so one clearly losing step is enough to pause.

    `slow_start` (the model-based proposers, whose drafted tokens each cost a draft forward): the draft length
    starts at 1, doubles after a step whose whole draft was accepted and falls back to the accepted length + 1
    after a rejection. Otherwise (history lookup: drafting is free) every step may draft up to the cap."""

    def __init__(self, *, cost: float = VERIFY_COST, min_gain: float = 1.0, decay: float = 0.7, pause: int = 4,
                 max_pause: int = 64, slow_start: bool = False, verify_cost: Sequence[float] | None = None) -> None:
        self.cost, self.min_gain, self.decay = cost, min_gain, decay
        self.verify_cost = verify_cost  # measured extra cost of a verifier step per draft count (replaces `cost`)
        self.base_pause, self.max_pause = pause, max_pause
        self.pause = pause
        self.slow_start = slow_start
        self.gain = min_gain + 0.1
        self.length = 1  # slow start: the next draft's length
        self.probing = False
        self.off_for = 0  # plain tokens left before probing again
        self.switches = 0

    @classmethod
    def for_proposer(cls, proposer: DraftProposer, verify_cost: Sequence[float] | None = None) -> Governor:
        """History lookup (drafting is free: pause briefly, probe often) or a model-based proposer (each drafted
        token costs `draft_cost` decode steps: slow start, long pauses). `verify_cost` (measured on this machine,
        Engine.verify_cost) prices history lookup's steps: its drafts never change the tokens (verify_sampled),
        so a measurement may steer it; a model-based proposer's sampled drafts draw from the stream's generator,
        so its steps stay priced by constants and a seeded stream by it replays on any machine."""
        draft_cost = float(getattr(proposer, "draft_cost", 0.0))
        if draft_cost <= 0.0:  # a failed draft costs the verifier's extra rows: pause only when clearly losing
            return cls(min_gain=0.95, verify_cost=verify_cost)
        return cls(cost=VERIFY_COST + draft_cost, min_gain=1.05, pause=16, max_pause=256, slow_start=True)

    def active(self) -> bool:
        return self.off_for == 0

    def draft_length(self, cap: int) -> int:
        """How many tokens the next step may draft (at most `cap`)."""
        if not self.slow_start:
            return cap
        return min(cap, 1 if self.probing else self.length)

    def plain_token(self) -> None:
        if self.off_for:
            self.off_for -= 1
            if self.off_for == 0:
                self.probing = True

    def step(self, drafted: int, emitted: int) -> None:
        accepted = emitted - 1
        extra = self.cost * drafted if self.verify_cost is None else self.verify_cost[drafted]
        gain = emitted / (1.0 + extra)
        if self.probing:  # a probe decides alone
            self.probing = False
            self.gain = gain if gain < self.min_gain else max(gain, self.min_gain + 0.1)
        else:
            self.gain = self.decay * self.gain + (1.0 - self.decay) * gain
        self.length = min(2 * self.length, MAX_DRAFT_TOKENS) if accepted == drafted else accepted + 1
        if self.gain < self.min_gain:
            self.off_for = self.pause
            self.pause = min(2 * self.pause, self.max_pause)
            self.switches += 1
            self.gain = self.min_gain + 0.1  # after the pause the probe alone decides
            self.length = 1
        elif self.gain >= self.min_gain + 0.3:
            self.pause = self.base_pause


class SpeculativeStream:
    """Like TokenStream for one sequence (B = 1), but each step yields the list of tokens it emitted (one or more),
    after the cache was trimmed to hold everything before the last of them. `result` is set once it ends.

    `ends_at(token)`, when given, is asked about each token in order (none after one it says True for): True ends
    the generation right after that token (finish STOP), the rest of the step dropped and the cache trimmed to
    match, exactly as at a stop token (the session layer's stop strings)."""

    def __init__(self, engine: Engine, cache: ModelKV, new_ids: Tensor, request: GenerateRequest,
                 proposer: DraftProposer, context: Sequence[int], max_draft_tokens: int,
                 should_stop: Callable[[], bool] | None = None, governor: Governor | None = None,
                 ends_at: Callable[[int], bool] | None = None, short_prompt: int | None = None) -> None:
        if cache.batch != 1 or new_ids.shape[0] != 1:
            raise GenerationError("speculative decoding takes one sequence (batch 1)")
        if not 0 <= max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise GenerationError(f"max_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}] (0: the proposer's "
                                  f"adaptive cap), got {max_draft_tokens}")
        if max_draft_tokens == 0:
            max_draft_tokens = min(auto_draft_tokens(proposer), MAX_DRAFT_TOKENS)
        engine.stream(cache, new_ids, request)  # the same request and capacity checks as plain decoding
        self.engine, self.cache, self.new_ids, self.request = engine, cache, new_ids, request
        self.proposer, self.max_draft = proposer, max_draft_tokens
        proposer.attach(cache)
        self.context = list(context)  # every token before the first generated one (history + new_ids)
        self.should_stop = should_stop
        self.ends_at = ends_at
        self.governor = governor or Governor.for_proposer(proposer, engine.verify_cost)
        self.stats = SpecStats()
        self.result: GenerationResult | None = None
        # A prompt longer than this is read in chunks, one per step of the caller (see _steps); None: whole.
        self.short_prompt = short_prompt
        self.prefill_left = new_ids.shape[1]  # prompt tokens not read yet (0 once the first token was sampled)

    def __iter__(self) -> Generator[list[int], int | None, None]:
        try:
            yield from self._steps()
        finally:
            self.cache.end_turn()

    def _steps(self) -> Generator[list[int], int | None, None]:
        eng, cache, req, stats, gov = self.engine, self.cache, self.request, self.stats, self.governor
        stop = set(req.stop_ids)
        gen = req.sampling.make_generator(eng.device)
        wants_hidden = bool(getattr(self.proposer, "wants_hidden", False))
        ctx = self.context
        t0 = time.perf_counter()
        # Room for the whole generation and a last verify's drafts now: no step after this one reallocates.
        cache.reserve(cache.length + self.new_ids.shape[1] + req.max_new_tokens + self.max_draft + 1)
        ids = self.new_ids
        if self.short_prompt is not None and ids.shape[1] > self.short_prompt:
            # A long prompt: one chunk per step, of the tokens the caller sends (`steps.send(n)`; a plain next()
            # reads eng.prefill_chunk), each step yielding no tokens, so rows batched beside this one go on decoding
            # and a cancel lands between chunks (the chunks read stay cached). The bits do not depend on the chunks.
            budget = (yield []) or eng.prefill_chunk
            while ids.shape[1] > budget:
                eng.prefill(cache, ids[:, :budget], logits=Logits.NONE)
                ids = ids[:, budget:]
                self.prefill_left = ids.shape[1]
                if self.should_stop is not None and self.should_stop():
                    return  # result stays None: the turn ended before its first token
                budget = (yield []) or eng.prefill_chunk
        if wants_hidden:
            out = eng.verify(cache, ids, logits=Logits.LAST, return_hidden=True)
        else:
            out = eng.prefill(cache, ids)
        self.prefill_left = 0
        result = GenerationResult([[]], FinishReason.LENGTH, prefill_tokens=self.new_ids.shape[1],
                                  prefill_s=time.perf_counter() - t0)
        self.result = result
        produced = result.token_ids[0]
        first = int(sample(out.logits[:, -1], req.sampling, gen)[0])
        t_first = time.perf_counter()
        result.ttft_s = t_first - t0
        self.proposer.begin(ctx)
        if wants_hidden:
            self.proposer.accepted(ctx, 0, out.hidden[0, -1:])
        emitted = [first]
        accepted, verified = 0, False  # drafts the last step accepted (the first of `emitted`); was it a verifier's
        while True:
            # Commit this step's tokens: cut at a stop token or max_new_tokens, trim the cache to match.
            room = req.max_new_tokens - len(produced)
            cut = emitted[:room]
            ended = False
            for i, tok in enumerate(cut):
                if tok in stop or (self.ends_at is not None and self.ends_at(tok)):
                    cut, ended = cut[: i + 1], True
                    break
            if len(cut) < len(emitted):  # keep the positions before the last kept token only
                cache.trim(cache.length - (len(emitted) - len(cut)))
                stats.accepted -= max(0, accepted - len(cut))  # drafts verified but cut off are not emitted
                if verified:
                    stats.verified_tokens -= len(emitted) - len(cut)
            produced.extend(cut)
            ctx.extend(cut)
            result.decode_tokens = len(produced)
            result.decode_s = time.perf_counter() - t_first
            yield cut
            if ended:
                result.finish_reason = FinishReason.STOP
                return
            if self.should_stop is not None and self.should_stop():
                result.finish_reason = FinishReason.CANCELLED
                return
            remaining = req.max_new_tokens - len(produced)
            if remaining <= 0:
                return
            # Next step: draft (unless off), one forward over [last, drafts], verify, roll back the rejected.
            draft = Draft([])
            k_max = gov.draft_length(min(self.max_draft, remaining - 1))
            if k_max > 0 and gov.active():
                draft = self.proposer.propose(ctx, k_max, req.sampling, gen)
                if len(draft.tokens) > k_max:
                    draft = Draft(draft.tokens[:k_max], None if draft.q is None else draft.q[:k_max])
            k = len(draft.tokens)
            L = cache.length
            ids = torch.tensor([[ctx[-1], *draft.tokens]], dtype=torch.long, device=eng.device)
            if k == 0:
                out = eng.decode_step(cache, ids) if not wants_hidden else eng.verify(cache, ids, return_hidden=True)
                emitted = [int(sample(out.logits[:, -1], req.sampling, gen)[0])]
                accepted, verified = 0, False
                stats.plain_steps += 1
                gov.plain_token()
                if wants_hidden:
                    self.proposer.accepted(ctx, 0, out.hidden[0])
                continue
            out = eng.verify(cache, ids, return_hidden=wants_hidden)
            logits = out.logits[0]  # (k+1, V) fp32
            if req.sampling.greedy:
                emitted = verify_greedy(logits, draft.tokens)
            else:
                emitted = verify_sampled(logits, draft, req.sampling, gen)
            n = len(emitted) - 1
            if n < k:
                cache.trim(L + n + 1)  # roll back the rejected drafts: the cache holds [.., x, d_1..d_n]
            stats.drafted += k
            stats.accepted += n
            stats.verified_tokens += len(emitted)
            accepted, verified = n, True
            stats.verifier_steps += 1
            gov.step(k, len(emitted))
            stats.off_switches = gov.switches
            if wants_hidden:
                self.proposer.accepted(ctx, n, out.hidden[0, : n + 1])


def measure_verify_cost(engine: Engine, *, context: int = 256, repeats: int = 3) -> tuple[float, ...]:
    """What a verifier step over k drafts (k + 1 tokens: in one call of the whole stack where the caches allow,
    models.native_layer, else each layer's halves) costs beyond a one-row decode step,
    in decode steps, for k = 0..MAX_DRAFT_TOKENS: timed on this machine at `context` cached tokens (the median of
    `repeats` after a warm-up per shape), interpolated between the timed row counts. With AMX tiles 16 rows cost
    about one decode step; without them 4 drafts cost 0.4-0.65 more (2-core EPYC, SmolLM2 bf16; 1.5-2.1 before
    the few-row projections of e00ebe0), where the constant VERIFY_COST kept history speculation on at T = 0.7
    while it ran at 0.62x plain decode (0.95x priced by this; results/spec/epyc_constant_verify_cost,
    results/spec/epyc_measured_verify_cost, results/spec/epyc_few_rows)."""
    import statistics

    context = max(1, min(context, engine.config.max_position_embeddings - MAX_DRAFT_TOKENS - 2))  # tiny models
    cache = engine.new_cache(capacity=context + MAX_DRAFT_TOKENS + 2)
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(0)
    engine.prefill(cache, torch.randint(0, vocab, (1, context), generator=g, device=engine.device))

    def timed(rows: int) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run warms this shape up
            ids = torch.randint(0, vocab, (1, rows), generator=g).to(engine.device)
            t0 = time.perf_counter()
            if rows == 1:
                engine.decode_step(cache, ids)
            else:
                engine.verify(cache, ids)
            times.append(time.perf_counter() - t0)
            cache.trim(context)
        return statistics.median(times[1:])

    # Up to 16 rows: a sliding layer's ring rolls back at most MAX_DRAFT_TOKENS positions (the 17-row step extrapolated)
    rows = (1, 2, 3, 5, 8, 9, MAX_DRAFT_TOKENS)
    step = {r: timed(r) for r in rows}
    extra = {r - 1: max(0.0, step[r] / step[1] - 1.0) for r in rows}  # by draft count
    known = sorted(extra)
    segments = list(zip(known, known[1:], strict=False))
    out = []
    for k in range(MAX_DRAFT_TOKENS + 1):  # linear between timed counts, the last segment extended
        lo, hi = next(((a, b) for a, b in segments if k <= b), segments[-1])
        out.append(extra[lo] + (extra[hi] - extra[lo]) * (k - lo) / (hi - lo))
    return tuple(round(max(0.0, c), 3) for c in out)
