"""`kakeya bench engine`: prefill/decode speed, TTFT, peak RSS and fidelity per model x context x
weight format, against transformers and llama.cpp on the same GGUF weights, in one run.

Every measurement runs in a fresh subprocess (`python -m kakeya_runtime.bench.engine JOB_JSON`), so
peak RSS of one configuration never includes another's, and a crashing peer cannot take the run down.
The machine is shared (other processes may be busy): before each job the harness waits, up to
`idle_wait_s`, for the CPUs to go idle, and records how busy they were.

Text is CPython's bundled language reference (`pydoc_data.topics`): real English prose with code,
~110k tokens, available offline on every Python install.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "kakeya.bench.engine"
SCHEMA_VERSION = 1
RESULT_MARK = "@@KAKEYA_RESULT@@ "
# Random-weight models for tests and quick smoke runs (no tokenizer: text bytes become token ids).
TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1),
    "tiny-gemma": dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       max_position_embeddings=4096, rope_theta=1e6, rope_local_base_freq=1e4,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=32, sliding_window=16,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
ALL_FORMATS = ("bf16", "fp32", "int8", "int4", "int4-mixed")
# Our jobs also decode sampled, as a chat client asks (the timed greedy run's steps again, on its cache).
SAMPLED_DECODE = {"temperature": 0.7, "top_p": 0.95, "seed": 0}


@dataclass(slots=True)
class EngineBenchSpec:
    models: tuple[str, ...] = ("smollm2", "gemma3-270m")
    contexts: tuple[int, ...] = (1024, 4096)
    formats: tuple[str, ...] = ALL_FORMATS
    compile: bool = False  # compiled decode step (engine.compiled) for our engine (serve runs eager by default)
    peers: bool = True  # transformers + llama.cpp (if importable)
    decode_steps: int = 64
    fidelity_positions: int = 256  # next-token KL / top-1 agreement over this many positions of text
    prefill_chunk: int = 512
    long_prefill: tuple[int, ...] = (1024, 4096, 16384, 30000)  # peak RSS of a long bf16 prefill ...
    long_prefill_model: str | None = "gemma3-270m"  # ... on this model (None: skip)
    long_prefill_chunks: tuple[int, ...] = (512, 2048)  # chunk sizes; the largest only at the two shortest T
    threads: int | None = None  # torch / llama.cpp threads (None: torch's default, the core count)
    idle_wait_s: float = 90.0  # per job, wait at most this long for an idle machine
    job_timeout_s: float = 1800.0
    extra_ours: dict[str, Any] = field(default_factory=dict)  # passed to every `ours` job (head, prefill ...)
    # Formats also run on PyTorch's own kernels (the sdpa backend: library GEMMs and SDPA, not invariant), as the
    # peer of our invariant kernels in the same run; they show as "<fmt>@sdpa".
    previous_formats: tuple[str, ...] = ("bf16", "fp32")
    # llama.cpp runs with flash attention off and on; the peer is the better of the two per metric.
    llamacpp_flash_attn: tuple[bool, ...] = (False, True)


# ------------------------------------------------------------------------------------------------
# the run (parent process)


def plan_jobs(spec: EngineBenchSpec) -> list[dict[str, Any]]:
    """Every subprocess job of a run, in order: fidelity first (its bf16 logits are the peers' reference)."""
    jobs: list[dict[str, Any]] = []
    for i, model in enumerate(spec.models):
        ref = f"fidelity-ref-{i}.pt"  # `model` may be a path
        jobs.append({"kind": "fidelity", "model": model, "formats": list(spec.formats),
                     "positions": spec.fidelity_positions, "ref_file": ref, **spec.extra_ours})
        for ctx in spec.contexts:
            for fmt in spec.formats:
                for kernels in ("native", "sdpa") if fmt in spec.previous_formats else ("native",):
                    jobs.append({"kind": "ours", "model": model, "fmt": fmt, "ctx": ctx, "compile": spec.compile,
                                 "steps": spec.decode_steps, "chunk": spec.prefill_chunk, "kernels": kernels,
                                 **spec.extra_ours})
        if spec.peers and model not in TINY_MODELS:
            jobs.append({"kind": "transformers", "model": model, "contexts": list(spec.contexts),
                         "steps": spec.decode_steps, "positions": spec.fidelity_positions, "ref_file": ref})
            for j, ctx in enumerate(spec.contexts):
                for flash in spec.llamacpp_flash_attn:  # its best setting is the peer (per metric)
                    jobs.append({"kind": "llamacpp", "model": model, "ctx": ctx, "steps": spec.decode_steps,
                                 "flash_attn": flash, "ref_file": ref,
                                 "positions": spec.fidelity_positions if j == 0 and flash is False else 0})
    if spec.long_prefill_model and spec.long_prefill:
        lengths = sorted(spec.long_prefill)
        for chunk in sorted(spec.long_prefill_chunks):
            for t in lengths if chunk == min(spec.long_prefill_chunks) else lengths[:2]:
                jobs.append({"kind": "long_prefill", "model": spec.long_prefill_model, "tokens": t, "chunk": chunk})
    for job in jobs:
        job["threads"] = spec.threads
    return jobs


def run_engine_bench(spec: EngineBenchSpec, *, command_line: str | None = None,
                     on_job: Callable[[int, int, dict[str, Any]], None] | None = None,
                     partial: Path | None = None) -> dict[str, Any]:
    """Run every job in its own subprocess; returns the evidence dict (see `SCHEMA`)."""
    import tempfile

    from kakeya_runtime.bench.machine import machine_info, memory_read_gb_s

    jobs = plan_jobs(spec)
    started = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="kakeya-bench-") as tmp:  # reference logits shared by jobs
        for i, job in enumerate(jobs):
            if on_job:
                on_job(i, len(jobs), job)
            busy = wait_for_idle(spec.idle_wait_s)
            read = memory_read_gb_s()  # the machine's pace now: decode speed follows it
            res = run_job(job, workdir=Path(tmp), timeout_s=spec.job_timeout_s)
            res["cpu_busy_before"], res["memory_read_gb_s_before"] = busy, read
            results.append(res)
            if partial is not None:  # what is done so far survives an interrupted run
                partial.write_text(json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                                               "partial": True, "jobs": results}, indent=1))
    if on_job:
        on_job(len(jobs), len(jobs), {})
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created_unix": started,
        "wall_s": round(time.time() - started, 1),
        "command_line": command_line if command_line is not None else shlex.join(sys.argv),
        "machine": machine_info(),
        "spec": asdict(spec),
        "text_source": "pydoc_data.topics (CPython language reference), topics in sorted order",
        "jobs": results,
    }
    out["summary"] = summarize(out)
    return out


