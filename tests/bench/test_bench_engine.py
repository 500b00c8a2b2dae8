"""`kakeya bench engine` end to end on a tiny random model (peers off), and its summary logic."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from kakeya_runtime.bench.engine import (
    SCHEMA,
    SCHEMA_VERSION,
    EngineBenchSpec,
    kv_read_bytes,
    plan_jobs,
    streamed_weight_bytes,
    summarize,
)
from kakeya_runtime.bench.machine import memory_read_gb_s
from kakeya_runtime.cli import app
from kakeya_runtime.engine.weights import quantize_model
from kakeya_runtime.kv.cache import make_cache


def test_bench_engine_cli_on_tiny_model_writes_valid_json(tmp_path):
    out = tmp_path / "engine_tiny.json"
    result = CliRunner().invoke(app, [
        "bench", "engine", "--models", "tiny", "--contexts", "48", "--formats", "bf16,int4", "--no-compile",
        "--no-peers", "--decode-steps", "4", "--fidelity-positions", "32", "--long-prefill", "64",
        "--long-prefill-model", "tiny", "--long-prefill-chunks", "16", "--idle-wait", "0", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())
    assert run["schema"] == SCHEMA and run["schema_version"] == SCHEMA_VERSION
    assert run["command_line"].startswith("kakeya bench engine")
    for key in ("cpu_model", "logical_cpus", "torch_threads", "torch", "ram_bytes", "memory_read_gb_s"):
        assert run["machine"][key]
    errors = [r for r in run["jobs"] if "error" in r]
    assert not errors, errors
    kinds = [r["job"]["kind"] for r in run["jobs"]]
    # bf16 twice (our invariant kernels, and PyTorch's as the previous path), int4 once
    assert kinds.count("ours") == 3 and kinds.count("fidelity") == 1 and kinds.count("long_prefill") == 1
    assert sorted(r["kernels"] for r in run["jobs"] if r["job"]["kind"] == "ours") == ["native", "native", "sdpa"]
    for r in run["jobs"]:
        if r["job"]["kind"] == "ours":
            assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["ttft_s"] > 0
            assert r["decode_steps"] == 4 and r["peak_rss_process"] >= r["peak_rss_run"] > 0
            assert r["weight_bytes"] > 0 and r["memory_read_gb_s_before"] > 0
            assert r["decode_weight_bytes"] > 0 and r["decode_kv_bytes"] > 0
            sampled = r["decode_sampled"]  # the same steps sampled, on the same cache
            assert sampled["steps"] == 4 and sampled["decode_tok_s"] > 0 and sampled["sampling"]["top_p"] == 0.95
    (row,) = run["summary"]["rows"]
    # every decode's share of the machine's read speed, from its own bytes and rate
    for fmt, v in row["formats"].items():
        r = next(r for r in run["jobs"] if r["job"]["kind"] == "ours" and (r["job"]["fmt"] == fmt.split("@")[0])
                 and (r["kernels"] == "sdpa") == fmt.endswith("@sdpa"))
        want = ((r["decode_weight_bytes"] + r["decode_kv_bytes"]) * r["decode_tok_s"]
                / (r["memory_read_gb_s_before"] * 1e9))
        assert v["decode_roofline_share"] == round(want, 3) and want > 0  # a tiny model's share can round to 0.000
    assert set(row["formats"]) == {"bf16", "int4", "bf16@sdpa"} and row["peers"] == {}
    ratios = row["invariant_vs_previous"]["bf16"]
    assert ratios["prefill"] > 0 and ratios["decode"] > 0
    assert "Invariant kernels (default) vs PyTorch's" in out.with_suffix(".md").read_text()
    fid = run["summary"]["fidelity"]["tiny"]["int4"]
    assert fid["positions"] == 32 and 0.0 <= fid["top1_agree"] <= 1.0 and fid["kl_mean"] >= 0.0
    assert out.with_suffix(".md").read_text().startswith("# Engine benchmark")
    assert all(v["decode_sampled_tok_s"] > 0 for v in row["formats"].values())
    assert "## Decode sampled, ours (temperature 0.7, top_p 0.95, seed 0)" in out.with_suffix(".md").read_text()


def test_plan_runs_fidelity_before_speed_and_peers_once_per_model():
    spec = EngineBenchSpec(models=("smollm2",), contexts=(1024, 4096), formats=("bf16", "int4"),
                           long_prefill=(), long_prefill_model=None)
    jobs = plan_jobs(spec)
    kinds = [j["kind"] for j in jobs]
    assert kinds == ["fidelity"] + ["ours"] * 6 + ["transformers"] + ["llamacpp"] * 4
    # llama.cpp at each context with flash attention off and on; fidelity once (its logits do not depend on it)
    assert [(j["ctx"], j["flash_attn"], j["positions"] > 0) for j in jobs if j["kind"] == "llamacpp"] == [
        (1024, False, True), (1024, True, False), (4096, False, False), (4096, True, False)]
    assert [(j["fmt"], j["kernels"]) for j in jobs if j["kind"] == "ours"][:3] == [
        ("bf16", "native"), ("bf16", "sdpa"), ("int4", "native")]


def test_summary_ratios_and_targets():
    def ours(fmt, ctx, prefill, decode):
        return {"job": {"kind": "ours", "model": "m", "fmt": fmt, "ctx": ctx},
                "prefill_tok_s": prefill, "decode_tok_s": decode, "ttft_s": ctx / prefill}

    run = {"jobs": [
        ours("bf16", 1024, 3000.0, 45.0), ours("int4", 1024, 2500.0, 110.0),
        {"job": {"kind": "transformers", "model": "m"}, "contexts": {
            "1024": {"prefill_tok_s": 2600.0, "decode_tok_s": 28.0, "ttft_s": 0.4}}},
        {"job": {"kind": "llamacpp", "model": "m", "ctx": 1024},
         "prefill_tok_s": 300.0, "decode_tok_s": 87.0, "ttft_s": 3.4},
    ]}
    s = summarize(run)
    (row,) = s["rows"]
    assert abs(row["formats"]["int4"]["vs"]["llama.cpp"]["decode"] - 110 / 87) < 1e-3
    met = {t["target"]: t["met"] for t in s["targets"]}
    assert met == {"bf16 decode >= 1.5x transformers": True, "fastest format decode >= 1.2x llama.cpp": True,
                   "prefill >= 5x llama.cpp": True}


def test_llamacpp_peer_is_its_best_setting_per_metric():
    def lc(flash, prefill, decode):
        return {"job": {"kind": "llamacpp", "model": "m", "ctx": 4096, "flash_attn": flash},
                "prefill_tok_s": prefill, "decode_tok_s": decode, "ttft_s": 4096 / prefill}

    run = {"jobs": [
        {"job": {"kind": "ours", "model": "m", "fmt": "int4", "ctx": 4096}, "prefill_tok_s": 1000.0,
         "decode_tok_s": 60.0, "ttft_s": 4.1},
        lc(False, 185.0, 42.4), lc(True, 239.0, 35.9),  # the measurement: each setting wins one metric
    ]}
    (row,) = summarize(run)["rows"]
    best = row["peers"]["llama.cpp"]
    assert (best["prefill_tok_s"], best["decode_tok_s"]) == (239.0, 42.4)
    assert set(row["peers"]) == {"llama.cpp", "llama.cpp fa=on", "llama.cpp fa=off"}
    assert abs(row["formats"]["int4"]["vs"]["llama.cpp"]["decode"] - 60.0 / 42.4) < 1e-3
    assert abs(row["formats"]["int4"]["vs"]["llama.cpp"]["prefill"] - 1000.0 / 239.0) < 1e-3


def test_roofline_shares_are_bytes_times_rate_over_read_speed():
    """Ours: its weights and K/V; llama.cpp: its GGUF and the same K/V; each against the read speed before its job."""
    run = {"jobs": [
        {"job": {"kind": "ours", "model": "m", "fmt": "int4", "ctx": 1024}, "prefill_tok_s": 3000.0,
         "decode_tok_s": 100.0, "ttft_s": 0.3, "decode_weight_bytes": 100_000_000, "decode_kv_bytes": 25_000_000,
         "memory_read_gb_s_before": 25.0},
        {"job": {"kind": "llamacpp", "model": "m", "ctx": 1024, "flash_attn": False}, "prefill_tok_s": 300.0,
         "decode_tok_s": 70.0, "ttft_s": 3.4, "gguf_bytes": 95_000_000, "memory_read_gb_s_before": 20.0},
    ]}
    (row,) = summarize(run)["rows"]
    assert row["formats"]["int4"]["decode_roofline_share"] == 0.5  # 125 MB x 100 / 25 GB/s
    assert row["peers"]["llama.cpp fa=off"]["decode_roofline_share"] == 0.42  # 120 MB x 70 / 20 GB/s
    assert row["peers"]["llama.cpp"]["decode_roofline_share"] == 0.42


def test_streamed_bytes_count_each_weight_once_and_the_kv_in_view(make_tiny_model):
    model = make_tiny_model("gemma3", dtype=torch.bfloat16)  # a tied head; sliding layers with a window of 8
    cfg = model.config
    c, v, ffn, layers = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = c * (q + 2 * kv) + q * c + c * 2 * ffn + ffn * c  # qkv, o, gate/up, down
    quantize_model(model, "bf16")
    assert streamed_weight_bytes(model) == 2 * (layers * per_layer + v * c)  # the head is the embedding, once
    quantized = make_tiny_model("gemma3")
    quantize_model(quantized, "int4", head="int8")
    assert streamed_weight_bytes(quantized) < 2 * (layers * per_layer + v * c) * 0.6
    cache = make_cache(cfg, capacity=64, dtype=torch.bfloat16)
    one = 2 * kv * 2  # K and V of one position, bf16
    windows = [getattr(layer, "window", None) for layer in cache]
    assert None in windows and 8 in windows
    assert kv_read_bytes(cache, 40) == sum(one * (40 if w is None else 8) for w in windows)
    assert kv_read_bytes(cache, 5) == len(windows) * one * 5


def test_memory_read_speed_is_measured():
    assert 0.1 < memory_read_gb_s(mib=16, repeats=2) < 10_000
