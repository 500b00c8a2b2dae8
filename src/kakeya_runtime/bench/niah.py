"""NIAH ladder (seed 000 §11.12): needle recall of each KV policy against the full-attention oracle.

RULER-style single needle: a random 7-digit number ("One of the special magic numbers for {key} is:
{value}.") planted at a relative depth in RULER's noise filler, scored by case-insensitive substring
recall of the value in the greedy continuation (no judge model). Seeded; depth x length grid; N samples
per cell; SmolLM2 is chat-prompted (ChatML), Gemma 3 270M (a base model) completion-prompted.

Every sample runs as a two-turn session: a context turn (the instruction and the haystack, prefill
only; the turn then ends, so restore per_turn drops its restored K/V and idle configurations compress),
then a question turn (question + answer prefix, greedy generation). The question turn is what is
measured: TTFT (including restoration / decompression), decode tok/s, sustained KV bytes after the turn,
per-step peak (the cache's own K/V accounting, plus the process's peak RSS delta over the turn: VmHWM
reset through /proc/self/clear_refs, so the peak covers only the turn). Context turns are shared only
where the computation is provably the same: idle configurations resume the full run's context state
(state()/load_state, then compress_idle/decompress), and restore per_turn resumes restore per_step's
(identical caches).

`kakeya bench niah` (register_niah) writes `niah.json` (schema_version, machine), one recall heatmap
PNG per configuration and `summary.md` under the output directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kakeya_runtime.bench.machine import current_rss_bytes, machine_info, peak_rss_bytes, reset_peak_rss
from kakeya_runtime.bench.options import dtype_of
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.proposers import same_checkpoint_proposer
from kakeya_runtime.kv.policy import (
    CodecSpec,
    PolicySpec,
    check_head_profile,
    compress_idle,
    decompress,
    make_policy_cache,
)
from kakeya_runtime.kv.spec import SPARSE_BUDGET

SCHEMA = "kakeya.bench.niah"
SCHEMA_VERSION = 1

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
KEYS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
        "lagoon", "meadow", "nimbus", "orchid", "pebble", "quartz", "raven", "saffron", "tundra", "umber",
        "violet", "willow", "zephyr")


@dataclass(slots=True, frozen=True)
class NiahConfig:
    """One column of the ladder: a policy, plus an optional codec applied while the session is idle."""

    key: str
    policy: PolicySpec
    idle: CodecSpec | None = None


def standard_configs(sink: int = 4, window: int = 64, qs: Sequence[int] = (38, 10),
                     sparse: dict[str, float | str] | None = None) -> dict[str, NiahConfig]:
    """full; full + idle lattice at each Q; sink_window and restore (both granularities) at sink+window;
    sink_window and restore per_turn with a lattice-coded resident cache at each Q; sparse with its own hot
    window, block and top-k (`sparse`), cold tier d4 at each Q and bf16 (identity)."""
    sw = {"sink": sink, "window": window}
    out = {"full": NiahConfig("full", PolicySpec.parse("full"))}
    for q in qs:
        out[f"full+idle-d4q{q}"] = NiahConfig(f"full+idle-d4q{q}", PolicySpec.parse("full"), CodecSpec("d4", q))
    out["sink_window"] = NiahConfig("sink_window", PolicySpec.parse("sink_window", sw))
    for q in qs:
        key = f"sink_window-d4q{q}"
        out[key] = NiahConfig(key, PolicySpec.parse("sink_window", {**sw, "codec": "d4", "q": q}))
    out["restore-per_step"] = NiahConfig("restore-per_step", PolicySpec.parse("restore", {**sw, "granularity": "per_step"}))
    out["restore-per_turn"] = NiahConfig("restore-per_turn", PolicySpec.parse("restore", {**sw, "granularity": "per_turn"}))
    for q in qs:
        key = f"restore-per_turn-d4q{q}"
        out[key] = NiahConfig(key, PolicySpec.parse("restore", {**sw, "granularity": "per_turn", "codec": "d4",
                                                                "q": q}))
    sp = {"sink": sink, **SPARSE, **(sparse or {})}
    for q in qs:
        out[f"sparse-d4q{q}"] = NiahConfig(f"sparse-d4q{q}", PolicySpec.parse("sparse", {**sp, "codec": "d4", "q": q}))
    out["sparse-identity"] = NiahConfig("sparse-identity", PolicySpec.parse("sparse", {**sp, "codec": "identity"}))
    return out


SPARSE = {"window": 512, "block": 32, "topk": 32, "budget": SPARSE_BUDGET}  # the sparse columns' defaults (the policy's own)


# -- prompts ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Prompt:
    context_ids: list[int]
    question_ids: list[int]
    key: str
    value: str
    depth: float
    needle_token: int  # approximate token index of the needle in the context

    @property
    def length(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


class PromptBuilder:
    """Builds prompts of a target total token length for one tokenizer and prompt style."""

    def __init__(self, tokenizer, style: str, bos_id: int | None = None) -> None:
        if style not in ("chat", "completion"):
            raise ValueError(f"prompt style must be chat or completion, got {style!r}")
        self.tok, self.style, self.bos_id = tokenizer, style, bos_id
        self._noise_tokens = len(self._encode(NOISE * 20)) / 20

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _frame(self, key: str) -> tuple[str, str]:
        question = f"What is the special magic number for {key} mentioned in the provided text?"
        answer = f"The special magic number for {key} mentioned in the provided text is"
        if self.style == "chat":
            head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + INSTRUCTION
            tail = f"\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}"
        else:
            head = INSTRUCTION
            tail = f"\n\nQuestion: {question}\nAnswer: {answer}"
        return head, tail

    def build(self, length: int, depth: float, rng: random.Random) -> Prompt:
        key = rng.choice(KEYS)
        value = str(rng.randint(1_000_000, 9_999_999))
        needle = f"One of the special magic numbers for {key} is: {value}. "
        head, tail = self._frame(key)
        fixed = len(self._encode(head)) + len(self._encode(tail)) + len(self._encode(needle)) + 1
        sentences = [s + "." for s in NOISE.split(".") if s.strip()]
        per_sentence = self._noise_tokens / len(sentences)
        n = max(1, round((length - fixed) / per_sentence))
        filler = [sentences[i % len(sentences)].strip() + " " for i in range(n)]
        # Trim or pad until the token count is at or just under the target.
        while True:
            at = round(depth * len(filler))
            text = "".join(filler[:at]) + needle + "".join(filler[at:])
            context = self._encode(head + text)
            question = self._encode(tail)
            total = len(context) + len(question) + (self.bos_id is not None and self.style == "completion")
            if total <= length or len(filler) <= 1:
                break
            filler.pop()
        if self.style == "completion" and self.bos_id is not None:
            context = [self.bos_id, *context]
        needle_token = len(self._encode(head + "".join(filler[:at])))
        return Prompt(context, question, key, value, depth, needle_token)


def score(text: str, value: str) -> bool:
    """RULER string-match: case-insensitive substring recall."""
    return value.lower() in text.lower()


# -- one run ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    tokens: list[int]
    text: str
    recall: bool
    context_s: float | None  # None where the context turn was resumed from another configuration's
    ttft_s: float
    decode_tok_s: float | None  # None: a single generated token, so no decode rate
    turn_s: float
    restore_s: float  # proposer time (restore) or decompression time (idle) inside the question turn
    eaf: float
    idle_kv_bytes: int  # between the turns
    sustained_kv_bytes: int  # after the question turn
    decoded_kv_bytes: int  # of which decoded copies kept to speed up reads (sparse with a lattice cold tier)
    history_bytes: int
    peak_kv_bytes: int  # resident + the largest transient K/V during the question turn
    peak_rss_delta_bytes: int | None
    top2_gaps: list[float]  # per step: logit of the greedy token minus the runner-up's
    step_logits: list[torch.Tensor]  # per step (1, V) fp32; not written out, used by divergence()


RECORD_FIELDS = tuple(f for f in Run.__slots__ if f != "step_logits")


def divergence(run: Run, full: Run) -> dict[str, Any] | None:
    """Where `run`'s greedy tokens first leave the oracle's, and how close a call it was there: full's logit
    lead of its own token over the one `run` chose (a near-tie is a lead small against full's median
    top-1/top-2 gap), and `run`'s lead the other way. None when the tokens are identical."""
    for i, (mine, oracle) in enumerate(zip(run.tokens, full.tokens, strict=False)):
        if mine != oracle:
            ref, own = full.step_logits[i][0], run.step_logits[i][0]
            return {"step": i, "full_lead": float(ref[oracle] - ref[mine]), "own_lead": float(own[mine] - own[oracle]),
                    "full_median_gap": statistics.median(full.top2_gaps)}
    return None


