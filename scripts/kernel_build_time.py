"""How long the first run's kernel build takes on this machine: the library built from scratch into a temporary
folder with one compiler at a time and with one per usable core (the default), alternated `--rounds` times.

python scripts/kernel_build_time.py --rounds 1 --out results/engine/kernel_build_time_epyc.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.sparse import cpu_busy
from kakeya_runtime.models import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    busy = cpu_busy()
    cores = native._usable_cores()
    seconds: dict[str, list[float]] = {"1": [], str(cores): []}
    for _ in range(args.rounds):
        for jobs in (1, cores):
            with tempfile.TemporaryDirectory() as work:
                t0 = time.perf_counter()
                native.build(Path(work) / "cached_attention.so", jobs=jobs)
                seconds[str(jobs)].append(round(time.perf_counter() - t0, 1))
    result = {"command": "python " + shlex.join(sys.argv), "machine": machine_info(), "cpu_busy_before": busy,
              "sources": [s.name for s in native.SOURCES], "usable_cores": cores, "seconds_by_jobs": seconds}
    print(json.dumps(seconds))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
