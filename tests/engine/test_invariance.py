"""INV-3 at the engine: the K/V a position writes and the logits it produces do not depend on the shape of the
step it ran in: one prefill, prefill chunks of any size, turn boundaries, decode steps, or a batched decode step
beside other sequences of other lengths. Bit for bit, on tiny models and on both real models in both dtypes."""

from __future__ import annotations

import pytest
import torch

from kakeya_runtime.engine.generate import Engine, GenerationError
from kakeya_runtime.kv.cache import ModelKV


def run(engine: Engine, ids: torch.Tensor, schedule: list[int | str], cache: ModelKV | None = None,
        end_turns: bool = False) -> tuple[ModelKV, torch.Tensor]:
    """Feed ids (1, T) as prefills of the given sizes and single decode steps ("d"); the last step's logits.
    `end_turns`: each prefill ends a turn (what a session's Generate does)."""
    cache = engine.new_cache() if cache is None else cache
    pos, logits = 0, None
    for step in schedule:
        if step == "d":
            logits = engine.decode_step(cache, ids[:, pos : pos + 1]).logits
            pos += 1
        else:
            logits = engine.prefill(cache, ids[:, pos : pos + step]).logits
            pos += step
            if end_turns:
                cache.end_turn()
    assert pos == ids.shape[1]
    return cache, logits


def assert_same_cache(a: ModelKV, b: ModelKV) -> None:
    assert a.layer_lengths() == b.layer_lengths()
    for i, (x, y) in enumerate(zip(a.state(), b.state(), strict=True)):
        assert x.keys() == y.keys()
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {i} {name} differs"