class NiahRunner:
    """Runs one prompt through each configuration on one model."""

    def __init__(self, loaded, *, max_new_tokens: int, prefill_chunk: int = 512) -> None:
        self.loaded = loaded
        self.engine = Engine(loaded.model, prefill_chunk=prefill_chunk)
        self.max_new_tokens = max_new_tokens
        self.stop_ids = tuple(loaded.eos_ids)
        self._proposers: dict[int, Any] = {}

    def _cache(self, policy: PolicySpec, capacity: int):
        cfg = self.loaded.config
        proposer = None
        if policy.name == "restore":
            proposer = self._proposers.setdefault(policy.chunk, same_checkpoint_proposer(self.loaded.model,
                                                                                         chunk=policy.chunk))
        return make_policy_cache(cfg, policy, capacity=capacity, dtype=self.engine.dtype, device=self.engine.device,
                                 proposer=proposer)

    def run_prompt(self, prompt: Prompt, configs: Sequence[NiahConfig]) -> dict[str, Run]:
        capacity = min(self.loaded.config.max_position_embeddings, prompt.length + self.max_new_tokens + 8)
        ctx = torch.tensor([prompt.context_ids], dtype=torch.long)
        question = torch.tensor([prompt.question_ids], dtype=torch.long)
        runs: dict[str, Run] = {}
        snapshots: dict[str, tuple[list, float]] = {}  # policy label -> (state after the context turn, seconds)
        for cfg in configs:
            cache = self._cache(cfg.policy, capacity)
            shared = snapshots.get(_context_key(cfg.policy))
            if shared is not None:
                cache.load_state(shared[0])
                context_s = None
            else:
                t0 = time.perf_counter()
                self.engine.prefill(cache, ctx)
                cache.end_turn()
                context_s = time.perf_counter() - t0
                if any(_context_key(c.policy) == _context_key(cfg.policy) for c in configs if c is not cfg):
                    snapshots[_context_key(cfg.policy)] = (cache.state(), context_s)
            runs[cfg.key] = self._question_turn(cache, question, prompt, cfg, context_s)
        return runs

    def _question_turn(self, cache, question, prompt: Prompt, cfg: NiahConfig, context_s: float | None) -> Run:
        resume_s = 0.0
        if cfg.idle is not None:
            compress_idle(cache, cfg.idle)
        idle_bytes = cache.nbytes
        cache.reset_stats()
        _trim_heap()
        rss_ok = reset_peak_rss()
        rss0 = current_rss_bytes()
        t0 = time.perf_counter()
        if cfg.idle is not None:
            decompress(cache)
            resume_s = time.perf_counter() - t0
        proposer_s0 = getattr(cache, "proposer_s", 0.0)
        stream = self.engine.stream(cache, question, GenerateRequest(self.max_new_tokens, stop_ids=self.stop_ids,
                                                                     keep_logits=True))
        for _ in stream:
            pass
        result = stream.result
        assert result is not None
        turn_s = time.perf_counter() - t0
        peak_rss = peak_rss_bytes() - rss0 if rss_ok else None
        tokens = result.token_ids[0]
        text = self.loaded.tokenizer.decode(tokens)
        n = len(tokens)
        return Run(
            tokens=tokens, text=text, recall=score(text, prompt.value), context_s=context_s,
            ttft_s=resume_s + result.ttft_s,
            decode_tok_s=(n - 1) / result.decode_s if n > 1 and result.decode_s > 0 else None,  # None: one token
            turn_s=turn_s, restore_s=resume_s + getattr(cache, "proposer_s", 0.0) - proposer_s0,
            eaf=cache.effective_attention_fraction, idle_kv_bytes=idle_bytes,
            sustained_kv_bytes=cache.resident_nbytes, history_bytes=cache.history_nbytes,
            decoded_kv_bytes=getattr(cache, "memory_stats", dict)().get("decoded_bytes", 0),
            peak_kv_bytes=cache.resident_nbytes + cache.peak_transient_bytes, peak_rss_delta_bytes=peak_rss,
            top2_gaps=[float(g[0] - g[1]) for g in (lg[0].topk(2).values for lg in stream.step_logits)],
            step_logits=stream.step_logits,
        )


