"""`kakeya bench spec`: speculative decoding against plain decode, same process, same prompts, same run.

Workloads: copy-heavy agent turns (quote a tool output; re-emit a file with one change; reformat a JSON document)
and open chat prompts, chat-formatted for a chat model (SmolLM2); for a base model (Gemma 3 270M: `--prompts
completion`) completion prompts of the same kinds (the text to copy, then the start of its copy; open prose).
For each workload, temperature and proposer at each max draft length K (0: the adaptive setting, the proposer's
own cap): acceptance (accepted / drafted, seed 004's alpha), mean accepted length per verifier step, tokens per
verifier step, and wall time per generated token against plain decode in the same run. Per workload and
temperature, one plain run and one run of every speculative setting alternate `repeats` times; each keeps its
fastest (the least disturbed on a shared machine). At T = 0, and at any T with history drafts (whose verifier
draws the target's own samples, so a seeded stream is plain decoding's), the speculative tokens are also checked
identical to plain decode's (`identical`). Generation stops at the model's EOS tokens or after `max_tokens`.

The machine may be shared: each record carries the CPU busy fraction sampled just before it, and the JSON the
machine facts (load average included) at the start and the end, and the exact command line. `--merge` keeps the
records of other workloads already in the output JSON (a long run split into several invocations; every
invocation's command line is kept). Writes <out>/spec.json (<out>/spec-<model>.json for a model other than
smollm2) and, when matplotlib is installed, the plot next to it.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

TOOL_OUTPUT = """$ kubectl get pods -n payments
NAME                                 READY   STATUS             RESTARTS   AGE
payments-api-7d9f8b6c5d-4xk2p        1/1     Running            0          3d4h
payments-api-7d9f8b6c5d-9q7mz        1/1     Running            0          3d4h
payments-worker-5c8d7f9b4-hh2lt      0/1     CrashLoopBackOff   27         2h11m
payments-worker-5c8d7f9b4-zr8wn      1/1     Running            0          2h11m
ledger-sync-6b7c9d8e7f-p4v6x         1/1     Running            2          5d1h
redis-cache-0                        1/1     Running            0          12d
"""

SOURCE_FILE = '''import json
from pathlib import Path


def load_settings(path: Path) -> dict:
    """Read the settings file and fill in defaults."""
    with open(path) as f:
        data = json.load(f)
    data.setdefault("host", "127.0.0.1")
    data.setdefault("port", 8080)
    data.setdefault("workers", 4)
    return data


def save_settings(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def main() -> None:
    settings = load_settings(Path("settings.json"))
    print(f"serving on {settings['host']}:{settings['port']} with {settings['workers']} workers")
    save_settings(Path("settings.json"), settings)


if __name__ == "__main__":
    main()
'''

JSON_DOC = ('{"order":{"id":"A-10492","customer":{"name":"Ada Lovelace","email":"ada@example.com"},'
            '"items":[{"sku":"KB-101","name":"Mechanical keyboard","qty":1,"price":89.5},'
            '{"sku":"MS-220","name":"Wireless mouse","qty":2,"price":24.0},'
            '{"sku":"CB-003","name":"USB-C cable","qty":3,"price":7.25}],'
            '"shipping":{"method":"express","address":"12 Analytical Row, London"},"total":159.25}}')

WORKLOADS: dict[str, tuple[str, str]] = {
    "quote_tool_output": ("copy", f"Here is the output of a tool I ran:\n\n{TOOL_OUTPUT}\nQuote the tool output "
                                  "back to me exactly, then say which pod is failing."),
    "reemit_file_one_change": ("copy", f"Here is a file:\n\n{SOURCE_FILE}\nRe-emit the whole file with one change: "
                                       "the default port becomes 9090. Output only the file."),
    "reformat_json": ("copy", f"Reformat this JSON with an indent of 2 spaces, same keys and values:\n\n{JSON_DOC}"),
    "chat_explain": ("chat", "Explain in a few paragraphs why the sky is blue."),
    "chat_story": ("chat", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
}

# Completion prompts (a base model): the text to copy, then the start of its copy (what an agent's turn looks like
# to a model without a chat template), and open prose.
COMPLETION_WORKLOADS: dict[str, tuple[str, str]] = {
    "quote_tool_output": ("copy", f"Tool output:\n\n{TOOL_OUTPUT}\nThe same output, quoted exactly:\n\n"
                                  "$ kubectl get pods -n payments\n"),
    "reemit_file_one_change": ("copy", f"settings.py:\n\n{SOURCE_FILE}\nsettings.py after changing the default port "
                                       "to 9090:\n\nimport json\n"),
    "reformat_json": ("copy", f"Compact JSON:\n{JSON_DOC}\n\nThe same JSON, one key per line:\n{{\"order\":"),
    "chat_explain": ("chat", "The sky is blue because"),
    "chat_story": ("chat", "The lighthouse keeper found the bottle on a grey morning in March. Inside it"),
}
PROMPT_STYLES = ("chat", "completion")


def chat_prompt(user: str) -> str:
    return (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def workload_prompt(name: str, style: str) -> tuple[str, str]:
    """(kind, prompt text) of a workload in a prompt style."""
    if style == "chat":
        kind, user = WORKLOADS[name]
        return kind, chat_prompt(user)
    if style == "completion":
        return COMPLETION_WORKLOADS[name]
    raise ValueError(f"unknown prompt style {style!r} (use one of {', '.join(PROMPT_STYLES)})")


def _busy() -> float:
    import psutil

    return round(psutil.cpu_percent(interval=0.5) / 100.0, 3)


def _run(engine, ids: list[int], max_tokens: int, temperature: float, seed: int, stop_ids: tuple[int, ...],
         proposer=None, k: int = 0) -> dict[str, Any]:
    from kakeya_runtime.engine.generate import GenerateRequest
    from kakeya_runtime.engine.sampling import SamplingParams
    from kakeya_runtime.engine.speculative import SpeculativeStream

    req = GenerateRequest(max_tokens, SamplingParams(temperature=temperature, seed=seed), stop_ids=stop_ids)
    cache = engine.new_cache(capacity=len(ids) + max_tokens + 1)
    new = torch.tensor([ids], dtype=torch.long)
    if proposer is None:
        stream = engine.stream(cache, new, req)
        tokens = [step[0] for step in stream]
        stats = None
    else:
        stream = SpeculativeStream(engine, cache, new, req, proposer, ids, k)
        tokens = [t for step in stream for t in step]
        stats = stream.stats
    r = stream.result
    per_token = r.decode_s / max(1, r.decode_tokens - 1)
    out: dict[str, Any] = {"tokens": tokens, "decode_tokens": r.decode_tokens, "decode_s": round(r.decode_s, 4),
                           "s_per_token": per_token}
    if stats is not None:
        out.update(drafted=stats.drafted, accepted=stats.accepted, verifier_steps=stats.verifier_steps,
                   plain_steps=stats.plain_steps, pauses=stats.off_switches,
                   acceptance=round(stats.acceptance_rate, 4),
                   mean_accepted=round(stats.accepted / stats.verifier_steps, 3) if stats.verifier_steps else 0.0,
                   tokens_per_verifier_step=round(stats.tokens_per_verifier_step, 3))
    return out


def k_label(k: int) -> str:
    return "auto" if k == 0 else str(k)


def run_spec_bench(model, encode: Callable[[str], list[int]], *, model_name: str, dtype: str,
                   proposers: Sequence[str], ks: Sequence[int], temperatures: Sequence[float], max_tokens: int,
                   workloads: Sequence[str], prompts: str = "chat", eos_ids: Sequence[int] = (), repeats: int = 2,
                   out_file: Path | None = None, merge: bool = False, command: str | None = None,
                   log: Callable[[str], None] | None = print, measured_cost: bool = True,
                   draft_head: Path | None = None, weights: str | None = None) -> dict[str, Any]:
    """The bench over a loaded model (`encode`: text -> token ids); returns (and writes to `out_file`) the JSON.
    `draft_head`: trained weights for the draft_head proposer (else a randomly initialised head); `weights`: the
    weight format the model was converted to, recorded."""
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.engine.drafts import HistoryLookup
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft
    from kakeya_runtime.engine.speculative import measure_verify_cost

    for name in workloads:
        workload_prompt(name, prompts)  # unknown names or styles fail before any work
    unknown = set(proposers) - {"history", "self", "draft_head"}
    if unknown:
        raise ValueError(f"unknown proposers {sorted(unknown)}")
    head = DraftHead(model) if draft_head is None else DraftHead.from_file(model, draft_head)  # a bad file: now
    engine = Engine(model)
    # as `kakeya serve` measures it at start-up (measured_cost False: the constant price of the versions before)
    engine.verify_cost = measure_verify_cost(engine) if measured_cost else None
    make = {"history": HistoryLookup, "self": lambda: LayerSkipDraft(model),
            "draft_head": lambda: DraftHeadProposer(head)}
    stop_ids = tuple(eos_ids)
    started = machine_info()
    records: list[dict[str, Any]] = []
    settings = [(p, k) for p in proposers for k in ks]
    for name in workloads:
        kind, text = workload_prompt(name, prompts)
        ids = encode(text)
        _run(engine, ids, 8, 0.0, 0, stop_ids)  # warm up this prompt length's shapes
        for temperature in temperatures:
            busy = _busy()
            # One plain run, then one run of every setting, `repeats` times; each keeps its fastest: on a shared
            # machine the minimum is the least disturbed measurement (the tokens are the same every repeat).
            bases: list[dict[str, Any]] = []
            specs: dict[tuple[str, int], list[dict[str, Any]]] = {s: [] for s in settings}
            for _ in range(repeats):
                bases.append(_run(engine, ids, max_tokens, temperature, 1, stop_ids))
                for proposer, k in settings:
                    specs[proposer, k].append(_run(engine, ids, max_tokens, temperature, 1, stop_ids,
                                                   proposer=make[proposer](), k=k))
            base = min(bases, key=lambda r: r["s_per_token"])
            for (proposer, k), runs in specs.items():
                spec = min(runs, key=lambda r: r["s_per_token"])
                rec = {"workload": name, "kind": kind, "temperature": temperature, "proposer": proposer,
                       "k": k_label(k), "prompt_tokens": len(ids), "cpu_busy_before": busy,
                       "plain_s_per_token": round(base["s_per_token"], 7),  # the summary sums these: kept fine
                       "spec_s_per_token": round(spec["s_per_token"], 7),
                       "speedup": round(base["s_per_token"] / spec["s_per_token"], 3),
                       "plain_decode_tokens": base["decode_tokens"],
                       **{key: spec[key] for key in ("drafted", "accepted", "verifier_steps", "plain_steps",
                                                     "pauses", "acceptance", "mean_accepted",
                                                     "tokens_per_verifier_step", "decode_tokens")}}
                if temperature == 0.0 or proposer == "history":  # history drafts keep even a sampled stream
                    rec["identical"] = base["tokens"] == spec["tokens"]
                records.append(rec)
                if log is not None:
                    log(json.dumps(rec))
    commands = [command if command is not None else shlex.join(["kakeya", *sys.argv[1:]])]
    if merge and out_file is not None and out_file.exists():
        old = json.loads(out_file.read_text())
        if old.get("model") == model_name and old.get("dtype") == dtype:
            ran = set(workloads)
            records = [r for r in old.get("records", []) if r["workload"] not in ran] + records
            commands = list(old.get("commands", [])) + commands
            started = old.get("machine_start", started)
    head_info = {"path": None if draft_head is None else str(draft_head),
                 "vocab": int(head.vocab.numel()) if hasattr(head, "vocab") else None,
                 "params": sum(p.numel() for p in head.parameters())}
    result = {"schema": "kakeya.bench.spec", "model": model_name, "dtype": dtype, "weights": weights or dtype,
              "draft_head": head_info, "prompts": prompts,
              "max_tokens": max_tokens, "repeats": repeats, "threads": torch.get_num_threads(),
              "eos_ids": list(stop_ids), "commands": commands, "machine_start": started,
              "machine_end": machine_info(), "verify_cost": list(engine.verify_cost or ()),
              "summary": summarize(records), "records": records,
              "note": "wall time per generated token after the first (decode only); per workload and temperature one "
                      "plain run and one run of each speculative setting alternate `repeats` times and each keeps "
                      "its fastest; k 'auto' is the adaptive setting (max_draft_tokens 0); cpu_busy_before is the "
                      "whole machine's CPU use over 0.5 s (other processes included)"}
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result, indent=1))
        _plot(result, out_file.with_suffix(".png"))
    return result


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per kind, temperature, proposer and K: the speedup over the kind's workloads (per-token times summed), the
    worst workload's, the acceptance, and whether every T = 0 run matched plain decode."""
    summary: dict[str, Any] = {}
    keys: list[tuple[str, float, str, str]] = []
    for r in records:
        key = (r["kind"], r["temperature"], r["proposer"], r["k"])
        if key not in keys:
            keys.append(key)
    for kind, temperature, proposer, k in sorted(keys, key=lambda x: (x[0] != "copy", x[1], x[2], x[3])):
        rows = [r for r in records if (r["kind"], r["temperature"], r["proposer"], r["k"]) ==
                (kind, temperature, proposer, k)]
        plain = sum(r["plain_s_per_token"] for r in rows)
        spec = sum(r["spec_s_per_token"] for r in rows)
        entry = {"speedup": round(plain / spec, 3), "min_speedup": min(r["speedup"] for r in rows),
                 "acceptance": round(sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows)), 4),
                 "workloads": len(rows)}
        if temperature == 0.0 or proposer == "history":
            entry["identical"] = all(r.get("identical", False) for r in rows)
        summary[f"{kind}/T={temperature}/{proposer}/K={k}"] = entry
    return summary


