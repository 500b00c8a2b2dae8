"""`kakeya bench ...`: the evidence commands. Each writes JSON (with a schema version) the README cites.

To add a command, define it on `bench_app` below (keep heavy imports inside the function, so
`kakeya --help` stays fast; lists through `options`, and `answers_bad_input` so the runtime's typed errors are
answered as errors, not tracebacks), e.g.:

    @bench_app.command("session")
    @answers_bad_input
    def session_cmd(...): ...
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer

from kakeya_runtime.bench.options import (
    answers_bad_input,
    check_model,
    csv,
    floats_in,
    items,
    make_out_dirs,
    positive_ints,
)
from kakeya_runtime.kv.spec import SPARSE_BUDGET

bench_app = typer.Typer(help="Benchmarks that write evidence JSON under results/.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
    app.add_typer(calibrate_app, name="calibrate")


@bench_app.command("compiled-step")
@answers_bad_input
def compiled_step_cmd(
    model: str = typer.Option("smollm2", help="smollm2, gemma3-270m, a .gguf path, or tiny / tiny-gemma."),
    weights: str = typer.Option("bf16", help="Served weight format: bf16, fp32, int8, int4, "
                                "int4-mixed."),
    context: int = typer.Option(1024, min=1, help="Tokens prefilled before the timed decode steps."),
    steps: int = typer.Option(64, min=1, help="Timed decode steps per variant."),
    profile_steps: int = typer.Option(16, min=1, help="Further steps under the profiler (guard time per step)."),
    threads: int = typer.Option(0, min=0, help="Torch threads (0: torch's default)."),
    out: str = typer.Option("results/engine/compiled_step.json", help="Output JSON."),
) -> None:
    """One decode step eager, compiled over the cache object, and compiled over tensors: step time and Dynamo's
    guard time per step."""
    from kakeya_runtime.bench.compiled_step import CompiledStepSpec, run_compiled_step_bench
    from kakeya_runtime.engine.serving import parse_weights

    try:
        weights = parse_weights(weights)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if weights == "auto":
        raise typer.BadParameter("--weights names one format here")
    spec = CompiledStepSpec(model=model, weights=weights, context=context, steps=steps, profile_steps=profile_steps,
                            threads=threads or None)
    command_line = shlex.join(["kakeya", "bench", "compiled-step", "--model", model, "--weights", weights,
                               "--context", str(context), "--steps", str(steps), "--profile-steps",
                               str(profile_steps), "--threads", str(threads), "--out", out])
    run = run_compiled_step_bench(spec, command_line=command_line)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1) + "\n")
    for name, v in run["variants"].items():
        typer.echo(f"{name:>17}: step {v['step_ms_median']:.2f} ms median ({v['decode_tok_s_median']:.1f} tok/s), "
                   f"guards {v['guard_ms_per_step']:.3f} ms/step over {v['guard_lookups_per_step']:.1f} lookups")
    typer.echo(f"tokens equal eager: {run['tokens_equal_eager']}; wrote {path}")


@bench_app.command("engine")
@answers_bad_input
def engine_cmd(
    models: str = typer.Option("smollm2,gemma3-270m", help="Comma-separated: smollm2, gemma3-270m, a .gguf path, "
                               "or tiny / tiny-gemma (random weights, for smoke tests)."),
    contexts: str = typer.Option("1024,4096", help="Prompt lengths (tokens) to prefill before decoding."),
    formats: str = typer.Option("bf16,fp32,int8,int4,int4-mixed", help="Weight formats of our engine."),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="Compiled decode step (torch.compile; "
                                 "`kakeya serve` runs eager unless asked)."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also run transformers and llama.cpp."),
    decode_steps: int = typer.Option(64, min=1, help="Decode steps timed per configuration."),
    fidelity_positions: int = typer.Option(256, min=1, help="Positions of real text for KL / top-1 vs bf16."),
    long_prefill: str = typer.Option("1024,4096,16384,30000", help="Long-prefill peak-RSS lengths ('' to skip)."),
    long_prefill_model: str = typer.Option("gemma3-270m", help="Model for the long-prefill memory runs."),
    long_prefill_chunks: str = typer.Option("512,2048", help="Prefill chunk sizes for the long-prefill runs "
                                            "(the larger ones only at the two shortest lengths)."),
    prefill_chunk: int = typer.Option(512, min=1, help="Our engine's prefill chunk (tokens per forward)."),
    prefill_mode: str = typer.Option("kernel", help="How int formats prefill: kernel (the int kernel, as `kakeya "
                                     "serve` does), dequant (bf16 matmul on weights dequantized per call), copy (keep "
                                     "a bf16 copy)."),
    head: str = typer.Option("int8", help="LM head format for the int formats: int8 or int4."),
    threads: int = typer.Option(0, min=0, help="Threads for every engine (0: torch's default)."),
    idle_wait: float = typer.Option(90.0, min=0.0, help="Seconds to wait for an idle CPU before each job."),
    previous: str = typer.Option("bf16,fp32", help="Formats also run on PyTorch's kernels (not invariant) as the "
                                 "peer of our invariant ones ('' to skip)."),
    out: str = typer.Option("", help="Output JSON (default results/engine/engine_<machine>.json)."),
) -> None:
    """Prefill/decode tok/s, TTFT, peak RSS and fidelity per model x context x format, vs peers."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kakeya_runtime.bench.engine import ALL_FORMATS, EngineBenchSpec, render_markdown, run_engine_bench
    from kakeya_runtime.bench.machine import machine_slug

    if head not in ("int8", "int4"):
        raise typer.BadParameter(f"--head must be int8 or int4, got {head!r}")
    if prefill_mode not in ("dequant", "copy", "kernel"):
        raise typer.BadParameter(f"--prefill-mode must be dequant, copy or kernel, got {prefill_mode!r}")
    from kakeya_runtime.bench.engine import TINY_MODELS

    fmts = items(formats, "--formats", ALL_FORMATS)
    previous_fmts = csv(previous)  # those of --formats also run on PyTorch's kernels (the rest: not measured here)
    if set(previous_fmts) - set(ALL_FORMATS):
        raise typer.BadParameter(f"--previous: unknown {', '.join(sorted(set(previous_fmts) - set(ALL_FORMATS)))}")
    spec = EngineBenchSpec(
        models=tuple(check_model(m, TINY_MODELS) for m in items(models, "--models")),
        contexts=positive_ints(contexts, "--contexts"), formats=fmts, compile=compile, peers=peers,
        decode_steps=decode_steps, fidelity_positions=fidelity_positions,
        long_prefill=positive_ints(long_prefill, "--long-prefill", allow_empty=True),
        long_prefill_model=long_prefill_model or None,
        long_prefill_chunks=positive_ints(long_prefill_chunks, "--long-prefill-chunks", allow_empty=True),
        threads=threads or None, idle_wait_s=idle_wait, prefill_chunk=prefill_chunk, previous_formats=previous_fmts,
        extra_ours={**({} if prefill_mode == "dequant" else {"prefill": prefill_mode}),
                    **({} if head == "int8" else {"head": head})},
    )
    # The full command with every option resolved, so a reader can rerun exactly this.
    command_line = shlex.join([
        "kakeya", "bench", "engine", "--models", models, "--contexts", contexts, "--formats", formats,
        "--compile" if compile else "--no-compile", "--peers" if peers else "--no-peers",
        "--decode-steps", str(decode_steps), "--fidelity-positions", str(fidelity_positions),
        "--long-prefill", long_prefill, "--long-prefill-model", long_prefill_model,
        "--long-prefill-chunks", long_prefill_chunks, "--prefill-chunk", str(prefill_chunk),
        "--prefill-mode", prefill_mode, "--head", head, "--threads", str(threads), "--idle-wait", str(idle_wait),
        "--previous", previous,
    ])
    out_path = Path(out) if out else Path("results/engine") / f"engine_{machine_slug()}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task("bench engine", total=None)

        def on_job(i: int, n: int, job: dict) -> None:
            what = " ".join(str(job[k]) for k in ("kind", "model", "fmt", "ctx", "tokens") if k in job)
            progress.update(task, total=n, completed=i, description=what or "done")

        partial = out_path.with_suffix(".partial.json")
        run = run_engine_bench(spec, on_job=on_job, command_line=command_line, partial=partial)
        partial.unlink(missing_ok=True)
    out_path.write_text(json.dumps(run, indent=1) + "\n")
    md = out_path.with_suffix(".md")
    md.write_text(render_markdown(run))
    typer.echo(render_markdown(run))
    typer.echo(f"wrote {out_path} and {md}")


