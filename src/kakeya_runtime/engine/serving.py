"""What `kakeya serve` runs: a weight format (engine.weights) and, optionally, the compiled decode step
(engine.compiled), chosen per model and per machine.

Served formats keep INV-3: a quantized linear runs every row count through its int kernel
(`Prefill.KERNEL`), never the dequantize-then-matmul prefill path, whose numbers differ from the kernel's
(a session built turn by turn would then differ from one built in one shot). That holds only if the int
kernel's result for a row does not depend on how many rows share the call, which depends on the torch
build and the CPU: `kernel_rows_invariant` checks it on this machine, and a format that fails is refused.

`--weights auto` (the default) picks, among the formats that are
- faithful: next-token KL vs our bf16 <= FIDELITY_KL_MAX and top-1 agreement >= FIDELITY_TOP1_MIN over
  FIDELITY_POSITIONS positions of the bench text (CPython's language reference). It depends on the model,
  the format and the kernels' numerics, so it is measured once per model file, format and kernel build and cached;
- invariant on this machine (above),
the one that serves REFERENCE_TURN (a turn's new tokens prefilled, then its reply decoded) fastest, from
prefill and decode rates measured on this machine (each format's best of two rounds, the second in reverse order;
eager; cached per machine: CPU, threads, torch, kernels).
Both caches live in one JSON file under the kakeya cache dir; `recalibrate` measures again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kakeya_runtime.engine.weights import (
    Int4Linear,
    Int5Linear,
    Int8Linear,
    Prefill,
    WeightFormat,
    int8_grid,
    quantize_model,
)
from kakeya_runtime.models import native

_log = logging.getLogger(__name__)

AUTO = "auto"
FORMATS: tuple[str, ...] = tuple(f.value for f in WeightFormat)
FIDELITY_KL_MAX = 0.01  # nats, mean over positions
FIDELITY_TOP1_MIN = 0.95
# Top-1 agreement near 0.95 has a standard error of ~0.7% over 1,024 positions, ~1.4% over 256, where Gemma 3's
# int4-mixed read 0.942 on the first 256 and 0.960 on 1,024 (int8: 0.949, 0.955): one position decided it.
FIDELITY_POSITIONS = 1024
FIDELITY_CHUNK = 128  # positions compared at a time (Gemma 3's 1,024 x 262,144 fp32 logits alone are 1 GB)
# The turn `auto` minimises: new tokens prefilled, tokens generated. An agent turn reads more than it writes (a
# tool result in, a reply out); at 512:128 int4's faster decode won here while prefilling 3.5x slower than bf16.
REFERENCE_TURN = (1024, 128)
SPEED_DECODE_STEPS = 32
CALIBRATION_VERSION = 4  # bump when what is measured, or how a format is built, changes


class ServingError(ValueError):
    """A --weights / --compile request that cannot be served (unknown format, not invariant here, ...)."""


def parse_weights(text: str) -> str:
    """'auto' or a weight format name (case-insensitive); ServingError listing the choices otherwise."""
    value = text.strip().lower()
    if value == AUTO or value in FORMATS:
        return value
    raise ServingError(f"--weights must be {AUTO} or one of {', '.join(FORMATS)}, got {text!r}")


def load_dtype(fmt: str) -> torch.dtype:
    """The dtype to load weights in before `apply_format`: quantized formats start from fp32, where the
    loader's weights hold a GGUF file's values exactly."""
    return torch.float32 if fmt in ("fp32", "int8", "int4", "int4-mixed") else torch.bfloat16


def apply_format(model: nn.Module, fmt: str) -> nn.Module:
    """Convert a model loaded in `load_dtype(fmt)` to the served form of `fmt`, in place. bf16 and fp32 are
    served as loaded; quantized formats run every row count through the int kernel (INV-3)."""
    f = WeightFormat(fmt)
    if f.quantized:
        quantize_model(model, f, prefill=Prefill.KERNEL)
    return model.eval()


def kernel_rows_invariant(fmt: str, *, rows: int = 300) -> bool:
    """Whether this machine's int kernel(s) for `fmt` give a row the same bits whatever rows share its call
    (one row, chunks of several sizes, all at once). True for the unquantized formats (our kernels' job)."""
    f = WeightFormat(fmt)
    if not f.quantized:
        return True
    kinds = {WeightFormat.INT8: (Int8Linear,), WeightFormat.INT4: (Int4Linear,),
             WeightFormat.INT4_MIXED: (Int8Linear, Int4Linear) + ((Int5Linear,) if native.enabled() else ())}[f]
    g = torch.Generator().manual_seed(0)
    modules: list = [(kind, n, k, None) for kind in kinds for n, k in ((192, 256), (64, 512))]
    if native.enabled():  # grouped int8 (a Q8_0 head, in every int format) has its own kernel (q8_linear)
        modules += [(Int8Linear, n, k, "q8_0") for n, k in ((192, 256), (64, 512))]
    for kind, n, k, grid in modules:
        w = torch.randn(n, k, generator=g) * 0.05
        if grid is not None:  # snapped to Q8_0 blocks: d = the group's largest magnitude / 127, in fp16
            d = (w.view(n, k // 32, 32).abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
            w = (torch.round(w.view(n, k // 32, 32) / d) * d).view(n, k)
        exact = None if grid is None else int8_grid(w)
        if grid is not None and exact is None:
            raise AssertionError("the Q8_0 probe weight is not on its own grid")
        lin = kind(w, None) if grid is None else Int8Linear(w, None, grid=exact)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            whole = lin.kernel_mm(x)
            for size in (1, 3, 16, 64, 128, 257):
                parts = torch.cat([lin.kernel_mm(x[i : i + size]) for i in range(0, rows, size)])
                if not torch.equal(parts, whole):
                    return False
    return True


# ------------------------------------------------------------------------------------------------
# measurements


@dataclass(slots=True)
class Fidelity:
    """Next-token agreement with our bf16 over the bench text."""

    positions: int
    kl_mean: float
    kl_max: float
    top1_agree: float

    @property
    def faithful(self) -> bool:
        return self.kl_mean <= FIDELITY_KL_MAX and self.top1_agree >= FIDELITY_TOP1_MIN


@dataclass(slots=True)
class Speed:
    """Eager rates on this machine: a REFERENCE_TURN[0]-token prefill, then decode steps right after it."""

    prefill_tok_s: float
    decode_tok_s: float

    def turn_s(self, turn: tuple[int, int] = REFERENCE_TURN) -> float:
        return turn[0] / self.prefill_tok_s + turn[1] / self.decode_tok_s


@dataclass(slots=True)
class Candidate:
    fmt: str
    invariant: bool
    fidelity: Fidelity | None  # None: the reference itself (bf16)
    speed: Speed | None = None  # measured only for formats that may be served
    cached: bool = False  # fidelity and speed came from the calibration file

    @property
    def faithful(self) -> bool:
        return self.fidelity is None or self.fidelity.faithful

    @property
    def eligible(self) -> bool:
        return self.faithful and self.invariant

    def why_not(self) -> str:
        if not self.invariant:
            return "its int kernel gives a row different bits depending on the rows beside it on this machine"
        if not self.faithful:
            assert self.fidelity is not None
            return (f"not faithful: KL {self.fidelity.kl_mean:.4f} (max {FIDELITY_KL_MAX}), top-1 "
                    f"{self.fidelity.top1_agree:.3f} (min {FIDELITY_TOP1_MIN})")
        return ""


@dataclass(slots=True)
class ServingChoice:
    """The configuration a server runs, and how it was arrived at (printed at start-up, in GetModelInfo, in
    /metrics)."""

    weights: str
    compiled: bool
    source: str  # "flag" (--weights) or "auto"
    invariant: bool  # the format's kernels are row-invariant here (our kernels handle the rest of INV-3)
    fidelity: Fidelity | None = None  # vs bf16; None for bf16 itself, or a flag-chosen format never measured
    speed: Speed | None = None  # eager, measured at start-up or cached
    decode_tok_s: float | None = None  # the served decode step (compiled if so), measured after warm-up
    compile_s: float | None = None
    candidates: list[Candidate] = field(default_factory=list)
    verify_cost: tuple[float, ...] | None = None  # a speculative verifier step's extra cost (Engine.verify_cost)

    def describe(self) -> str:
        parts = [f"weights {self.weights} ({self.source})", f"decode {'compiled' if self.compiled else 'eager'}"]
        if self.fidelity is not None:
            parts.append(f"KL vs bf16 {self.fidelity.kl_mean:.4f}, top-1 {self.fidelity.top1_agree:.3f}")
        if self.decode_tok_s:
            parts.append(f"decode {self.decode_tok_s:.1f} tok/s (the served step, measured now)")
        if self.compile_s is not None:
            parts.append(f"compiled in {self.compile_s:.0f} s")
        if self.verify_cost is not None:
            parts.append(f"a verifier step of 4 drafts costs {1 + self.verify_cost[4]:.2f} decode steps")
        return "; ".join(parts)


def bench_text_ids(encode: Callable[[str], list[int]], n: int) -> list[int]:
    """The first n tokens of the bench text (CPython's language reference), repeated if short."""
    from pydoc_data.topics import topics

    ids = encode("\n\n".join(topics[k] for k in sorted(topics)[:40]))
    if not ids:
        raise ServingError("the bench text encodes to no tokens")
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


@torch.inference_mode()
def measure_fidelity(ref: nn.Module, model: nn.Module, ids: Sequence[int], *, chunk: int = FIDELITY_CHUNK) -> Fidelity:
    """Next-token KL(ref || model) in nats (mean and max over positions) and top-1 agreement over `ids`. Both models
    prefill the same chunks into their caches and are compared chunk by chunk, so memory holds one chunk's logits,
    not the whole text's."""
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.models.base import Logits

    ids = list(ids)[: min(ref.config.max_position_embeddings, model.config.max_position_embeddings)]
    engines = [Engine(m, prefill_chunk=chunk) for m in (ref, model)]
    caches = [engine.new_cache(capacity=len(ids)) for engine in engines]
    kl_sum, kl_max, agree = 0.0, 0.0, 0
    for c0 in range(0, len(ids), chunk):
        piece = torch.tensor([ids[c0:c0 + chunk]], dtype=torch.long)
        a, b = (engine.prefill(cache, piece, logits=Logits.ALL).logits[0].float().log_softmax(-1)
                for engine, cache in zip(engines, caches, strict=True))
        kl = (a.exp() * (a - b)).sum(-1).clamp(min=0)
        kl_sum, kl_max = kl_sum + float(kl.sum()), max(kl_max, float(kl.max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    return Fidelity(positions=len(ids), kl_mean=kl_sum / len(ids), kl_max=kl_max, top1_agree=agree / len(ids))


def measure_speed(engine: Any, ids: Sequence[int], *, steps: int = SPEED_DECODE_STEPS) -> Speed:
    """Prefill `ids` from an empty cache, then `steps` decode steps; eager or as `engine` is set up. A model with
    a shorter context than that prefills fewer tokens."""
    ids = list(ids)[: engine.config.max_position_embeddings - steps - 1]
    t = torch.tensor([list(ids)], dtype=torch.long, device=engine.device)
    warm = engine.new_cache(capacity=min(len(ids), 64) + 4)
    out = engine.prefill(warm, t[:, :min(len(ids), 64)])  # first-call costs off the clock
    engine.decode_step(warm, out.logits[:, -1].argmax(-1, keepdim=True))
    cache = engine.new_cache(capacity=len(ids) + steps + 1)
    t0 = time.perf_counter()
    out = engine.prefill(cache, t)
    prefill_s = time.perf_counter() - t0
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = engine.decode_step(cache, tok).logits[:, -1].argmax(-1, keepdim=True)
    decode_s = time.perf_counter() - t0
    return Speed(prefill_tok_s=len(ids) / prefill_s, decode_tok_s=steps / decode_s)


# ------------------------------------------------------------------------------------------------
# the calibration file


CALIBRATION_ENV = "KAKEYA_SERVE_CALIBRATION"


def calibration_path() -> Path:
    """$KAKEYA_SERVE_CALIBRATION, else serve/calibration.json in the kakeya cache dir (models.loader.cache_root)."""
    env = os.environ.get(CALIBRATION_ENV)
    if env:
        return Path(env)
    from kakeya_runtime.models.loader import cache_root

    return cache_root() / "serve" / "calibration.json"


def kernels_key() -> str:
    """The kernels a measurement ran on: the attention backend and, for ours, their build (source, flags, torch,
    compiler, CPU: models.native.library_path's key). A new build can move last bits, and with them a few top-1 picks
    (the engine bench's Gemma 3 int4-mixed over 256 positions: 0.961 on an earlier tree, 0.938 on this one), and
    speeds: both are measured again."""
    from kakeya_runtime.models import native

    kernels = native.backend()
    if kernels == "native":
        kernels += ("+amx" if native.bf16_amx() else "") + "@" + _native_build()
    return kernels


@functools.cache
def _native_build() -> str:  # hashes the kernel sources and asks the compiler its version: once a process
    from kakeya_runtime.models import native

    return native.library_path().parent.name


def machine_key() -> str:
    """What a speed measurement depends on besides the model and format: the CPU, the threads, torch, our kernels."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|cores={os.cpu_count()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{kernels_key()}"


def model_key(source: str | Path | None, name: str) -> str:
    """A model file (or directory) identity: its path, size and mtime; for a directory (a Hugging Face model) every
    file in it, so weights replaced inside it are measured again (the directory's own mtime does not move when a
    file in it is overwritten); a name alone for in-memory models."""
    if source is None:
        return f"name:{name}"
    p = Path(source)
    try:
        st = p.stat()
        key = f"{p.resolve()}|{st.st_size}|{int(st.st_mtime)}"
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file())
            key += "|" + hashlib.sha256("\x1f".join(
                f"{f.name}:{(s := f.stat()).st_size}:{s.st_mtime_ns}" for f in files).encode()).hexdigest()[:16]
        return key
    except OSError:
        return f"name:{name}"


class Calibration:
    """Fidelity per (model, format, kernels) and speed per (machine, model, format), kept in one JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"version": CALIBRATION_VERSION, "fidelity": {}, "speed": {}}
        self.dirty = False  # something was measured since the file was read
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if (isinstance(data, dict) and data.get("version") == CALIBRATION_VERSION
                        and isinstance(data.get("fidelity"), dict) and isinstance(data.get("speed"), dict)):
                    self.data = data
            except (OSError, ValueError):
                pass  # unreadable or not ours: measure again and overwrite

    @staticmethod
    def _key(*parts: str) -> str:
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]

    def fidelity(self, model: str, fmt: str) -> Fidelity | None:
        d = self.data["fidelity"].get(self._key(model, fmt, torch.__version__, kernels_key()))
        try:
            return None if d is None else Fidelity(d["positions"], d["kl_mean"], d["kl_max"], d["top1_agree"])
        except (KeyError, TypeError):  # a damaged entry: measured again
            return None

    def speed(self, machine: str, model: str, fmt: str) -> Speed | None:
        d = self.data["speed"].get(self._key(machine, model, fmt))
        try:
            return None if d is None else Speed(d["prefill_tok_s"], d["decode_tok_s"])
        except (KeyError, TypeError):
            return None

    def measured(self, model: str, formats: Sequence[str]) -> bool:
        """Whether calibrate() would measure nothing: every format's fidelity (bf16 is the reference) is kept, and
        its speed on this machine where it may be served (faithful and row-invariant: calibrate measures no other's
        speed, so a kept unfaithful format did not mean minutes of measuring at every start)."""
        machine = machine_key()
        for f in formats:
            fidelity = None if f == "bf16" else self.fidelity(model, f)
            if f != "bf16" and fidelity is None:
                return False
            servable = (fidelity is None or fidelity.faithful) and kernel_rows_invariant(f)
            if servable and self.speed(machine, model, f) is None:
                return False
        return True

    def put_fidelity(self, model: str, fmt: str, value: Fidelity) -> None:
        self.data["fidelity"][self._key(model, fmt, torch.__version__, kernels_key())] = asdict(value) | {
            "model": model, "fmt": fmt, "kernels": kernels_key()}
        self.dirty = True

    def put_speed(self, machine: str, model: str, fmt: str, value: Speed) -> None:
        self.data["speed"][self._key(machine, model, fmt)] = asdict(value) | {"machine": machine, "model": model,
                                                                              "fmt": fmt}
        self.dirty = True

    def save(self) -> None:
        """Write the file (a read-only or full cache directory: a warning, and the next start measures again)."""
        if self.path is None or not self.dirty:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            _log.warning("could not save the serving calibration to %s (%s); the next start measures again",
                         self.path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()


# ------------------------------------------------------------------------------------------------
# choosing


Progress = Callable[[str], None]


def calibrate(load: Callable[[str], nn.Module], encode: Callable[[str], list[int]], model: str,
              formats: Sequence[str] = FORMATS, *, calibration: Calibration | None = None,
              recalibrate: bool = False, progress: Progress | None = None) -> list[Candidate]:
    """Fidelity (vs bf16), row invariance and speed of each format in `formats`, measured or from `calibration`.

    `load(fmt)` returns a fresh model already in `fmt`'s served form; `encode` tokenizes text; `model` keys the
    cache (see model_key). Speed is measured only for faithful, invariant formats."""
    from kakeya_runtime.engine.generate import Engine

    cal = calibration or Calibration(None)
    machine = machine_key()
    say = progress or (lambda _msg: None)
    ids = bench_text_ids(encode, max(FIDELITY_POSITIONS, REFERENCE_TURN[0]))
    fid_ids, speed_ids = ids[:FIDELITY_POSITIONS], ids[:REFERENCE_TURN[0]]
    todo = list(dict.fromkeys(formats))
    need_ref = any(f != "bf16" and (recalibrate or cal.fidelity(model, f) is None) for f in todo)
    ref: nn.Module | None = None  # the bf16 model, the reference
    out: list[Candidate] = []
    measured: list[Candidate] = []  # speeds measured in this call (the rest came from the cache)
    last: nn.Module | None = None  # the last measured format's model
    for fmt in sorted(todo, key=lambda f: f != "bf16"):  # bf16 first: it is the reference
        invariant = kernel_rows_invariant(fmt)
        fidelity = None if fmt == "bf16" or recalibrate else cal.fidelity(model, fmt)
        cand = Candidate(fmt, invariant, fidelity, None if recalibrate else cal.speed(machine, model, fmt),
                         cached=True)
        m: nn.Module | None = None
        if fmt != "bf16" and fidelity is None:
            cand.cached = False
            if ref is None:
                say("bf16: loading the reference")
                ref = load("bf16")
            say(f"{fmt}: loading")
            m = load(fmt)
            say(f"{fmt}: fidelity")
            cand.fidelity = measure_fidelity(ref, m, fid_ids)
            cal.put_fidelity(model, fmt, cand.fidelity)
        if cand.eligible and cand.speed is None:
            cand.cached = False
            if m is None:
                say(f"{fmt}: loading")
                m = load(fmt)
            if fmt == "bf16" and need_ref and ref is None:
                ref = m  # kept as the reference for the formats after it
            say(f"{fmt}: speed")
            cand.speed = measure_speed(Engine(m), speed_ids)
            measured.append(cand)
            last = m  # the second round starts with this format: no reload
        del m
        out.append(cand)
        say(f"{fmt}: done")
    # A second round in reverse order, each format keeping its best: a format measured while the machine ran slow
    # (a job ending beside it) is measured again beside the others. One round once cached int4 at 47 tok/s against
    # bf16's 71 on the EPYC, where both measured on the idle machine give 137 and 51 (docs/evidence.md, concurrent).
    if len(measured) > 1:
        for i, cand in enumerate(reversed(measured)):
            say(f"{cand.fmt}: speed again")
            again = measure_speed(Engine(last if i == 0 and last is not None else load(cand.fmt)), speed_ids)
            last = None
            first = cand.speed
            assert first is not None
            cand.speed = Speed(max(first.prefill_tok_s, again.prefill_tok_s), max(first.decode_tok_s, again.decode_tok_s))
    for cand in measured:
        cal.put_speed(machine, model, cand.fmt, cand.speed)
    cal.save()
    return out


def pick(candidates: Sequence[Candidate], turn: tuple[int, int] = REFERENCE_TURN) -> Candidate:
    """The eligible candidate with the shortest reference turn (bf16 when nothing else qualifies)."""
    eligible = [c for c in candidates if c.eligible and c.speed is not None]
    if not eligible:
        bf16 = [c for c in candidates if c.fmt == "bf16"]
        if bf16:
            return bf16[0]
        raise ServingError("no weight format is both faithful and invariant on this machine")
    return min(eligible, key=lambda c: c.speed.turn_s(turn))  # type: ignore[union-attr]


def check_requested(fmt: str) -> bool:
    """For an explicit --weights: refuse a quantized format whose kernel is not row-invariant here."""
    if not kernel_rows_invariant(fmt):
        raise ServingError(f"--weights {fmt}: this machine's {fmt} kernel gives a row different bits depending on "
                           "the rows beside it, so a session built turn by turn would differ from one built in one "
                           "shot; serve bf16 or another format")
    return True


def served_as_loaded(model: nn.Module, compiled: bool) -> ServingChoice:
    """The choice a server embedded without `kakeya serve`'s (tests, benches) reports: the model as it is."""
    from kakeya_runtime.engine.weights import QuantLinear
    from kakeya_runtime.models import native

    kinds = {type(m) for name, m in model.named_modules() if isinstance(m, QuantLinear) and name != "lm_head"}
    if kinds:
        fmt = "int8" if kinds == {Int8Linear} else "int4" if kinds == {Int4Linear} else "int4-mixed"
        invariant = all(m.prefill is Prefill.KERNEL for m in model.modules() if isinstance(m, QuantLinear))
    else:
        dtype = next(model.parameters()).dtype
        fmt = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))
        invariant = True
    return ServingChoice(weights=fmt, compiled=compiled, source="as loaded",
                         invariant=invariant and native.backend() == "native")


def compiled_step_invariant(model: nn.Module, compiled: Any, ids: Sequence[int], *, steps: int = 8) -> bool:
    """INV-3 for a compiled decode step on this machine: `ids` prefilled in one shot (eager) against all but the
    last `steps` prefilled and those fed as decode steps through `compiled`: the same last logits and the same
    cache, bit for bit. Inductor generates its own reductions and elementwise kernels, whose rounding may differ
    from eager's on some shapes and CPUs: then the compiled step would write other K/V than a prefill does."""
    from kakeya_runtime.engine.generate import Engine

    ids = list(ids)[: model.config.max_position_embeddings]
    t = torch.tensor([ids], dtype=torch.long)
    eager = Engine(model)  # caches made outside inference mode, as sessions make theirs (the engine's calls are in it)
    ref = eager.new_cache(capacity=len(ids))
    ref_logits = eager.prefill(ref, t).logits
    stepped = Engine(model)
    stepped.decode_forward = compiled
    cache = stepped.new_cache(capacity=len(ids))
    stepped.prefill(cache, t[:, : len(ids) - steps])
    logits = None
    for i in range(len(ids) - steps, len(ids)):
        logits = stepped.decode_step(cache, t[:, i : i + 1]).logits
    if logits is None or not torch.equal(logits, ref_logits):
        return False
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
               for x, y in zip(ref.state(), cache.state(), strict=True))
