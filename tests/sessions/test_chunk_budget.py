"""The measured prompt budget (sessions.chunk_budget): it settles where a step carrying a chunk takes at most
`slowdown` x a decode step, shrinks after slow steps, grows (at most doubling) after fast ones, and moves only on
evidence."""

from __future__ import annotations

import pytest

from kakeya_runtime.sessions.chunk_budget import START_TOKENS, ChunkBudget


def _settle(budget: ChunkBudget, rows: int, base_s: float, token_s: float, fixed_s: float = 0.0,
            steps: int = 60) -> list[int]:
    """Steps of a machine where `rows` decode rows take base_s, and a chunk of T tokens adds fixed_s + T * token_s.
    Returns the budget after each chunk step."""
    sizes = []
    budget.decode_step(rows, base_s)
    for _ in range(steps):
        t = budget.tokens()
        budget.chunk_step(rows, t, base_s + fixed_s + t * token_s)
        sizes.append(budget.tokens())
    return sizes


@pytest.mark.parametrize(("base_s", "token_s", "slowdown"), [(0.020, 0.0035, 1.6), (0.036, 0.004, 1.6),
                                                            (0.015, 0.0005, 1.6), (0.020, 0.0035, 2.0)])
def test_it_settles_on_the_largest_chunk_within_the_slowdown(base_s, token_s, slowdown):
    budget = ChunkBudget(slowdown, ceiling=512)
    sizes = _settle(budget, 4, base_s, token_s)
    best = int((slowdown - 1) * base_s / token_s)  # the largest chunk whose step stays within slowdown x base
    assert best - 1 <= sizes[-1] <= best
    assert sizes[-10:] == [sizes[-1]] * 10  # settled, not oscillating
    assert base_s + sizes[-1] * token_s <= slowdown * base_s + 1e-12


def test_a_slow_step_shrinks_it_at_once_and_a_fixed_cost_keeps_it_at_one_token():
    budget = ChunkBudget(1.6, ceiling=512)
    budget.decode_step(4, 0.020)
    budget.chunk_step(4, START_TOKENS, 0.090)  # 4.5x: the next chunk is much smaller
    assert budget.tokens() < START_TOKENS // 2
    # a chunk of any size costs more than the slowdown allows: the prompt still moves, a token a step
    assert _settle(ChunkBudget(1.6), 4, 0.020, 0.001, fixed_s=0.020)[-1] == 1


def test_it_grows_at_most_doubling_up_to_the_ceiling():
    budget = ChunkBudget(1.6, ceiling=100)
    sizes = _settle(budget, 2, 0.020, 0.0)  # chunks cost nothing
    assert sizes[0] == 2 * START_TOKENS - START_TOKENS // 2  # halfway to double
    assert all(b <= 2 * a for a, b in zip([START_TOKENS, *sizes], sizes, strict=False))
    assert sizes[-1] == 100


def test_it_moves_only_on_evidence():
    budget = ChunkBudget(1.6)
    budget.chunk_step(3, 16, 1.0)  # no decode step of 3 rows timed yet: nothing to compare with
    assert budget.tokens() == START_TOKENS and budget.resized == 0
    budget.decode_step(3, 0.020)
    budget.chunk_step(3, 4, 0.021)  # the prompt's last 4 tokens, fast: says nothing about 16
    assert budget.tokens() == START_TOKENS and budget.resized == 0
    budget.chunk_step(3, 0, 0.5)  # read nothing
    assert budget.tokens() == START_TOKENS
    budget.chunk_step(3, 4, 0.2)  # 4 tokens made the step 10x: that does say 16 is too many
    assert budget.tokens() < START_TOKENS and budget.resized == 1


def test_the_decode_base_follows_recent_steps_per_row_count_and_ignores_a_few_stalls():
    budget = ChunkBudget(1.6)
    budget.decode_step(2, 0.010)
    budget.decode_step(8, 0.040)
    for _ in range(40):
        budget.decode_step(2, 0.020)
    assert budget.base[2] == 0.020 and budget.base[8] == 0.040
    for stall in (0.050, 0.051, 0.055, 0.181, 0.045):  # steps slowed while a 4k-token request arrived
        budget.decode_step(2, stall)
    assert budget.base[2] == 0.020
    budget.chunk_step(2, 16, 0.100)  # against the plain steps' time: a 16-token chunk made it 5x
    assert budget.tokens() == 2


@pytest.mark.parametrize("slowdown", [1.0, 0.5, float("nan")])
def test_a_slowdown_of_at_most_one_is_refused(slowdown):
    with pytest.raises(ValueError, match="slowdown"):
        ChunkBudget(slowdown)
