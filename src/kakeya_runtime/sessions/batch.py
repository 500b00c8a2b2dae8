"""Continuous batching: one engine thread steps every running Generate.

The loop admits Generates up to `max_batch` running at once (the rest wait in the queue), FIFO within an API key
and, across keys, the key with the fewest rows running first (a free row goes to a waiting key before another turn
of a key that already runs more), and then, step after step:

* every plain (non-speculative) row that has a sampled token to feed decodes it in ONE forward
  (`Engine.decode_rows`: projections and MLP batched, attention per row over the row's own cache; each row's
  logits are bit-identical to its decode step alone, so a session's stream does not depend on who it ran beside);
  a lone row takes `Engine.decode_step` (the same logits, and the compiled decode path when one is set);
* a row still prefilling its new tokens gets the step's prompt token budget (by default sized from the steps'
  measured times so a step carrying a chunk takes at most `slowdown` x a decode step alone: chunk_budget; with a
  fixed `step_tokens`, that minus the decode rows, at least a quarter of it; `Engine.prefill_chunk` while more rows
  prefill than decode), oldest first, so a long prompt is cut into chunks between decode steps instead of stalling
  the others. A short prompt (at most
  `short_prompt` tokens in all, an agent turn's message) is read whole in one step instead: cut into step-sized
  chunks it would take tens of steps, each barely cheaper than a step without it (8 sessions starting turns of
  ~250 tokens beside each other waited up to 2.5 s for their first token), while reading it whole costs the
  others one slower step.
  With nobody decoding, a prefill takes `Engine.prefill_chunk` tokens a step. A position's K/V and the last
  position's logits do not depend on how the prompt was chunked (INV-3), so neither does the stream. The oldest
  prefill's chunk rides the decode rows' forward (`Engine.step_chunks`: its tokens are extra rows of the
  projections and MLP, its attention the plain chunk path over its own cache), so a step costs one forward, not
  two; its K/V and logits are the bits its own forward gives. When that chunk is a short prompt, the other short
  prompts waiting ride along too, whole, up to one forward's worth (`Engine.prefill_chunk` tokens in all), and with
  nobody decoding the short prompts waiting are read together in one forward: turns that start together (8
  sessions' next messages) share forwards instead of taking one each;
* a speculative row runs one verifier step of its own stream: its forward is over [last token, drafts] of its own
  cache, so it is not batched with the others. Its prompt is read whole when short, else one chunk a step
  (`Engine.prefill_chunk` tokens alone, a quarter of that beside other rows), cancellation checked between chunks;
* every row's step ends with the `Turn` committing and streaming its tokens, then checking stops and cancellation
  (checked between prefill chunks too).

Each row samples with its own stream's generator (its own seed), so batch composition never changes a stream.
An engine error in a batched forward is isolated: every row of it is put back to its length before the step and
decoded alone; the rows that fail alone end with their own error (their Turn rolls the session back), the others
go on with the logits they got alone (the same bits). Other engine work (idle compression, snapshots, imports) is
submitted as plain calls and runs between steps, in order.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kakeya_runtime.engine.generate import Engine, TokenStream
from kakeya_runtime.engine.sampling import greedy
from kakeya_runtime.engine.speculative import SpeculativeStream
from kakeya_runtime.models import native
from kakeya_runtime.sessions.chunk_budget import DEFAULT_SLOWDOWN, ChunkBudget

_log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 8
DEFAULT_STEP_TOKENS: int | None = None  # None: the prompt budget is sized by measurement (chunk_budget)
DEFAULT_SHORT_PROMPT = 512  # prompts up to this many tokens are read in one step (at most Engine.prefill_chunk)


class Turn(Protocol):
    """One Generate as the loop drives it (the session service implements it); every method runs on the loop."""

    def begin(self) -> TokenStream | SpeculativeStream | None:
        """Set up the session and open its stream: a TokenStream (batched rows) or a SpeculativeStream (one list of
        tokens per step); None when the turn answered already (cancelled while queued, or failed)."""

    def cancelled(self) -> bool: ...

    def deliver(self, tokens: list[int]) -> bool:
        """Commit and stream a step's tokens; True ends the turn after them (a stop string completed)."""

    def finish(self) -> None:
        """The stream ended (stop, length, cancel: also a cancel before the prefill completed)."""

    def resumed(self, parked_s: float) -> None:
        """The turn was parked for another key's turn this long (a wait for a row, not engine time)."""

    def fail(self, error: Exception) -> None:
        """The turn's engine work raised: roll its session back and answer the error."""


