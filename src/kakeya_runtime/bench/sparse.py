"""`kakeya bench sparse`: what the sparse KV policy keeps of full attention, what it costs, what it saves.

Per context length, on real text (the engine bench's text: CPython's language reference), one run:
- oracle attention-mass recall: for sampled decode steps, every governed layer computes its newest query's full
  fp32 attention over every position with exact keys and reports the share of that mass on the set the policy
  attended (sinks, hot range, selected cold blocks); mean and worst per layer, over query heads and steps;
- its ceiling: the mass with as many blocks per KV head as the indexer kept, picked by their true mass (no indexer
  keeping that many can do better), and what 0.99 would take: per KV head the fewest blocks so picked that reach
  it, as the share of the history a query would then attend;
- greedy agreement: the tokens sparse decodes against full's, position by position;
- decode speed: ms per token for full, sink_window (the bounded floor) and sparse, same prompt, same run;
- memory: hot bytes (fixed), cold bytes (packed) and index bytes against full's K/V bytes at that length, and the
  step's peak of decoded cold blocks; the attended share of the prefix.
Writes sparse.json (+ summary.md) with the machine and whether it was idle before the run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kakeya_runtime.bench.engine import bench_text
from kakeya_runtime.bench.machine import machine_info
from kakeya_runtime.bench.options import dtype_of
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.kv.policy import PolicySpec, check_head_profile, make_policy_cache
from kakeya_runtime.kv.sparse import OracleProbe, SparseKV, SparseLayerKV
from kakeya_runtime.kv.spec import LATTICE_KINDS

SCHEMA = "kakeya.bench.sparse"
SCHEMA_VERSION = 1
DEFAULT_OUT = "results/sparse/latest"


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of the CPUs busy over `seconds` (from /proc/stat): other work skews timings."""
    def read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    try:
        t0, i0 = read()
        time.sleep(seconds)
        t1, i1 = read()
    except OSError:
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


class SparseBenchError(ValueError):
    """A length the model's context cannot hold with the bench's own decode steps."""


def _for_codec(params: dict[str, Any], codec: str | None) -> dict[str, Any]:
    """One codec's sparse params: the command's shared q goes only to a lattice codec (the others take none)."""
    if codec is None:
        return params
    if codec not in LATTICE_KINDS:
        params = {k: v for k, v in params.items() if k != "q"}
    return {**params, "codec": codec}


