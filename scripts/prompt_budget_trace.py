"""The concurrent bench's long-prompt phase (4 sessions decoding 400 tokens, a 4,096-token prompt arriving) against a
server in this process, with the engine loop's prompt budget traced: every step that read a prompt chunk beside
decode rows (rows, tokens read, step ms, budget after), and the decode-step base it was compared with. Shows what
chunk the measured budget settles on, on this machine, beside the bench's ITL numbers.

PYTHONPATH=src:sdks/python/src python scripts/prompt_budget_trace.py --weights int8 --out results/concurrent/budget_trace.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--slowdown", type=float, default=None, help="--step-slowdown (default: the server's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from kakeya import Client
    from rich.console import Console

    from kakeya_runtime.bench.concurrent import ConcurrentConfig, _long_phase, _Prompts
    from kakeya_runtime.bench.long_session import load_served
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.bench.sparse import cpu_busy
    from kakeya_runtime.server.testing import running_server
    from kakeya_runtime.sessions.chunk_budget import ChunkBudget

    busy = cpu_busy()
    served = load_served(args.model, args.weights, None, Console(quiet=True))
    chunk_steps: list[list[float]] = []
    decode_steps = 0
    chunk_step, decode_step = ChunkBudget.chunk_step, ChunkBudget.decode_step

    def traced_chunk(self: ChunkBudget, rows: int, tokens: int, seconds: float) -> None:
        base = self.base.get(rows)
        chunk_step(self, rows, tokens, seconds)
        chunk_steps.append([rows, tokens, round(seconds * 1e3, 2), None if base is None else round(base * 1e3, 2),
                            self.size])

    def traced_decode(self: ChunkBudget, rows: int, seconds: float) -> None:
        nonlocal decode_steps
        decode_steps += 1
        decode_step(self, rows, seconds)

    ChunkBudget.chunk_step, ChunkBudget.decode_step = traced_chunk, traced_decode  # type: ignore[method-assign]
    extra = {} if args.slowdown is None else {"step_slowdown": args.slowdown}
    with running_server(served, max_concurrent=8, max_sessions=64, **extra) as server:
        budget = server.server.service.scheduler.budget
        assert budget is not None, "the server's default prompt budget is the measured one"
        with Client(server.address) as client:
            prompts = _Prompts(client, client.model_info().context_length)
            phase = _long_phase(server.address, prompts, ConcurrentConfig(sessions=(1,), long_prompt=4096))
        slowdown, base = budget.slowdown, {rows: round(s * 1e3, 2) for rows, s in budget.base.items()}
    settled = Counter(step[1] for step in chunk_steps).most_common(3)
    out = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(), "cpu_busy_before": busy, "weights": served.serving.weights if served.serving else args.weights,
        "slowdown": slowdown, "long_phase": phase, "decode_steps_timed": decode_steps,
        "decode_base_ms_at_end": base, "chunk_tokens_most_read": settled,
        "chunk_steps_fields": ["decode rows", "prompt tokens read", "step ms", "decode base ms", "budget after"],
        "chunk_steps": chunk_steps,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in out.items() if k not in ("chunk_steps", "machine")}, indent=1))


if __name__ == "__main__":
    main()
