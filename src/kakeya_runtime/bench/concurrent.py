"""`kakeya bench concurrent`: N sessions driving agent turns through the Python SDK at once, against a real
`kakeya serve` (bench.serve_process), with continuous batching (`--max-batch B`) and the serial scheduler
(`--max-batch 1`) as its peer in the same run.

For N = 1, 2, 4, 8 (by default) every session runs `turns` agent turns at once (append a user / tool message,
generate a reply of `reply_tokens` tokens, greedy, EOS ignored so every run generates the same amount): aggregate
decode tok/s (all generated tokens / the wall time from the common start to the last reply), per-turn latency
(append + the whole reply) and inter-token latency (between streamed tokens) p50/p99.

Long-prompt interference: `long_decoders` sessions decode long replies; the ITLs streamed while nothing else runs
are the baseline; then the same again with a `long_prompt`-token prompt arriving once they are decoding, and the
ITLs streamed between its arrival and its first token compared with the baseline (p99 ratio).

Where the server's engine spent each phase comes from its /metrics (kakeya_engine_step_seconds by step kind, read
before and after the phase): seconds and steps that decoded only, that decoded with prompt tokens (mixed), and that
read prompt tokens only, and their sum over the phase's wall time (how busy the engine was).

Targets: aggregate at 8 sessions >= 4x one session's; p99 turn latency at 8 <= 3x solo; the long prompt
raises the others' p99 ITL by <= 2x. Each is reported with its number and met / missed. The server and the SDK
clients share the machine; each phase records the CPU busy fraction sampled just before it, and the JSON the
machine facts at the start and the end.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
AGENT_SYSTEM = ("You are a coding agent working in a repository. Answer tersely, then propose the next shell command "
                "to run. Tools available: shell, read_file, write_file.")
TOOL_TEXT = ("$ pytest -q tests/test_orders.py\n....F..\nFAILED tests/test_orders.py::test_total_includes_shipping - "
             "AssertionError: assert 151.25 == 159.25\n1 failed, 6 passed in 0.42s\n")
FILLER = ("The order service computes totals from line items, applies discounts, then adds shipping for express "
          "orders. The ledger sync job reads completed orders every minute and writes them to the accounting "
          "database, retrying with exponential backoff when the database is unavailable. ")


CLIENTS = ("real Python SDK clients over gRPC, one thread each, in the bench process (not the server's): they "
           "only stamp each streamed token's arrival time")


@dataclass(slots=True)
class ConcurrentConfig:
    model: str = "smollm2"
    sessions: tuple[int, ...] = (1, 2, 4, 8)
    turns: int = 2
    reply_tokens: int = 48
    long_prompt: int = 4096  # 0: skip the long-prompt phase
    long_decoders: int = 4
    long_reply_tokens: int = 800  # the others decode while the prompt is read beside them (10-13 s here)
    max_batch: int = 8
    step_tokens: int | None = None  # None: the server's default (prompt chunks sized by step time)
    step_slowdown: float | None = None  # None: the server's default
    schedulers: tuple[str, ...] = ("batch", "serial")
    serve_args: tuple[str, ...] = ()  # extra `kakeya serve` arguments
    out: Path = field(default_factory=lambda: Path("results/concurrent"))


@dataclass(frozen=True, slots=True)
class Served:
    """A server for one scheduler: its gRPC address and its /metrics URL."""

    address: str
    metrics_url: str


ServerFactory = Callable[[int], AbstractContextManager[Served]]  # max_batch -> a serving server for the with block


def serve_process(config: ConcurrentConfig) -> ServerFactory:
    """A real `kakeya serve` child process per scheduler."""
    from kakeya_runtime.bench.serve_process import ServeProcess

    @contextlib.contextmanager
    def start(max_batch: int) -> Iterator[Served]:
        step = [] if config.step_tokens is None else ["--step-tokens", str(config.step_tokens)]
        if config.step_slowdown is not None:
            step += ["--step-slowdown", f"{config.step_slowdown:g}"]
        args = ["--model", config.model, "--max-batch", str(max_batch), *step,
                "--max-sessions", str(max(64, 2 * max(config.sessions) + config.long_decoders + 4)),
                *config.serve_args]
        with ServeProcess(args) as proc:
            yield Served(proc.address, f"http://127.0.0.1:{proc.metrics_port}/metrics")

    return start


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def _ms(x: float) -> float:
    return round(1000 * x, 2)


def _busy() -> float:
    import psutil

    return round(psutil.cpu_percent(interval=0.5) / 100.0, 3)


@dataclass(slots=True)
class _Turn:
    latency_s: float
    ttft_s: float
    arrivals: list[float]


def _agent_turn(session: Any, message: list[int], reply_tokens: int) -> _Turn:
    t0 = time.perf_counter()
    session.append(message)
    arrivals: list[float] = []
    for _ in session.generate(max_tokens=reply_tokens, ignore_eos=True):
        arrivals.append(time.perf_counter())
    return _Turn(arrivals[-1] - t0, arrivals[0] - t0, arrivals)


def _itls(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


class _Prompts:
    """Token ids for the sessions' first messages, turns and the long prompt, from the served tokenizer."""

    def __init__(self, client: Any, context: int) -> None:
        from kakeya.tokenization import Tokenizer

        self.tok = Tokenizer.from_model_info(client.model_info())
        self.context = context

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def opening(self, i: int) -> list[int]:
        """A system prompt and a task of 1 to 3 paragraphs (at most a sixth of the context)."""
        task = f"Task {i}: the test below fails. " + FILLER * (1 + i % 3)
        return self.ids(f"{AGENT_SYSTEM}\n\nUser: {task}\n")[: self.context // 6]

    def turn(self, i: int, k: int) -> list[int]:
        return self.ids(f"\nTool output (step {k} of session {i}):\n{TOOL_TEXT}\nAssistant:")[: self.context // 12]

    def long(self, n: int) -> list[int]:
        text = FILLER
        ids = self.ids(text)
        while len(ids) < n:
            text += FILLER
            ids = self.ids(text)
        return ids[:n]


STEP_KINDS = ("decode", "mixed", "prefill")


def engine_steps(metrics_url: str) -> dict[str, tuple[float, float]]:
    """kakeya_engine_step_seconds from the server's /metrics: (seconds, steps) so far for each step kind."""
    import re

    from kakeya_runtime.bench.serve_process import read_metrics

    text = read_metrics(metrics_url)
    out = {}
    for kind in STEP_KINDS:
        sums, counts = (re.search(rf'^kakeya_engine_step_seconds_{part}{{kind="{kind}"[^}}]*}} (\S+)$', text, re.MULTILINE)
                        for part in ("sum", "count"))
        if sums is None or counts is None:
            raise RuntimeError(f"the server's /metrics has no kakeya_engine_step_seconds for kind {kind}")
        out[kind] = (float(sums.group(1)), float(counts.group(1)))
    return out


def _engine_share(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                  wall: float) -> dict[str, Any]:
    seconds = {k: after[k][0] - before[k][0] for k in STEP_KINDS}
    return {"seconds": {k: round(v, 3) for k, v in seconds.items()},
            "steps": {k: int(after[k][1] - before[k][1]) for k in STEP_KINDS},
            "busy_share": round(sum(seconds.values()) / wall, 3) if wall > 0 else None}


def _phase(served: Served, prompts: _Prompts, n: int, config: ConcurrentConfig) -> dict[str, Any]:
    from kakeya import Client

    address = served.address
    busy = _busy()
    steps_before = engine_steps(served.metrics_url)
    barrier = threading.Barrier(n)
    turns: dict[int, list[_Turn]] = {}
    errors: list[str] = []
    start_end: list[tuple[float, float]] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            with Client(address) as c, c.create_session(initial_tokens=prompts.opening(i)) as s:
                barrier.wait(120)
                t0 = time.perf_counter()
                mine = [_agent_turn(s, prompts.turn(i, k), config.reply_tokens) for k in range(config.turns)]
                with lock:
                    turns[i] = mine
                    start_end.append((t0, time.perf_counter()))
        except Exception as e:  # recorded, the phase fails loudly in the JSON
            with lock:
                errors.append(f"session {i}: {type(e).__name__}: {e}")
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_turns = [t for ts in turns.values() for t in ts]
    wall = max(e for _, e in start_end) - min(s for s, _ in start_end) if start_end else 0.0
    tokens = sum(len(t.arrivals) for t in all_turns)
    latencies = [t.latency_s for t in all_turns]
    itls = [x for t in all_turns for x in _itls(t.arrivals)]
    return {"sessions": n, "turns_per_session": config.turns, "reply_tokens": config.reply_tokens,
            "cpu_busy_before": busy, "errors": errors, "generated_tokens": tokens, "wall_s": round(wall, 3),
            "aggregate_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "turn_latency_p50_ms": _ms(_pct(latencies, 0.5)), "turn_latency_p99_ms": _ms(_pct(latencies, 0.99)),
            "ttft_p50_ms": _ms(_pct([t.ttft_s for t in all_turns], 0.5)),
            "itl_p50_ms": _ms(_pct(itls, 0.5)), "itl_p99_ms": _ms(_pct(itls, 0.99)),
            "engine": _engine_share(steps_before, engine_steps(served.metrics_url), wall)}


def _long_phase(address: str, prompts: _Prompts, config: ConcurrentConfig) -> dict[str, Any]:
    """The decoders' ITLs with nothing else running (baseline) and while a long prompt is prefilled."""
    from kakeya import Client

    errors: list[str] = []

    def decode_together(with_long: bool) -> tuple[list[list[float]], tuple[float, float] | None, int]:
        arrivals: dict[int, list[float]] = {}
        started = threading.Barrier(config.long_decoders + 1)
        window: list[float] = []

        def decoder(i: int) -> None:
            try:
                with Client(address) as c, c.create_session(initial_tokens=prompts.opening(100 + i)) as s:
                    mine: list[float] = []
                    arrivals[i] = mine
                    for k, _ in enumerate(s.generate(max_tokens=config.long_reply_tokens, ignore_eos=True)):
                        mine.append(time.perf_counter())
                        if k == min(4, config.long_reply_tokens - 1):  # the 5th token, or the last of fewer
                            started.wait(300)
            except Exception as e:
                errors.append(f"decoder {i}: {type(e).__name__}: {e}")
                started.abort()

        threads = [threading.Thread(target=decoder, args=(i,)) for i in range(config.long_decoders)]
        for t in threads:
            t.start()
        try:
            started.wait(300)
        except threading.BrokenBarrierError:
            for t in threads:
                t.join()
            raise RuntimeError(f"the long-prompt phase failed: {errors}") from None
        long_first = 0
        if with_long:
            with Client(address) as c, c.create_session(initial_tokens=prompts.long(config.long_prompt)) as s:
                t0 = time.perf_counter()
                for _ in s.generate(max_tokens=1, ignore_eos=True):
                    window = [t0, time.perf_counter()]
                long_first = 1
        for t in threads:
            t.join()
        return list(arrivals.values()), (window[0], window[1]) if window else None, long_first

    busy = _busy()
    base, _, _ = decode_together(False)
    base_itls = [x for a in base for x in _itls(a[5:])]  # after every decoder is running
    busy_long = _busy()
    during, window, _ = decode_together(True)
    assert window is not None
    w0, w1 = window
    itls_in = [b - a for arr in during for a, b in zip(arr, arr[1:], strict=False) if w0 <= b <= w1]
    last_token = max(a[-1] for a in during)
    p99_base, p99_in = _pct(base_itls, 0.99), _pct(itls_in, 0.99)
    return {"decoders": config.long_decoders, "long_prompt_tokens": config.long_prompt,
            "reply_tokens": config.long_reply_tokens, "cpu_busy_before": [busy, busy_long], "errors": errors,
            "prefill_window_s": round(w1 - w0, 3),
            "decoders_covered_window": last_token >= w1,  # they kept decoding until the prompt was read
            "itls_in_window": len(itls_in),
            "baseline_itl_p50_ms": _ms(_pct(base_itls, 0.5)), "baseline_itl_p99_ms": _ms(p99_base),
            "during_itl_p50_ms": _ms(_pct(itls_in, 0.5)), "during_itl_p99_ms": _ms(p99_in),
            "during_itl_max_ms": _ms(max(itls_in, default=0.0)),
            "p99_ratio": round(p99_in / p99_base, 3) if p99_base > 0 else None}


def run_concurrent(config: ConcurrentConfig, start_server: ServerFactory | None = None,
                   command_line: str = "", log: Callable[[str], None] = print) -> dict[str, Any]:
    from kakeya import Client

    from kakeya_runtime.bench.machine import machine_info

    start_server = start_server or serve_process(config)
    began = machine_info()
    runs: dict[str, Any] = {}
    for name in config.schedulers:
        max_batch = config.max_batch if name == "batch" else 1
        with start_server(max_batch) as served_at:
            address = served_at.address
            with Client(address) as c:
                info = c.model_info()
                served = {"weight_format": info.weight_format, "weight_format_source": info.weight_format_source,
                          "compiled_decode": info.compiled_decode, "invariant_numerics": info.invariant_numerics}
                prompts = _Prompts(c, info.context_length)
                with c.create_session(initial_tokens=prompts.opening(0)) as s:  # warm up
                    s.generate(max_tokens=4, ignore_eos=True).collect()
            phases = []
            for n in config.sessions:
                phases.append(_phase(served_at, prompts, n, config))
                log(json.dumps({"scheduler": name, **phases[-1]}))
            long = None
            if config.long_prompt:
                long = _long_phase(address, prompts, config)
                log(json.dumps({"scheduler": name, "long_prompt": long}))
            runs[name] = {"max_batch": max_batch, "served": served, "phases": phases, "long_prompt": long}
    result = {"schema": SCHEMA, "bench": "concurrent", "command": command_line, "config": _jsonable(asdict(config)),
              "clients": CLIENTS,
              "machine": began, "machine_end": machine_info(), "runs": runs, "targets": _targets(runs, config)}
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / "concurrent.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    result["path"] = str(path)
    return result


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _targets(runs: dict[str, Any], config: ConcurrentConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batch = runs.get("batch")
    if batch is None:
        return out
    by_n = {p["sessions"]: p for p in batch["phases"]}
    top = max(by_n)
    if 1 in by_n and top > 1:
        agg = by_n[top]["aggregate_tok_s"] / max(by_n[1]["aggregate_tok_s"], 1e-9)
        out[f"aggregate_{top}_over_1"] = {"value": round(agg, 3), "target": ">= 4", "met": agg >= 4}
        p99 = by_n[top]["turn_latency_p99_ms"] / max(by_n[1]["turn_latency_p99_ms"], 1e-9)
        out[f"turn_latency_p99_{top}_over_1"] = {"value": round(p99, 3), "target": "<= 3", "met": p99 <= 3}
    long = batch.get("long_prompt")
    if long and long["p99_ratio"] is not None:
        out["long_prompt_itl_p99_ratio"] = {"value": long["p99_ratio"], "target": "<= 2",
                                            "met": long["p99_ratio"] <= 2}
    serial = runs.get("serial")
    if serial is not None:
        s_by_n = {p["sessions"]: p for p in serial["phases"]}
        if top in s_by_n:
            out[f"batch_over_serial_aggregate_at_{top}"] = round(
                by_n[top]["aggregate_tok_s"] / max(s_by_n[top]["aggregate_tok_s"], 1e-9), 3)
    return out
