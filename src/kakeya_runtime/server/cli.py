"""`kakeya serve` (the gRPC runtime) and `kakeya chat` (a terminal chat that goes through the SDK)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kakeya_runtime.engine.dtypes import DTYPE_HELP, dtype_name
from kakeya_runtime.engine.heap import freeze_heap
from kakeya_runtime.sdk import sdk_missing
from kakeya_runtime.server.ports import Listen, port_problem
from kakeya_runtime.sessions.batch import DEFAULT_SHORT_PROMPT, DEFAULT_STEP_TOKENS
from kakeya_runtime.sessions.chunk_budget import DEFAULT_SLOWDOWN
from kakeya_runtime.sessions.errors import InvalidArgument
from kakeya_runtime.sessions.limits import size_text

# How the start-up line names the code a bf16 projection runs on here (models/native.py's linear_path).
KERNEL_ISA = {"amx": "AMX", "avx512-bf16": "AVX-512 BF16", "avx512": "AVX-512", "avx2": "AVX2", "generic": "portable"}


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("chat")(chat)


def serve(
    model: str = typer.Option("smollm2", "--model", "-m", help="smollm2 or gemma3-270m (the bundled models), a "
                              ".gguf file, or a Hugging Face model directory."),
    host: str = typer.Option("127.0.0.1", help="Bind address; anything but loopback requires --api-key, and TLS "
                             "(--tls-cert/--tls-key) or --insecure."),
    port: int = typer.Option(50051, help="gRPC port (0: any free port)."),
    metrics_port: int = typer.Option(9464, "--metrics-port", help="Prometheus /metrics HTTP port (0: any)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not serve /metrics."),
    openai_port: int | None = typer.Option(
        None, "--openai-port",
        help="Also serve the deprecated OpenAI-style HTTP API (/v1/chat/completions, /v1/completions, /v1/models; "
             "single-shot, no sessions) on this port of --host, with the same API keys (default: off; 0: any).",
    ),
    openai_max_queue: int = typer.Option(
        16, "--openai-max-queue", help="OpenAI-style requests waiting beyond --max-concurrent before 429s."),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Bind address of /metrics."),
    metrics_key: str | None = typer.Option(
        None, "--metrics-key", envvar="KAKEYA_METRICS_KEY",
        help="Require `Authorization: Bearer <key>` on /metrics (default: no key)."),
    api_key: list[str] = typer.Option(  # noqa: B008 - typer reads defaults at definition time
        [], "--api-key", envvar="KAKEYA_API_KEY",
        help="Accepted bearer key (repeatable; KAKEYA_API_KEY may hold several, separated by spaces): 8-4096 "
        "printable ASCII characters without spaces. Each key sees only the sessions it created.",
    ),
    max_sessions: int = typer.Option(64, "--max-sessions", help="Sessions held at once, all keys together."),
    max_sessions_per_key: int | None = typer.Option(
        None, "--max-sessions-per-key", help="Sessions one API key holds at once; a key's new session beyond it "
        "evicts that key's least recently used idle one. Default: an equal share of --max-sessions per key."),
    kv_budget: str | None = typer.Option(
        None, "--kv-budget", metavar="SIZE", help="KV cache bytes all sessions may reserve (each reserves its "
        "policy's worst case at the context when created), e.g. 8GiB. Default: half of the memory the weights "
        "leave free."),
    kv_budget_per_key: str | None = typer.Option(
        None, "--kv-budget-per-key", metavar="SIZE", help="KV cache bytes one API key's sessions may reserve. "
        "Default: an equal share of --kv-budget per key."),
    evict_across_keys: bool = typer.Option(
        False, "--evict-across-keys", help="Let a key's new session evict other keys' idle sessions when the "
        "server is full (default: only its own)."),
    tls_cert: str | None = typer.Option(None, "--tls-cert", metavar="PEM", help="Serve gRPC over TLS with this "
                                        "certificate chain (needs --tls-key)."),
    tls_key: str | None = typer.Option(None, "--tls-key", metavar="PEM", help="The TLS certificate's private key."),
    insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback --host without TLS (API keys and "
                                  "tokens then cross the network in clear)."),
    ttl: float = typer.Option(1800.0, "--ttl", help="Idle seconds before a session is evicted."),
    max_concurrent: int = typer.Option(
        8, "--max-batch", "--max-concurrent", help="Generates running at once, decoded together in one batched "
        "forward per step (continuous batching); more wait in FIFO order. 1: one at a time (serial)."),
    step_tokens: int | None = typer.Option(
        DEFAULT_STEP_TOKENS, "--step-tokens", help="A fixed number of tokens per engine step (one per decoding "
        "session, the rest for a new prompt's prefill chunk). Default: the prompt's chunk is sized as the server runs, "
        "from its steps' measured times, so that a step reading it takes at most --step-slowdown times a step "
        "without it."),
    step_slowdown: float = typer.Option(
        DEFAULT_SLOWDOWN, "--step-slowdown", help="While a long prompt is read beside decoding sessions, how much "
        "longer their steps may take (their inter-token latency): smaller keeps it lower and reads the prompt slower."),
    short_prompt: int = typer.Option(
        DEFAULT_SHORT_PROMPT, "--short-prompt", help="A prompt of at most this many tokens (an agent turn's message) "
        "is read in one step beside the decoding sessions; a longer one in chunks (--step-tokens). 0: chunk every "
        "prompt."),
    context: int | None = typer.Option(None, "--context", help="Per-session context limit (default: the model's)."),
    dtype: str | None = typer.Option(None, "--dtype", help=f"Weights/activations dtype: {DTYPE_HELP} (the same as "
                                     "--weights bf16 / fp32)."),
    weights: str = typer.Option(
        "auto", "--weights", help="Projection weight format: auto, bf16, fp32, int8, int4 or int4-mixed (each GGUF "
        "tensor in the fewest bits that hold it exactly: int4, int5 or int8). auto (the "
        "default) serves the fastest format on this machine among those faithful to bf16 (next-token KL <= 0.01, "
        "top-1 >= 0.95 on the bench text) whose kernels keep a session's tokens the same however its history was built; measured at the first start, then cached."),
    compile_decode: bool = typer.Option(
        False, "--compile/--no-compile", help="Run decode steps through a torch.compile'd step, compiled at start-up "
        "(tens of seconds). Usually slower than the eager step, which runs each decode step as native calls (SmolLM2 "
        "int4-mixed at 1k on a Xeon: 73 against 105 tok/s). Off by default: Inductor's own reductions and elementwise kernels "
        "can round a decode step differently from an eager prefill of the same tokens, so a session built turn by turn "
        "may not equal one built in one shot with it; GetModelInfo then reports invariant_numerics false."),
    recalibrate: bool = typer.Option(
        False, "--recalibrate", help="Measure --weights auto's fidelity and speed again instead of using the cache."),
    idle_compress_after: float | None = typer.Option(
        None, "--idle-compress-after", metavar="SECONDS",
        help="Compress a session's KV cache in place once it has been idle this long (default: never).",
    ),
    idle_codec: str = typer.Option(
        "d4", "--idle-codec",
        help="Idle-compression codec for sessions that name none: identity, d4, e8, int8 (or none: only those that "
        "do).",
    ),
    idle_q: int | None = typer.Option(None, "--idle-q", help="Lattice range of the d4/e8 idle codec (default 38)."),
    state_dir: str | None = typer.Option(
        None, "--state-dir", metavar="DIR",
        help="Keep sessions across restarts and crashes: each session's token history is journaled here before a "
             "call answers, and its KV cache is snapshotted at shutdown; on start every session comes back "
             "(default: sessions live in memory only)."),
    fsync: str = typer.Option(
        "call", "--fsync", help="When journal writes reach the disk: always (before each token is streamed), call "
        "(when each call ends; a killed server loses nothing either way), never (left to the OS)."),
    max_request_bytes: int | None = typer.Option(
        None, "--max-request-bytes", metavar="BYTES",
        help="Largest request accepted (gRPC receive limit; bigger ones get RESOURCE_EXHAUSTED). Default: sized "
             "to the context, 5 bytes per token id + 1 MiB.",
    ),
    draft_head: str | None = typer.Option(
        None, "--draft-head", metavar="PATH",
        help="Trained weights (safetensors) for the draft_head speculation proposer, checked against the model.",
    ),
) -> None:
    """Serve a model over gRPC (kakeya.v1) with server-owned sessions."""
    from kakeya_runtime.kv.spec import DEFAULT_Q, LATTICE_KINDS
    from kakeya_runtime.server.grpc_app import PortTaken, RuntimeServer, ServedModel, ServerConfig
    from kakeya_runtime.sessions.policy import parse_codec

    console = Console(stderr=True)
    try:
        budget = parse_size(kv_budget, "--kv-budget")
        budget_per_key = parse_size(kv_budget_per_key, "--kv-budget-per-key")
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    config = ServerConfig(host=host, port=port, metrics_port=None if no_metrics else metrics_port,
                          api_keys=tuple(api_key), max_sessions=max_sessions, idle_ttl_s=ttl,
                          max_concurrent=max_concurrent, step_tokens=step_tokens, step_slowdown=step_slowdown,
                          short_prompt=short_prompt,
                          context_length=context,
                          idle_compress_after_s=idle_compress_after, idle_codec=idle_codec,
                          idle_q=DEFAULT_Q if idle_q is None else idle_q,
                          max_request_bytes=max_request_bytes, openai_port=openai_port,
                          openai_max_queue=openai_max_queue, max_sessions_per_key=max_sessions_per_key,
                          kv_budget=budget, kv_budget_per_key=budget_per_key, evict_across_keys=evict_across_keys,
                          tls_cert=tls_cert, tls_key=tls_key, insecure=insecure, metrics_host=metrics_host,
                          metrics_key=metrics_key, state_dir=state_dir, fsync=fsync)
    try:
        config.validate()  # before the (slow) model load: a refused bind should fail at once
        parse_codec(idle_codec, config.idle_q)  # the model-independent checks (head_dim is checked once loaded)
        if idle_q is not None and str(idle_codec).lower() not in LATTICE_KINDS:  # it would change nothing
            raise ValueError(f"--idle-q sets the range of a lattice --idle-codec ({', '.join(LATTICE_KINDS)}); "
                             f"--idle-codec {idle_codec} takes none")
    except ValueError as e:  # InsecureBindError included
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if draft_head is not None and not Path(draft_head).is_file():
        console.print(f"[red]error:[/] --draft-head {draft_head}: no such file")
        raise typer.Exit(2)
    problem = port_problem(_listens(config, no_metrics))  # before the model load, not after it
    if not problem and openai_port is not None:
        problem = sdk_missing("--openai-port (the shim renders chat prompts)")
    if problem:
        console.print(f"[red]error:[/] {problem}", soft_wrap=True)
        raise typer.Exit(2)
    try:
        weights = resolve_weights(weights, dtype)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    if context is not None:  # past the model's positions: refused now, not after the load and calibration
        from kakeya_runtime.models.loader import declared_context

        positions = declared_context(model)
        if positions is not None and context > positions:
            console.print(f"[red]error:[/] --context {context} exceeds the model's {positions} positions (leave it "
                          "out for the model's)")
            raise typer.Exit(2)
    if state_dir is not None:  # another server on it: refused now, not after the model load
        from kakeya_runtime.sessions.journal import StateDir, StateDirError

        try:
            StateDir.check_free(state_dir)
        except StateDirError as e:
            console.print(f"[red]error:[/] {e}", soft_wrap=True)
            raise typer.Exit(1) from None


    try:
        from kakeya_runtime.models.loader import ModelLoadError, load_model
    except ImportError as e:
        console.print(f"[red]error:[/] model loading is unavailable: {e}")
        raise typer.Exit(1) from None

    first_dtype = first_load_dtype(weights)
    t0 = time.perf_counter()
    try:
        with console.status(f"Loading [bold]{model}[/] ({first_dtype})…", spinner="dots"):
            loaded = load_model(model, dtype=first_dtype)
    except ModelLoadError as e:  # a missing or unreadable model: its message, not a traceback
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(f"Loaded [bold]{model}[/] in {time.perf_counter() - t0:.1f} s")
    from kakeya_runtime.models import native

    try:  # build (once per machine) and load our kernels now, not at the first Generate
        with console.status("Kernels…", spinner="dots"):
            if native.enabled():
                import torch

                kernel = f"invariant ({KERNEL_ISA[native.linear_path(torch.bfloat16, 576, 1536)]} kernels)"
            else:
                kernel = f"PyTorch's SDPA and GEMMs ({native.BACKEND_ENV}=sdpa: not invariant)"
    except native.NativeKernelError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(1) from None
    console.print(f"Numerics: {kernel}")
    if draft_head is not None:  # the model's sizes are known now: a wrong head is refused before any calibration
        _load_draft_head(loaded.model, draft_head, console)
    try:
        choice, decode_forward = choose_serving(loaded, model, weights, compile_decode, recalibrate, console)
    except ValueError as e:  # ServingError: a format that cannot be served here
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(f"Serving: {choice.describe()}", soft_wrap=True)
    head = None
    if draft_head is not None:  # on the served model: the chosen format may have loaded another one
        head = _load_draft_head(loaded.model, draft_head, console)
        console.print(f"Draft head: {draft_head}")
    from kakeya_runtime.sessions.journal import StateDirError

    try:
        served = ServedModel.from_loaded(loaded, model)
        served.serving, served.decode_forward = choice, decode_forward
        server = RuntimeServer(served, config)
    except ValueError as e:  # e.g. an idle codec the model's head_dim cannot take
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    except (StateDirError, OSError) as e:  # a state dir of another model, a session the limits cannot hold
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(1) from None
    if head is not None:
        server.service.draft_head = head
    if state_dir is not None:
        r = server.recovery
        console.print(f"State dir {state_dir} (fsync {fsync}): recovered {r.sessions} session(s), {r.tokens} tokens, "
                      f"{r.snapshots} KV snapshot(s)" + (f"; cut {r.dropped_bytes} torn bytes" if r.dropped_bytes else ""),
                      soft_wrap=True)
        if r.previous_weights is not None:
            console.print(f"  They were last served by other weights ({r.previous_weights}: another --weights or "
                          "build): each cache is recomputed from its history at its first Generate.", soft_wrap=True)
    try:
        asyncio.run(_serve_forever(server, console))
    except PortTaken as e:  # taken while the model loaded (the check before the load passed)
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None


def _load_draft_head(model: Any, path: str, console: Console) -> Any:
    """The --draft-head weights on `model`; the wrong model's head or a truncated file exits with its message."""
    from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadError

    try:
        return DraftHead.from_file(model, path)
    except DraftHeadError as e:
        console.print(f"[red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(2) from None


def resolve_weights(weights: str, dtype: str | None) -> str:
    """--weights with --dtype folded in: --dtype bf16/fp32 alone means that format; both given must agree.
    ValueError (a clear message) otherwise."""
    from kakeya_runtime.engine.serving import AUTO, parse_weights

    fmt = parse_weights(weights)
    if dtype is None:
        return fmt
    as_format = {"bfloat16": "bf16", "float32": "fp32"}[dtype_name(dtype)]
    if fmt == AUTO:
        return as_format
    if fmt != as_format:
        raise ValueError(f"--dtype {dtype} and --weights {weights} disagree: give one of them")
    return fmt


def first_load_dtype(weights: str) -> Any:
    """The dtype `kakeya serve` loads a model in for a resolved --weights: bf16 for auto (what calibration measures
    the other formats against), else what the format is converted from."""
    from kakeya_runtime.engine import serving

    return serving.load_dtype("bf16" if weights == serving.AUTO else weights)


def choose_serving(loaded: Any, name: str, weights: str, compile_decode: bool, recalibrate: bool,
                   console: Console) -> tuple[Any, Any]:
    """Settle the format (measuring, for auto, behind a progress bar), convert `loaded.model` to it in place of the
    first load, and compile and warm the decode step. Returns (ServingChoice, the compiled step or None)."""
    import torch
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from kakeya_runtime.engine import serving
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.engine.speculative import measure_verify_cost
    from kakeya_runtime.models.loader import load_model

    key = serving.model_key(getattr(loaded, "source", None), name)
    cal = serving.Calibration(serving.calibration_path())
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())

    first = "bf16" if weights == serving.AUTO else weights  # what the first load holds (unconverted)

    def load(fmt: str) -> torch.nn.Module:
        if fmt == first and fmt in ("bf16", "fp32"):
            return loaded.model  # served as loaded: nothing to convert, nothing to copy
        return serving.apply_format(load_model(name, dtype=serving.load_dtype(fmt)).model, fmt)

    fidelity = None
    speed = None
    candidates: list = []
    if weights == serving.AUTO:
        formats = serving.FORMATS
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("Choosing the weight format", total=len(formats))

            if not console.is_terminal:  # a log file: the bar shows only when done, so say what runs meanwhile
                kept = not recalibrate and cal.measured(key, formats)
                console.print("Choosing the weight format " + ("(from the measurements kept by an earlier start)"
                              if kept else "(first start on this machine only: minutes; the result is kept for the "
                              "next start)"), soft_wrap=True)

            def step(msg: str) -> None:
                if not console.is_terminal:
                    console.print(f"  {msg}", soft_wrap=True, highlight=False)
                bar.update(task, description=f"Choosing the weight format: {msg}")
                if msg.endswith(": done"):
                    bar.advance(task)

            candidates = serving.calibrate(load, lambda t: loaded.tokenizer.encode(t).ids, key, formats,
                                           calibration=cal, recalibrate=recalibrate, progress=step)
            best = serving.pick(candidates)
            bar.update(task, description=f"Choosing the weight format: {best.fmt}")  # not the last one measured
        for c in candidates:
            f, sp = c.fidelity, c.speed
            console.print(f"  {'*' if c is best else ' '} {c.fmt:<10} "
                          + (f"KL {f.kl_mean:.4f} top-1 {f.top1_agree:.3f}  " if f else "reference        ")
                          + (f"prefill {sp.prefill_tok_s:6.0f} decode {sp.decode_tok_s:5.1f} tok/s, turn "
                             f"{sp.turn_s():.2f} s" if sp else c.why_not() or "not measured")
                          + ("  (cached)" if c.cached else ""), soft_wrap=True, highlight=False)
        fmt, source, fidelity, speed = best.fmt, "auto", best.fidelity, best.speed
    else:
        fmt, source = weights, "flag"
        serving.check_requested(fmt)
        fidelity = None if fmt == "bf16" else cal.fidelity(key, fmt)
        if fmt not in ("bf16", "fp32"):  # served as asked; say how close to bf16 it is, where known
            if fidelity is None:
                console.print(f"[yellow]note:[/] {fmt}'s fidelity to bf16 was not measured here (`--weights auto` "
                              "measures every format once and keeps the result)", soft_wrap=True)
            elif not fidelity.faithful:
                console.print(f"[yellow]warning:[/] {fmt} is not faithful to bf16 on this model (next-token KL "
                              f"{fidelity.kl_mean:.4f}, top-1 {fidelity.top1_agree:.3f}; auto requires KL <= "
                              f"{serving.FIDELITY_KL_MAX} and top-1 >= {serving.FIDELITY_TOP1_MIN})", soft_wrap=True)
    if fmt == first and fmt not in ("bf16", "fp32"):  # --weights int...: the first load was fp32 for this
        with console.status(f"Converting to {fmt}…", spinner="dots"):
            serving.apply_format(loaded.model, fmt)
    elif fmt != first:  # auto chose another format than the bf16 it measured against
        with console.status(f"Loading {fmt}…", spinner="dots"):
            loaded.model = load(fmt)
    from kakeya_runtime.models import native

    choice = serving.ServingChoice(weights=fmt, compiled=compile_decode, source=source, invariant=native.enabled(),
                                   fidelity=fidelity, speed=speed, candidates=candidates)
    engine = Engine(loaded.model)
    compiled = None
    ids = serving.bench_text_ids(lambda t: loaded.tokenizer.encode(t).ids, 256)
    if compile_decode:
        from kakeya_runtime.engine.compiled import CompiledDecode

        compiled = CompiledDecode(loaded.model)
        engine.decode_forward = compiled
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("Compiling the decode step", total=None)
            choice.compile_s = compiled.warmup(engine, progress=lambda i, n: bar.update(task, completed=i, total=n))
        # Not invariant by construction (a probe over some tokens cannot show it for all: on SmolLM2 a compiled step
        # matched eager for 12 steps and then rounded one logit differently, results/engine/compiled_step_*.json).
        choice.invariant = False
        console.print("[yellow]note:[/] --compile: decode steps may round differently from an eager prefill of the "
                      "same tokens, so a session built turn by turn can differ from one built in one shot "
                      "(invariant_numerics is reported false)", soft_wrap=True)
    freeze_heap()  # the loaded model out of the collector's walks, as it will be while serving
    with console.status("Measuring the served decode step…", spinner="dots"):
        choice.decode_tok_s = serving.measure_speed(engine, ids, steps=16).decode_tok_s
        choice.verify_cost = measure_verify_cost(engine)  # what speculation's off-switch prices its steps by
    return choice, compiled


