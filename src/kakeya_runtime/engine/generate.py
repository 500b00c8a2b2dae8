"""Prefill and decode over a caller-owned cache, and the generation loop built on them.

The engine never allocates a cache on its own behalf: callers make one (`Engine.new_cache`) and
pass it in. Prefill is chunked so its peak memory is set by the chunk size, and logits are only
computed where they are used. Overflow is checked before any work is done.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kakeya_runtime.engine.sampling import SamplingParams, sample
from kakeya_runtime.kv.cache import ModelKV, make_cache
from kakeya_runtime.models.base import DecoderModel, ForwardOutput, Logits


class GenerationError(ValueError):
    """Bad generation request (shapes, lengths, capacity); raised before any work is done."""


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS / stop token was generated
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the caller asked to stop


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[list[int]]  # per batch row, generated tokens (including the stop token if any)
    finish_reason: FinishReason
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # from the call to the first sampled token
    decode_s: float = 0.0  # from the first sampled token to the last
    decode_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class GenerateRequest:
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    trace_layer: int | None = None
    keep_logits: bool = False  # TokenStream.step_logits: each step's fp32 logits (B, V), for fidelity evidence


class Engine:
    """A model plus the prefill/decode entry points every caller (sessions, bench, CLI) uses."""

    def __init__(self, model: DecoderModel, *, prefill_chunk: int = 512) -> None:
        if prefill_chunk < 1:
            raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model.eval()
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # Optional replacement for `model` in decode_step, same call signature (engine.compiled.CompiledDecode).
        self.decode_forward: Callable[..., ForwardOutput] | None = None
        # What a speculative verifier step over k drafts costs beyond a decode step, in decode steps, k = 0..16
        # (engine.speculative.measure_verify_cost measures it on this machine; None: the governor's default).
        self.verify_cost: tuple[float, ...] | None = None

    def new_cache(self, *, batch: int = 1, capacity: int | None = None) -> ModelKV:
        return make_cache(self.config, batch=batch, capacity=capacity, dtype=self.dtype, device=self.device)

    def _check_ids(self, cache: ModelKV, ids: Tensor) -> None:
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise GenerationError(f"token ids must be a (B, T) int64 tensor, got {tuple(ids.shape)} {ids.dtype}")
        if ids.shape[0] != cache.batch:
            raise GenerationError(f"batch size mismatch: ids have B={ids.shape[0]}, cache B={cache.batch}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise GenerationError(f"token ids must be in [0, {self.config.vocab_size})")

    @torch.inference_mode()
    def prefill(self, cache: ModelKV, input_ids: Tensor, *, logits: Logits = Logits.LAST,
                trace_layer: int | None = None, require_empty: bool = False) -> ForwardOutput:
        """Append `input_ids` (B, T) to the cache in chunks; logits/trace for the last chunk only
        (Logits.ALL returns every position, concatenated)."""
        self._check_ids(cache, input_ids)
        t = input_ids.shape[1]
        if t == 0:
            raise GenerationError("prefill needs at least one token")
        if require_empty and cache.length != 0:
            raise GenerationError(f"cache must be empty before prefill, holds {cache.length} positions")
        start = cache.length
        if start + t > cache.capacity:
            raise GenerationError(f"prompt length {start + t} exceeds the cache capacity {cache.capacity}")
        chunks = range(0, t, self.prefill_chunk)
        all_logits: list[Tensor] = []
        out = ForwardOutput(None, None)
        cache.begin_step(input_ids, start)  # policy hook (restore: recompute evicted K/V)
        try:
            for c0 in chunks:
                c1 = min(c0 + self.prefill_chunk, t)
                last = c1 == t
                mode = logits if (last or logits is Logits.ALL) else Logits.NONE
                positions = torch.arange(start + c0, start + c1, device=self.device)
                out = self.model(input_ids[:, c0:c1], positions, cache, logits=mode,
                                 trace_layer=trace_layer if last else None)
                if logits is Logits.ALL:
                    all_logits.append(out.logits)
        finally:
            cache.end_step()
        if logits is Logits.ALL:
            out.logits = torch.cat(all_logits, dim=1)
        return out

    @torch.inference_mode()
    def decode_step(self, cache: ModelKV, token_ids: Tensor, *, trace_layer: int | None = None) -> ForwardOutput:
        """Consume exactly one token per row, (B, 1); returns its logits (B, 1, V)."""
        if token_ids.dim() != 2 or token_ids.shape[1] != 1:
            raise GenerationError(f"decode_step requires exactly (B, 1) input, got {tuple(token_ids.shape)}")
        if token_ids.shape[0] != cache.batch:
            raise GenerationError(f"batch size mismatch: ids have B={token_ids.shape[0]}, cache B={cache.batch}")
        pos = cache.length
        if pos >= cache.capacity:
            raise GenerationError(f"cache overflow: t={pos} must be < capacity={cache.capacity}")
        positions = torch.arange(pos, pos + 1, device=self.device)
        cache.begin_step(token_ids, pos)
        try:
            forward = self.model if self.decode_forward is None else self.decode_forward
            return forward(token_ids, positions, cache, logits=Logits.LAST, trace_layer=trace_layer)
        finally:
            cache.end_step()

    @torch.inference_mode()
    def verify(self, cache: ModelKV, ids: Tensor, *, logits: Logits = Logits.ALL,
               return_hidden: bool = False) -> ForwardOutput:
        """Append `ids` (B, T) to the cache like prefill (the chunk path), returning the last chunk's logits at
        every position (Logits.ALL, fp32 (B, T, V)) and, with `return_hidden`, its final hidden states: a
        speculative verifier step over [last token, drafts], or a prefill whose hidden states a draft needs."""
        self._check_ids(cache, ids)
        t = ids.shape[1]
        if t == 0:
            raise GenerationError("verify needs at least one token")
        start = cache.length
        if start + t > cache.capacity:
            raise GenerationError(f"{start} + {t} positions exceed the cache capacity {cache.capacity}")
        out = ForwardOutput(None, None)
        cache.begin_step(ids, start)
        try:
            for c0 in range(0, t, self.prefill_chunk):
                c1 = min(c0 + self.prefill_chunk, t)
                last = c1 == t
                positions = torch.arange(start + c0, start + c1, device=self.device)
                out = self.model(ids[:, c0:c1], positions, cache, logits=logits if last else Logits.NONE,
                                 return_hidden=return_hidden and last)
        finally:
            cache.end_step()
        return out

    def decode_rows(self, caches: Sequence[ModelKV], token_ids: Sequence[int]) -> Tensor:
        """One decode step for several independent sequences at once (one token each, each cache its own
        length and policy): projections and MLP batched, attention per row. Returns fp32 logits (N, V), row i
        bit-identical to `decode_step(caches[i], ...)` alone."""
        return self.step_rows(caches, token_ids)[0]

    def step_rows(self, caches: Sequence[ModelKV], token_ids: Sequence[int], chunk_cache: ModelKV | None = None,
                  chunk_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """`decode_rows`, and optionally a prefill chunk of one more sequence in the same forward: `chunk_ids`
        (1, T) appended to `chunk_cache` (T at most `prefill_chunk`, so one forward of its own too). Returns the
        decode rows' logits (N, V) and the chunk's last-token logits (1, V) (None without a chunk), each
        bit-identical to `decode_step` / `prefill` on that cache alone."""
        chunks = [] if chunk_cache is None else [(chunk_cache, chunk_ids)]
        logits, chunk_logits = self.step_chunks(caches, token_ids, chunks)
        return logits, (chunk_logits[0] if chunk_logits else None)

    @torch.inference_mode()
    def step_chunks(self, caches: Sequence[ModelKV], token_ids: Sequence[int],
                    chunks: Sequence[tuple[ModelKV, Tensor]] = ()) -> tuple[Tensor, list[Tensor]]:
        """`decode_rows` and prefill chunks of more sequences in ONE forward: chunks[j] = (cache, ids (1, T_j)),
        T_j at most `prefill_chunk` (one forward of its own too), appended to its cache. No decode rows at all is
        allowed with chunks (several prompts read together). Returns the decode rows' logits (N, V) and each
        chunk's last-token logits (1, V), every one bit-identical to `decode_step` / `prefill` on its cache alone."""
        if len(caches) != len(token_ids) or not (caches or chunks):
            raise GenerationError(f"need one token per cache, got {len(token_ids)} tokens for {len(caches)} caches")
        every = [*caches, *(c for c, _ in chunks)]
        if len({id(c) for c in every}) != len(every):
            raise GenerationError("a cache appears twice in one batched step")
        for c in caches:
            if c.batch != 1:
                raise GenerationError(f"decode_rows takes single-sequence caches, got batch {c.batch}")
            if c.length >= c.capacity:
                raise GenerationError(f"cache overflow: t={c.length} must be < capacity={c.capacity}")
        if any(not 0 <= t < self.config.vocab_size for t in token_ids):
            raise GenerationError(f"token ids must be in [0, {self.config.vocab_size})")
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device).T  # (N, 1)
        positions = torch.tensor([c.length for c in caches], dtype=torch.long, device=self.device)
        sizes = []
        for cache, chunk_ids in chunks:
            self._check_ids(cache, chunk_ids)
            t, start = chunk_ids.shape[1], cache.length
            if cache.batch != 1 or not 0 < t <= self.prefill_chunk:
                raise GenerationError(f"a fused prefill chunk takes 1 to {self.prefill_chunk} tokens of one sequence")
            if start + t > cache.capacity:
                raise GenerationError(f"{start} + {t} positions exceed the cache capacity {cache.capacity}")
            sizes.append(t)
        if chunks:
            ids = torch.cat((ids, *(chunk_ids.reshape(-1, 1) for _, chunk_ids in chunks)))
            positions = torch.cat((positions, *(torch.arange(c.length, c.length + t, device=self.device)
                                                for (c, _), t in zip(chunks, sizes, strict=True))))
        begun: list[ModelKV] = []
        try:
            for i, c in enumerate(caches):
                c.begin_step(ids[i : i + 1], c.length)
                begun.append(c)
            for cache, chunk_ids in chunks:
                cache.begin_step(chunk_ids, cache.length)
                begun.append(cache)
            logits = self.model.forward_rows(ids, positions, every, sizes).logits[:, -1]
        finally:
            for c in begun:
                c.end_step()
        n = len(caches)
        return logits[:n], [logits[n + j : n + j + 1] for j in range(len(chunks))]

    def stream(self, cache: ModelKV, new_ids: Tensor, request: GenerateRequest,
               should_stop: Callable[[], bool] | None = None) -> TokenStream:
        """Prefill `new_ids` (B, T >= 1) onto the cache, then sample up to max_new_tokens.

        The last sampled token is not fed back: the cache ends holding everything before it, so a
        session's next turn prefills [last sampled token, *appended tokens].
        """
        self._check_ids(cache, new_ids)
        if new_ids.shape[1] == 0:
            raise GenerationError("generation needs at least one new token to prefill")
        if request.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        total = cache.length + new_ids.shape[1] + request.max_new_tokens
        if total > cache.capacity:
            raise GenerationError(
                f"history {cache.length} + new {new_ids.shape[1]} + max_new_tokens {request.max_new_tokens} "
                f"exceeds the context capacity {cache.capacity}"
            )
        return TokenStream(self, cache, new_ids, request, should_stop)

    def generate(self, cache: ModelKV, new_ids: Tensor, request: GenerateRequest) -> GenerationResult:
        stream = self.stream(cache, new_ids, request)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result


