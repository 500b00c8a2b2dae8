"""`kakeya calibrate heads`: which KV heads need the sparse policy's cold tier, measured on synthetic passkey prompts.

For every prompt (the NIAH needle at several lengths and depths), the model reads the context, then the question
one token per step and a few answer tokens greedily; at each of those steps, for every query head of every governed
layer, the full fp32 attention row (exact keys) is split into the mass on the sinks and hot window (what a
streaming head sees) and the mass on the hot set plus the top-k cold blocks the indexer picks (a sparse head).
A KV head takes the cheapest mode whose mass, the mean over steps of the worst query head sharing it, reaches the
target: `streaming` (no cold tier), `sparse` (top-k blocks), else `dense` (every cold block).

Writes the profile the policy loads (`heads=profile`) into the user's cache dir, keyed by the model's
architecture fingerprint, with every score, the settings, the machine and the command.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.niah import MODELS, PromptBuilder
from kakeya_runtime.bench.options import BenchInputError, dtype_of
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.heads import SCHEMA, SCHEMA_VERSION, fingerprint, user_dir
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.kv.sparse import OracleProbe, SparseLayerKV


def calibrate_heads(model: str = "smollm2", *, dtype: str = "bf16", lengths: tuple[int, ...] = (2048, 4096),
                    depths: tuple[float, ...] = (0.1, 0.5, 0.9), sink: int = 4, window: int = 512, block: int = 32,
                    topk: int = 32, target: float = 0.99, answer_tokens: int = 8, seed: int = 7,
                    loaded=None, out: Path | str | None = None, command: str = "") -> dict[str, Any]:
    if loaded is None:
        from kakeya_runtime.models.loader import load_model

        loaded = load_model(model, dtype=dtype_of(dtype))
    cfg = loaded.config
    style = MODELS.get(model, "chat" if loaded.chat_template else "completion")
    builder = PromptBuilder(loaded.tokenizer, style, loaded.bos_id)
    spec = PolicySpec.parse("sparse", {"sink": sink, "window": window, "block": block, "topk": topk,
                                       "codec": "identity"})
    engine, stepper = Engine(loaded.model, prefill_chunk=512), Engine(loaded.model, prefill_chunk=1)
    limit = cfg.max_position_embeddings - answer_tokens - 8
    too_long = [n for n in lengths if n > limit]
    if too_long:  # once cut to the limit silently, with the requested length recorded
        raise BenchInputError(f"lengths {too_long} do not fit {model}'s context ({limit} positions for a prompt)")
    # At most sink + window + topk blocks of history a sparse head attends to everything: no head can show it needs
    # more (a 1,024-token run called every head streaming or sparse, and its profile replaced the shipped one)
    floor = sink + window + topk * block
    too_short = [n for n in lengths if n <= floor]
    if too_short:
        raise BenchInputError(f"lengths {too_short} are too short to tell the head modes apart: a sparse head attends "
                              f"to every position up to sink + window + topk x block = {floor}; give longer ones")
    window_mass: dict[int, list[list[float]]] = {}  # layer -> per step, per query head
    sparse_mass: dict[int, list[list[float]]] = {}
    started = time.time()
    prompts = 0
    for n in lengths:
        for d in depths:
            prompt = builder.build(n, d, random.Random(f"{seed}/{n}/{d}"))
            cache = make_policy_cache(cfg, spec, capacity=prompt.length + answer_tokens + 2, dtype=engine.dtype)
            layers = {i: layer for i, layer in enumerate(cache) if isinstance(layer, SparseLayerKV)}
            for layer in layers.values():
                layer.probe = OracleProbe.new()
            engine.prefill(cache, torch.tensor([prompt.context_ids]))
            for layer in layers.values():
                layer.probe.active = True
            question = torch.tensor([prompt.question_ids])
            stepper.prefill(cache, question[:, :-1])  # one question token per step, each measured
            for _ in engine.stream(cache, question[:, -1:], GenerateRequest(answer_tokens, stop_ids=())):
                pass
            for i, layer in layers.items():
                window_mass.setdefault(i, []).extend(layer.probe.window_masses)
                sparse_mass.setdefault(i, []).extend(layer.probe.masses)
                layer.probe = None
            prompts += 1
    hk, g = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    modes: dict[str, list[str]] = {}
    scores: dict[str, dict[str, list[float]]] = {}
    for i in sorted(window_mass):
        w = _per_kv_head(window_mass[i], hk, g)
        s = _per_kv_head(sparse_mass[i], hk, g)
        modes[str(i)] = ["streaming" if wm >= target else "sparse" if sm >= target else "dense"
                         for wm, sm in zip(w, s, strict=True)]
        scores[str(i)] = {"window_mass": w, "sparse_mass": s}
    heads = [m for ms in modes.values() for m in ms]
    summary = {m: heads.count(m) / len(heads) for m in ("streaming", "sparse", "dense")}
    summary["retrieval_fraction"] = 1 - summary["streaming"]
    summary["cold_bytes_vs_all_heads"] = summary["retrieval_fraction"]  # streaming heads store no cold tier
    summary["by_target"] = {str(t): _modes_at(scores, t) for t in (0.9, 0.95, 0.97, 0.98, 0.99)}
    result = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fingerprint": fingerprint(cfg), "model": model,
        "dtype": dtype, "modes": modes, "scores": scores, "summary": summary,
        "settings": {"lengths": list(lengths), "depths": list(depths), "sink": sink, "window": window, "block": block,
                     "topk": topk, "target": target, "answer_tokens": answer_tokens, "seed": seed, "prompts": prompts,
                     "steps_per_layer": len(next(iter(window_mass.values()))) if window_mass else 0,
                     "style": style},
        "created_unix": int(time.time()), "wall_s": round(time.time() - started, 1), "machine": machine_info(),
        "command": command, "method": __doc__,
    }
    path = Path(out) if out is not None else user_dir() / f"{fingerprint(cfg)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # a server reading the profile never sees half of it
    try:
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    result["path"] = str(path)
    return result


def _per_kv_head(steps: list[list[float]], hk: int, g: int) -> list[float]:
    """Mean over steps of the worst query head in each KV head's group (query head h * g + j shares KV head h)."""
    return [statistics.fmean(min(row[h * g : (h + 1) * g]) for row in steps) for h in range(hk)]


def _modes_at(scores: dict[str, dict[str, list[float]]], target: float) -> dict[str, int]:
    """How many KV heads each mode takes at another target (the same measurements)."""
    out = {"streaming": 0, "sparse": 0, "dense": 0}
    for layer in scores.values():
        for w, s in zip(layer["window_mass"], layer["sparse_mass"], strict=True):
            out["streaming" if w >= target else "sparse" if s >= target else "dense"] += 1
    return out