def _listens(config: Any, no_metrics: bool) -> list[Listen]:
    metrics_host = getattr(config, "metrics_host", config.host)  # /metrics may bind elsewhere
    return [Listen("--port", config.host, config.port),
            *([] if no_metrics else [Listen("--metrics-port", metrics_host, config.metrics_port)]),
            *([] if config.openai_port is None else [Listen("--openai-port", config.host, config.openai_port)])]


def open_metrics_warning(config: Any) -> str | None:
    """What to say when /metrics is reachable beyond this machine with no key (None: it is not)."""
    from kakeya_runtime.server.grpc_app import is_loopback

    if config.metrics_key or is_loopback(config.metrics_host):
        return None
    return (f"/metrics on {config.metrics_host} needs no key: anyone who can reach it reads the server's counters "
            "(no session content); --metrics-key sets one")


def _step_text(config: Any) -> str:
    if config.step_tokens is not None:
        return f"step_tokens={config.step_tokens}"
    return f"prompt chunks sized by step time (<= {config.step_slowdown:g}x a decode step)"


async def _serve_forever(server: Any, console: Console) -> None:
    freeze_heap()  # everything built so far lives as long as the process: never walked by the collector again
    await server.start()
    cfg = server.config
    console.print(f"Kakeya serving [bold]{server.served.name}[/] on [bold cyan]{server.address}[/] "
                  f"(max_sessions={cfg.max_sessions}, ttl={cfg.idle_ttl_s:g}s, max_batch={cfg.max_concurrent}, "
                  f"{_step_text(cfg)}, short_prompt={cfg.short_prompt}, "
                  f"auth={'on' if server.auth.enabled else 'off'}, kv policies={','.join(server.service.policies.names())}, "
                  f"idle compression={_idle_text(server)}, max request={size_text(server.max_request_bytes)})")
    limits = server.service.store.limits
    console.print(f"TLS {'on' if server.tls else 'off'}; limits: {limits.max_sessions} sessions, "
                  f"{limits.key_sessions} per key; KV budget {_size(limits.kv_budget or 0)}, "
                  f"{_size(limits.key_budget or 0)} per key; evictions "
                  f"{'across keys' if limits.evict_across_keys else 'within a key only'}")
    if (warning := small_budget_warning(server.service)) is not None:
        console.print(f"[yellow]warning:[/] {warning}")
    if server.metrics_port is not None:
        host = cfg.metrics_host if ":" not in cfg.metrics_host else f"[{cfg.metrics_host}]"
        console.print(f"Metrics on http://{host}:{server.metrics_port}/metrics"
                      f"{' (bearer key required)' if cfg.metrics_key else ''}")
        if (warning := open_metrics_warning(cfg)) is not None:
            console.print(f"[yellow]warning:[/] {warning}")
    if server.openai_port is not None:
        scheme = "https" if server.tls else "http"
        console.print(f"Deprecated OpenAI-style API on {scheme}://{cfg.host}:{server.openai_port}/v1 (single-shot)")
    print(server.address, flush=True)  # machine-readable: the last stdout line is the address
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        console.print("Shutting down…")
        await server.stop()


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | None, flag: str) -> int | None:
    """'8GiB', '512MB', '1.5g', '1000000' -> bytes (None stays None); ValueError naming the flag otherwise."""
    if text is None:
        return None
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not (math.isfinite(value) and value * _UNITS[unit] >= 1):  # inf, nan, < 1 byte
        raise ValueError(f"{flag} takes a size such as 8GiB, 512MB or a number of bytes, got {text!r}")
    return int(value * _UNITS[unit])