class TokenStream:
    """Iterates one list of B token ids per step; `result` is set once the stream ends.

    The same stream can be driven step by step from outside (sessions.batch, continuous batching): `prefill(n)`
    feeds the next n prompt tokens and, after the last, samples the first step; `take(logits)` samples a step
    from a decode forward the driver ran itself (`next_input` is the token to feed); `ended()`, asked after the
    consumer saw a step's ids, says whether the stream is over (and why); `close()` runs the cache's end-of-turn
    hook. Iterating does exactly that with whole prefills and solo decode steps, so both ways sample the same."""

    def __init__(self, engine: Engine, cache: ModelKV, new_ids: Tensor, request: GenerateRequest,
                 should_stop: Callable[[], bool] | None) -> None:
        self.engine, self.cache, self.new_ids, self.request = engine, cache, new_ids, request
        self.should_stop = should_stop
        self.result: GenerationResult | None = None
        self.attn_rows: list[Tensor] = []  # per step, when request.trace_layer is set
        self.step_logits: list[Tensor] = []  # per step (B, V) fp32, when request.keep_logits is set
        self.next_input: Tensor | None = None  # (B, 1): the last sampled ids, what the next decode step consumes
        self._gen = request.sampling.make_generator(engine.device)
        self._stop = set(request.stop_ids)
        self._done = [False] * cache.batch
        self._prefilled = 0
        self._t0 = 0.0
        self._t_first: float | None = None
        self._closed = False

    def __iter__(self) -> Iterator[list[int]]:
        return self._run()

    def _run(self) -> Iterator[list[int]]:
        try:
            yield from self._steps()
        finally:
            self.close()

    def _steps(self) -> Iterator[list[int]]:
        ids = self.prefill()
        while True:
            assert ids is not None
            yield ids
            if self.ended():
                return
            ids = self.decode()

    @property
    def prefill_left(self) -> int:
        """Prompt tokens not yet prefilled (0 once the first step was sampled)."""
        return self.new_ids.shape[1] - self._prefilled

    def prefill(self, max_tokens: int | None = None) -> list[int] | None:
        """Prefill up to `max_tokens` more prompt tokens (all that are left when None); after the last of them,
        sample the first step and return its ids (None while prompt tokens are left)."""
        t = self.new_ids.shape[1]
        ids = self.next_chunk(max_tokens)
        last = self._prefilled + ids.shape[1] == t
        out = self.engine.prefill(self.cache, ids, trace_layer=self.request.trace_layer if last else None)
        return self.chunk_done(ids.shape[1], out.logits[:, -1] if last else None, out.attn_row)

    def next_chunk(self, max_tokens: int | None = None) -> Tensor:
        """The next prompt tokens to prefill (1, n), n up to `max_tokens` (all that are left when None), for a
        driver that runs the forward itself (sessions.batch: a chunk fused into a decode step); then
        `chunk_done`. `prefill` is exactly these two around `Engine.prefill`."""
        t = self.new_ids.shape[1]
        a = self._prefilled
        if a >= t:
            raise GenerationError("the prompt is already prefilled")
        b = t if max_tokens is None else min(t, a + max(1, max_tokens))
        if a == 0 and self.result is None:
            self._t0 = time.perf_counter()
            # Room for the whole generation now: the decode steps then write into storage that is already there.
            self.cache.reserve(self.cache.length + t + self.request.max_new_tokens)
            self.result = GenerationResult([[] for _ in range(self.cache.batch)], FinishReason.LENGTH,
                                           prefill_tokens=t)
        return self.new_ids[:, a:b]

    def chunk_done(self, n: int, logits: Tensor | None, attn_row: Tensor | None = None) -> list[int] | None:
        """`n` tokens from `next_chunk` are in the cache; with the last of the prompt, `logits` (B, V) are its
        last position's and the first step is sampled and returned (None while prompt tokens are left)."""
        self._prefilled += n
        assert self.result is not None
        self.result.prefill_s = time.perf_counter() - self._t0  # wall time, other rows' steps included
        if self._prefilled < self.new_ids.shape[1]:
            return None
        assert logits is not None
        return self.take(logits, attn_row)

    def decode(self) -> list[int]:
        """One solo decode step over `next_input`, sampled."""
        assert self.next_input is not None
        out = self.engine.decode_step(self.cache, self.next_input, trace_layer=self.request.trace_layer)
        return self.take(out.logits[:, -1], out.attn_row)

    def take(self, logits: Tensor, attn_row: Tensor | None = None, picked: Tensor | None = None) -> list[int]:
        """Sample one step from its logits (B, V) (the prefill's last position or a decode step's). `picked`: a
        greedy stream's ids (B,) chosen already (sampling.greedy over a batched step's rows: the same ids)."""
        req, result = self.request, self.result
        assert result is not None
        if attn_row is not None:
            self.attn_rows.append(attn_row)
        if req.keep_logits:
            self.step_logits.append(logits.float())
        if picked is not None and not req.sampling.greedy:
            raise GenerationError("only a greedy stream takes ids picked for it")
        next_ids = sample(logits, req.sampling, self._gen) if picked is None else picked  # (B,)
        ids = next_ids.tolist()  # the one sync point per step
        if self._t_first is None:
            self._t_first = time.perf_counter()
            result.ttft_s = self._t_first - self._t0
        for b, tok in enumerate(ids):
            if not self._done[b]:
                result.token_ids[b].append(tok)
                self._done[b] = tok in self._stop
        result.decode_tokens += 1
        result.decode_s = time.perf_counter() - self._t_first
        self.next_input = next_ids[:, None]
        return ids

    def ended(self) -> bool:
        """After the consumer saw a step: whether the stream ends here (setting result.finish_reason)."""
        result = self.result
        assert result is not None
        if all(self._done):
            result.finish_reason = FinishReason.STOP
            return True
        if self.should_stop is not None and self.should_stop():
            result.finish_reason = FinishReason.CANCELLED
            return True
        return result.decode_tokens >= self.request.max_new_tokens

    def close(self) -> None:
        """The cache's end-of-turn hook (restore per_turn: drop the turn's restored K/V), once."""
        if not self._closed:
            self._closed = True
            self.cache.end_turn()