@bench_app.command("session")
@answers_bad_input
def session_cmd(
    model: str = typer.Option("smollm2", help="Bundled model name or path."),
    turns: int = typer.Option(300, min=1, help="Agent turns on one session (size to fit the model's context)."),
    reply_tokens: int = typer.Option(4, min=1, help="Tokens generated per turn."),
    baseline_every: int = typer.Option(5, min=0, help="Run the stateless re-prefill baseline every N turns (0: never)."),
    policies: str = typer.Option("full", help="';'-separated policies, e.g. 'full;sink_window:sink=4,window=64'."),
    weights: str = typer.Option("auto", help="As `kakeya serve --weights`: auto (its default: the format it serves "
                                "on this machine), bf16, fp32, int8, int4 or int4-mixed."),
    dtype: str | None = typer.Option(None, help="As `kakeya serve --dtype` (bf16 / fp32: that format)."),
    out: str = typer.Option("results/session/long_session.json", help="Output JSON (a PNG goes beside it)."),
    seed: int = typer.Option(0),
    attention: str = typer.Option("native", help="Attention backends, ','-separated: native (our kernel), sdpa."),
) -> None:
    """Long agent session through the Python SDK vs the stateless baseline (latency per turn, KV bytes), on the
    model as `kakeya serve` serves it."""
    from kakeya_runtime.bench.long_session import command
    from kakeya_runtime.server.cli import resolve_weights

    try:  # flags serve would refuse: before anything loads
        resolve_weights(weights, dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    command(model=model, turns=turns, reply_tokens=reply_tokens, baseline_every=baseline_every,
            policies=policies, weights=weights, dtype=dtype, out=Path(out), seed=seed, attention=attention)


@bench_app.command("soak")
@answers_bad_input
def soak_cmd(
    model: str = typer.Option("smollm2", help="Bundled model name or path, served by a child `kakeya serve`."),
    weights: str = typer.Option("auto", help="As `kakeya serve --weights`: auto (its default: the format it serves "
                                "on this machine), bf16, fp32, int8, int4 or int4-mixed."),
    requests: int = typer.Option(10_000, min=2, help="Requests in all (half before the kill -9, half after)."),
    max_seconds: float = typer.Option(900.0, min=1.0, help="Stop (and fail) past this wall time."),
    keys: int = typer.Option(3, min=1, help="API keys, one client thread each."),
    context: int = typer.Option(1024, min=128, help="The server's per-session context (small: limits are reached; "
                                "at least 128, which the valid requests' policies need)."),
    seed: int = typer.Option(0),
    kill: bool = typer.Option(True, "--kill/--no-kill", help="SIGKILL and restart the server halfway."),
    max_rss_gib: float = typer.Option(6.0, min=0.1, help="Fail if the server's RSS goes above this."),
    out: str = typer.Option("results/soak", help="Output directory for the JSON."),
) -> None:
    """Randomized valid and invalid requests from several keys, cancellations, evictions, idle compression and a
    kill -9 + restart, against a real server on loopback; exits 1 on any failure it reports."""
    from kakeya_runtime.bench.soak import SoakConfig, command
    from kakeya_runtime.server.cli import resolve_weights

    try:  # a format serve would refuse: before the server starts
        resolve_weights(weights, None)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    result = command(SoakConfig(model=check_model(model), weights=weights, requests=requests, max_seconds=max_seconds,
                                keys=keys, context=context, seed=seed, kill=kill,
                                max_rss_bytes=int(max_rss_gib * 2**30)), Path(out))
    if not result["passed"]:
        raise typer.Exit(1)


@bench_app.command("attention")
@answers_bad_input
def attention_cmd(
    lengths: str = typer.Option("1024,4096,7168", help="Cache lengths (keys)."),
    chunks: str = typer.Option("1,21,128", help="New tokens per call (1: decode)."),
    dtypes: str = typer.Option("bfloat16,float32", help="K/V and query dtypes."),
    prompts: str = typer.Option("512", help="Fresh prompt lengths (causal attention over themselves; '' to skip)."),
    threads: int = typer.Option(0, min=0, help="Threads (0: torch's default)."),
    out: str = typer.Option("results/attention/attention.json", help="Output JSON."),
) -> None:
    """Per-layer attention: our invariant kernel vs PyTorch's SDPA path, SmolLM2 shapes, same run."""
    from kakeya_runtime.bench.attention import command

    keys, rows = positive_ints(lengths, "--lengths"), positive_ints(chunks, "--chunks")
    if max(rows) > min(keys):  # a chunk's rows are the last of its keys: it cannot be longer than the cache
        raise typer.BadParameter(f"--chunks: {max(rows)} new tokens do not fit a cache of {min(keys)} keys")
    command(lengths=keys, chunks=rows,
            dtypes=items(dtypes, "--dtypes", ("bfloat16", "float32")),
            prompts=positive_ints(prompts, "--prompts", allow_empty=True),
            threads=threads or None, out=Path(out))


@bench_app.command("sparse")
@answers_bad_input
def sparse_cmd(
    model: str = typer.Option("smollm2", help="Bundled model: smollm2 or gemma3-270m."),
    lengths: str = typer.Option("2048,4096,7680", help="Context lengths (tokens of real text)."),
    dtype: str = typer.Option("bf16", help="bf16 or fp32."),
    sink: int = typer.Option(4), window: int = typer.Option(512, help="Hot window."),
    block: int = typer.Option(32, help="Positions per cold block."),
    topk: int = typer.Option(32, help="Cold blocks each query attends to (at least)."),
    budget: float = typer.Option(SPARSE_BUDGET, help="Share of its selectable cold blocks a query attends to, when "
                                 "more than topk (0: topk only)."),
    codec: str = typer.Option("d4", help="Cold-tier codec: identity, d4, e8 or int8; several, comma-separated, are "
                                         "timed in the same run (one row per length and codec)."),
    q: int = typer.Option(38, help="Lattice range of the codec."),
    heads: str = typer.Option("all", help="all (every head sparse) or profile (the model's head profile)."),
    oracle_steps: int = typer.Option(8, min=1, help="Decode steps whose full attention is measured (oracle mass)."),
    decode_tokens: int = typer.Option(32, min=2, help="Tokens decoded per policy for the speed columns (the first "
                                      "is the prefill's: at least 2)."),
    threads: int = typer.Option(0, min=0, help="Threads (0: torch's default)."),
    out: str = typer.Option("results/sparse/latest", help="Output directory."),
    decoded_per_topk: float = typer.Option(0.0, min=0.0, help="Lattice codes: decoded blocks kept per KV head, in multiples "
                                                     "of the blocks a query keeps (0: the policy's default)."),
    repeats: int = typer.Option(1, min=1, help="Rounds in which every policy decodes --decode-tokens in turn (the median "
                                        "round is reported)."),
) -> None:
    """The sparse KV policy against full attention: oracle attention mass, agreement, decode speed, memory."""
    from kakeya_runtime.bench.sparse import command
    from kakeya_runtime.kv.spec import CODEC_KINDS

    params = {"sink": sink, "window": window, "block": block, "topk": topk, "budget": budget, "q": q, "heads": heads,
              "codec": ",".join(items(codec, "--codec", CODEC_KINDS))}
    command(model, positive_ints(lengths, "--lengths"), dtype, params, oracle_steps, decode_tokens, threads or None, Path(out),
            decoded_per_topk or None, repeats)


@bench_app.command("spec")
@answers_bad_input
def spec_cmd(
    model: str = typer.Option("smollm2", help="Bundled model (smollm2: chat prompts; others: completion prompts)."),
    dtype: str = typer.Option("bf16", help="bf16 or fp32."),
    proposers: str = typer.Option("history,self,draft_head", help="Draft proposers."),
    ks: str = typer.Option("1,2,4,auto", help="Max draft tokens per verifier step (auto: the adaptive setting)."),
    temperatures: str = typer.Option("0,0.7", help="Sampling temperatures."),
    max_tokens: int = typer.Option(128, min=1, help="Tokens generated per run (fewer when the model ends its reply)."),
    workloads: str = typer.Option("quote_tool_output,reemit_file_one_change,reformat_json,chat_explain,chat_story",
                                  help="Comma-separated workloads: copy-heavy agent turns (quote_tool_output, "
                                       "reemit_file_one_change, reformat_json) and open chat (chat_explain, chat_story)."),
    prompts: str = typer.Option("", help="Prompt style: chat or completion (default: chat for smollm2)."),
    repeats: int = typer.Option(2, min=1, help="Alternating plain/speculative runs per setting (each keeps its fastest)."),
    threads: int = typer.Option(0, min=0, help="Threads (0: torch's default)."),
    merge: bool = typer.Option(False, "--merge", help="Keep the output JSON's records of other workloads."),
    verify_cost: str = typer.Option("measured", help="How the off-switch prices a verifier step: measured (on this "
                                    "machine at start, as `kakeya serve` does) or constant (a fixed 1% per draft)."),
    out: str = typer.Option("results/spec/latest", help="Output directory."),
    draft_head: str = typer.Option("", "--draft-head", metavar="PATH",
                                   help="Trained draft head (`kakeya train draft-head`) for the draft_head proposer "
                                        "(default: a randomly initialised one)."),
    weights: str = typer.Option("", help="Convert the weights as `kakeya serve --weights` does (bf16, int8, int4, "
                                         "int4-mixed; default: --dtype as loaded)."),
) -> None:
    """Speculative decoding vs plain decode: acceptance at each K, mean accepted length, wall time per token."""
    from kakeya_runtime.bench.spec import PROMPT_STYLES, WORKLOADS, command

    k_values = tuple(0 if k.lower() == "auto" else positive_ints(k, "--ks")[0] for k in items(ks, "--ks"))  # 0: auto
    if prompts and prompts not in PROMPT_STYLES:
        raise typer.BadParameter(f"--prompts: one of {', '.join(PROMPT_STYLES)}")
    from kakeya_runtime.engine.self_draft import DraftHeadError

    try:
        command(model, dtype, items(proposers, "--proposers", ("history", "self", "draft_head")), k_values,
                floats_in(temperatures, "--temperatures", 0.0, 100.0), max_tokens,
                items(workloads, "--workloads", WORKLOADS), threads or None, Path(out), repeats, prompts or None,
                merge, measured_cost=items(verify_cost, "--verify-cost", ("measured", "constant"))[0] == "measured",
                draft_head=_existing_file(draft_head, "--draft-head") if draft_head else None,
                weights=items(weights, "--weights", ("bf16", "int8", "int4", "int4-mixed"))[0] if weights else None)
    except DraftHeadError as e:  # a head of another model, or not a head file
        raise typer.BadParameter(f"--draft-head: {e}") from None


def _existing_file(path: str, flag: str) -> Path:
    if not Path(path).is_file():
        raise typer.BadParameter(f"{flag} {path}: no such file")
    return Path(path)


@bench_app.command("concurrent")
@answers_bad_input
def concurrent_cmd(
    model: str = typer.Option("smollm2", help="Model `kakeya serve` loads."),
    weights: str = typer.Option("auto", help="As `kakeya serve --weights`: auto (its default: the format it serves "
                                "on this machine), bf16, fp32, int8, int4 or int4-mixed."),
    sessions: str = typer.Option("1,2,4,8", help="Concurrent sessions per phase."),
    turns: int = typer.Option(2, min=1, help="Agent turns per session per phase."),
    reply_tokens: int = typer.Option(48, min=1, help="Tokens generated per turn (greedy, EOS ignored)."),
    long_prompt: int = typer.Option(4096, min=0, help="Tokens of the prompt arriving while others decode (0: skip)."),
    long_decoders: int = typer.Option(4, min=1, help="Sessions decoding while the long prompt arrives."),
    long_reply_tokens: int = typer.Option(800, min=1, help="Tokens each of those decodes (enough to cover the "
                                          "prompt's read)."),
    max_batch: int = typer.Option(8, min=1, help="--max-batch of the batching server."),
    step_tokens: int | None = typer.Option(None, min=1, help="--step-tokens of both servers (default: theirs)."),
    step_slowdown: float | None = typer.Option(None, help="--step-slowdown of both servers (default: theirs)."),
    schedulers: str = typer.Option("batch,serial", help="batch (--max-batch N) and/or serial (--max-batch 1)."),
    out: str = typer.Option("results/concurrent", help="Output directory (concurrent.json)."),
) -> None:
    """Continuous batching vs the serial scheduler: aggregate tok/s, turn and inter-token latency at N sessions."""
    import sys

    from kakeya_runtime.bench.concurrent import ConcurrentConfig, run_concurrent
    from kakeya_runtime.server.cli import resolve_weights
    from kakeya_runtime.server.grpc_app import check_step_slowdown

    try:  # what serve would refuse: before the server starts
        resolve_weights(weights, None)
        if step_slowdown is not None:
            check_step_slowdown(step_slowdown)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    config = ConcurrentConfig(model=check_model(model), sessions=positive_ints(sessions, "--sessions"), turns=turns,
                              reply_tokens=reply_tokens, long_prompt=long_prompt, long_decoders=long_decoders,
                              long_reply_tokens=long_reply_tokens, max_batch=max_batch, step_tokens=step_tokens,
                              step_slowdown=step_slowdown,
                              schedulers=items(schedulers, "--schedulers", ("batch", "serial")),
                              serve_args=("--weights", weights), out=Path(out))
    result = run_concurrent(config, command_line="kakeya " + shlex.join(sys.argv[1:]))
    typer.echo(json.dumps(result["targets"], indent=2))
    typer.echo(f"wrote {result['path']}")


calibrate_app = typer.Typer(help="Per-model measurements the runtime loads (head profiles).", no_args_is_help=True)


@calibrate_app.command("heads")
@answers_bad_input
def calibrate_heads_cmd(
    model: str = typer.Option("smollm2", help="Bundled model: smollm2 or gemma3-270m."),
    dtype: str = typer.Option("bf16", help="bf16 or fp32."),
    lengths: str = typer.Option("2048,4096", help="Passkey prompt lengths (tokens)."),
    depths: str = typer.Option("0.1,0.5,0.9", help="Needle depths."),
    window: int = typer.Option(512, min=1, help="Hot window the profile is measured for."),
    block: int = typer.Option(32, min=1, help="Positions per cold block."),
    topk: int = typer.Option(32, min=1, help="Cold blocks a sparse head attends to."),
    target: float = typer.Option(0.99, help="Attention mass a head's mode must keep (mean over steps)."),
    fit: bool = typer.Option(True, help="Give each sparse head its own block count, topk on average (--no-fit: "
                             "every sparse head keeps topk, and heads that need more are dense)."),
    floor: float = typer.Option(1.0, help="Share of topk every fitted sparse head keeps at least."),
    mean: float = typer.Option(1.25, help="Blocks a fitted sparse head keeps on average, as a multiple of topk."),
    text_steps: int = typer.Option(64, min=0, help="Steps measured on real text (standard-library source) at each "
                                   "length, beside the passkey prompts (0: passkey prompts only)."),
    out: str = typer.Option("", help="Profile path (default: the user's cache dir, where the policy looks)."),
) -> None:
    """Score each KV head as streaming, sparse or dense on passkey prompts, fit each sparse head's block count;
    write the sparse policy's head profile."""
    import sys

    from kakeya_runtime.bench.heads import calibrate_heads
    from kakeya_runtime.kv.heads import user_dir

    if dtype not in ("bf16", "fp32"):
        raise typer.BadParameter(f"--dtype must be bf16 or fp32, got {dtype!r}")
    if out and (not out.endswith(".json") or Path(out).expanduser().is_dir()):
        raise typer.BadParameter(f"--out is the profile's file, a path ending in .json, got {out!r}")
    if not out:  # the cache dir's heads/ must be a folder we can write, before minutes of work
        make_out_dirs(str(user_dir() / "profile.json"))
    if not 0 < target <= 1:
        raise typer.BadParameter(f"--target is a share of attention mass in (0, 1], got {target}")
    r = calibrate_heads(model, dtype=dtype, lengths=positive_ints(lengths, "--lengths"),
                        depths=floats_in(depths, "--depths", 0.0, 1.0),
                        window=window, block=block, topk=topk, target=target, fit=fit, floor=floor, mean=mean,
                        text_steps=text_steps,
                        out=out or None, command="kakeya " + " ".join(sys.argv[1:]))
    s = r["summary"]
    typer.echo(f"{r['path']}: streaming {s['streaming']:.0%}, sparse {s['sparse']:.0%}, dense {s['dense']:.0%} "
               f"of {sum(len(m) for m in r['modes'].values())} KV heads")
    if fit:
        f = s["fitted"]
        spread = f["blocks_per_sparse_head"]
        typer.echo(f"blocks per sparse head {spread.get('min')}-{spread.get('max')} (median {spread.get('median')}); "
                   f"mass {f['mass']['fitted']:.4f} fitted, {f['mass']['topk_every_head']:.4f} with top-{topk} for every "
                   "head (blocks in the indexer's order, mean over the calibration steps)")


def _register_niah() -> None:
    from kakeya_runtime.bench.niah import register_niah

    register_niah(bench_app)


_register_niah()