def pin_malloc() -> bool:
    """glibc only: a fixed 128 KiB mmap threshold, so every sizeable tensor is mmapped and its pages go
    back to the OS when freed (the default threshold adapts upward and keeps freed blocks in the heap).
    Then RSS follows live memory, and a turn's VmHWM delta is its transient peak. Process-wide."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 128 * 1024)) and bool(libc.mallopt(m_trim_threshold, 128 * 1024))


def _trim_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _context_key(policy: PolicySpec) -> str:
    """Configurations whose context turn is the same computation share it (full with its idle variants;
    restore per_step with per_turn, same resident codec)."""
    if policy.name == "restore":
        return f"restore({policy.sink}+{policy.window}, {policy.codec.label})"
    return policy.label


# -- the ladder ---------------------------------------------------------------------------------------


SMALL = dict(lengths=(288,), depths=(0.5,), samples=1)  # CI: one cell, every configuration
DEFAULT_OUT = "results/niah/latest"
MODELS = {"smollm2": "chat", "gemma3-270m": "completion"}


def run_niah(model: str = "smollm2", *, lengths: Sequence[int] = (1024, 2048, 4096, 7680),
             depths: Sequence[float] = (0.1, 0.5, 0.9), samples: int = 2,
             configs: Sequence[str] | None = None, sink: int = 4, window: int = 64, qs: Sequence[int] = (38, 10),
             seed: int = 42, max_new_tokens: int = 10, dtype: str = "fp32", threads: int | None = None,
             per_step_max_length: int | None = None, small: bool = False, out_dir: Path | str | None = None,
             loaded=None, progress: bool = True, memory: bool = False,
             sparse: dict[str, float | str] | None = None) -> dict[str, Any]:
    """Run the ladder; return (and, with `out_dir`, write) the evidence dict. `memory` pins glibc's mmap
    threshold so the RSS column is exact; it slows allocation-heavy steps, so time with it off."""
    if small:
        lengths, depths, samples = SMALL["lengths"], SMALL["depths"], SMALL["samples"]
    if threads:
        torch.set_num_threads(threads)
    malloc_pinned = pin_malloc() if memory else False
    from kakeya_runtime.bench.sparse import cpu_busy

    sparse = {**SPARSE, **(sparse or {})}
    if small:  # the CI cell is short: a sparse window that still leaves cold blocks to select
        sparse = {"window": 64, "block": 16, "topk": 4}
    table = standard_configs(sink, window, qs, sparse)
    keys = list(configs) if configs else list(table)
    unknown = [k for k in keys if k not in table]
    if unknown:  # before the model loads
        raise NiahConfigError(f"unknown NIAH configuration(s) {unknown} (known: {list(table)})")
    busy = cpu_busy()  # other work on the machine skews the timing columns
    if loaded is None:
        from kakeya_runtime.models.loader import load_model

        loaded = load_model(model, dtype=dtype_of(dtype))
    style = MODELS.get(model, "chat" if loaded.chat_template else "completion")
    if "full" in keys:
        keys.remove("full")
        keys.insert(0, "full")  # first: everything is compared against it
    limit = loaded.config.max_position_embeddings - max_new_tokens - 8
    if max(lengths, default=0) > limit:
        raise NiahConfigError(f"length {max(lengths)} does not fit {model}'s context of "
                              f"{loaded.config.max_position_embeddings} positions with {max_new_tokens} new tokens: at "
                              f"most {limit}")
    # heads=profile names the profile it ran with (profile:<digest>, in the JSON's configs)
    table = {k: dataclasses.replace(c, policy=check_head_profile(loaded.config, c.policy)) for k, c in table.items()}
    builder = PromptBuilder(loaded.tokenizer, style, loaded.bos_id)
    runner = NiahRunner(loaded, max_new_tokens=max_new_tokens)
    records: list[dict[str, Any]] = []
    cells = [(n, d, s) for n in lengths for d in depths for s in range(samples)]
    started = time.time()
    with _progress(progress) as bar:
        task = bar.add_task(f"NIAH {model}", total=len(cells) * len(keys)) if bar else None
        for n, d, s in cells:
            prompt = builder.build(n, d, random.Random(f"{seed}/{n}/{d}/{s}"))
            wanted = [table[k] for k in keys
                      if not (k == "restore-per_step" and per_step_max_length and n > per_step_max_length)]
            runs = runner.run_prompt(prompt, wanted)
            full = runs.get("full")
            for key, run in runs.items():
                rec = {"config": key, "policy": table[key].policy.label, "length": n, "prompt_tokens": prompt.length,
                       "loadavg_1m": os.getloadavg()[0],  # other work on the machine skews timings
                       "depth": d, "sample": s, "needle_token": prompt.needle_token, "value": prompt.value,
                       **{f: getattr(run, f) for f in RECORD_FIELDS}}
                if full is not None:
                    rec["agreement"] = _agreement(run.tokens, full.tokens)
                    rec["identical"] = run.tokens == full.tokens
                    rec["divergence"] = divergence(run, full)
                records.append(rec)
                if out_dir is not None:  # progress that survives an interrupted ladder
                    Path(out_dir).mkdir(parents=True, exist_ok=True)
                    with open(Path(out_dir) / "records.partial.jsonl", "a") as f:
                        f.write(json.dumps(rec, default=str) + "\n")
            if bar:
                bar.update(task, advance=len(keys), description=f"NIAH {model} {n} tok, depth {d:.2f}")
    result = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created_unix": int(time.time()),
        "wall_s": round(time.time() - started, 1), "machine": machine_info(), "cpu_busy_before": busy,
        "command": " ".join(sys.argv),
        "model": {"name": model, "style": style, "dtype": dtype, "layers": loaded.config.num_hidden_layers,
                  "governed_layers": sum(loaded.config.layer_window(i) is None
                                         for i in range(loaded.config.num_hidden_layers)),
                  "max_positions": loaded.config.max_position_embeddings},
        "ladder": {"lengths": list(lengths), "depths": list(depths), "samples": samples, "seed": seed,
                   "max_new_tokens": max_new_tokens, "sink": sink, "window": window, "qs": list(qs),
                   "sparse": sparse,
                   "per_step_max_length": per_step_max_length, "threads": torch.get_num_threads(),
                   "malloc_pinned": malloc_pinned,
                   "scoring": "RULER string match: case-insensitive substring of the 7-digit value"},
        "configs": {k: {"policy": table[k].policy.label, "params": table[k].policy.params,
                        "idle_codec": table[k].idle.label if table[k].idle else None} for k in keys},
        "cells": summarize(records, keys),
        "rungs": rungs(records, keys),
        "records": records,
        "method": __doc__,
    }
    if out_dir is not None:
        write_outputs(result, Path(out_dir))
        (Path(out_dir) / "records.partial.jsonl").unlink(missing_ok=True)
    return result


def _agreement(tokens: list[int], ref: list[int]) -> float:
    """Fraction of the reference's greedy tokens reproduced position by position."""
    if not ref:
        return 1.0
    return sum(a == b for a, b in zip(tokens, ref, strict=False)) / len(ref)


