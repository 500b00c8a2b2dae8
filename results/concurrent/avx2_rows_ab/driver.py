"""Run the same concurrent phases (int8, 1 and 8 sessions, 4 turns) from one tree: argv = tree out_dir."""

import json
import sys
from pathlib import Path

from kakeya_runtime.bench.concurrent import ConcurrentConfig, run_concurrent

tree, out = sys.argv[1], Path(sys.argv[2])
cfg = ConcurrentConfig(
    sessions=(1, 8), turns=4, long_prompt=0, schedulers=("batch",), serve_args=("--weights", "int8"), out=out
)
command = f"PYTHONPATH={tree}/src:{tree}/sdks/python/src python driver.py {tree} {out}  # {cfg}"
run_concurrent(cfg, command_line=command, log=lambda _: None)
d = json.loads((out / "concurrent.json").read_text())
for p in d["runs"]["batch"]["phases"]:
    print(tree, p["sessions"], p["aggregate_tok_s"], p["turn_latency_p99_ms"], p["itl_p50_ms"], p["cpu_busy_before"])
print(d["runs"]["batch"]["served"])
