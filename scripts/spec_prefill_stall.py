"""What a speculative turn's long prompt does to the sessions beside it, through a real `kakeya serve`: one session
decodes (plain) while another session's prompt of `--prompt-tokens` is read by a Generate with speculation off and
with `history`; reported: the decoding session's inter-token gaps while that prompt is read (max, p50), the
prompt's time to first token, and how long a cancelled speculative Generate on a longer prompt keeps working.
Run it on two trees (PYTHONPATH) to compare them; the server is the tree's own `kakeya serve --weights bf16`.

PYTHONPATH=src:sdks/python/src python scripts/spec_prefill_stall.py --out results/concurrent/spec_prefill_stall/after.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from kakeya import Client

from kakeya_runtime.bench.serve_process import ServeProcess


def _prompt(tok, n: int, salt: int) -> list[int]:
    ids = tok.encode(" ".join(f"item {salt}-{i} is filed under shelf {i % 97}." for i in range(n)))
    return ids[:n]


def _stall(client: Client, tok, prompt_tokens: int, speculation: str | None) -> dict:
    """The decoding session's gaps between tokens while the other session's prompt is read."""
    busy = client.create_session(_prompt(tok, 20, 1))
    stamps: list[float] = []

    def decode() -> None:
        for _ in busy.generate(600, ignore_eos=True):
            stamps.append(time.perf_counter())

    worker = threading.Thread(target=decode)
    worker.start()
    time.sleep(1.0)
    long = client.create_session(_prompt(tok, prompt_tokens, 2))
    t0 = time.perf_counter()
    gen = long.generate(4, ignore_eos=True, speculation=speculation)
    first = None
    for _ in gen:
        first = first or time.perf_counter()
    worker.join()
    window = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b >= t0 and a <= first]  # overlapping
    busy.close()
    long.close()
    return {"speculation": speculation or "off", "prompt_ttft_s": round(first - t0, 3),
            "gaps_during_prompt": len(window), "gap_max_ms": round(max(window) * 1000, 1),
            "gap_p50_ms": round(statistics.median(window) * 1000, 1)}


def _cancel(client: Client, tok, prompt_tokens: int) -> dict:
    """A speculative Generate on a long prompt cancelled 1 s in: seconds until the session stops generating."""
    s = client.create_session(_prompt(tok, prompt_tokens, 3))
    gen = s.generate(4, ignore_eos=True, speculation="history")
    reader = threading.Thread(target=lambda: [None for _ in gen])
    reader.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    gen.cancel()
    while s.info().generating:
        time.sleep(0.01)
    stopped = time.perf_counter() - t0
    reader.join()
    info = s.info()
    s.close()
    return {"prompt_tokens": prompt_tokens, "stopped_after_cancel_s": round(stopped, 3),
            "cached_after_cancel": info.cached_length}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--cancel-prompt-tokens", type=int, default=3000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import kakeya_runtime

    tree = Path(kakeya_runtime.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu_busy = round(psutil.cpu_percent(interval=1.0) / 100.0, 3)
    with ServeProcess(["--weights", "bf16"], start_timeout_s=300) as proc, Client(proc.address) as client:
        tok = client.tokenizer()
        stalls = [_stall(client, tok, args.prompt_tokens, spec) for spec in (None, "history")]
        cancel = _cancel(client, tok, args.cancel_prompt_tokens)
    out = {"command": shlex.join(["python", *sys.argv]), "source_tree": str(tree), "commit": commit,
           "cpu_busy_before": cpu_busy, "served": "kakeya serve --weights bf16 (defaults otherwise)",
           "stall": stalls, "cancel": cancel}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