def split(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


def check_schedules(model, ids: torch.Tensor, schedules: dict[str, list[int | str]], chunks=(512,)) -> None:
    """Every schedule (and one prefill call under every engine prefill chunk) ends in the same cache and logits."""
    ref_cache, ref_logits = run(Engine(model), ids, [ids.shape[1]])
    for chunk in chunks:
        cache, logits = run(Engine(model, prefill_chunk=chunk), ids, [ids.shape[1]])
        assert_same_cache(ref_cache, cache)
        assert torch.equal(logits, ref_logits), f"prefill_chunk={chunk}"
    for name, schedule in schedules.items():
        cache, logits = run(Engine(model), ids, schedule)
        assert_same_cache(ref_cache, cache)
        assert torch.equal(logits, ref_logits), name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_models_any_chunking(family, dtype, make_tiny_model):
    model = make_tiny_model(family, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(3))
    check_schedules(model, ids, {
        "turns": [37, 1, 90, 5, 67],
        "prefill then decode steps": [150] + ["d"] * 50,
        "decode steps from the first token": ["d"] * 200,
    }, chunks=(1, 7, 64, 512))


REAL = ["smollm2_bf16", "smollm2_fp32", "gemma3_bf16", "gemma3_fp32"]


@pytest.mark.real_model
@pytest.mark.parametrize("fixture", REAL)
def test_real_models_any_chunking(fixture, request, english_text):
    """600 tokens of prose (past the 512-token prefill chunk and Gemma's 512-token sliding window)."""
    loaded = request.getfixturevalue(fixture)
    ids = torch.tensor([loaded.tokenizer.encode(english_text).ids[:600]])
    check_schedules(loaded.model, ids, {
        "chunks of 7": split(600, 7),
        "chunks of 64": split(600, 64),
        "turns": [130, 21, 300, 149],
        "prefill then decode steps": [590] + ["d"] * 10,
    }, chunks=(64, 512))


def check_batched_rows(model, histories: list[torch.Tensor], next_ids: list[int]) -> None:
    engine = Engine(model)

    states = []
    for h in histories:
        c = engine.new_cache()
        engine.prefill(c, h)
        states.append(c.state())

    def caches() -> list[ModelKV]:  # fresh copies of the prefilled caches
        out = []
        for state in states:
            c = engine.new_cache()
            c.load_state(state)
            out.append(c)
        return out

    alone = [engine.decode_step(c, torch.tensor([[t]])).logits[0, -1] for c, t in zip(caches(), next_ids, strict=True)]
    for n in (1, 3, len(histories)):
        batch = caches()[:n]
        logits = engine.decode_rows(batch, next_ids[:n])
        assert logits.shape == (n, model.config.vocab_size)
        for i in range(n):
            assert torch.equal(logits[i], alone[i]), (n, i)
            assert batch[i].length == histories[i].shape[1] + 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_batched_decode_rows_equal_rows_alone(family, dtype, make_tiny_model):
    model = make_tiny_model(family, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    lengths = [5, 120, 33, 1, 64, 200, 9, 77]
    histories = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in lengths]
    check_batched_rows(model, histories, [int(torch.randint(0, model.config.vocab_size, (), generator=gen))
                                          for _ in lengths])


@pytest.mark.real_model
@pytest.mark.parametrize("fixture", ["smollm2_bf16", "gemma3_fp32"])
def test_real_batched_decode_rows_equal_rows_alone(fixture, request, english_text):
    loaded = request.getfixturevalue(fixture)
    ids = loaded.tokenizer.encode(english_text).ids
    lengths = [5, 300, 600, 33, 120, 1, 64, 530]
    histories = [torch.tensor([ids[i : i + n]]) for i, n in enumerate(lengths)]
    check_batched_rows(loaded.model, histories, [ids[(n + 7) % len(ids)] for n in lengths])


def test_decode_rows_refuses_bad_batches(make_tiny_model):
    engine = Engine(make_tiny_model("llama"))
    c = engine.new_cache()
    engine.prefill(c, torch.tensor([[1, 2, 3]]))
    with pytest.raises(GenerationError, match="one token per cache"):
        engine.decode_rows([c], [1, 2])
    with pytest.raises(GenerationError, match="twice"):
        engine.decode_rows([c, c], [1, 2])
    with pytest.raises(GenerationError, match="token ids must be in"):
        engine.decode_rows([c], [10_000])
    assert c.length == 3


POLICIES = [
    ("sink_window", {"sink": 4, "window": 16}),
    ("sink_window", {"sink": 4, "window": 16, "codec": "d4"}),  # a lossy resident codec is applied on write
    ("sink_window", {"sink": 4, "window": 16, "codec": "e8", "spare": 8}),
    ("restore", {"sink": 4, "window": 16, "granularity": "per_step"}),
    ("restore", {"sink": 4, "window": 16, "granularity": "per_turn"}),
    ("restore", {"sink": 4, "window": 16, "granularity": "per_turn", "codec": "e8"}),  # restored K/V read alike
    ("restore", {"sink": 4, "window": 16, "granularity": "per_step", "codec": "d4"}),
    ("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2}),
    ("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "int8"}),
]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name,params", POLICIES, ids=lambda x: x if isinstance(x, str) else ",".join(
    f"{k}={v}" for k, v in x.items()))
def test_every_policy_any_chunking(family, name, params, make_tiny_model):
    """Every KV policy, lossy codecs included: one prefill, one call the engine reads in chunks of 16, calls of
    7, turns (each ending the turn, so per_turn restore rebuilds its overlay) and decode steps from the first
    token end in the same logits."""
    from kakeya_runtime.sessions.policy import PolicyRegistry

    model = make_tiny_model(family)
    engine, registry = Engine(model), PolicyRegistry()
    spec = registry.resolve(name, params, engine.config, 256)
    ids = torch.randint(3, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(3))

    def run_policy(schedule: list[int | str], engine: Engine = engine) -> torch.Tensor:
        return run(engine, ids, schedule, registry.build(engine, spec, 256), end_turns=True)[1][0, -1]

    ref = run_policy([120])
    assert torch.equal(run_policy([120], Engine(model, prefill_chunk=16)), ref), "one call read in chunks of 16"
    for label, schedule in {"chunks of 7": split(120, 7), "turns": [37, 1, 50, 32],
                            "prefill then decode steps": [100] + ["d"] * 20, "decode steps": ["d"] * 120}.items():
        assert torch.equal(run_policy(schedule), ref), label