def run_sparse_bench(model: str = "smollm2", *, lengths: tuple[int, ...] = (2048, 4096, 7680), dtype: str = "bf16",
                     params: dict[str, Any] | None = None, sink_window: dict[str, Any] | None = None,
                     oracle_steps: int = 8, decode_tokens: int = 32, prefill_chunk: int = 512,
                     threads: int | None = None, loaded=None, out_dir: Path | str | None = None,
                     decoded_per_topk: float | None = None, repeats: int = 1) -> dict[str, Any]:
    """`params["codec"]` may name several codecs ("identity,d4"): each is a sparse policy of its own, timed in the
    same run beside full and sink_window, one row per (length, codec). `repeats`: every policy decodes
    `decode_tokens` that many times, the policies taking turns, and ms/token is the median of its repeats."""
    if threads:
        torch.set_num_threads(threads)
    busy = cpu_busy()
    if loaded is None:
        from kakeya_runtime.models.loader import load_model

        loaded = load_model(model, dtype=dtype_of(dtype))
    cfg = loaded.config
    params = dict(params or {})
    codecs = [c for c in str(params.pop("codec", "")).split(",") if c] or [None]
    # heads=profile names the profile it ran with (profile:<digest>, in the JSON's policy)
    specs = {c: check_head_profile(cfg, PolicySpec.parse("sparse", _for_codec(params, c))) for c in codecs}
    first = next(iter(specs.values()))
    floor = PolicySpec.parse("sink_window", sink_window or {"sink": first.sink, "window": first.window})
    engine = Engine(loaded.model, prefill_chunk=prefill_chunk)
    text = loaded.tokenizer.encode(bench_text()).ids
    started = time.time()
    rows = []
    governed = 0
    most = cfg.max_position_embeddings - repeats * decode_tokens - oracle_steps - 2  # the steps decoded after it
    if max(lengths, default=0) > most:
        raise SparseBenchError(f"length {max(lengths)} does not fit {model}'s context of {cfg.max_position_embeddings} "
                               f"positions with these decode steps: at most {most}")
    for n in lengths:
        ids = torch.tensor([text[:n]], dtype=torch.long)
        # oracle mass and agreement: full and sparse decode greedily from the same prompt
        full_tokens = _generate(engine, cfg, PolicySpec.parse("full"), ids, oracle_steps)
        probed = {}
        for codec, spec in specs.items():
            probed[codec] = _oracle(engine, cfg, spec, ids, n, oracle_steps, decode_tokens, full_tokens)
            governed = probed[codec].pop("governed")
        # decode speed and memory: each policy prefilled, then decoding the same greedy continuation length
        policies = {"full": PolicySpec.parse("full"), "sink_window": floor,
                    **{f"sparse:{codec}": spec for codec, spec in specs.items()}}
        timing = _timings(engine, cfg, ids, n, policies, decode_tokens, repeats, decoded_per_topk)
        for codec, spec in specs.items():
            row: dict[str, Any] = {"length": n, **({"codec": spec.params.get("codec", codec)} if codec else {}),
                                   **probed[codec]}
            row["decode"] = {"full": timing["full"], "sink_window": timing["sink_window"],
                             "sparse": timing[f"sparse:{codec}"]}
            ms = {k: v["ms_per_token"] for k, v in row["decode"].items()}
            row["speedup_vs_full"] = ms["full"] / ms["sparse"]
            row["vs_sink_window"] = ms["sparse"] / ms["sink_window"]
            if repeats > 1:  # the same ratios repeat by repeat (each pair decoded back to back)
                reps = {k: v["ms_per_token_repeats"] for k, v in row["decode"].items()}
                row["vs_sink_window_repeats"] = [a / b for a, b in zip(reps["sparse"], reps["sink_window"],
                                                                        strict=True)]
                row["speedup_vs_full_repeats"] = [b / a for a, b in zip(reps["sparse"], reps["full"], strict=True)]
            row["memory"] = _memory(row["decode"]["sparse"], governed * 2 * n * cfg.num_key_value_heads
                                    * cfg.head_dim * 2)
            rows.append(row)
    result = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created_unix": int(time.time()),
        "command": " ".join(sys.argv),
        "wall_s": round(time.time() - started, 1), "machine": machine_info(), "cpu_busy_before": busy,
        "threads": torch.get_num_threads(), "loadavg_1m_after": os.getloadavg()[0],
        "model": {"name": model, "dtype": dtype, "layers": cfg.num_hidden_layers, "governed_layers": governed},
        "policy": {"sparse": first.params, "sparse_label": first.label, "sink_window": floor.params,
                   **({"sparse_by_codec": {c: {"params": s.params, "label": s.label} for c, s in specs.items()}}
                      if len(specs) > 1 else {})},
        "settings": {"oracle_steps": oracle_steps, "decode_tokens": decode_tokens, "prefill_chunk": prefill_chunk,
                     "repeats": repeats,
                     "decoded_per_topk": (SparseLayerKV.decoded_per_topk if decoded_per_topk is None
                                          else decoded_per_topk),
                     "text": "pydoc_data.topics (CPython language reference), topics in sorted order"},
        "rows": rows,
        "method": __doc__,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sparse.json").write_text(json.dumps(result, indent=1))
        (out / "summary.md").write_text(summary_markdown(result))
    return result


def probed_prefill(engine: Engine, cfg, spec: PolicySpec, context: torch.Tensor,
                   capacity: int) -> tuple[Any, dict[int, SparseLayerKV]]:
    """A sparse cache whose layers carry an OracleProbe, `context` (1, T) prefilled unmeasured, the probes then
    active: every later step is measured. Returns the cache and its sparse layers by layer index."""
    cache = make_policy_cache(cfg, spec, capacity=capacity, dtype=engine.dtype)
    layers = {i: layer for i, layer in enumerate(cache) if isinstance(layer, SparseLayerKV)}
    for layer in layers.values():
        layer.probe = OracleProbe.new()
    engine.prefill(cache, context)
    for layer in layers.values():
        layer.probe.active = True
    return cache, layers


