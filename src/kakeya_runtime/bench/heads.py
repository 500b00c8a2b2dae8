"""`kakeya calibrate heads`: which KV heads need the sparse policy's cold tier, measured on synthetic passkey prompts.

For every prompt (the NIAH needle at several lengths and depths), the model reads the context, then the question
one token per step and a few answer tokens greedily; and for real text (`calibration_text`, as long as each
length), it reads the text, then the text's next `text_steps` tokens one per step. At each of those steps, for every query head of every governed
layer, the full fp32 attention row (exact keys) is split into the mass on the sinks and hot window (what a
streaming head sees) and the mass on the hot set plus the top-k cold blocks the indexer picks (a sparse head).
A KV head takes the cheapest mode whose mass, the mean over steps of the worst query head sharing it, reaches the
target: `streaming` (no cold tier), `sparse` (top-k blocks), else `dense` (every cold block).

Fitted (the default): every head that is not streaming is sparse with its own block count: `floor` x topk at least
(topk by default) and `mean` x topk on average (1.25: a quarter more cold keys a step than top-k for every head).
From the same steps, each head's mass curve (its query heads' mean mass with k = 0, 1, ... blocks taken in the
indexer's order: what keeping k blocks gets it; a step with fewer blocks to pick holds its last value) is averaged
over steps, and the blocks above the floor go one at a time to the head whose curve gains most: spread heads get
more, focused ones none. With the floor at topk a head's blocks are a superset of what top-k for every head keeps
(the same ranking, more of it), so nothing it recalls is lost. Mass is not recall: fitted on mass down to 6 blocks
(floor 2), or to 24 with the same total, SmolLM2 lost a needle at 7.7k that top-32 for every head keeps (the one head
carrying it, in layer 18, needed more than 16 blocks for the indexer to reach the needle's block).

Writes the profile the policy loads (`heads=profile`) into the user's cache dir, keyed by the model's
architecture fingerprint, with every score, the settings, the machine and the command.
"""

from __future__ import annotations

import json
import math
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
from kakeya_runtime.bench.sparse import probed_prefill
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.heads import SCHEMA, SCHEMA_VERSION, fingerprint, user_dir
from kakeya_runtime.kv.policy import PolicySpec


def calibrate_heads(model: str = "smollm2", *, dtype: str = "bf16", lengths: tuple[int, ...] = (2048, 4096),
                    depths: tuple[float, ...] = (0.1, 0.5, 0.9), sink: int = 4, window: int = 512, block: int = 32,
                    topk: int = 32, target: float = 0.99, answer_tokens: int = 8, seed: int = 7, fit: bool = True,
                    floor: float = 1.0, mean: float = 1.25, text_steps: int = 64, loaded=None,
                    out: Path | str | None = None,
                    command: str = "") -> dict[str, Any]:
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
    reach = sink + window + topk * block
    too_short = [n for n in lengths if n <= reach]
    if too_short:
        raise BenchInputError(f"lengths {too_short} are too short to tell the head modes apart: a sparse head attends "
                              f"to every position up to sink + window + topk x block = {reach}; give longer ones")
    if not 0 < floor <= 1 or mean < floor:
        raise BenchInputError(f"floor is a share of topk in (0, 1] and mean at least floor, got {floor} and {mean}")
    least = math.ceil(floor * topk)  # blocks every fitted sparse head keeps
    per_head = max(least, round(mean * topk))  # and on average
    window_mass: dict[int, list[list[float]]] = {}  # layer -> per step, per query head
    sparse_mass: dict[int, list[list[float]]] = {}
    curves: dict[int, list[torch.Tensor]] = {}  # layer -> per step (Hk, n + 1), blocks in the indexer's order
    started = time.time()
    prompts = 0

    def measure(context: list[int], stepped: list[int], generate: int) -> None:
        """Prefill `context`, then feed `stepped` one token per step and generate `generate` greedily, every step
        measured."""
        cache, layers = probed_prefill(engine, cfg, spec, torch.tensor([context]),
                                       len(context) + len(stepped) + generate + 2)
        ids = torch.tensor([stepped])
        if not generate:
            stepper.prefill(cache, ids)
        else:
            stepper.prefill(cache, ids[:, :-1])
            for _ in engine.stream(cache, ids[:, -1:], GenerateRequest(generate, stop_ids=())):
                pass
        for i, layer in layers.items():
            window_mass.setdefault(i, []).extend(layer.probe.window_masses)
            sparse_mass.setdefault(i, []).extend(layer.probe.masses)
            curves.setdefault(i, []).extend(layer.probe.index_curves)
            layer.probe = None

    for n in lengths:
        for d in depths:
            prompt = builder.build(n, d, random.Random(f"{seed}/{n}/{d}"))
            measure(prompt.context_ids, prompt.question_ids, answer_tokens)  # one question token per step
            prompts += 1
    text = loaded.tokenizer.encode(calibration_text()).ids if text_steps else []
    for n in lengths if text_steps else ():
        if len(text) < n + text_steps:
            raise BenchInputError(f"the calibration text has {len(text)} tokens, fewer than {n} + {text_steps}")
        measure(text[:n], text[n : n + text_steps], 0)  # the text's own next tokens, one per step
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
    summary = _summary(modes)
    summary["by_target"] = {str(t): _modes_at(scores, t) for t in (0.9, 0.95, 0.97, 0.98, 0.99)}
    blocks = None
    if fit:
        mean_curves = {str(i): _mean_curve(curves[i]) for i in sorted(curves)}
        modes = {k: ["streaming" if m == "streaming" else "sparse" for m in ms] for k, ms in modes.items()}
        blocks = fit_blocks(mean_curves, modes, per_head, least)
        uniform = {k: [0 if m == "streaming" else topk for m in ms] for k, ms in modes.items()}
        summary.update(_summary(modes))
        summary["fitted"] = {
            "floor": least, "mean": per_head, "blocks_in_total": sum(map(sum, blocks.values())),
            "blocks_per_sparse_head": _spread([c for v in blocks.values() for c in v if c]),
            # the mean over heads of each head's mass curve (the mean over the calibration steps) at its count
            "mass": {"fitted": _mass_at(mean_curves, blocks), "topk_every_head": _mass_at(mean_curves, uniform)},
        }
    result = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fingerprint": fingerprint(cfg), "model": model,
        "dtype": dtype, "modes": modes, **({"blocks": blocks} if blocks is not None else {}), "scores": scores,
        "summary": summary,
        "settings": {"lengths": list(lengths), "depths": list(depths), "sink": sink, "window": window, "block": block,
                     "topk": topk, "target": target, "answer_tokens": answer_tokens, "seed": seed, "prompts": prompts,
                     "steps_per_layer": len(next(iter(window_mass.values()))) if window_mass else 0,
                     "style": style, "fit": fit, "text_steps": text_steps, "text": TEXT_MODULES, "floor": floor,
                     "mean": mean},
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