def generate_greedy_cached(engine: Engine, prompt_ids: Sequence[int], *, max_new_tokens: int,
                           stop_ids: Sequence[int] = ()) -> list[int]:
    """Prompt + greedy continuation using the KV cache (seed 002's reference entry point)."""
    _check_budget(engine, len(prompt_ids), max_new_tokens)
    cache = engine.new_cache(capacity=min(engine.config.max_position_embeddings, len(prompt_ids) + max_new_tokens))
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=engine.device)
    result = engine.generate(cache, ids, GenerateRequest(max_new_tokens, stop_ids=tuple(stop_ids)))
    return list(prompt_ids) + result.token_ids[0]


@torch.inference_mode()
def generate_greedy_full(engine: Engine, prompt_ids: Sequence[int], *, max_new_tokens: int,
                         stop_ids: Sequence[int] = ()) -> list[int]:
    """The baseline: recompute the whole prefix every step, no cache; same caps and stops."""
    _check_budget(engine, len(prompt_ids), max_new_tokens)
    seq = list(prompt_ids)
    for _ in range(max_new_tokens):
        ids = torch.tensor([seq], dtype=torch.long, device=engine.device)
        positions = torch.arange(len(seq), device=engine.device)
        out = engine.model(ids, positions, None, logits=Logits.LAST)
        tok = int(out.logits[0, -1].argmax())
        seq.append(tok)
        if tok in stop_ids:
            break
    return seq


def _check_budget(engine: Engine, prompt_len: int, max_new_tokens: int) -> None:
    limit = engine.config.max_position_embeddings
    if prompt_len < 1:
        raise GenerationError("prompt must hold at least one token")
    if prompt_len > limit:
        raise GenerationError(f"prompt length {prompt_len} exceeds T_max {limit}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > limit:
        raise GenerationError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds T_max {limit}")
