"""Where a served concurrent phase's time goes: the server `kakeya serve` builds (`--weights`, max batch 8, step
tokens 16) runs in this process with timers around the engine loop's steps (BatchScheduler._step), the forwards
(Engine.step_chunks) and the sampling and delivery (BatchScheduler._take); the concurrent bench's own phases (1 and
`--sessions` agent sessions, 2 turns of 48 tokens) drive it from a child process through the SDK, as the bench does.
Per step kind (decode rows, with or without prefill chunks riding the forward): steps, median step / forward /
sampling ms, and their total seconds, beside the phases' aggregate tok/s.

PYTHONPATH=src:sdks/python/src python scripts/served_step_breakdown.py --out results/concurrent/step_breakdown/breakdown.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

CLIENT = """
import json, sys
from kakeya import Client
from kakeya_runtime.bench.concurrent import ConcurrentConfig, _Prompts, _phase
addr, sessions = sys.argv[1], int(sys.argv[2])
cfg = ConcurrentConfig(sessions=(1, sessions), long_prompt=0)
with Client(addr) as c:
    prompts = _Prompts(c, c.model_info().context_length)
    with c.create_session(initial_tokens=prompts.opening(0)) as s:
        s.generate(max_tokens=4, ignore_eos=True).collect()
print(json.dumps([_phase(addr, prompts, n, cfg) for n in (1, sessions)]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from rich.console import Console

    from kakeya_runtime.bench.long_session import load_served
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.bench.sparse import cpu_busy
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.server.testing import running_server
    from kakeya_runtime.sessions.batch import BatchScheduler

    busy = cpu_busy()
    served = load_served(args.model, args.weights, None, Console(quiet=True))
    steps: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    current: dict[str, float] = {}
    step, forward, take = BatchScheduler._step, Engine.step_chunks, BatchScheduler._take

    def timed_step(self: BatchScheduler) -> None:
        rows = sum(1 for r in self._active if not r.done and r.stream is not None and r.stream.prefill_left == 0)
        current.clear()
        t0 = time.perf_counter()
        step(self)
        kind = f"{rows} rows" + (" + chunks" if current.get("chunks") else "")
        steps[kind].append((time.perf_counter() - t0, current.get("forward", 0.0), current.get("take", 0.0)))

    def timed_forward(self: Engine, caches, tokens, chunks=()):
        t0 = time.perf_counter()
        out = forward(self, caches, tokens, chunks)
        current["forward"], current["chunks"] = time.perf_counter() - t0, len(chunks)
        return out

    def timed_take(self: BatchScheduler, rows, logits) -> None:
        t0 = time.perf_counter()
        take(self, rows, logits)
        current["take"] = time.perf_counter() - t0

    BatchScheduler._step, Engine.step_chunks, BatchScheduler._take = timed_step, timed_forward, timed_take
    with running_server(served, max_concurrent=8, step_tokens=16, max_sessions=64) as server:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        child = subprocess.run([sys.executable, "-c", CLIENT, server.address, str(args.sessions)], env=env,
                               capture_output=True, text=True, check=True)
    phases = json.loads(child.stdout.strip().splitlines()[-1])
    kinds = {}
    for kind, got in sorted(steps.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
        kinds[kind] = {"steps": len(got), "total_s": round(sum(x[0] for x in got), 3),
                       **{f"median_{name}_ms": round(statistics.median(x[i] for x in got) * 1e3, 3)
                          for i, name in enumerate(("step", "forward", "take"))}}
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "cpu_busy_before": busy,
              "weights": served.serving.weights if served.serving else args.weights,
              "phases": [{k: p[k] for k in ("sessions", "wall_s", "aggregate_tok_s", "itl_p50_ms", "ttft_p50_ms")}
                         for p in phases],
              "aggregate_ratio": round(phases[1]["aggregate_tok_s"] / phases[0]["aggregate_tok_s"], 3),
              "steps": kinds}
    print(json.dumps({k: result[k] for k in ("phases", "aggregate_ratio", "steps")}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