def summarize(records: list[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (config, length, depth) cell, with deltas and ratios against full."""
    by_cell: dict[tuple, list[dict]] = {}
    for r in records:
        by_cell.setdefault((r["config"], r["length"], r["depth"]), []).append(r)
    rows = []
    for (key, n, d), rs in sorted(by_cell.items(), key=lambda kv: (keys.index(kv[0][0]), kv[0][1], kv[0][2])):
        full = by_cell.get(("full", n, d))
        row = {"config": key, "length": n, "depth": d, "samples": len(rs),
               "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in rs)),
               "recall": _mean(rs, "recall"), "ttft_s": _mean(rs, "ttft_s"), "decode_tok_s": _mean(rs, "decode_tok_s"),
               "turn_s": _mean(rs, "turn_s"), "restore_s": _mean(rs, "restore_s"), "eaf": _mean(rs, "eaf"),
               "idle_kv_bytes": max(r["idle_kv_bytes"] for r in rs),
               "sustained_kv_bytes": max(r["sustained_kv_bytes"] for r in rs),
               "decoded_kv_bytes": max(r.get("decoded_kv_bytes", 0) for r in rs),
               "history_bytes": max(r["history_bytes"] for r in rs),
               "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
               "peak_rss_delta_bytes": max((r["peak_rss_delta_bytes"] or 0) for r in rs)}
        if full:
            row["delta_recall"] = row["recall"] - _mean(full, "recall")
            row["agreement"] = _mean(rs, "agreement")
            row["identical"] = _mean(rs, "identical")
            row["decode_ratio_vs_full"] = _ratio(row["decode_tok_s"], _mean(full, "decode_tok_s"))
            row["ttft_ratio_vs_full"] = _ratio(row["ttft_s"], _mean(full, "ttft_s"))
            row["turn_ratio_vs_full"] = _ratio(row["turn_s"], _mean(full, "turn_s"))
        rows.append(row)
    return rows


def rungs(records: list[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Per length and configuration (over depths and samples): recall, Δ recall, token identity, and the
    question turn's cost against full: TTFT, decode tok/s and whole-turn time ratios, and the restoration
    time itself (proposer forward for restore, decompression for idle configurations)."""
    out = []
    lengths = sorted({r["length"] for r in records})
    for n in lengths:
        full = [r for r in records if r["length"] == n and r["config"] == "full"]
        for key in keys:
            rs = [r for r in records if r["length"] == n and r["config"] == key]
            if not rs:
                continue
            row = {"length": n, "config": key, "samples": len(rs), "recall": _mean(rs, "recall"),
                   "ttft_s": _mean(rs, "ttft_s"), "decode_tok_s": _mean(rs, "decode_tok_s"),
                   "turn_s": _mean(rs, "turn_s"), "restore_s": _mean(rs, "restore_s"),
                   "sustained_kv_bytes": max(r["sustained_kv_bytes"] for r in rs),
                   "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs)}
            if full:
                row.update(
                    delta_recall=row["recall"] - _mean(full, "recall"), identical=_mean(rs, "identical"),
                    ttft_ratio_vs_full=_ratio(row["ttft_s"], _mean(full, "ttft_s")),
                    decode_ratio_vs_full=_ratio(row["decode_tok_s"], _mean(full, "decode_tok_s")),
                    turn_ratio_vs_full=_ratio(row["turn_s"], _mean(full, "turn_s")),
                    full_kv_bytes=max(r["sustained_kv_bytes"] for r in full))
                leads = [r["divergence"]["full_lead"] for r in rs if r.get("divergence")]
                row.update(divergences=len(leads), max_divergence_full_lead=max(leads, default=None))
            out.append(row)
    return out


def _mean(rs: list[dict], key: str) -> float | None:
    """The mean of the values present (None when there are none: a rate a run could not measure)."""
    vals = [float(r[key]) for r in rs if r[key] is not None]
    return float(statistics.mean(vals)) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- outputs ------------------------------------------------------------------------------------------


def rewrite_outputs(out: Path | str) -> dict[str, Any]:
    """Recompute the summaries, heatmaps and summary.md of an existing niah.json (no model runs)."""
    out = Path(out)
    result = json.loads((out / "niah.json").read_text())
    keys = list(result["configs"])
    result["cells"] = summarize(result["records"], keys)
    result["rungs"] = rungs(result["records"], keys)
    write_outputs(result, out)
    return result


def write_outputs(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "niah.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot_heatmaps(result, out)
    (out / "summary.md").write_text(summary_markdown(result))


def plot_heatmaps(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = result["ladder"]["lengths"], result["ladder"]["depths"]
    paths = []
    for key in result["configs"]:
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for row in result["cells"]:
            if row["config"] == key:
                grid[depths.index(row["depth"])][lengths.index(row["length"])] = row["recall"]
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.0 + 0.55 * len(depths)))
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context tokens")
        ax.set_ylabel("needle depth")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=9)
        ax.set_title(f"{result['model']['name']}: {result['configs'][key]['policy']}"
                     + (f" idle {result['configs'][key]['idle_codec']}" if result["configs"][key]["idle_codec"] else ""),
                     fontsize=9)
        fig.tight_layout()
        path = out / f"heatmap_{key.replace('+', '_').replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def summary_markdown(result: dict[str, Any]) -> str:
    """Per configuration and length (averaged over depths)."""
    m, lad = result["model"], result["ladder"]
    lines = [f"# NIAH ladder: {m['name']} ({m['dtype']}, {m['style']} prompt)", "",
             f"sink {lad['sink']} + window {lad['window']}; depths {lad['depths']}; {lad['samples']} sample(s) per "
             f"cell; seed {lad['seed']}; greedy, {lad['max_new_tokens']} new tokens; {lad['threads']} thread(s); "
             f"machine: {result['machine']['cpu_model']}; wall {result['wall_s']} s"
             + (f"; CPU busy before the run {result['cpu_busy_before']:.0%}" if "cpu_busy_before" in result else "")
             + ".", "",
             "| config | tokens | recall | Δ vs full | identical to full | agreement | EAF | TTFT s | decode tok/s "
             "| turn time / full | idle KV | sustained KV | peak KV (step) | peak RSS Δ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for row in result["cells"]:
        groups.setdefault((row["config"], row["length"]), []).append(row)
    for (key, _n), rows in sorted(groups.items(), key=lambda kv: (list(result["configs"]).index(kv[0][0]), kv[0][1])):
        def avg(f, rows=rows):
            vals = [r[f] for r in rows if r.get(f) is not None]
            return statistics.mean(vals) if vals else None
        lines.append(
            f"| {key} | {round(avg('prompt_tokens'))} | {avg('recall'):.2f} | {_fmt(avg('delta_recall'), '+.2f')} "
            f"| {_fmt(avg('identical'), '.2f')} | {_fmt(avg('agreement'), '.2f')} | {avg('eaf'):.3f} "
            f"| {avg('ttft_s'):.2f} | {_fmt(avg('decode_tok_s'), '.1f')} | {_fmt(avg('turn_ratio_vs_full'), '.2f')} "
            f"| {_bytes(max(r['idle_kv_bytes'] for r in rows))} "
            f"| {_bytes(max(r['sustained_kv_bytes'] for r in rows))} | {_bytes(max(r['peak_kv_bytes'] for r in rows))} "
            f"| {_bytes(max(r['peak_rss_delta_bytes'] for r in rows))} |")
    restore_keys = [k for k in result["configs"] if k.startswith("restore")]
    if "full" in result["configs"] and restore_keys:
        lines += ["", "## Restoration cost per rung (question turn, against full)", "",
                  "| length | config | TTFT s (full) | TTFT ratio | decode tok/s ratio | turn time ratio "
                  "| proposer s / turn |", "|---|---|---|---|---|---|---|"]
        full_ttft = {r["length"]: r["ttft_s"] for r in result["rungs"] if r["config"] == "full"}
        for r in result["rungs"]:
            if r["config"] in restore_keys:
                lines.append(f"| {r['length']} | {r['config']} | {r['ttft_s']:.2f} ({full_ttft.get(r['length'], 0):.2f}) "
                             f"| {_fmt(r.get('ttft_ratio_vs_full'), '.1f')} | {_fmt(r.get('decode_ratio_vs_full'), '.2f')} "
                             f"| {_fmt(r.get('turn_ratio_vs_full'), '.1f')} | {r['restore_s']:.2f} |")
    diverged = [r for r in result["records"] if r.get("divergence")]
    if diverged:
        lines += ["", "## Greedy divergences from full (is each a near-tie?)", "",
                  "Where a configuration's greedy tokens first differ from full's: full's logit lead of its own token "
                  "over the one the configuration chose, against full's median top-1/top-2 gap on that sample.", "",
                  "| config | length | depth | sample | step | full's lead | config's lead | full's median gap |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in diverged:
            d = r["divergence"]
            lines.append(f"| {r['config']} | {r['length']} | {r['depth']} | {r['sample']} | {d['step']} "
                         f"| {d['full_lead']:.3f} | {d['own_lead']:.3f} | {d['full_median_gap']:.2f} |")
    lines += ["", "Idle KV: K/V bytes held between the two turns (packed for the idle-compressed configurations). "
              "Sustained KV: resident K/V bytes after the question turn (full: its allocated storage; restore "
              "also keeps the token ids, `history_bytes` in niah.json, 4 bytes/token). Peak KV (step): resident + "
              "the largest transient K/V (restored, or decoded for a step) held during the question turn, as the "
              "cache accounts it. Peak RSS Δ: the process's peak RSS over the question turn (VmHWM, reset just "
              "before it) minus its RSS at the start; activations included"
              + (" (glibc mmap threshold pinned so freed tensors leave RSS)." if lad.get("malloc_pinned") else
                 " (allocator not pinned: freed heap blocks may hide growth; treat as a lower bound)."), ""]
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


class NiahConfigError(ValueError):
    """A configuration name the ladder does not know."""


# -- CLI ------------------------------------------------------------------------------------------------


def register_niah(bench_app) -> None:
    """Add `niah` to a typer app (the lead wires it as `kakeya bench niah`)."""
    import typer

    from kakeya_runtime.bench.options import answers_bad_input, csv, floats_in, positive_ints

    @bench_app.command("niah")
    @answers_bad_input
    def niah(
        model: str = typer.Option("smollm2", help="bundled model: smollm2 (chat) or gemma3-270m (completion)"),
        lengths: str = typer.Option("1024,2048,4096,7680", help="comma-separated context lengths (tokens)"),
        depths: str = typer.Option("0.1,0.5,0.9", help="comma-separated needle depths in [0, 1]"),
        samples: int = typer.Option(2, min=1, help="samples per (length, depth) cell"),
        configs: str = typer.Option("", help="comma-separated configurations (default: all)"),
        sink: int = typer.Option(4), window: int = typer.Option(64),
        sparse_window: int = typer.Option(SPARSE["window"], help="the sparse columns' hot window"),
        block: int = typer.Option(SPARSE["block"], help="the sparse columns' cold block size"),
        topk: int = typer.Option(SPARSE["topk"], help="the sparse columns' selected blocks per query (at least)"),
        budget: float = typer.Option(SPARSE["budget"], help="the sparse columns' share of the selectable blocks"),
        heads: str = typer.Option("all", help="the sparse columns' heads: all, or profile (the model's head profile)"),
        qs: str = typer.Option("38,10", help="lattice ranges Q for the packed-lattice configurations"),
        seed: int = typer.Option(42), max_new_tokens: int = typer.Option(10, min=1),
        dtype: str = typer.Option("fp32", help="fp32 (restore == full bit-exact) or bf16"),
        threads: int = typer.Option(0, min=0, help="torch threads (0: leave torch's default)"),
        per_step_max_length: int = typer.Option(0, min=0, help="skip restore per_step above this length (0: never)"),
        memory: bool = typer.Option(False, "--memory", help="pin malloc so peak RSS is exact (slower timings)"),
        small: bool = typer.Option(False, "--small", help="the CI ladder: one short cell, every configuration"),
        out: str = typer.Option(DEFAULT_OUT, help="output directory"),
    ) -> None:
        """Needle-in-a-haystack recall of each KV policy against the full-attention oracle."""
        out_dir = Path(out)
        result = run_niah(
            model, lengths=list(positive_ints(lengths, "--lengths")), depths=list(floats_in(depths, "--depths", 0.0, 1.0)),
            samples=samples, configs=list(csv(configs)) or None, sink=sink, window=window,
            qs=list(positive_ints(qs, "--qs")), seed=seed, max_new_tokens=max_new_tokens, dtype=dtype,
            threads=threads or None, per_step_max_length=per_step_max_length or None, small=small, out_dir=out_dir,
            memory=memory, sparse={"window": sparse_window, "block": block, "topk": topk, "budget": budget,
                                   "heads": heads})
        typer.echo((out_dir / "summary.md").read_text())
        typer.echo(f"wrote {out_dir / 'niah.json'} ({len(result['records'])} runs)")