TEXT_MODULES = ("argparse", "dataclasses", "textwrap")


def calibration_text() -> str:
    """Real text beside the passkey prompts: the source of a few standard-library modules (code, docstrings and
    comments, as an agent's session holds), not the text `kakeya bench sparse` measures on."""
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in TEXT_MODULES)


def fit_blocks(mean_curves: dict[str, torch.Tensor], modes: dict[str, list[str]], per_head: int,
               floor: int) -> dict[str, list[int]]:
    """Blocks per sparse head (streaming heads 0), `floor` each at least and `per_head` on average: one at a time to
    the head whose mean mass curve (Hk, W) gains most by it (ties to the first layer and head); a head holds at
    most W - 1 (every block of the longest prompt)."""
    keys = sorted(mean_curves, key=int)
    sparse = [(k, h) for k in keys for h, m in enumerate(modes[k]) if m == "sparse"]
    blocks = {k: [0] * len(modes[k]) for k in keys}
    if not sparse:
        return blocks
    width = max(c.shape[1] for c in mean_curves.values())
    # (S, width + 1): each sparse head's curve, its last value held to the common width; a final -inf column
    # stops a head at its last block
    rows = torch.stack([torch.nn.functional.pad(mean_curves[k][h], (0, width - mean_curves[k].shape[1]),
                                                value=float(mean_curves[k][h, -1])) for k, h in sparse]).double()
    rows = torch.cat((rows, torch.full((len(sparse), 1), float("-inf"), dtype=rows.dtype)), dim=1)
    count = torch.full((len(sparse),), min(floor, width - 1), dtype=torch.long)
    idx = torch.arange(len(sparse))
    for _ in range(per_head * len(sparse) - int(count.sum())):
        gain = rows[idx, count + 1] - rows[idx, count]
        best = int(torch.argmax(gain))
        if gain[best] == float("-inf"):
            break  # every head holds every block
        count[best] += 1
    for (k, h), c in zip(sparse, count.tolist(), strict=True):
        blocks[k][h] = c
    return blocks


def _mean_curve(steps: list[torch.Tensor]) -> torch.Tensor:
    """(Hk, W): the steps' curves (Hk, n + 1) averaged, each held at its last value out to the widest."""
    width = max(c.shape[1] for c in steps)
    return torch.stack([torch.cat((c, c[:, -1:].expand(-1, width - c.shape[1])), dim=1) for c in steps]).mean(0)


def _mass_at(mean_curves: dict[str, torch.Tensor], counts: dict[str, list[int]]) -> float:
    """The mean over every KV head of its mean mass curve at its count (a streaming head: its window's mass)."""
    vals = [float(c[h, min(k, c.shape[1] - 1)]) for key, c in mean_curves.items() for h, k in enumerate(counts[key])]
    return statistics.fmean(vals)


def _spread(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


def _summary(modes: dict[str, list[str]]) -> dict[str, float]:
    heads = [m for ms in modes.values() for m in ms]
    summary = {m: heads.count(m) / len(heads) for m in ("streaming", "sparse", "dense")}
    summary["retrieval_fraction"] = 1 - summary["streaming"]
    summary["cold_bytes_vs_all_heads"] = summary["retrieval_fraction"]  # streaming heads store no cold tier
    return summary


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
