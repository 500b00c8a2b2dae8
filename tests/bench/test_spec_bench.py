"""`kakeya bench spec` end to end on a tiny random-config model (seconds): every record and summary field the docs
cite is there, T = 0 runs are identical to plain decode, the adaptive setting is reported as K=auto, the command
line is recorded, and --merge keeps the other workloads' records."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from kakeya_runtime.bench.spec import run_spec_bench, workload_prompt
from kakeya_runtime.server.testing import byte_tokenizer_json, tiny_model

RECORD_KEYS = {"workload", "kind", "temperature", "proposer", "k", "prompt_tokens", "cpu_busy_before",
               "plain_s_per_token", "spec_s_per_token", "speedup", "plain_decode_tokens", "drafted", "accepted",
               "verifier_steps", "plain_steps", "pauses", "acceptance", "mean_accepted", "tokens_per_verifier_step",
               "decode_tokens"}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", context=2048)
    tok = Tokenizer.from_str(byte_tokenizer_json())
    return model, lambda text: tok.encode(text, add_special_tokens=False).ids


@pytest.mark.usefixtures("single_thread")
def test_spec_bench_json_schema_and_merge(tiny, tmp_path) -> None:
    model, encode = tiny
    out = tmp_path / "spec.json"
    common = dict(model_name="tiny-llama", dtype="fp32", proposers=("history", "self"), ks=(1, 0),
                  temperatures=(0.0, 0.7), max_tokens=10, repeats=1, out_file=out, log=None)
    first = run_spec_bench(model, encode, workloads=("reformat_json", "chat_explain"), command="kakeya bench spec a",
                           **common)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(first))
    assert written["schema"] == "kakeya.bench.spec" and written["commands"] == ["kakeya bench spec a"]
    assert {"machine_start", "machine_end", "summary", "records", "max_tokens", "repeats", "prompts"} <= set(written)
    records = written["records"]
    assert len(records) == 2 * 2 * 2 * 2  # workloads x temperatures x proposers x K
    for r in records:
        assert not RECORD_KEYS - set(r), RECORD_KEYS - set(r)
        assert r["k"] in ("1", "auto") and r["speedup"] > 0 and r["decode_tokens"] >= 1
        if r["temperature"] == 0.0:
            assert r["identical"] is True  # exact: greedy speculative tokens are plain decode's
    assert {r["kind"] for r in records} == {"copy", "chat"}
    summary = written["summary"]
    assert set(summary) == {f"{kind}/T={t}/{p}/K={k}" for kind in ("copy", "chat") for t in (0.0, 0.7)
                            for p in ("history", "self") for k in ("1", "auto")}
    assert all({"speedup", "min_speedup", "acceptance", "workloads"} <= set(v) for v in summary.values())
    assert summary["copy/T=0.0/history/K=auto"]["identical"] is True
    # A second invocation with --merge adds its workloads and keeps the first's.
    run_spec_bench(model, encode, workloads=("chat_story",), command="kakeya bench spec b", merge=True, **common)
    merged = json.loads(out.read_text())
    assert merged["commands"] == ["kakeya bench spec a", "kakeya bench spec b"]
    assert len(merged["records"]) == 16 + 8
    assert {r["workload"] for r in merged["records"]} == {"reformat_json", "chat_explain", "chat_story"}
    assert merged["summary"]["chat/T=0.0/history/K=1"]["workloads"] == 2


def test_spec_bench_refuses_unknown_workloads_and_styles(tiny) -> None:
    model, encode = tiny
    with pytest.raises(KeyError):
        run_spec_bench(model, encode, model_name="t", dtype="fp32", proposers=("history",), ks=(1,),
                       temperatures=(0.0,), max_tokens=4, workloads=("nope",), log=None)
    with pytest.raises(ValueError, match="prompt style"):
        workload_prompt("reformat_json", "poetry")
    assert workload_prompt("reformat_json", "completion")[0] == "copy"


@pytest.mark.usefixtures("single_thread")
def test_spec_bench_runs_a_given_draft_head(tiny, tmp_path) -> None:
    """--draft-head: the bench drafts with that file's head (here one restricted to even token ids) and records it."""
    import torch

    from kakeya_runtime.engine.self_draft import DraftHead

    model, encode = tiny
    path = tmp_path / "head.safetensors"
    head = DraftHead(model, seed=3, vocab=torch.arange(0, model.config.vocab_size, 2))
    head.save(path)
    out = run_spec_bench(model, encode, model_name="t", dtype="fp32", proposers=("draft_head",), ks=(2,),
                         temperatures=(0.0,), max_tokens=12, workloads=("chat_explain",), repeats=1, log=None,
                         measured_cost=False, draft_head=path)
    assert out["draft_head"] == {"path": str(path), "vocab": head.vocab.numel(),
                                 "params": sum(p.numel() for p in head.parameters())}
    (rec,) = out["records"]
    assert rec["identical"] is True and rec["drafted"] > 0


def test_spec_bench_cli_refuses_a_bad_draft_head(tmp_path) -> None:
    from typer.testing import CliRunner

    from kakeya_runtime.cli import app

    runner = CliRunner(env={"COLUMNS": "400"})
    res = runner.invoke(app, ["bench", "spec", "--draft-head", str(tmp_path / "missing.safetensors")])
    assert res.exit_code == 2 and "no such file" in res.output
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    res = runner.invoke(app, ["bench", "spec", "--draft-head", str(tmp_path / "junk.safetensors"),
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "--draft-head: cannot read" in res.output
    assert not (tmp_path / "out").exists()  # refused before any run
    res = runner.invoke(app, ["bench", "spec", "--weights", "int3"])
    assert res.exit_code == 2
