"""A/B of the native decoder layers on the engine bench's own job (bench.engine.job_ours), alternating off/on in
fresh processes: `python scripts/native_layer_job_ab.py --model gemma3-270m --fmt int4-mixed --rounds 2 --out X.json`.
Each round runs the job once with KAKEYA_NATIVE_LAYER=0 and once with =1 and records decode tok/s (mean, median)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, sys
from kakeya_runtime.bench import engine as be
r = be.job_ours(json.loads(sys.argv[1]))
print(json.dumps({k: r[k] for k in ("decode_tok_s", "decode_tok_s_median", "step_ms_p10", "step_ms_p90")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--fmt", default="int4-mixed")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    job = {"kind": "ours", "model": a.model, "fmt": a.fmt, "ctx": a.ctx, "compile": False, "steps": 64, "chunk": 512,
           "kernels": "native", "prefill": "kernel", "threads": None}
    runs = []
    for r in range(a.rounds):
        for flag in ("0", "1"):
            env = dict(os.environ, KAKEYA_NATIVE_LAYER=flag)
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], env=env, check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs.append({"round": r, "native_layer": flag == "1", **json.loads(out)})
            print(runs[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "job": job, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