@dataclass(slots=True)
class _Row:
    turn: Turn
    future: Future
    owner: str = ""  # the API key whose Generate this is (admission shares the batch between keys)
    stream: TokenStream | None = None  # plain rows
    spec: SpeculativeStream | None = None  # speculative rows
    steps: Generator[list[int], int | None, None] | None = None  # spec's steps (sent prefill budgets)
    began: bool = False  # a speculative row's first step was taken (from then on its steps are sent budgets)
    parked: bool = False  # begun, then taken out of the batch for another key's turn: waits with its state kept
    parked_at: float = 0.0  # perf_counter when it was last parked
    done: bool = False


@dataclass(slots=True)
class _Chunk:
    """A prefill chunk fused into the step's decode forward: its row and the prompt tokens it feeds."""

    row: _Row
    ids: Any  # (1, n) token ids from TokenStream.next_chunk


@dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future = field(default_factory=Future)


class StepKind(enum.Enum):
    """What one engine step carried (kakeya_engine_step_seconds{kind}): where the engine's time went."""

    DECODE = "decode"  # decode rows (or a speculative verifier step) and no prompt tokens
    MIXED = "mixed"  # decode rows and prompt tokens (chunks riding the forward, or read beside it)
    PREFILL = "prefill"  # prompt tokens only


@dataclass(slots=True)
class StepStats:
    """Counters of the loop (read by metrics)."""

    steps: int = 0
    batched_steps: int = 0  # decode forwards over more than one row
    decode_rows: int = 0  # rows decoded, all steps together
    prefill_chunks: int = 0
    fused_chunks: int = 0  # prefill chunks that rode a decode forward
    isolated_errors: int = 0  # batched forwards that raised and were replayed row by row
    parked: int = 0  # running Generates taken out of a full batch for another key's waiting turn