def _oracle(engine: Engine, cfg, spec: PolicySpec, ids: torch.Tensor, n: int, oracle_steps: int, decode_tokens: int,
            full_tokens: list[int]) -> dict[str, Any]:
    """The sparse policy's oracle attention mass over `oracle_steps` greedy steps and its agreement with full."""
    cache, probed = probed_prefill(engine, cfg, spec, ids[:, :-1], n + decode_tokens + oracle_steps + 2)
    layers = list(probed.values())
    stream = engine.stream(cache, ids[:, -1:], GenerateRequest(oracle_steps, stop_ids=()))
    sparse_tokens = [step[0] for step in stream]
    per_layer = [_mass_stats(layer.probe.masses) | {"ceiling_mean": _mass_stats(layer.probe.best_masses)["mean"],
                                                     "blocks_for_0.99": _blocks_needed(layer.probe)}
                 for layer in layers]
    needed = [x["blocks_for_0.99"]["mean"] for x in per_layer]
    for layer in layers:
        layer.probe = None
    return {"oracle_mass": {"mean": statistics.fmean(x["mean"] for x in per_layer),
                            "worst_layer_mean": min(x["mean"] for x in per_layer),
                            "worst_layer": min(range(len(per_layer)), key=lambda i: per_layer[i]["mean"]),
                            "worst_head_step": min(x["min"] for x in per_layer),
                            # the best any indexer keeping as many blocks could do (blocks picked by true mass)
                            "ceiling_mean": statistics.fmean(x["ceiling_mean"] for x in per_layer),
                            # what 0.99 would take: each KV head its fewest such blocks (mean over steps), as a
                            # share of the history a query would attend
                            "attended_for_0.99": _attended_share(needed, layers[0], n + oracle_steps // 2),
                            "per_layer": per_layer,
                            "steps": oracle_steps},
            "greedy_agreement": _agreement(sparse_tokens, full_tokens), "governed": len(layers)}


def _timings(engine: Engine, cfg, ids: torch.Tensor, n: int, policies: dict[str, PolicySpec], decode_tokens: int,
             repeats: int, decoded_per_topk: float | None) -> dict[str, dict[str, Any]]:
    """Every policy prefilled, then `repeats` rounds in which each decodes `decode_tokens` greedily (continuing
    its own sequence), one after the other: ms/token per round and their median, bytes after the last round."""
    caches, nxt, before = {}, {}, {}
    for name, spec in policies.items():
        c = make_policy_cache(cfg, spec, capacity=n + repeats * decode_tokens + 2, dtype=engine.dtype)
        if decoded_per_topk is not None:  # the decoded-block cache's size per cold head, in multiples of kept
            for layer in c:
                if isinstance(layer, SparseLayerKV):
                    layer.decoded_blocks = int(decoded_per_topk * layer.most_kept(-(-n // layer.block)))
        engine.prefill(c, ids[:, :-1])
        c.reset_stats()
        caches[name], nxt[name] = c, ids[:, -1:]
        before[name] = c.decoded_counts() if isinstance(c, SparseKV) else (0, 0)
    samples: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(repeats):
        for name, c in caches.items():
            s = engine.stream(c, nxt[name], GenerateRequest(decode_tokens, stop_ids=()))
            last = None
            for step in s:
                last = step[0]
            res = s.result
            samples[name].append(1000 * res.decode_s / max(1, res.decode_tokens - 1))
            nxt[name] = torch.tensor([[last]], dtype=torch.long)
    timing: dict[str, dict[str, Any]] = {}
    for name, c in caches.items():
        t: dict[str, Any] = {"ms_per_token": statistics.median(samples[name]), "kv_bytes": c.resident_nbytes,
                             "peak_transient_bytes": c.peak_transient_bytes}
        if repeats > 1:
            t["ms_per_token_repeats"] = samples[name]
        if isinstance(c, SparseKV):
            t.update(c.memory_stats())
            t["attended_fraction"] = c.effective_attention_fraction
            hits, misses = (a - b for a, b in zip(c.decoded_counts(), before[name], strict=True))
            t["decoded_hits"], t["decoded_misses"] = hits, misses
        timing[name] = t
    caches.clear()
    return timing


def _memory(sparse: dict[str, Any], full_bf16: int) -> dict[str, Any]:
    return {"full_bf16_kv_bytes_governed": full_bf16,
            "cold_over_full_bf16": sparse["cold_bytes"] / full_bf16,
            "cold_and_index_over_full_bf16": (sparse["cold_bytes"] + sparse["index_bytes"]) / full_bf16,
            "hot_bytes": sparse["hot_bytes"],
            "peak_decoded_bytes": sparse["peak_transient_bytes"],
            "decoded_cache_bytes": sparse["decoded_bytes"],
            # what a step holds of the history at most: cold codes, summaries, the decoded-block cache and the
            # step's freshly decoded blocks
            "step_peak_over_full_bf16": (sparse["cold_bytes"] + sparse["index_bytes"] + sparse["decoded_bytes"]
                                         + sparse["peak_transient_bytes"]) / full_bf16,
            "decoded_cache_hit_rate": sparse["decoded_hits"] / max(1, sparse["decoded_hits"] + sparse["decoded_misses"])}


def _generate(engine: Engine, cfg, spec: PolicySpec, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens after the prompt `ids` (its last token is the first decode input, as in the probed run)."""
    cache = make_policy_cache(cfg, spec, capacity=ids.shape[1] + n + 2, dtype=engine.dtype)
    engine.prefill(cache, ids[:, :-1])
    stream = engine.stream(cache, ids[:, -1:], GenerateRequest(n, stop_ids=()))
    return [step[0] for step in stream]


def _mass_stats(masses: list[list[float]]) -> dict[str, float]:
    flat = [m for step in masses for m in step]
    return {"mean": statistics.fmean(flat), "min": min(flat), "samples": len(flat)}


def _blocks_needed(probe: OracleProbe) -> dict[str, float]:
    """Per KV head, over the measured steps: blocks (picked by true mass) its query heads need for a 0.99 mean."""
    flat = [b for step in probe.blocks_for_99 for b in step]
    return {"mean": statistics.fmean(flat), "max": max(flat), "selectable": probe.selectable[-1]}


def _attended_share(needed: list[float], layer: SparseLayerKV, length: int) -> float:
    """The share of `length` positions a query would attend with every layer keeping its 0.99 blocks (`needed`, per
    layer; mean over layers): sinks + hot range + those blocks."""
    hot = length - layer.hot_lo(length - 1) + layer.sink
    return statistics.fmean(min(length, hot + blocks * layer.block) / length for blocks in needed)


def _agreement(tokens: list[int], ref: list[int]) -> float:
    return sum(a == b for a, b in zip(tokens, ref, strict=False)) / max(1, len(ref))


def summary_markdown(result: dict[str, Any]) -> str:
    lines = [f"# Sparse policy: {result['policy']['sparse_label']} on {result['model']['name']} "
             f"({result['model']['dtype']})", "",
             f"Machine: {result['machine'].get('cpu_model')}, {result['threads']} threads, CPU busy before the run "
             f"{result['cpu_busy_before']:.0%}.", "",
             "| length | codec | oracle mass (mean) | worst layer | ceiling at these blocks | attended for 0.99 | "
             "greedy agreement | attended | full ms/tok | sink_window "
             "ms/tok | sparse ms/tok | vs full | vs sink_window | cold / full bf16 | + index | decoded cache / full bf16 "
             "| decode hits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d, m, o = r["decode"], r["memory"], r["oracle_mass"]
        lines.append(f"| {r['length']} | {r.get('codec', result['policy']['sparse'].get('codec', ''))} | {o['mean']:.4f} | {o['worst_layer_mean']:.4f} (layer {o['worst_layer']}) | "
                     f"{o['ceiling_mean']:.4f} | {o['attended_for_0.99']:.1%} | {r['greedy_agreement']:.2f} | {d['sparse']['attended_fraction']:.1%} | "
                     f"{d['full']['ms_per_token']:.1f} | {d['sink_window']['ms_per_token']:.1f} | "
                     f"{d['sparse']['ms_per_token']:.1f} | {_speed_word(r['speedup_vs_full'])} | "
                     f"{r['vs_sink_window']:.2f}x | {m['cold_over_full_bf16']:.3f} | "
                     f"{m['cold_and_index_over_full_bf16']:.3f} | "
                     f"{m.get('decoded_cache_bytes', 0) / m['full_bf16_kv_bytes_governed']:.3f} | "
                     f"{m.get('decoded_cache_hit_rate', 0):.1%} |")
    return "\n".join(lines) + "\n"


def command(model: str, lengths: tuple[int, ...], dtype: str, params: dict[str, Any], oracle_steps: int,
            decode_tokens: int, threads: int | None, out: Path, decoded_per_topk: float | None = None,
            repeats: int = 1) -> None:
    result = run_sparse_bench(model, lengths=lengths, dtype=dtype, params=params, oracle_steps=oracle_steps,
                              decode_tokens=decode_tokens, threads=threads, out_dir=out,
                              decoded_per_topk=decoded_per_topk, repeats=repeats)
    print(summary_markdown(result))
    print(f"wrote {out / 'sparse.json'}")


def _speed_word(speedup: float) -> str:
    """'1.34x faster' or '1.11x slower' (a speedup below 1 read as 'faster' once)."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
