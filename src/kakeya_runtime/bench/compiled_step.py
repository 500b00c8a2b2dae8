"""`kakeya bench compiled-step`: what one decode step costs eagerly, through the compiled step taking the cache
object (the old way: Dynamo evaluates guards on every layer's attributes each call), and through the compiled step
taking tensors (engine.compiled's default), in one process on one machine, after the same prefill.

Per variant: the median and mean step time over `steps` steps, and from a profiler pass over `profile_steps` more
steps the time inside Dynamo's cache lookup (guard evaluation: the `TorchDynamo Cache Lookup` events) per step.
The three variants' greedy tokens must agree (the compiled step computes what eager computes).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA = "kakeya.bench.compiled_step"
SCHEMA_VERSION = 1
# The last runs the tensor step with Dynamo's guards skipped (torch.compiler.set_stance(skip_guard_eval_unsafe=True)):
# not something to serve (a state no variant was compiled for would run a wrong one), but the bound on what any
# further guard work could still save.
VARIANTS = ("eager", "compiled-object", "compiled-tensors", "compiled-tensors-no-guards")


@dataclass(slots=True)
class CompiledStepSpec:
    model: str = "smollm2"
    weights: str = "bf16"
    context: int = 1024
    steps: int = 64
    profile_steps: int = 16
    threads: int | None = None


def run_compiled_step_bench(spec: CompiledStepSpec, *, command_line: str = "") -> dict[str, Any]:
    import psutil
    import torch

    from kakeya_runtime.bench.engine import load_bench_model
    from kakeya_runtime.bench.machine import machine_info
    from kakeya_runtime.engine import serving
    from kakeya_runtime.engine.compiled import CompiledDecode
    from kakeya_runtime.engine.generate import Engine

    if spec.threads:
        torch.set_num_threads(spec.threads)
    busy_before = psutil.cpu_percent(interval=1.0) / 100.0
    bm = load_bench_model(spec.model, serving.load_dtype(spec.weights))
    serving.apply_format(bm.model, spec.weights)
    ids = (bm.token_ids * (spec.context // max(1, len(bm.token_ids)) + 1))[: spec.context]
    results: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    step_logits: dict[str, list[Any]] = {}
    for variant in VARIANTS:
        engine = Engine(bm.model)
        compile_s = None
        if variant != "eager":
            compiled = CompiledDecode(bm.model, tensor_args=variant != "compiled-object")
            engine.decode_forward = compiled
            compile_s = compiled.warmup(engine)
        stance = (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
                  if variant.endswith("no-guards") else contextlib.nullcontext())
        cache = engine.new_cache(capacity=spec.context + spec.steps + spec.profile_steps + 2)
        out = engine.prefill(cache, torch.tensor([ids]))
        # Every variant feeds the eager run's greedy tokens (teacher forcing), so each step's logits compare.
        forced = tokens.get("eager")
        seq = [int(out.logits[:, -1].argmax())]
        logits: list[torch.Tensor] = []

        def step(seq=seq, forced=forced, logits=logits, engine=engine, cache=cache) -> None:
            fed = seq[-1] if forced is None else forced[len(logits)]
            lg = engine.decode_step(cache, torch.tensor([[fed]])).logits[0, -1]
            logits.append(lg)
            seq.append(int(lg.argmax()))

        step()  # this cache's compiled variant, found through the guards
        with stance:
            stamps = [time.perf_counter()]
            for _ in range(spec.steps):
                step()
                stamps.append(time.perf_counter())
            step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(spec.profile_steps):
                    step()
        lookups = [e for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
        guard_us = sum(e.cpu_time_total for e in lookups)  # microseconds
        results[variant] = {
            "compile_s": None if compile_s is None else round(compile_s, 1),
            "step_ms_median": 1e3 * statistics.median(step_s),
            "step_ms_mean": 1e3 * statistics.fmean(step_s),
            "decode_tok_s_median": 1.0 / statistics.median(step_s),
            "guard_lookups_per_step": len(lookups) / spec.profile_steps,
            "guard_ms_per_step": guard_us / 1e3 / spec.profile_steps,
        }
        tokens[variant] = seq
        step_logits[variant] = logits
    ref = tokens["eager"]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created_unix": time.time(),
        "command_line": command_line, "machine": machine_info(), "spec": asdict(spec),
        "cpu_busy_before": round(busy_before, 3),
        "variants": results,
        "tokens_equal_eager": {v: tokens[v] == ref for v in VARIANTS},
        # Per variant: the first decode step whose logits differ from eager's in any bit (None: none did).
        "first_logits_mismatch": {v: next((i for i, (a, b) in enumerate(zip(step_logits[v], step_logits["eager"],
                                                                             strict=True)) if not torch.equal(a, b)),
                                           None) for v in VARIANTS},
        "guard_ms_saved_per_step": results["compiled-object"]["guard_ms_per_step"]
        - results["compiled-tensors"]["guard_ms_per_step"],
        "speedup_tensors_vs_object": results["compiled-object"]["step_ms_median"]
        / results["compiled-tensors"]["step_ms_median"],
    }