def _size(n: int) -> str:
    return size_text(n) if n else "none"


def small_budget_warning(service: Any) -> str | None:
    """A KV budget (per key) smaller than what one session of the default policy reserves: every such create is
    refused, which the operator should learn at start-up rather than from the first client."""
    limits = service.store.limits
    per_key = limits.tighter_key_limits[1]  # what a refusal names: the per-key share where it is the tighter one
    budget, what = (per_key, "the KV budget per key") if per_key is not None else (limits.kv_budget, "the KV budget")
    try:
        default = service.policies.resolve("", {}, service.engine.config, service.context_length)
    except InvalidArgument:  # the default policy is not served: nothing to compare
        return None
    need = service.kv_reserve(default)
    if budget is None or need <= budget:
        return None
    return (f"a {default.name} session reserves {size_text(need)} of KV cache at the context of "
            f"{service.context_length}, more than {what} ({size_text(budget)}): such sessions are "
            "refused; raise --kv-budget, shorten --context or use a bounded policy")


def _idle_text(server: Any) -> str:
    after = server.config.idle_compress_after_s
    if after is None:
        return "off"
    codec = server.service.idle_codec
    return f"after {after:g}s with {codec.label if codec else 'the session idle_codec only'}"


def chat(
    addr: str = typer.Option("127.0.0.1:50051", "--addr", help="Runtime address."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KAKEYA_API_KEY"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Upper bound per reply."),
    temperature: float = typer.Option(0.2, help="0 is greedy."),
    top_p: float | None = typer.Option(0.9, "--top-p"),
    seed: int | None = typer.Option(None, help="Fix the sampler for reproducible replies."),
    system: str | None = typer.Option(None, "--system", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="No chat template: append your text as-is (base models)."),
    tls: bool = typer.Option(False, "--tls", help="Connect over TLS, trusting the system's root certificates."),
    root_certificates: str | None = typer.Option(
        None, "--root-certificates", help="Connect over TLS, trusting this PEM file (e.g. the server's own cert)."),
) -> None:
    """Multi-turn terminal chat through the Python SDK, tokenizing client-side.

    Each turn appends only the new tokens to one server session; the stats line shows how many
    tokens were prefilled (the incremental delta, not the whole conversation). Commands: /reset,
    /info, /exit. A line of just \"\"\" starts a message of several lines (paste them), ended by
    another \"\"\" line. KAKEYA_API_KEY may hold the server's space-separated keys: the first is used.
    """
    problem = sdk_missing("kakeya chat")
    if problem:
        raise SystemExit(problem)
    with contextlib.suppress(ImportError):  # line editing, and lines past the terminal's 4095-byte line buffer
        import readline  # noqa: F401
    from kakeya import Client, KakeyaError, SessionNotFound, Unauthenticated, Unavailable
    from kakeya.tokenization import ChatTemplateMismatch, Tokenizer
    console = Console(highlight=False)
    out = sys.stdout
    problem = next((text for bad, text in (
        (max_tokens < 1, f"--max-tokens must be >= 1, got {max_tokens}"),
        (not 0 <= temperature <= 100, f"--temperature must be in [0, 100], got {temperature}"),
        (top_p is not None and not 0 < top_p <= 1, f"--top-p must be in (0, 1], got {top_p}"),
        (seed is not None and not 0 <= seed < 2**63, f"--seed must be in [0, 2**63), got {seed}"),
    ) if bad), None)
    if problem:  # before connecting, not at the first reply
        console.print(f"[red]error:[/] {problem}")
        raise typer.Exit(2)
    if root_certificates is not None and (problem := _pem_problem(root_certificates)):
        console.print(f"[red]error:[/] --root-certificates {root_certificates!r} {problem}")
        raise typer.Exit(2)
    api_key = next(iter((api_key or "").split()), None)  # KAKEYA_API_KEY may list the server's keys: the first
    try:
        client = Client(addr, api_key=api_key, tls=tls, root_certificates=root_certificates)
    except KakeyaError as e:  # a malformed key, checked before connecting
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    with client:
        try:
            info = client.model_info()
        except Unauthenticated as e:  # reached: the key is what is wrong
            console.print(f"[red]{addr} refused the API key:[/] {e} (pass --api-key or set KAKEYA_API_KEY)")
            raise typer.Exit(1) from None
        except Unavailable as e:
            secure = tls or root_certificates is not None
            hint = ("if it serves plaintext, leave out --tls/--root-certificates" if secure else
                    "if it serves TLS, pass --root-certificates (its certificate) or --tls")
            console.print(f"[red]cannot reach {addr}:[/] {e} ({hint})")
            raise typer.Exit(1) from None
        except KakeyaError as e:
            console.print(f"[red]{addr} answered:[/] {e}")
            raise typer.Exit(1) from None
        tok = Tokenizer.from_model_info(info)
        use_template = tok.has_chat_template and not raw
        console.print(f"[bold]{info.model_name}[/] at {addr} · context {info.context_length} · "
                      f"{'chat template' if use_template else 'raw text'} · /reset /info /exit")
        try:
            session = client.create_session()
        except KakeyaError as e:  # the server's limits (sessions, KV budget): its message, not a traceback
            console.print(f"[red]{type(e).__name__}:[/] {e}")
            raise typer.Exit(1) from None
        history: list[int] = []  # a mirror of the session history: appended + generated ids
        messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        try:
            while True:
                ended = False  # the input ended inside a block: its lines are sent, then the chat ends
                try:
                    user = console.input("[bold green]you>[/] ")
                    if user.rstrip() == '"""':  # a message of several lines, up to the next line that is """
                        lines = []  # (an indented """, as in pasted code, is part of the message)
                        try:
                            while (line := console.input("[dim]...[/] ")).rstrip() != '"""':
                                lines.append(line.rstrip("\r"))  # pasted CRLF text: the line ends, not its \r
                        except EOFError:
                            ended = True
                        user = "\n".join(lines)
                except EOFError:
                    out.write("\n")
                    break
                cmd = user.strip()
                if cmd in ("/exit", "/quit"):
                    break
                if cmd == "/reset":
                    session.close()
                    session, history = client.create_session(), []
                    messages = messages[:1] if system else []
                    console.print("[dim]new session[/]")
                    continue
                if cmd == "/info":
                    si = session.info()
                    console.print(f"[dim]session {si.session_id}: history {si.history_length}, cached "
                                  f"{si.cached_length}, KV {si.kv_live_bytes / 2**20:.1f} MiB"
                                  f"{' (compressed)' if si.kv_compressed else ''}, policy "
                                  f"{si.policy_label or si.policy.name}, attends to "
                                  f"{si.effective_attention_fraction:.0%} of the prefix, "
                                  f"invariant checks {si.inv1_checks}/{si.inv2_checks}[/]")
                    continue
                if not cmd:
                    if ended:
                        break
                    continue
                if use_template:
                    messages.append({"role": "user", "content": user})
                    try:
                        delta = tok.chat_delta(history, messages)
                    except ChatTemplateMismatch:
                        # The template rewrote earlier turns: the history cannot be extended, start over.
                        session.close()
                        session, history = client.create_session(), []
                        delta = tok.tokens_for_chat(messages)
                        console.print("[yellow]template re-render: new session, full prefill[/]")
                else:
                    preamble = system + "\n\n" if system and not history else ""  # raw text: the system text first
                    # the first turn with the tokenizer's own special tokens (BOS where the model wants one, as
                    # `kakeya generate --raw` encodes): not bos_token_id always (SmolLM2's is <|im_start|>)
                    delta = tok.encode(preamble + user + "\n", add_special_tokens=not history)
                room = info.context_length - len(history) - len(delta)
                if room < 1:
                    console.print("[red]context full:[/] /reset to start a new session")
                    if use_template:
                        messages.pop()
                    continue
                session.append(delta)
                history += delta
                reply_from = len(history)
                gen = session.generate(max_tokens=min(max_tokens, room), temperature=temperature,
                                       top_p=top_p if temperature > 0 else None, seed=seed)
                stream = tok.stream_decoder()
                console.print("[bold blue]bot>[/] ", end="")
                try:
                    for t in gen:
                        out.write(stream.push(t))
                        out.flush()
                    out.write(stream.flush() + "\n")
                except KeyboardInterrupt:
                    gen.cancel()
                    out.write(" [interrupted]\n")
                    history = _resync(session)
                else:
                    history += gen.token_ids
                # The reply is what the session holds (an interrupted one may hold a token we never saw), so the
                # next turn's template render extends the history and only the new turn is appended.
                reply = tok.decode(history[reply_from:], skip_special_tokens=True)
                if use_template:
                    messages.append({"role": "assistant", "content": reply})
                st = gen.stats
                if st is not None:
                    console.print(f"[dim]prefill {st.prefill_tokens} tok in {st.prefill_s * 1e3:.0f} ms · TTFT "
                                  f"{st.ttft_s * 1e3:.0f} ms · {st.decode_tokens} tok at "
                                  f"{st.decode_tokens_per_s:.1f} tok/s · history {len(history)}/{info.context_length}[/]")
                if ended:
                    break
        except SessionNotFound as e:
            console.print(f"\n[red]the server no longer has this session[/] ({e}): it was restarted without "
                          "--state-dir, or evicted the session; start `kakeya chat` again")
            raise typer.Exit(1) from None
        except KakeyaError as e:
            console.print(f"\n[red]{type(e).__name__}:[/] {e}")
            raise typer.Exit(1) from None
        finally:
            with contextlib.suppress(KakeyaError):
                session.close()


def _pem_problem(path: str) -> str | None:
    """Why `path` is not a PEM certificate file (None when it is one)."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        return f"is not a readable file ({e.strerror or e})"
    return None if b"-----BEGIN CERTIFICATE-----" in text else "holds no PEM certificate"


def _resync(session: Any) -> list[int]:
    """After an interrupted reply the server may have committed a token or two we never saw."""
    for _ in range(100):
        info = session.info(include_history=True)
        if not info.generating:
            return list(info.history_token_ids)
        time.sleep(0.02)
    return list(session.info(include_history=True).history_token_ids)
