"""`kakeya bench concurrent` on a tiny model (in-process servers instead of `kakeya serve`): it runs both schedulers,
every phase and the long-prompt comparison, and writes JSON of the documented shape."""

from __future__ import annotations

import contextlib
import json

from kakeya_runtime.bench.concurrent import SCHEMA, ConcurrentConfig, Served, run_concurrent
from kakeya_runtime.server.testing import running_server, tiny_served


def test_concurrent_bench_writes_its_json(tmp_path):
    batches = []

    @contextlib.contextmanager
    def start(max_batch):
        batches.append(max_batch)
        with running_server(tiny_served(), max_concurrent=max_batch, step_tokens=16) as thread:
            yield Served(thread.address, f"http://127.0.0.1:{thread.server.metrics_port}/metrics")

    config = ConcurrentConfig(model="tiny", sessions=(1, 2), turns=2, reply_tokens=6, long_prompt=200,
                              long_decoders=2, long_reply_tokens=40, max_batch=4, step_tokens=16, out=tmp_path)
    result = run_concurrent(config, start, command_line="kakeya bench concurrent (test)", log=lambda _: None)
    assert batches == [4, 1]
    data = json.loads((tmp_path / "concurrent.json").read_text())
    assert data["schema"] == SCHEMA and data["bench"] == "concurrent" and data["command"]
    assert {"cpu_model", "load_avg_1m"} <= set(data["machine"]) and "load_avg_1m" in data["machine_end"]
    assert set(data["runs"]) == {"batch", "serial"}
    for name, run in data["runs"].items():
        assert run["max_batch"] == (4 if name == "batch" else 1)
        assert [p["sessions"] for p in run["phases"]] == [1, 2]
        for p in run["phases"]:
            assert p["errors"] == []
            assert p["generated_tokens"] == p["sessions"] * 2 * 6
            assert p["aggregate_tok_s"] > 0 and p["wall_s"] > 0
            assert 0 < p["turn_latency_p50_ms"] <= p["turn_latency_p99_ms"]
            assert 0 <= p["itl_p50_ms"] <= p["itl_p99_ms"] and "cpu_busy_before" in p
            # the engine's steps in the phase, read from the server's /metrics: every session's prompt was read
            # (alone or beside decode rows) and its replies decoded
            engine = p["engine"]
            assert engine["steps"]["prefill"] + engine["steps"]["mixed"] >= 1
            assert engine["steps"]["decode"] + engine["steps"]["mixed"] >= 6 - 1
            assert sum(engine["seconds"].values()) > 0 and 0 < engine["busy_share"] <= 1.05
        long = run["long_prompt"]
        assert long["long_prompt_tokens"] == 200 and long["prefill_window_s"] > 0
        assert long["baseline_itl_p99_ms"] > 0 and isinstance(long["decoders_covered_window"], bool)
    targets = data["targets"]
    assert {"aggregate_2_over_1", "turn_latency_p99_2_over_1", "batch_over_serial_aggregate_at_2"} <= set(targets)
    assert set(targets["aggregate_2_over_1"]) == {"value", "target", "met"}
    assert result["path"] == str(tmp_path / "concurrent.json")


def test_serve_process_passes_the_prompt_budget_flags(monkeypatch):
    """The budget flags reach `kakeya serve`: --step-tokens and --step-slowdown when given, neither otherwise."""
    from kakeya_runtime.bench import concurrent, serve_process

    seen = []

    class Captured:
        def __init__(self, args):
            seen.append(list(args))
            self.address, self.metrics_port = "unused", 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(serve_process, "ServeProcess", Captured)
    for config in (ConcurrentConfig(step_tokens=16, step_slowdown=1.8), ConcurrentConfig()):
        with concurrent.serve_process(config)(8):
            pass
    assert seen[0][seen[0].index("--step-tokens") + 1] == "16"
    assert seen[0][seen[0].index("--step-slowdown") + 1] == "1.8"
    assert "--step-tokens" not in seen[1] and "--step-slowdown" not in seen[1]