def command(model: str, dtype: str, proposers: tuple[str, ...], ks: tuple[int, ...],
            temperatures: tuple[float, ...], max_tokens: int, workloads: tuple[str, ...], threads: int | None,
            out: Path, repeats: int = 2, prompts: str | None = None, merge: bool = False,
            measured_cost: bool = True, draft_head: Path | None = None, weights: str | None = None) -> dict[str, Any]:
    from kakeya_runtime.bench.options import dtype_of
    from kakeya_runtime.models.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    style = prompts or ("chat" if model == "smollm2" else "completion")
    if weights is None:
        loaded = load_model(model, dtype=dtype_of(dtype))
    else:  # converted as `kakeya serve --weights` converts it (int formats from the fp32 first load)
        from kakeya_runtime.engine.weights import WeightFormat, quantize_model

        fmt = WeightFormat(weights)
        loaded = load_model(model, dtype=torch.float32 if fmt.quantized else dtype_of(weights))
        quantize_model(loaded.model, fmt, **({"head": "int8"} if fmt.quantized else {}))
    tok = loaded.tokenizer
    bos = [] if style == "chat" or loaded.bos_id is None else [loaded.bos_id]
    name = "spec.json" if model == "smollm2" else f"spec-{Path(model).name}.json"
    return run_spec_bench(loaded.model, lambda text: bos + tok.encode(text, add_special_tokens=False).ids,
                          model_name=model, dtype=dtype, proposers=proposers, ks=ks, temperatures=temperatures,
                          max_tokens=max_tokens, workloads=workloads, prompts=style, eos_ids=loaded.eos_ids,
                          repeats=repeats, out_file=out / name, merge=merge, measured_cost=measured_cost,
                          draft_head=draft_head, weights=weights)


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(result["summary"])
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(keys)), 4))
    ax.bar(range(len(keys)), [result["summary"][k]["speedup"] for k in keys],
           color=["tab:blue" if k.startswith("copy") else "tab:orange" for k in keys])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
    ax.set_ylabel("speedup vs plain decode (wall per token)")
    ax.set_title(f"Speculative decoding, {result['model']} {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
