"""How many prompt tokens a step may read beside decoding sessions, sized by the steps' measured times.

A step that carries a prefill chunk beside decode rows makes every decoding session wait for it. A fixed token
budget is a rule measured on one machine: 16 tokens a step raised the others' p99 inter-token latency 1.36x on a
2-core Xeon with AMX and 3.8x on a 2-core AVX2 EPYC, where each extra row of a step costs as much compute as a
decode row. So the engine loop times its steps instead: `base` is the recent time (a lower quartile) of a step of n
decode rows alone, and after each step whose chunk the budget sized, the budget goes to the chunk that would have
made that step take `slowdown` x base (the extra time taken as proportional to the chunk's tokens): down at once, up
halfway (at least a token, at most doubling), rounded down, between one token and `ceiling`. A position's K/V and
logits do not depend on how its prompt was chunked (INV-3), so no stream depends on these timings; only how fast a
long prompt is read beside the others does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DEFAULT_SLOWDOWN = 1.6  # a step carrying a prompt chunk takes at most this many times a decode step without it
START_TOKENS = 16  # the budget before any step was timed
_WINDOW = 32  # `base` is the lower quartile of this many recent decode steps: the steps taken while a new 4k-token
# prompt's request was parsed (the server's other threads hold the interpreter) took 2-8x a plain step, and an
# average let them set the chunk


@dataclass(slots=True)
class ChunkBudget:
    """The prompt tokens the next step may read beside decoding sessions (`tokens()`), and what sizes it."""

    slowdown: float = DEFAULT_SLOWDOWN
    ceiling: int = 512  # the engine's prefill chunk (one forward's worth)
    size: int = START_TOKENS
    base: dict[int, float] = field(default_factory=dict)  # rows -> seconds of a decode step of that many rows alone
    resized: int = 0  # steps that moved the budget (read by tests)
    _recent: dict[int, deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"slowdown must be > 1 (a step with a chunk takes longer), got {self.slowdown}")
        if self.ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {self.ceiling}")
        self.size = max(1, min(self.size, self.ceiling))

    def tokens(self) -> int:
        return self.size

    def decode_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode rows and no prompt tokens took `seconds`."""
        recent = self._recent.setdefault(rows, deque(maxlen=_WINDOW))
        recent.append(seconds)
        self.base[rows] = sorted(recent)[len(recent) // 4]

    def chunk_step(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` decode rows that read `tokens` prompt tokens under this budget took `seconds`."""
        base = self.base.get(rows)
        if base is None or tokens < 1:  # nothing to compare with yet: the budget stays
            return
        extra = seconds / base - 1.0
        fits = tokens * (self.slowdown - 1.0) / extra if extra > 0 else float("inf")
        if tokens < self.size and fits >= self.size:  # the step read less than allowed (the prompt's end): no news
            return
        # down at once (the others wait on every such step); up halfway, at least a token, at most doubling (probing)
        if fits < self.size:
            new = max(1, math.floor(fits))
        elif fits >= self.size + 1:
            halfway = self.size + 0.5 * (min(fits, 2.0 * self.size) - self.size)
            new = min(self.ceiling, max(self.size + 1, math.floor(halfway)))
        else:
            return
        if new != self.size:
            self.size = new
            self.resized += 1