class BatchScheduler:
    """The engine thread. `submit_turn` queues a Generate (its future completes when the turn ended, or is
    cancelled if the loop shut down before it began); `submit` queues any other engine call."""

    def __init__(self, engine: Engine, *, max_batch: int = DEFAULT_MAX_BATCH,
                 step_tokens: int | None = DEFAULT_STEP_TOKENS, slowdown: float = DEFAULT_SLOWDOWN,
                 short_prompt: int = DEFAULT_SHORT_PROMPT,
                 on_step: Callable[[int], None] | None = None,
                 deliveries: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        if short_prompt < 0:
            raise ValueError(f"short_prompt must be >= 0, got {short_prompt}")
        self.engine = engine
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        # the prompt tokens a step reads beside decode rows, from the steps' times (None: the fixed step_tokens)
        self.budget = ChunkBudget(slowdown, ceiling=engine.prefill_chunk) if step_tokens is None else None
        self.short_prompt = min(short_prompt, engine.prefill_chunk)  # read whole: one forward's worth at most
        self.on_step = on_step  # called with the rows decoded in each step that decoded any
        self.on_step_seconds: Callable[[StepKind, float], None] | None = None  # each step's kind and wall time
        self.on_park: Callable[[], None] | None = None  # called for each row parked for another key's turn
        # entered around a batched step's deliveries (the turns may hand their events on once for all of them)
        self.deliveries = deliveries or contextlib.nullcontext
        self.stats = StepStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._calls: deque[_Call] = deque()
        self._active: list[_Row] = []
        self._in_call = False
        self._closing = False
        if native.enabled():  # this thread loaded the model: its OpenMP pool would throttle the engine thread's
            native.release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="kakeya-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread) -----------------------------------------------------

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        call = _Call(fn, args)
        with self._cv:
            if self._closing:
                raise RuntimeError("the scheduler is shut down")
            self._calls.append(call)
            self._cv.notify()
        return call.future

    def submit_turn(self, turn: Turn, owner: str = "") -> Future:
        row = _Row(turn, Future(), owner)
        with self._cv:
            if self._closing:
                raise RuntimeError("the scheduler is shut down")
            self._waiting.append(row)
            self._cv.notify()
        return row.future

    def withdraw_cancelled(self) -> int:
        """End now the queued Generates whose turn was cancelled (its client went away, its session was closed), not
        when the loop reaches them: a closed session's cache and KV reservation are freed at once, and abandoned turns
        stop counting as a backlog. Returns how many. A cancelled turn's begin() answers without touching the
        session or the engine, so it runs here, on the caller's thread."""
        with self._cv:  # (a parked row has begun: the engine thread ends it)
            gone = [row for row in self._waiting if row.turn.cancelled() and not row.parked]
            for row in gone:
                self._waiting.remove(row)
        for row in gone:
            if not row.future.set_running_or_notify_cancel():
                continue
            try:
                opened = row.turn.begin()  # answers CANCELLED
            except Exception as e:
                self._fail(row, e)
                continue
            if opened is not None:  # the Turn contract broke (a cancelled turn began): end it, never batch it from here
                self._open(row, opened)
                self._fail(row, RuntimeError("a cancelled Generate began"))
                continue
            self._end(row)
        return len(gone)

    @property
    def queued(self) -> int:
        """Generates and engine calls waiting for the engine (Generates parked for another key's turn included)."""
        return len(self._waiting) + len(self._calls)

    @property
    def backlog(self) -> int:
        """Work that waits for room: Generates queued beyond the batch's free rows, plus engine calls (a burst the
        loop has not picked up yet, with rows free, is not a backlog)."""
        free = max(0, self.max_batch - len(self._active))
        return max(0, len(self._waiting) - free) + len(self._calls)

    @property
    def running(self) -> int:
        """Generates in the batch, plus an engine call being run."""
        return len(self._active) + self._in_call

    @property
    def prompt_chunk_tokens(self) -> int:
        """The prompt tokens a step may read beside decode rows now (a fixed budget: beside one decode row)."""
        if self.budget is not None:
            return self.budget.tokens()
        assert self.step_tokens is not None
        return max(self.step_tokens - 1, -(-self.step_tokens // 4))

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def closing(self) -> bool:
        """shutdown() was called: queued work is dropped, running work ends."""
        return self._closing

    def shutdown(self, *, wait: bool = True) -> None:
        """Queued Generates and calls are dropped (their futures cancelled); running Generates (parked ones too) go on
        until they end (the server cancels them), then the thread exits."""
        with self._cv:
            self._closing = True
            dropped = [*(r for r in self._waiting if not r.parked), *self._calls]
            self._waiting = deque(r for r in self._waiting if r.parked)
            self._calls.clear()
            self._cv.notify()
        for item in dropped:
            item.future.cancel()
        if wait:
            self._thread.join()

    # ---- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._calls or self._waiting or self._active or self._closing):
                    self._cv.wait()
                if self._closing and not self._active and not self._waiting:
                    return
                calls = list(self._calls)
                self._calls.clear()
                gone = [r for r in self._waiting if r.parked and r.turn.cancelled()]  # ended here, on this thread
                for row in gone:
                    self._waiting.remove(row)
                if not self._closing:
                    self._park_for_fairness()
                admit: list[_Row] = []
                while self._waiting and len(self._active) + len(admit) < self.max_batch:
                    admit.append(self._next_waiting(admit))
            for row in gone:
                self._end_parked(row)
            for call in calls:
                self._run_call(call)
            for row in admit:
                self._admit(row)
            if self._active:
                self._step()
                self._active = [r for r in self._active if not r.done]

    def _next_waiting(self, admitted: list[_Row]) -> _Row:
        """FIFO within an owner; across owners, the first waiting turn of the owner with the fewest rows in the batch,
        so one key's burst of Generates cannot take every row while another key's turn waits. (Under the lock.)"""
        rows: dict[str, int] = {}
        for row in (*self._active, *admitted):
            if not row.done:
                rows[row.owner] = rows.get(row.owner, 0) + 1
        best = min(self._waiting, key=lambda r: rows.get(r.owner, 0))  # min keeps the first of equals: FIFO
        self._waiting.remove(best)
        return best

    def _park_for_fairness(self) -> None:
        """Batch full, and the key running the most rows runs at least two more than a key whose turn waits (and was
        not abandoned): its newest row leaves the batch (keeping its stream, cache and tokens) and waits at the head
        of the queue, so the waiting key's turn takes the row now instead of after the busy key's turns end (the
        parked row comes back when its key runs the fewest). One row per step, so the batch evens out gradually; a
        parked row's tokens are those it would have produced in the batch (the engine's rows do not depend on their
        neighbours). (Under the lock.)"""
        if len(self._active) < self.max_batch:
            return
        waiting = [r.owner for r in self._waiting if not r.turn.cancelled()]
        if not waiting:
            return
        rows: dict[str, int] = {}
        for row in self._active:
            rows[row.owner] = rows.get(row.owner, 0) + 1
        busiest = max(rows, key=rows.__getitem__)
        if rows[busiest] - min(rows.get(owner, 0) for owner in waiting) < 2:
            return
        victim = next(r for r in reversed(self._active) if r.owner == busiest)
        self._active.remove(victim)
        victim.parked, victim.parked_at = True, time.perf_counter()
        self._waiting.appendleft(victim)
        self.stats.parked += 1
        if self.on_park is not None:
            self.on_park()

    def _unpark(self, row: _Row) -> None:
        row.parked = False
        row.turn.resumed(time.perf_counter() - row.parked_at)

    def _end_parked(self, row: _Row) -> None:
        """A parked turn cancelled while it waited ends as its next step would have ended it, outside the batch
        (its room went to another row): a plain row without a step, a speculative one in the send that sees the
        cancel (in its decode, before any forward; in its prompt, after one more chunk)."""
        self._unpark(row)
        if row.steps is not None:
            self._speculate(row, self.engine.prefill_chunk)
            if not row.done:  # (it always ends there; should it not, it goes on as a row like any other)
                self._active.append(row)
            return
        if row.stream.prefill_left == 0:
            row.stream.ended()  # sees the cancel: the finish reason is CANCELLED
        self._finish(row)

    def _run_call(self, call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        self._in_call = True
        try:
            call.future.set_result(call.fn(*call.args))
        except BaseException as e:
            call.future.set_exception(e)
        finally:
            self._in_call = False

    def _admit(self, row: _Row) -> None:
        if row.parked:  # back where it left off
            self._unpark(row)
            self._active.append(row)
            return
        if not row.future.set_running_or_notify_cancel():
            return
        try:
            opened = row.turn.begin()
        except Exception as e:  # begin answers its own errors; this is a bug, but the turn must still end
            self._fail(row, e)
            return
        if opened is None:
            self._end(row)
            return
        self._open(row, opened)
        self._active.append(row)

    @staticmethod
    def _open(row: _Row, opened: TokenStream | SpeculativeStream) -> None:
        if isinstance(opened, TokenStream):
            row.stream = opened
        else:
            row.spec, row.steps = opened, iter(opened)

    def _step(self) -> None:
        self.stats.steps += 1
        began = time.perf_counter()
        rows = [r for r in self._active if not r.done]
        decoding = [r for r in rows if r.stream is not None and r.stream.prefill_left == 0]
        prefilling = [r for r in rows if r.stream is not None and r.stream.prefill_left > 0]
        speculative = [r for r in rows if r.steps is not None]
        others = len(decoding) + len(speculative)
        # a prefill always moves: at least one token (a quarter of a fixed budget), however many rows decode. When
        # more rows wait in their prefill than decode (a burst of new turns), they catch up at the unbatched rate:
        # each step at the small budget would leave most of the batch idle for many steps (8 new turns: 3 s of mostly
        # one-row steps)
        sized = bool(others) and len(prefilling) <= others  # the budget, not the forward's size, bounds the prompt
        if not sized:
            budget = self.engine.prefill_chunk
        elif self.budget is not None:
            budget = self.budget.tokens()
        else:
            assert self.step_tokens is not None
            budget = max(self.step_tokens - len(decoding), -(-self.step_tokens // 4))
        allowed = budget
        chunks: list[_Chunk] = []
        if decoding and prefilling:  # the oldest prefill's next chunk rides the decode forward
            # the oldest short prompt first (a turn's message need not wait for a long prompt's read), read whole
            lead = next((r for r in prefilling if self._short(r)), prefilling[0])
            prefilling = [r for r in prefilling if r is not lead]
            if lead.turn.cancelled():  # between chunks: the turn keeps the chunks read (store.keep_prefilled)
                self._finish(lead)  # (before the raise below: a cancelled prompt must not hand it to a long one)
            else:
                if self._short(lead):
                    budget = max(budget, lead.stream.prefill_left)
                    sized = False  # read whole: its size is the prompt's, not the budget's
                if self._fusable(lead, budget, len(decoding)):
                    chunks.append(_Chunk(lead, lead.stream.next_chunk(budget)))
                    if self._short(lead):  # the other short prompts waiting ride along, whole
                        chunks += self._take_short(prefilling, self.engine.prefill_chunk - chunks[0].ids.shape[1],
                                                   len(decoding))
                else:
                    prefilling.insert(0, lead)
        elif not decoding and not speculative and len(prefilling) > 1:  # nobody decodes: short prompts together
            chunks = self._take_short(prefilling, self.engine.prefill_chunk, 0)
        read = sum(chunk.ids.shape[1] for chunk in chunks)  # prompt tokens this step reads
        budget -= read
        if decoding or chunks:
            self._decode(decoding, chunks)
        # a speculative row's long prompt reads a forward's worth a step alone, a quarter of it beside other rows
        chunk = self.engine.prefill_chunk if len(rows) == 1 else max(self.step_tokens or 0, self.engine.prefill_chunk // 4)
        prompt_rows = sum(self._speculate(row, chunk) for row in speculative)  # speculative rows that read a prompt
        for row in prefilling:
            if budget <= 0:
                break
            n = self._prefill(row, budget)
            budget -= n
            read += n
        seconds = time.perf_counter() - began
        if self.on_step_seconds is not None and (decoding or speculative or read):
            decoded = bool(decoding) or len(speculative) > prompt_rows
            kind = (StepKind.PREFILL if not decoded else StepKind.MIXED if read or prompt_rows else StepKind.DECODE)
            self.on_step_seconds(kind, seconds)
        if self.budget is not None and decoding and not speculative:  # time it: what the decoding rows waited
            if not chunks and budget == allowed:
                self.budget.decode_step(len(decoding), seconds)
            elif sized:
                self.budget.chunk_step(len(decoding), allowed - budget, seconds)

    def _short(self, row: _Row) -> bool:
        """A prompt read whole in one step (a turn's message): at most `short_prompt` new tokens."""
        return row.stream.new_ids.shape[1] <= self.short_prompt

    def _take_short(self, prefilling: list[_Row], room: int, decoding: int) -> list[_Chunk]:
        """The short prompts waiting whose whole (rest of the) prompt fits in `room` tokens, oldest first, as chunks
        of one forward (taken out of `prefilling`): several turns starting together are read in one forward instead
        of one each. With no decode rows at least two are taken, or none (a lone prompt takes its own forward)."""
        picked = []
        for row in prefilling:
            left = row.stream.prefill_left
            if (self._short(row) and left <= room and not row.turn.cancelled()
                    and self._fusable(row, left, decoding)):
                picked.append(row)
                room -= left
        if not decoding and len(picked) < 2:
            return []
        for row in picked:
            prefilling.remove(row)
        return [_Chunk(row, row.stream.next_chunk(row.stream.prefill_left)) for row in picked]

    def _fusable(self, row: _Row, budget: int, decoding: int) -> bool:
        """A chunk can share the decode forward: no attention trace asked for, one forward's worth of tokens, and
        not beside a lone row that decodes through the compiled decode path (its own forward)."""
        stream = row.stream
        assert stream is not None
        return (stream.request.trace_layer is None and stream.cache.batch == 1
                and min(budget, stream.prefill_left) <= self.engine.prefill_chunk
                and (decoding != 1 or self.engine.decode_forward is None))

    def _prefill(self, row: _Row, budget: int) -> int:
        stream = row.stream
        assert stream is not None
        if row.turn.cancelled():  # between chunks: the turn keeps the chunks read (store.keep_prefilled)
            self._finish(row)
            return 0
        n = min(budget, stream.prefill_left)
        try:
            ids = stream.prefill(n)
        except Exception as e:
            self._fail(row, e)
            return n
        self.stats.prefill_chunks += 1
        if ids is not None:
            self._deliver(row, ids)
        return n

    def _decode(self, rows: list[_Row], chunks: list[_Chunk]) -> None:
        """The decode rows and the prefill chunks riding them (at least two chunks without rows) in one forward."""
        if rows:
            self.stats.decode_rows += len(rows)
            if self.on_step is not None:
                self.on_step(len(rows))
        if len(rows) == 1 and not chunks:
            self._decode_alone(rows[0])
            return
        if len(rows) > 1:
            self.stats.batched_steps += 1
        streams = [r.stream for r in rows]
        caches = [s.cache for s in streams]
        lengths = [c.length for c in caches]
        chunk_caches = [c.row.stream.cache for c in chunks]
        chunk_lengths = [c.length for c in chunk_caches]
        try:
            tokens = [int(s.next_input[0, 0]) for s in streams]
            logits, chunk_logits = self.engine.step_chunks(
                caches, tokens, [(cache, c.ids) for cache, c in zip(chunk_caches, chunks, strict=True)])
        except Exception:  # isolate: replay each row alone from where it was
            self.stats.isolated_errors += 1
            for row, cache, length in zip(rows, caches, lengths, strict=True):
                try:
                    if cache.length != length:
                        cache.trim(length)
                except Exception as e:
                    self._fail(row, e)
                    continue
                self._decode_alone(row)
            for chunk, cache, length in zip(chunks, chunk_caches, chunk_lengths, strict=True):
                try:
                    if cache.length != length:
                        cache.trim(length)
                except Exception as e:
                    self._fail(chunk.row, e)
                    continue
                self._prefill(chunk.row, chunk.ids.shape[1])
            return
        with self.deliveries():
            self._take(rows, logits)
            for chunk, last in zip(chunks, chunk_logits, strict=True):
                self.stats.prefill_chunks += 1
                self.stats.fused_chunks += 1
                try:
                    first = chunk.row.stream.chunk_done(chunk.ids.shape[1], last)
                except Exception as e:
                    self._fail(chunk.row, e)
                    continue
                if first is not None:
                    self._deliver(chunk.row, first)

    def _take(self, rows: list[_Row], logits: Any) -> None:
        """Sample and deliver each decode row's token from the step's logits (N, V); the greedy rows' ids come from
        one argmax over them all (each row's own, sampling.greedy)."""
        is_greedy = [r.stream.request.sampling.greedy for r in rows]
        picked = greedy(logits) if sum(is_greedy) > 1 else None  # (N,)
        for i, row in enumerate(rows):
            stream = row.stream
            try:
                ids = stream.take(logits[i : i + 1], picked=picked[i : i + 1] if picked is not None and is_greedy[i]
                                  else None)
            except Exception as e:
                self._fail(row, e)
                continue
            self._deliver(row, ids)

    def _decode_alone(self, row: _Row) -> None:
        stream = row.stream
        try:
            ids = stream.decode()
        except Exception as e:
            self._fail(row, e)
            return
        self._deliver(row, ids)

    def _speculate(self, row: _Row, chunk: int) -> bool:
        """A speculative row's step; True when it read prompt tokens (its prompt was not all read before)."""
        steps, reading = row.steps, row.spec.prefill_left > 0
        try:  # a long prompt's next chunk gets `chunk` tokens (SpeculativeStream reads it one chunk a step)
            tokens = steps.send(chunk) if row.began else next(steps)
            row.began = True
        except StopIteration:  # the speculative stream ended by itself (stop, length, cancel)
            self._finish(row)
            return reading
        except Exception as e:
            self._fail(row, e)
            return reading
        if not tokens:  # a prefill chunk: nothing to commit yet
            return reading
        try:
            stop = row.turn.deliver(tokens)
        except Exception as e:
            self._fail(row, e)
            return reading
        if stop:
            self._finish(row)
        return reading

    def _deliver(self, row: _Row, ids: list[int]) -> None:
        """A plain row's step: commit and stream, then stop, cancel or length end it."""
        try:
            stop = row.turn.deliver(ids)
        except Exception as e:
            self._fail(row, e)
            return
        if stop or row.stream.ended():
            self._finish(row)

    def _close_stream(self, row: _Row) -> None:
        if row.stream is not None:
            row.stream.close()
        elif row.steps is not None and hasattr(row.steps, "close"):
            row.steps.close()

    def _finish(self, row: _Row) -> None:
        try:
            self._close_stream(row)
            row.turn.finish()
        except Exception as e:
            self._fail(row, e, closed=True)
            return
        self._end(row)

    def _fail(self, row: _Row, error: Exception, *, closed: bool = False) -> None:
        if not closed:
            with contextlib.suppress(Exception):
                self._close_stream(row)
        try:
            row.turn.fail(error)
        except Exception:  # the turn's own error handling broke: log it, the loop and the other rows go on
            _log.exception("a Generate's error handling failed")
        finally:
            self._end(row)

    def _end(self, row: _Row) -> None:
        row.done = True
        if not row.future.done():
            row.future.set_result(None)