def wait_for_idle(max_wait_s: float, busy_threshold: float = 0.25) -> float:
    """Wait until total CPU use over one second is below `busy_threshold`; return the last reading (0..1)."""
    import psutil

    deadline = time.monotonic() + max_wait_s
    while True:
        busy = psutil.cpu_percent(interval=1.0) / 100.0
        if busy < busy_threshold or time.monotonic() >= deadline:
            return round(busy, 3)


def run_job(job: dict[str, Any], *, workdir: Path, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kakeya_runtime.bench.engine", json.dumps(job)]
    env = dict(os.environ, KAKEYA_BENCH_WORKDIR=str(workdir))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"job": job, "error": f"timed out after {timeout_s} s"}
    wall = round(time.perf_counter() - t0, 2)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return {"job": job, "wall_s": wall, **json.loads(line[len(RESULT_MARK):])}
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"job": job, "wall_s": wall, "error": f"exit {proc.returncode}: {tail}"}


# ------------------------------------------------------------------------------------------------
# summary: tables and ratios


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per model x context: our formats, peers, ratios vs each peer, and the targets."""
    ours: dict[tuple, dict] = {}
    peers: dict[tuple, dict] = {}
    fidelity: dict[str, dict] = {}
    long_prefill = []
    for r in run["jobs"]:
        job = r["job"]
        if "error" in r:
            continue
        if job["kind"] == "ours":
            kernels = job.get("kernels", "native")
            ours[(job["model"], job["ctx"], job["fmt"] if kernels == "native" else f"{job['fmt']}@{kernels}")] = r
        elif job["kind"] == "transformers":
            for ctx, m in r["contexts"].items():
                peers[(job["model"], int(ctx), "transformers")] = {
                    **m, "cpu_busy_before": r.get("cpu_busy_before"),
                    "memory_read_gb_s_before": r.get("memory_read_gb_s_before")}
            fidelity.setdefault(job["model"], {})["transformers"] = r.get("fidelity")
        elif job["kind"] == "llamacpp":
            if r.get("skipped"):
                continue
            fa = job.get("flash_attn")
            peers[(job["model"], job["ctx"], "llama.cpp" if fa is None else f"llama.cpp fa={'on' if fa else 'off'}")] = r
            if r.get("fidelity"):
                fidelity.setdefault(job["model"], {})["llama.cpp"] = r["fidelity"]
        elif job["kind"] == "fidelity":
            fidelity.setdefault(job["model"], {}).update(r["formats"])
        elif job["kind"] == "long_prefill":
            long_prefill.append({k: r[k] for k in ("tokens", "chunk", "prefill_s", "prefill_tok_s", "kv_bytes",
                                                   "rss_before", "peak_rss_prefill", "prefill_peak_over_before")}
                                | {"model": job["model"]})
    _roofline(ours, peers)
    for (m, c) in {(k[0], k[1]) for k in peers if k[2].startswith("llama.cpp fa=")}:
        peers[(m, c, "llama.cpp")] = _best_of({k[2]: v for k, v in peers.items() if k[:2] == (m, c)
                                               and k[2].startswith("llama.cpp fa=")})
    rows = []
    models = list(dict.fromkeys(k[0] for k in ours))
    contexts = sorted({k[1] for k in ours})
    targets = []
    for model in models:
        for ctx in contexts:
            row: dict[str, Any] = {"model": model, "ctx": ctx, "formats": {}, "peers": {}}
            for (m, c, fmt), r in ours.items():
                if m == model and c == ctx:
                    row["formats"][fmt] = _speed(r)
            for (m, c, name), r in peers.items():
                if m == model and c == ctx:
                    row["peers"][name] = _speed(r)
            for s in row["formats"].values():
                s["vs"] = {name: _ratios(s, p) for name, p in row["peers"].items()}
            # The invariant kernels against PyTorch's on the same format (ratio > 1: ours faster).
            row["invariant_vs_previous"] = {fmt: _ratios(row["formats"][fmt], row["formats"][f"{fmt}@sdpa"])
                                            for fmt in list(row["formats"]) if f"{fmt}@sdpa" in row["formats"]}
            rows.append(row)
            targets += _targets(row)
    return {"rows": rows, "fidelity": fidelity, "long_prefill": long_prefill, "targets": targets}


def _roofline(ours: dict[tuple, dict], peers: dict[tuple, dict]) -> None:
    """Each decode's share of the machine's memory roofline: the bytes a step reads times steps per second, over
    the read speed measured just before its job. Ours: its weights and K/V (job_ours); llama.cpp's: its GGUF and
    the same K/V as ours at that context (its f16 cache has our bf16 cache's shape)."""
    def share(r: dict[str, Any], nbytes: int | None) -> float | None:
        bw, tok_s = r.get("memory_read_gb_s_before"), r.get("decode_tok_s")
        return round(nbytes * tok_s / (bw * 1e9), 3) if nbytes and bw and tok_s else None

    kv: dict[tuple, int] = {}
    for (m, c, _), r in ours.items():
        if r.get("decode_weight_bytes"):
            r["decode_bytes"] = r["decode_weight_bytes"] + r["decode_kv_bytes"]
            r["decode_roofline_share"] = share(r, r["decode_bytes"])
            kv[(m, c)] = min(kv.get((m, c), r["decode_kv_bytes"]), r["decode_kv_bytes"])  # 2-byte K/V if any
    for (m, c, name), r in peers.items():
        if name.startswith("llama.cpp") and r.get("gguf_bytes") and (m, c) in kv:
            r["decode_bytes"] = r["gguf_bytes"] + kv[(m, c)]
            r["decode_roofline_share"] = share(r, r["decode_bytes"])


def _best_of(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One peer from several settings of it: the best value of each metric, and which setting gave it."""
    out: dict[str, Any] = {"best_of": {}}
    for key, better in (("prefill_tok_s", max), ("decode_tok_s", max), ("decode_tok_s_median", max),
                        ("ttft_s", min), ("peak_rss_process", min), ("peak_rss_run", min),
                        ("decode_roofline_share", max)):
        have = {name: r[key] for name, r in runs.items() if r.get(key) is not None}
        if have:
            name = better(have, key=have.__getitem__)
            out[key] = have[name]
            out["best_of"][key] = name
    out["cpu_busy_before"] = max((r.get("cpu_busy_before") or 0.0) for r in runs.values())
    return out


def _speed(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("prefill_tok_s", "decode_tok_s", "decode_tok_s_median", "ttft_s", "peak_rss_process", "peak_rss_run",
            "weight_bytes", "cpu_busy_before", "compile_s", "load_s", "best_of", "flash_attn",
            "memory_read_gb_s_before", "decode_bytes", "decode_roofline_share")
    out = {k: r.get(k) for k in keys if r.get(k) is not None}
    sampled = (r.get("decode_sampled") or {}).get("decode_tok_s")
    if sampled is not None:  # ours only
        out["decode_sampled_tok_s"] = sampled
    return out


def _ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    def div(x, y):
        return round(x / y, 3) if x and y else None

    return {"prefill": div(a.get("prefill_tok_s"), b.get("prefill_tok_s")),
            "decode": div(a.get("decode_tok_s"), b.get("decode_tok_s")),
            "decode_median": div(a.get("decode_tok_s_median"), b.get("decode_tok_s_median")),
            "ttft_speedup": div(b.get("ttft_s"), a.get("ttft_s"))}


def _targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for this machine: bf16 decode >= 1.5x transformers; the fastest format's decode
    >= 1.2x llama.cpp at 1k and >= 1.0x at 4k; prefill >= 5x llama.cpp (the fastest format's)."""
    out = []
    fmts, peers = row["formats"], row["peers"]
    tf, lc = peers.get("transformers"), peers.get("llama.cpp")
    where = f"{row['model']} @ {row['ctx']}"
    if tf and "bf16" in fmts:
        rs = _ratios(fmts["bf16"], tf)
        out.append({"target": "bf16 decode >= 1.5x transformers", "where": where, "ratio": rs["decode"],
                    "ratio_median": rs["decode_median"], "met": rs["decode"] is not None and rs["decode"] >= 1.5})
    if lc and fmts:
        best = max(fmts, key=lambda f: fmts[f].get("decode_tok_s") or 0)
        need = 1.2 if row["ctx"] <= 1024 else 1.0
        rs = _ratios(fmts[best], lc)
        out.append({"target": f"fastest format decode >= {need}x llama.cpp", "where": where, "format": best,
                    "ratio": rs["decode"], "ratio_median": rs["decode_median"],
                    "met": rs["decode"] is not None and rs["decode"] >= need})
        best_p = max(fmts, key=lambda f: fmts[f].get("prefill_tok_s") or 0)
        r = _ratios(fmts[best_p], lc)["prefill"]
        out.append({"target": "prefill >= 5x llama.cpp", "where": where, "format": best_p, "ratio": r,
                    "met": r is not None and r >= 5.0})
    return out


def render_markdown(run: dict[str, Any]) -> str:
    """A short human summary of one run (the JSON is the evidence)."""
    s, m = run["summary"], run["machine"]
    lines = [f"# Engine benchmark: {m['cpu_model']}, {m['torch_threads']} threads, torch {m['torch']}", "",
             f"Command: `{run['command_line']}`  ", f"Wall time: {run['wall_s']} s; "
             f"llama-cpp-python {m.get('llama_cpp')}, transformers {m.get('transformers')}.", "",
             "## Speed (tok/s; ratio = ours / peer)", "",
             "Decode: mean over the steps (median step in brackets). CPU busy: share of both cores in use by "
             "other processes just before the job started (the machine is shared). Read GB/s: how fast the machine "
             "read memory just before the job. Roofline: the bytes a decode step reads (weights and K/V; "
             "llama.cpp: its GGUF and the same K/V) times the decode rate, over that read speed.", "",
             "| model | ctx | engine | prefill tok/s | decode tok/s | TTFT s | peak RSS MiB | CPU busy | read GB/s | "
             "decode MB/step | roofline | vs transformers (decode) | vs llama.cpp (prefill / decode) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in s["rows"]:
        for name, v in [*row["formats"].items(), *row["peers"].items()]:
            vs = v.get("vs", {})
            tf = vs.get("transformers", {}).get("decode")
            lc = vs.get("llama.cpp", {})
            med = v.get("decode_tok_s_median")
            lines.append(
                f"| {row['model']} | {row['ctx']} | {name} | {_f(v.get('prefill_tok_s'), 0)} | "
                f"{_f(v.get('decode_tok_s'), 1)}{f' ({med:.1f})' if med else ''} | {_f(v.get('ttft_s'), 2)} | "
                f"{_mib(v.get('peak_rss_process'))} | {_f(v.get('cpu_busy_before'), 2)} | "
                f"{_f(v.get('memory_read_gb_s_before'), 1)} | {_f((v.get('decode_bytes') or 0) / 1e6 or None, 0)} | "
                f"{_pct(v.get('decode_roofline_share'))} | {_x(tf)} | "
                f"{_x(lc.get('prefill'))} / {_x(lc.get('decode'))} |")
    sampled = [(row, name, v) for row in s["rows"] for name, v in row["formats"].items()
               if v.get("decode_sampled_tok_s") is not None]
    if sampled:
        lines += ["", "## Decode sampled, ours (" + ", ".join(f"{k} {v}" for k, v in SAMPLED_DECODE.items()) + ")", "",
                  "The same steps again on the same cache, sampled: what choosing a token costs beside the forward.", "",
                  "| model | ctx | engine | decode tok/s greedy | sampled | sampled / greedy |", "|---|---|---|---|---|---|"]
        for row, name, v in sampled:
            g, t = v.get("decode_tok_s"), v["decode_sampled_tok_s"]
            lines.append(f"| {row['model']} | {row['ctx']} | {name} | {_f(g, 1)} | {_f(t, 1)} | "
                         f"{_x(round(t / g, 3) if g else None)} |")
    lines += ["", "## Fidelity vs our bf16 (next-token KL, top-1 agreement)", "",
              "| model | format | KL (nats) | top-1 agree |", "|---|---|---|---|"]
    for model, fm in s["fidelity"].items():
        for fmt, v in fm.items():
            if v:
                lines.append(f"| {model} | {fmt} | {v['kl_mean']:.4f} | {v['top1_agree']:.3f} |")
    if s["long_prefill"]:
        lines += ["", "## Long prefill, bf16: peak RSS set by the chunk, not by T", "",
                  "| model | tokens | chunk | prefill s | KV MiB | peak over pre-prefill RSS MiB |",
                  "|---|---|---|---|---|---|"]
        for r in s["long_prefill"]:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['chunk']} | {r['prefill_s']:.1f} | "
                         f"{_mib(r['kv_bytes'])} | {_mib(r['prefill_peak_over_before'])} |")
    pairs = [(row, fmt, r) for row in s["rows"] for fmt, r in row.get("invariant_vs_previous", {}).items()]
    if pairs:
        lines += ["", "## Invariant kernels (default) vs PyTorch's (`KAKEYA_ATTENTION=sdpa`), same format", "",
                  "| model | ctx | format | prefill ratio | decode ratio |", "|---|---|---|---|---|"]
        for row, fmt, r in pairs:
            lines.append(f"| {row['model']} | {row['ctx']} | {fmt} | {_x(r['prefill'])} | {_x(r['decode'])} |")
    if s["targets"]:
        lines += ["", "## Targets (met: on the mean; the median ratio beside it)", "",
                  "| target | where | format | ratio | median ratio | met |", "|---|---|---|---|---|---|"]
        for t in s["targets"]:
            lines.append(f"| {t['target']} | {t['where']} | {t.get('format', 'bf16')} | {_x(t['ratio'])} | "
                         f"{_x(t.get('ratio_median'))} | {'yes' if t['met'] else 'no'} |")
    errors = [r for r in run["jobs"] if "error" in r]
    if errors:
        lines += ["", "## Failed jobs", ""] + [f"- {r['job']['kind']} {r['job'].get('model')}: "
                                               f"{r['error'][:200]!r}" for r in errors]
    return "\n".join(lines) + "\n"


def _f(x, nd):
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def _mib(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


# ------------------------------------------------------------------------------------------------
# jobs (child process)


def bench_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@dataclass(slots=True)
class BenchModel:
    model: Any  # DecoderModel
    token_ids: list[int]  # the bench text, tokenized
    gguf: Path | None  # the GGUF the peers load (None for tiny models)


def load_bench_model(name: str, dtype) -> BenchModel:
    import torch

    if name in TINY_MODELS:
        from kakeya_runtime.models.config import ModelConfig
        from kakeya_runtime.models.registry import build_model

        config = ModelConfig.from_hf(TINY_MODELS[name])
        torch.manual_seed(0)
        model = build_model(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.05)
        ids = [b % config.vocab_size for b in bench_text()[:20000].encode()]
        return BenchModel(model.to(dtype).eval().requires_grad_(False), ids, None)
    from kakeya_runtime.models.loader import load_model

    loaded = load_model(name, dtype=dtype)
    ids = loaded.tokenizer.encode(bench_text()).ids
    gguf = loaded.source if loaded.source.is_file() else None
    return BenchModel(loaded.model, ids, gguf)


def _set_threads(n: int | None) -> int:
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def _trim_heap() -> None:
    """Return freed heap to the OS so RSS after load reflects what is held, not what was freed; and freeze what is
    alive out of the garbage collector's walks, as `kakeya serve` does once it has loaded (engine.heap)."""
    from kakeya_runtime.engine.heap import freeze_heap

    freeze_heap()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _ids_tensor(ids: list[int]):
    import torch

    return torch.tensor([ids], dtype=torch.long)


def _text_ids(bm: BenchModel, n: int) -> list[int]:
    """The first n tokens of the bench text (repeated if the text is shorter)."""
    ids = bm.token_ids
    while len(ids) < n:
        ids = ids + bm.token_ids
    return ids[:n]


def job_ours(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kakeya_runtime.bench.machine import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from kakeya_runtime.engine.generate import Engine, GenerateRequest
    from kakeya_runtime.engine.sampling import SamplingParams
    from kakeya_runtime.engine.weights import WeightFormat, quantize_model
    from kakeya_runtime.models import native

    threads = _set_threads(job.get("threads"))
    native.set_backend(job.get("kernels", "native"))  # this job's process only
    fmt = WeightFormat(job["fmt"])
    t0 = time.perf_counter()
    # Quantized formats start from fp32 weights: the loader's fp32 copy holds the GGUF values exactly.
    bm = load_bench_model(job["model"], torch.bfloat16 if fmt is WeightFormat.BF16 else torch.float32)
    report = quantize_model(bm.model, fmt, **_quant_kwargs(job))
    load_s = time.perf_counter() - t0
    del t0
    _trim_heap()
    engine = Engine(bm.model, prefill_chunk=job["chunk"])
    compile_s = None
    if job.get("compile"):
        from kakeya_runtime.engine.compiled import CompiledDecode

        compiled = CompiledDecode(bm.model)
        engine.decode_forward = compiled
        compile_s = compiled.warmup(engine)
    ctx, steps = job["ctx"], job["steps"]
    ids = _ids_tensor(_text_ids(bm, ctx))
    warm = engine.new_cache(capacity=80)  # first-call costs (allocator, oneDNN primitives) off the clock
    engine.generate(warm, ids[:, :64], GenerateRequest(max_new_tokens=4))
    del warm
    _trim_heap()
    rss_ready = current_rss_bytes()
    reset_peak_rss()
    cache = engine.new_cache(capacity=ctx + 2 * steps + 2)
    stream = engine.stream(cache, ids, GenerateRequest(max_new_tokens=steps + 1))
    stamps = [time.perf_counter() for _ in stream]  # one per sampled token; the first ends prefill
    res = stream.result
    assert res is not None
    decode_steps = res.decode_tokens - 1  # the first token comes from prefill
    kv_bytes = cache.nbytes
    # The same number of steps sampled (SAMPLED_DECODE), continuing the greedy run's cache: what choosing a token
    # costs beside the forward (the vocabulary's size, top-p's nucleus).
    sampled = engine.stream(cache, stream.next_input, GenerateRequest(steps + 1, SamplingParams(**SAMPLED_DECODE)))
    sampled_stamps = [time.perf_counter() for _ in sampled]
    assert sampled.result is not None
    return {
        "threads": threads,
        "kernels": native.backend(),
        "amx": native.bf16_amx() if native.enabled() else None,  # our kernels' bf16 path here
        # the calibrated routes (which invariant path serves attention / projections) and their timings
        "routes": _routes_json(native) if native.enabled() else None,
        "load_s": round(load_s, 2),
        "compile_s": None if compile_s is None else round(compile_s, 1),
        "weight_bytes": report.weight_bytes_after,
        "quant": {"head": report.head_fmt.value, "modules": report.kinds, **_quant_kwargs(job)},
        "prefill_s": res.prefill_s,
        "prefill_tok_s": ctx / res.prefill_s,
        "ttft_s": res.ttft_s,
        "decode_steps": decode_steps,
        "decode_s": res.decode_s,
        "decode_tok_s": decode_steps / res.decode_s if res.decode_s > 0 else None,
        **_step_stats(stamps),
        "decode_sampled": {"sampling": SAMPLED_DECODE, "steps": sampled.result.decode_tokens - 1,
                           "decode_tok_s": ((sampled.result.decode_tokens - 1) / sampled.result.decode_s
                                            if sampled.result.decode_s > 0 else None), **_step_stats(sampled_stamps)},
        "kv_bytes": kv_bytes,
        # what one decode step reads from memory, on average over the run's steps: the projections' and the head's
        # weights, and every layer's K/V in view (the roofline below divides it by the machine's read speed)
        "decode_weight_bytes": streamed_weight_bytes(bm.model),
        "decode_kv_bytes": kv_read_bytes(cache, ctx + decode_steps // 2),
        "rss_ready": rss_ready,
        "peak_rss_run": peak_rss_bytes(),  # since reset: prefill + decode
        "peak_rss_process": _ru_maxrss(),  # the whole process, loading included
        "first_tokens": res.token_ids[0][:16],
    }


def streamed_weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads whole: every projection and the LM head (a tied head: the
    embedding it shares), each storage once; the embedding lookup (one row), norms and RoPE tables left out."""
    from torch import nn

    from kakeya_runtime.engine.weights import DenseLinear, QuantLinear

    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear | DenseLinear | QuantLinear):
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if t is not None:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    if getattr(model, "lm_head", None) is None:  # tied, unquantized: the embedding is the head
        w = model.embed_tokens.weight
        seen[w.untyped_storage().data_ptr()] = w.untyped_storage().nbytes()
    return sum(seen.values())


def kv_read_bytes(cache, positions: int) -> int:
    """K/V bytes a decode step at `positions` tokens reads: each layer's positions in view (a sliding layer's
    window at most), K and V."""
    total = 0
    for kv in cache:
        per_position = 2 * kv.k[:, :, :1].nbytes  # K and V of one position, every batch row and KV head
        total += per_position * min(positions, getattr(kv, "window", positions))
    return total


def _routes_json(native) -> dict[str, Any]:
    r = native.routes()
    return {"attention_amx": r.attention_amx, "linear_amx": r.linear_amx, "timings": r.timings, "source": r.source}


def _step_stats(stamps: list[float]) -> dict[str, float]:
    """Median decode speed from per-step times: on a shared machine a few steps stall while another
    process holds a core; the median shows the engine, the mean (decode_tok_s) what a user got."""
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    if not steps:
        return {}
    median = steps[len(steps) // 2]
    return {"decode_tok_s_median": 1.0 / median, "step_ms_p10": 1e3 * steps[len(steps) // 10],
            "step_ms_p90": 1e3 * steps[(9 * len(steps)) // 10]}


def _quant_kwargs(job: dict[str, Any]) -> dict[str, Any]:
    return {k: job[k] for k in ("head", "prefill", "prefill_rows") if job.get(k) is not None}


def _ru_maxrss() -> int:
    """Peak RSS of the whole process (getrusage; at least VmHWM, which the kernel samples differently)."""
    import resource

    from kakeya_runtime.bench.machine import peak_rss_bytes

    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_rss_bytes())


def _logprobs_all(engine, ids):
    from kakeya_runtime.models.base import Logits

    cache = engine.new_cache(capacity=ids.shape[1])
    out = engine.prefill(cache, ids, logits=Logits.ALL)
    return out.logits[0].float().log_softmax(-1)  # (P, V)


def compare_logprobs(ref, other) -> dict[str, float]:
    """Mean next-token KL(ref || other) in nats, its max, and top-1 agreement, over matching positions."""
    import torch

    n = min(ref.shape[0], other.shape[0])
    ref, other = ref[:n].float(), other[:n].float()
    kl = (ref.exp() * (ref - other)).sum(-1).clamp(min=0)
    return {"positions": n, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float((ref.argmax(-1) == other.argmax(-1)).float().mean()),
            "finite": bool(torch.isfinite(other).all())}


def job_fidelity(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.engine.weights import WeightFormat, quantize_model

    threads = _set_threads(job.get("threads"))
    p = job["positions"]
    ref = None
    out: dict[str, Any] = {}
    for fmt in ["bf16"] + [f for f in job["formats"] if f != "bf16"]:
        f = WeightFormat(fmt)
        bm = load_bench_model(job["model"], torch.bfloat16 if f is WeightFormat.BF16 else torch.float32)
        quantize_model(bm.model, f, **_quant_kwargs(job))
        ids = _ids_tensor(_text_ids(bm, p))
        lp = _logprobs_all(Engine(bm.model, prefill_chunk=p), ids)
        if ref is None:
            ref = lp
            torch.save(ref, _workdir() / job["ref_file"])
        elif fmt in job["formats"]:
            out[fmt] = compare_logprobs(ref, lp)
        del bm, lp
        _trim_heap()
    return {"threads": threads, "formats": out, "reference": "our bf16"}


def _workdir() -> Path:
    return Path(os.environ.get("KAKEYA_BENCH_WORKDIR", "."))


def job_transformers(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from kakeya_runtime.bench.machine import peak_rss_bytes, reset_peak_rss

    threads = _set_threads(job.get("threads"))
    bm = load_bench_model(job["model"], torch.bfloat16)  # for the token ids and the GGUF path only
    ids_all, gguf = bm.token_ids, bm.gguf
    del bm
    _trim_heap()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    hf.eval()
    load_s = time.perf_counter() - t0
    result: dict[str, Any] = {"threads": threads, "load_s": round(load_s, 1), "contexts": {},
                              "attn_implementation": getattr(hf.config, "_attn_implementation", None)}
    with torch.inference_mode():
        ref_path = _workdir() / job["ref_file"]
        if job.get("positions") and ref_path.exists():
            ids = _ids_tensor(_text_ids(BenchModel(None, ids_all, None), job["positions"]))
            lp = hf(ids).logits[0].float().log_softmax(-1)
            result["fidelity"] = compare_logprobs(torch.load(ref_path), lp)
            del lp
        hf(_ids_tensor(ids_all[:64]), logits_to_keep=1)  # warm-up
        for ctx in job["contexts"]:
            _trim_heap()
            reset_peak_rss()
            ids = _ids_tensor(_text_ids(BenchModel(None, ids_all, None), ctx))
            t0 = time.perf_counter()
            out = hf(ids, use_cache=True, logits_to_keep=1)
            prefill_s = time.perf_counter() - t0
            tok = int(out.logits[0, -1].argmax())
            ttft = time.perf_counter() - t0
            past = out.past_key_values
            stamps = [time.perf_counter()]
            for _ in range(job["steps"]):
                out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                stamps.append(time.perf_counter())
            decode_s = stamps[-1] - stamps[0]
            result["contexts"][str(ctx)] = {
                "prefill_s": prefill_s, "prefill_tok_s": ctx / prefill_s, "ttft_s": ttft,
                "decode_s": decode_s, "decode_tok_s": job["steps"] / decode_s, **_step_stats(stamps),
                "peak_rss_run": peak_rss_bytes(), "peak_rss_process": _ru_maxrss(),
            }
            del out, past
    return result


def job_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (optional extra)"}
    from kakeya_runtime.bench.machine import peak_rss_bytes, reset_peak_rss

    threads = job.get("threads") or torch.get_num_threads()
    bm = load_bench_model(job["model"], torch.bfloat16)
    ids_all, gguf = bm.token_ids, bm.gguf
    del bm
    _trim_heap()
    ctx, steps = job["ctx"], job["steps"]
    ids = _text_ids(BenchModel(None, ids_all, None), ctx)
    t0 = time.perf_counter()
    flash = bool(job.get("flash_attn", False))
    llm = llama_cpp.Llama(str(gguf), n_ctx=ctx + steps + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, n_ubatch=512, logits_all=False, verbose=False, flash_attn=flash)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    llm.eval(ids[:64])  # warm-up, then start over
    last_argmax()
    llm.reset()
    _trim_heap()
    reset_peak_rss()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    tok = last_argmax()
    ttft = time.perf_counter() - t0
    stamps = [time.perf_counter()]
    for _ in range(steps):
        llm.eval([tok])
        tok = last_argmax()
        stamps.append(time.perf_counter())
    decode_s = stamps[-1] - stamps[0]
    result: dict[str, Any] = {
        "threads": threads, "load_s": round(load_s, 2), "llama_cpp_version": llama_cpp.__version__, "flash_attn": flash,
        "gguf_bytes": gguf.stat().st_size,  # its weights (a tied model's output is its token embedding, read whole)
        "prefill_s": prefill_s, "prefill_tok_s": ctx / prefill_s, "ttft_s": ttft,
        "decode_s": decode_s, "decode_tok_s": steps / decode_s, **_step_stats(stamps),
        "peak_rss_run": peak_rss_bytes(), "peak_rss_process": _ru_maxrss(),
    }
    del llm
    ref_path = _workdir() / job["ref_file"]
    if job.get("positions") and ref_path.exists():
        p = job["positions"]
        llm = llama_cpp.Llama(str(gguf), n_ctx=p + 8, n_threads=threads, n_threads_batch=threads, n_batch=512,
                              logits_all=True, verbose=False)
        llm.eval(_text_ids(BenchModel(None, ids_all, None), p))
        lp = torch.from_numpy(np.array(llm.scores[:p], dtype=np.float32)).log_softmax(-1)
        result["fidelity"] = compare_logprobs(torch.load(ref_path), lp)
    return result


def job_long_prefill(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kakeya_runtime.bench.machine import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from kakeya_runtime.engine.generate import Engine

    threads = _set_threads(job.get("threads"))
    bm = load_bench_model(job["model"], torch.bfloat16)
    engine = Engine(bm.model, prefill_chunk=job["chunk"])
    t = job["tokens"]
    ids = _ids_tensor(_text_ids(bm, t))
    engine.prefill(engine.new_cache(capacity=64), ids[:, :32])  # warm-up
    _trim_heap()
    before = current_rss_bytes()
    reset_peak_rss()
    cache = engine.new_cache(capacity=t + 1)
    t0 = time.perf_counter()
    engine.prefill(cache, ids)
    prefill_s = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {"threads": threads, "tokens": t, "chunk": job["chunk"], "prefill_s": prefill_s,
            "prefill_tok_s": t / prefill_s, "kv_bytes": cache.nbytes, "rss_before": before,
            "peak_rss_prefill": peak, "prefill_peak_over_before": peak - before,
            "peak_rss_process": _ru_maxrss()}


JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ours": job_ours,
    "fidelity": job_fidelity,
    "transformers": job_transformers,
    "llamacpp": job_llamacpp,
    "long_prefill": job_long_prefill,
}


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    result = JOBS[job["kind"]](job)
    print(RESULT_MARK + json.dumps(_jsonable(result)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
