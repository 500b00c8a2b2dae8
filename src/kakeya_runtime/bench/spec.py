"""`kakeya bench spec`: speculative decoding against plain decode, same process, same prompts, same run.

Workloads (SmolLM2 chat-formatted): copy-heavy agent turns (quote a tool output; re-emit a file with one change;
reformat a JSON document) and open chat prompts. For each workload, temperature and proposer at each max draft
length K: acceptance (accepted / drafted, seed 004's alpha), mean accepted length per verifier step, tokens per
verifier step, and wall time per generated token against plain decode in the same run (plain and speculative
alternate `repeats` times; each keeps its fastest, the least disturbed on a shared machine). At T = 0 the
speculative tokens are also checked identical to plain decode's (`identical`).

The machine may be shared: each record carries the CPU busy fraction sampled just before it, and the JSON the
machine facts (load average included) at the start and the end. Writes <out>/spec.json and, when matplotlib is
installed, <out>/spec.png.
"""

from __future__ import annotations

import json
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


def chat_prompt(user: str) -> str:
    return (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def _busy() -> float:
    import psutil

    return round(psutil.cpu_percent(interval=0.5) / 100.0, 3)


def _run(engine, ids: list[int], max_tokens: int, temperature: float, seed: int, proposer=None,
         k: int = 0) -> dict[str, Any]:
    from kakeya_runtime.engine.generate import GenerateRequest
    from kakeya_runtime.engine.sampling import SamplingParams
    from kakeya_runtime.engine.speculative import SpeculativeStream

    req = GenerateRequest(max_tokens, SamplingParams(temperature=temperature, seed=seed))
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


def command(model: str, dtype: str, proposers: tuple[str, ...], ks: tuple[int, ...],
            temperatures: tuple[float, ...], max_tokens: int, workloads: tuple[str, ...], threads: int | None,
            out: Path, repeats: int = 2) -> dict[str, Any]:
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.engine.drafts import HistoryLookup
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadProposer, LayerSkipDraft
    from kakeya_runtime.models.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
    engine = Engine(loaded.model)
    head = DraftHead(loaded.model)
    make = {"history": HistoryLookup, "self": lambda: LayerSkipDraft(loaded.model),
            "draft_head": lambda: DraftHeadProposer(head)}
    started = machine_info()
    records: list[dict[str, Any]] = []
    for name in workloads:
        kind, user = WORKLOADS[name]
        ids = loaded.tokenizer.encode(chat_prompt(user), add_special_tokens=False).ids
        _run(engine, ids, 8, 0.0, 0)  # warm up this prompt length's shapes
        for temperature in temperatures:
            for proposer in proposers:
                for k in ks:
                    busy = _busy()
                    # Alternate plain and speculative runs and keep each one's fastest: on a shared machine the
                    # minimum is the least disturbed measurement (the tokens are the same every repeat).
                    bases, specs = [], []
                    for _ in range(repeats):
                        bases.append(_run(engine, ids, max_tokens, temperature, seed=1))
                        specs.append(_run(engine, ids, max_tokens, temperature, seed=1, proposer=make[proposer](),
                                          k=k))
                    base = min(bases, key=lambda r: r["s_per_token"])
                    spec = min(specs, key=lambda r: r["s_per_token"])
                    rec = {"workload": name, "kind": kind, "temperature": temperature, "proposer": proposer, "k": k,
                           "prompt_tokens": len(ids), "cpu_busy_before": busy,
                           "plain_s_per_token": round(base["s_per_token"], 5),
                           "spec_s_per_token": round(spec["s_per_token"], 5),
                           "speedup": round(base["s_per_token"] / spec["s_per_token"], 3),
                           **{key: spec[key] for key in ("drafted", "accepted", "verifier_steps", "plain_steps",
                                                         "pauses", "acceptance", "mean_accepted",
                                                         "tokens_per_verifier_step", "decode_tokens")}}
                    if temperature == 0.0:
                        rec["identical"] = base["tokens"] == spec["tokens"]
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
    summary: dict[str, Any] = {}
    for kind in ("copy", "chat"):
        for temperature in temperatures:
            for proposer in proposers:
                for k in ks:
                    rows = [r for r in records if r["kind"] == kind and r["temperature"] == temperature
                            and r["proposer"] == proposer and r["k"] == k]
                    if rows:
                        plain = sum(r["plain_s_per_token"] for r in rows)
                        spec = sum(r["spec_s_per_token"] for r in rows)
                        summary[f"{kind}/T={temperature}/{proposer}/K={k}"] = {
                            "speedup": round(plain / spec, 3),
                            "min_speedup": min(r["speedup"] for r in rows),
                            "acceptance": round(sum(r["accepted"] for r in rows) / max(1, sum(r["drafted"] for r in rows)), 4),
                        }
    result = {"model": model, "dtype": dtype, "max_tokens": max_tokens, "repeats": repeats,
              "threads": torch.get_num_threads(), "machine_start": started,
              "machine_end": machine_info(), "summary": summary, "records": records,
              "note": "wall time per generated token after the first (decode only); plain and speculative runs "
                      "alternate `repeats` times and each keeps its fastest; cpu_busy_before is the whole machine's CPU use over 0.5 s "
                      "(other processes included)"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(result, indent=1))
    _plot(result, out / "spec.png")
    return result


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
