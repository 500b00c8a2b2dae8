"""Long-session bench (seed 000 §7 G1–G5): an agent-like loop of many turns through the Python SDK.

Each turn appends a tool-output-sized chunk of tokens to a server-owned session and generates a
short reply. In the same run, the stateless baseline re-sends the whole history each turn (a fresh
session with the full history as initial tokens: what an OpenAI-style server without prefix reuse
does). Every call goes through `kakeya.Client` against a real gRPC server on loopback.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kakeya_runtime.kv.spec import PolicyError, PolicySpec

SCHEMA_VERSION = 1

# Filler for tool outputs: log lines, JSON fragments and file listings, as agents see them.
_WORDS = ("build", "error", "warning", "passed", "failed", "src", "tests", "main.py", "config", "json",
          "request", "status", "ok", "timeout", "retry", "cache", "index", "user", "query", "result",
          "value", "line", "import", "return", "def", "class", "None", "True", "42", "1024", "200", "404")


@dataclass(slots=True)
class TurnRecord:
    turn: int
    appended: int
    history_before: int
    latency_s: float  # client wall time: append + the whole generate stream
    prefill_tokens: int
    ttft_s: float
    decode_tokens: int
    kv_live_bytes: int
    inv1_violations: int
    inv2_violations: int


@dataclass(slots=True)
class BaselineRecord:
    turn: int
    history: int
    latency_s: float  # client wall time: create (full history) + generate + close
    prefill_tokens: int


@dataclass(slots=True)
class SessionBenchResult:
    policy: dict[str, Any]
    turns: list[TurnRecord] = field(default_factory=list)
    baseline: list[BaselineRecord] = field(default_factory=list)
    metrics_violations: float | None = None  # kakeya_cache_invariant_violations_total grew by this during the run


def tool_output(rng: random.Random, tokenizer: Any, n_tokens: int) -> list[int]:
    """About `n_tokens` ids of plausible tool output, trimmed to exactly n_tokens."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        line = " ".join(rng.choice(_WORDS) for _ in range(8))
        ids.extend(tokenizer.encode(f"{line}\n"))
    return ids[:n_tokens]


