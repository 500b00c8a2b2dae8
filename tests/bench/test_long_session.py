"""The long-session bench end to end through the SDK against a real in-process server (tiny model)."""

from __future__ import annotations

import json

from kakeya_runtime.bench.long_session import (
    bucket_p50,
    parse_policy,
    run_session_bench,
    summarize,
    write_evidence,
)
from kakeya_runtime.server.testing import running_server, tiny_served


def test_session_bench_prefills_only_new_tokens_and_writes_evidence(tmp_path):
    with running_server(tiny_served("llama", context=2048)) as server:
        result = run_session_bench(server.address, turns=24, append_tokens=(10, 20), reply_tokens=3,
                                   baseline_every=4,
                                   metrics_url=f"http://127.0.0.1:{server.server.metrics_port}/metrics")
    assert len(result.turns) == 24
    for turn in result.turns[1:]:
        # Incremental prefill: the appended chunk plus the previous reply's last token, never the history.
        assert turn.prefill_tokens == turn.appended + 1
        assert turn.inv1_violations == turn.inv2_violations == 0
    assert [b.turn for b in result.baseline] == list(range(0, 24, 4))
    for b in result.baseline:
        assert b.prefill_tokens == b.history  # the baseline re-prefills everything
    summary = summarize(result, num_buckets=4)
    assert result.metrics_violations == 0 and summary["invariant_violations"] == 0  # read from /metrics
    assert summary["gates"]["invariant_counters_zero"]
    unread = summarize(run_without_metrics := type(result)(policy=result.policy, turns=result.turns), num_buckets=4)
    assert unread["invariant_violations"] is None and not unread["gates"]["invariant_counters_zero"]
    del run_without_metrics
    assert len(summary["bucket_p50_latency_s"]) == 4
    doc = write_evidence({"full": result}, tmp_path / "ls.json", {"model": "tiny"})
    on_disk = json.loads((tmp_path / "ls.json").read_text())
    assert on_disk["schema_version"] == doc["schema_version"] == 1
    assert on_disk["runs"]["full"]["summary"]["turns"] == 24
    assert (tmp_path / "ls.png").stat().st_size > 1000


def test_bucket_p50_and_policy_parsing():
    assert bucket_p50([1, 2, 3, 4, 5, 6], 3) == [1.5, 3.5, 5.5]
    # Every sample counts: 299 turns in 10 buckets keep the last ones (a fixed size of 29 dropped 9 of them).
    assert bucket_p50([1.0] * 280 + [100.0] * 19, 10)[-1] == 100.0  # with 29-turn buckets it read 1.0
    assert bucket_p50([1, 2], 10) == [1, 2]
    assert parse_policy("full") == {"name": "full", "params": {}}
    assert parse_policy("sink_window:sink=4,window=64") == {"name": "sink_window", "params": {"sink": 4, "window": 64}}
    assert parse_policy("lattice:q=3.5,codec=d4")["params"] == {"q": 3.5, "codec": "d4"}


def test_command_runs_each_attention_backend_as_a_peer(tmp_path):
    """`--attention native,sdpa` serves the real model once and runs every policy under both backends."""
    from kakeya_runtime.bench.long_session import command

    # bf16 named: `auto` would calibrate every format on the real model first (150 s on a cold cache; the auto pick
    # itself is the next test's)
    doc = command(turns=6, policies="full", baseline_every=3, attention="native,sdpa", weights="bf16",
                  out=tmp_path / "ls.json")
    assert set(doc["runs"]) == {"full @native", "full @sdpa"}
    assert doc["attention_backends"] == ["native", "sdpa"]
    for name, run in doc["runs"].items():
        assert run["policy"]["attention"] == name.split("@")[1]
        assert run["summary"]["turns"] == 6 and run["summary"]["invariant_violations"] == 0
    from kakeya_runtime.models import native

    assert native.backend() == "native"  # the process is left on the backend it had


def test_command_serves_what_kakeya_serve_serves(tiny_gguf, tmp_path, monkeypatch):
    """By default the bench loads the model as `kakeya serve` does (--weights auto): the format a `kakeya serve`
    start picks from the same calibration, recorded in the JSON as the server reports it; --weights/--dtype override
    it as they do serve's."""
    from kakeya import Client

    from kakeya_runtime.bench.long_session import command
    from kakeya_runtime.bench.serve_process import ServeProcess
    from kakeya_runtime.engine import serving

    monkeypatch.setenv(serving.CALIBRATION_ENV, str(tmp_path / "calibration.json"))
    path = str(tiny_gguf("llama").path)
    doc = command(model=path, turns=3, baseline_every=0, out=tmp_path / "auto.json")
    assert (doc["weights"], doc["dtype"]) == ("auto", None)
    assert doc["serving"]["weight_format_source"] == "auto"
    assert doc["serving"]["weight_format"] in serving.FORMATS and doc["serving"]["compiled_decode"] is False
    assert doc["runs"]["full"]["summary"]["turns"] == 3
    with ServeProcess(["--model", path], start_timeout_s=300) as proc, Client(proc.address) as client:
        info = client.model_info()
    assert (info.weight_format, info.weight_format_source) == (doc["serving"]["weight_format"], "auto")
    assert json.loads((tmp_path / "auto.json").read_text())["serving"] == doc["serving"]
    flagged = command(model=path, turns=2, baseline_every=0, weights="fp32", out=tmp_path / "fp32.json")
    assert (flagged["serving"]["weight_format"], flagged["serving"]["weight_format_source"]) == ("fp32", "flag")
    as_dtype = command(model=path, turns=2, baseline_every=0, dtype="bf16", out=tmp_path / "bf16.json")
    assert (as_dtype["serving"]["weight_format"], as_dtype["serving"]["weight_format_source"]) == ("bf16", "flag")


def test_session_cmd_refuses_weight_flags_serve_refuses():
    import typer
    from typer.testing import CliRunner

    from kakeya_runtime.bench.cli import register

    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["bench", "session", "--dtype", "fp32", "--weights", "int8"])
    assert result.exit_code == 2
    assert "--dtype fp32 and --weights int8 disagree" in " ".join(result.output.split())