def bucket_p50(latencies: Sequence[float], num_buckets: int) -> list[float]:
    """Medians of `num_buckets` contiguous buckets that together hold every sample (sizes differ by at most one)."""
    n = len(latencies)
    k = min(num_buckets, n)
    return [statistics.median(latencies[i * n // k:(i + 1) * n // k]) for i in range(k)]


def violations_on_metrics(url: str) -> float:
    """kakeya_cache_invariant_violations_total, all kinds, read from the server's /metrics."""
    import re

    from kakeya_runtime.bench.serve_process import read_metrics

    text = read_metrics(url)
    return sum(float(v) for v in re.findall(r"^kakeya_cache_invariant_violations_total\{[^}]*\} (\S+)$", text,
                                             re.MULTILINE))


def run_session_bench(addr: str, *, turns: int = 300, append_tokens: tuple[int, int] = (12, 28),
                      reply_tokens: int = 4, baseline_every: int = 5, policy: dict[str, Any] | None = None,
                      seed: int = 0, progress: Any = None, metrics_url: str | None = None) -> SessionBenchResult:
    """Drive `turns` turns through the SDK on one session, and the stateless baseline every
    `baseline_every` turns (0: never). Sized by the caller to fit the model's context. With `metrics_url` (the
    server's /metrics), the invariant violations the server counted during the run are recorded."""
    from kakeya import Client, KvPolicy

    rng = random.Random(seed)
    result = SessionBenchResult(policy=policy or {"name": "full", "params": {}})
    violations_before = violations_on_metrics(metrics_url) if metrics_url else None
    with Client(addr) as client:
        info = client.model_info()
        tokenizer = client.tokenizer()
        bos = [info.bos_token_id] if info.bos_token_id is not None else []
        system = bos + tokenizer.encode("You are an agent. Tool outputs follow; reply briefly.\n")
        kv_policy = KvPolicy(result.policy["name"], result.policy.get("params", {}))
        history = list(system)
        with client.create_session(system, policy=kv_policy) as session:
            for turn in range(turns):
                chunk = tool_output(rng, tokenizer, rng.randint(*append_tokens))
                before = len(history)
                t0 = time.perf_counter()
                session.append(chunk)
                gen = session.generate(max_tokens=reply_tokens, ignore_eos=True)
                reply = list(gen)
                latency = time.perf_counter() - t0
                stats = gen.stats
                history += chunk + reply
                s_info = session.info()
                if s_info.history_length != len(history):
                    raise RuntimeError(f"server history {s_info.history_length} != client {len(history)}")
                result.turns.append(TurnRecord(
                    turn, len(chunk), before, latency, stats.prefill_tokens, stats.ttft_s, stats.decode_tokens,
                    s_info.kv_live_bytes, s_info.inv1_violations, s_info.inv2_violations))
                if baseline_every and turn % baseline_every == 0:
                    result.baseline.append(_baseline_turn(client, kv_policy, history[:-len(reply)], turn,
                                                          reply_tokens))
                if progress is not None:
                    progress(turn + 1)
    if metrics_url and violations_before is not None:
        result.metrics_violations = violations_on_metrics(metrics_url) - violations_before
    return result


def _baseline_turn(client: Any, policy: Any, history: list[int], turn: int, reply_tokens: int) -> BaselineRecord:
    t0 = time.perf_counter()
    with client.create_session(history, policy=policy) as fresh:
        gen = fresh.generate(max_tokens=reply_tokens, ignore_eos=True)
        for _ in gen:
            pass
    return BaselineRecord(turn, len(history), time.perf_counter() - t0, gen.stats.prefill_tokens)


def summarize(result: SessionBenchResult, num_buckets: int = 10) -> dict[str, Any]:
    lat = [t.latency_s for t in result.turns[1:]]  # turn 0 also prefills the system prompt
    p50 = bucket_p50(lat, num_buckets)  # every turn after the first counts, the last ones included
    base = [b.latency_s for b in result.baseline[1:]]
    base_p50 = bucket_p50(base, min(num_buckets, max(1, len(base)))) if base else []
    kv = [t.kv_live_bytes for t in result.turns]
    # The server's own counter (/metrics); the per-session fields read 0 on any live session by construction.
    violations = result.metrics_violations
    ratio = p50[-1] / p50[0] if p50 else None
    base_ratio = base_p50[-1] / base_p50[0] if len(base_p50) > 1 else None  # None: no baseline in this run
    return {
        "turns": len(result.turns),
        "final_history_tokens": result.turns[-1].history_before + result.turns[-1].appended if result.turns else 0,
        "bucket_p50_latency_s": p50,
        "last_over_first_p50": ratio,
        "baseline_bucket_p50_latency_s": base_p50,
        "baseline_last_over_first_p50": base_ratio,
        "max_prefill_tokens_after_first_turn": max((t.prefill_tokens for t in result.turns[1:]), default=0),
        "kv_live_bytes_first_last": [kv[0], kv[-1]] if kv else [],
        "invariant_violations": violations,  # from /metrics; None: not read, so not claimed
        "session_info_violations": sum(t.inv1_violations + t.inv2_violations for t in result.turns),
        "gates": {
            "G2_last_bucket_p50_le_1.5x_first": None if ratio is None else ratio <= 1.5,  # None: too few turns
            "bounded_policy_G2_le_1.2x": None if ratio is None else ratio <= 1.2,
            "baseline_grows": None if base_ratio is None else base_ratio > 1.5,
            "invariant_counters_zero": violations is not None and violations == 0,
            "all_calls_through_sdk": True,
        },
    }


def plot(results: dict[str, SessionBenchResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, res in results.items():
        ax.plot([t.turn for t in res.turns], [t.latency_s * 1e3 for t in res.turns], lw=1, label=f"session ({name})")
    first = next(iter(results.values()))
    if first.baseline:
        ax.plot([b.turn for b in first.baseline], [b.latency_s * 1e3 for b in first.baseline], "o-", ms=2, lw=1,
                label="stateless baseline (re-prefill)")
    ax.set_xlabel("turn")
    ax.set_ylabel("turn latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Per-turn latency through the SDK")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_evidence(results: dict[str, SessionBenchResult], out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    from kakeya_runtime.bench.machine import machine_info

    doc = {
        "schema_version": SCHEMA_VERSION,
        "bench": "long_session",
        "command": " ".join(sys.argv),
        "machine": machine_info(),
        **meta,
        "runs": {name: {"summary": summarize(res), "policy": res.policy,
                        "turns": [asdict(t) for t in res.turns],
                        "baseline": [asdict(b) for b in res.baseline]} for name, res in results.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(results, out.with_suffix(".png"))
    return doc


class SessionBenchError(ValueError):
    """A bench request it cannot run (an unknown attention backend)."""


def parse_policy(text: str) -> dict[str, Any]:
    """"full" or "sink_window:sink=4,window=64" -> {"name": ..., "params": {...}} (numbers parsed)."""
    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise PolicyError(f"policy parameter {item!r} is not key=value")
        try:
            params[key] = int(value)
        except ValueError:
            try:
                params[key] = float(value)
            except ValueError:
                params[key] = value
    return {"name": name.strip(), "params": params}


@contextmanager
def _restore_backend(previous: str) -> Iterator[None]:
    """The bench switches the process-wide attention backend per run; leave it as it was."""
    from kakeya_runtime.models import native

    try:
        yield
    finally:
        native.set_backend(previous)


def command(
    model: str = "smollm2",
    turns: int = 300,
    reply_tokens: int = 4,
    baseline_every: int = 5,
    policies: str = "full",
    weights: str = "auto",
    dtype: str | None = None,
    out: Path = Path("results/session/long_session.json"),
    seed: int = 0,
    attention: str = "native",
) -> dict[str, Any]:
    """Load the model as `kakeya serve` does (`weights`/`dtype` mean what its --weights/--dtype do: auto by default,
    the format it would serve on this machine), serve it on loopback, and run the bench once per policy
    (';'-separated) and attention backend (','-separated: `native,sdpa` runs our kernel and PyTorch's SDPA as peers
    in the same run). The JSON records the served format as the server reports it (GetModelInfo)."""
    from rich.console import Console
    from rich.progress import Progress

    from kakeya_runtime.bench.engine import wait_for_idle
    from kakeya_runtime.models import native
    from kakeya_runtime.server.grpc_app import RuntimeServer, ServerConfig, ServerThread

    console = Console(stderr=True)
    backends = [b.strip() for b in attention.split(",") if b.strip()]
    texts = [p.strip() for p in policies.split(";") if p.strip()]
    if not texts:
        raise SessionBenchError(f"policies {policies!r}: give at least one")
    for text in texts:  # each policy checked before the model loads: PolicyError names what is wrong
        PolicySpec.parse(**parse_policy(text))
    unknown = [b for b in backends if b not in native.BACKENDS]
    if unknown or not backends:
        raise SessionBenchError(f"attention backends {unknown or attention!r}: expected some of {native.BACKENDS}")
    served = load_served(model, weights, dtype, console)
    # What `kakeya serve` runs (its defaults), on loopback, with /metrics so violations are read where they are kept.
    server = RuntimeServer(served, ServerConfig(port=0, metrics_port=0))
    busy_before = wait_for_idle(90.0)
    results: dict[str, SessionBenchResult] = {}
    previous = native.backend()
    with ServerThread(server) as running, Progress(console=console) as bar, _restore_backend(previous):
        serving = served_format(running.address)
        for backend in backends:
            native.set_backend(backend)  # process-wide: the server's engine thread reads it per call
            for text in texts:
                name = text if len(backends) == 1 else f"{text} @{backend}"
                task = bar.add_task(name, total=turns)
                results[name] = run_session_bench(
                    running.address, turns=turns, reply_tokens=reply_tokens,
                    baseline_every=baseline_every if not results else 0,  # the baseline once per run
                    policy=parse_policy(text), seed=seed, progress=lambda n, task=task: bar.update(task, completed=n),
                    metrics_url=f"http://127.0.0.1:{server.metrics_port}/metrics")
                results[name].policy = {**results[name].policy, "attention": backend}
    doc = write_evidence(results, out, {"model": model, "weights": weights, "dtype": dtype, "serving": serving,
                                        "turns": turns,
                                        "reply_tokens": reply_tokens, "baseline_every": baseline_every,
                                        "attention_backends": backends, "cpu_busy_before": busy_before,
                                        "native_bf16_dot": native.bf16_dot() if "native" in backends else None})
    for name, run in doc["runs"].items():
        s = run["summary"]
        p50, base = s["bucket_p50_latency_s"], s["baseline_last_over_first_p50"]
        growth = (f"bucket p50 first {p50[0] * 1e3:.0f} ms, last {p50[-1] * 1e3:.0f} ms "
                  f"(x{s['last_over_first_p50']:.2f})" if p50 else "too few turns for buckets")
        console.print(f"[bold]{name}[/]: {growth}; baseline {'-' if base is None else f'x{base:.2f}'}; violations "
                      f"{s['invariant_violations']}")
    console.print(f"served weights {serving['weight_format']} ({serving['weight_format_source']})")
    console.print(f"wrote {out} and {out.with_suffix('.png')}")
    return doc


def load_served(model: str, weights: str, dtype: str | None, console: Any) -> Any:
    """The ServedModel `kakeya serve --model MODEL --weights WEIGHTS [--dtype DTYPE]` builds (eager decode, its
    default): the same first load, the same format choice (auto: measured once per machine, then cached) and
    conversion. ValueError for flags serve would refuse."""
    from kakeya_runtime.models.loader import load_model
    from kakeya_runtime.server.cli import choose_serving, first_load_dtype, resolve_weights
    from kakeya_runtime.server.grpc_app import ServedModel

    fmt = resolve_weights(weights, dtype)
    loaded = load_model(model, dtype=first_load_dtype(fmt))
    choice, decode_forward = choose_serving(loaded, model, fmt, False, False, console)
    served = ServedModel.from_loaded(loaded, model)
    served.serving, served.decode_forward = choice, decode_forward
    return served


def served_format(addr: str) -> dict[str, Any]:
    """What the running server says it serves (GetModelInfo through the SDK)."""
    from kakeya import Client

    with Client(addr) as client:
        info = client.model_info()
    return {"weight_format": info.weight_format, "weight_format_source": info.weight_format_source,
            "compiled_decode": info.compiled_decode, "invariant_numerics": info.invariant_numerics,
            "fidelity_kl": info.fidelity_kl, "fidelity_top1": info.fidelity_top1,
            "measured_decode_tok_s": info.measured_decode_tok_s}
