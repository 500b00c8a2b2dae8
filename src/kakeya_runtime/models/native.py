"""Our CPU kernels (csrc/): built once per machine, loaded as torch ops.

- `kakeya::cached_attention(q, k, v, q_pos, k_pos, window, sink, scale)`: every attention call of the models
  (fresh prompts, chunks over a cache, decode steps, windows), one fixed order of operations per query.
- `kakeya::linear(x, w, bias, out_fp32)`: every projection and the LM head, one fixed order per output element.
- `kakeya::sparse_attention` / `kakeya::block_select`: the sparse KV policy's attention over an exact hot set and
  selected cold blocks, and its indexer (kv.sparse), with the same per-query invariance.

So a position's K/V and logits do not depend on the shape of the step they ran in (see layers.attend and
layers.linear). The library is compiled with g++ against the installed torch for this CPU (-march=native) on
first use, under the kakeya cache dir, keyed by the sources, the flags, torch's version, the compiler and the
CPU's feature flags; later processes load it in milliseconds. A build takes ~16 s.

`KAKEYA_ATTENTION=sdpa` switches to PyTorch's SDPA and GEMMs (faster on long fresh prompts, not invariant);
with the default `native`, kernels that cannot be built raise NativeKernelError instead of quietly running the
other path. `KAKEYA_AMX=0` keeps the kernels off AMX tiles (the AVX-512 paths CPUs without AMX take).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("cached_attention.cpp", "invariant_linear.cpp", "block_index.cpp"))
BACKEND_ENV = "KAKEYA_ATTENTION"
BACKENDS = ("native", "sdpa")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the attention kernel's compiled head sizes
CXXFLAGS = ("-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fopenmp")


class NativeKernelError(RuntimeError):
    """The native attention kernel could not be built or loaded (the message has the compiler's output)."""


_lock = threading.Lock()
_loaded: Path | None = None
_backend: str | None = None
_bf16_dot = False


def backend() -> str:
    """The attention backend in force: $KAKEYA_ATTENTION, else "native" (read once per process)."""
    global _backend
    if _backend is None:
        value = os.environ.get(BACKEND_ENV, "native").strip().lower() or "native"
        if value not in BACKENDS:
            raise NativeKernelError(f"{BACKEND_ENV}={value!r}: expected one of {BACKENDS}")
        _backend = value
    return _backend


def set_backend(value: str) -> None:
    """Choose the backend for this process ("native" builds/loads the kernel now)."""
    global _backend
    if value not in BACKENDS:
        raise NativeKernelError(f"attention backend {value!r}: expected one of {BACKENDS}")
    _backend = value
    if value == "native":
        load()


def enabled() -> bool:
    """Whether `layers.attend` uses the kernel: the backend is native (the kernel is built and loaded on the
    first call). Cheap after that."""
    if (_backend or backend()) != "native":
        return False
    if _loaded is None:
        load()
    return True


def bf16_amx() -> bool:
    """Whether bf16 attention and projections run on AMX tiles here (CPUs with AMX-BF16)."""
    load()
    return bool(torch.ops.kakeya.bf16_amx())


def bf16_dot() -> bool:
    """Whether the kernel was built with AVX512-BF16 dot products (its bf16 chunk path beats SDPA's then)."""
    load()
    return _bf16_dot


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the kernel has code for (anything else stays on SDPA)."""
    return head_dim in HEAD_DIMS and dtype in (torch.float32, torch.bfloat16)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     scale: float, *, window: int | None = None, sink: int = 0) -> torch.Tensor:
    """q (B, Hk, R, D) rows ordered (group, token), T = len(q_pos) tokens; k, v (B, Hk, S, D) at positions
    k_pos (S,). Token t sees key j iff k_pos[j] <= q_pos[t] and, with a window, q_pos[t] - k_pos[j] < window
    or k_pos[j] < sink. Each query's result depends only on the keys it sees. Returns (B, Hk, R, D)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.cached_attention(q, k, v, q_pos, k_pos, window or 0, sink, scale)


def sparse_attention(q: torch.Tensor, hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     cold: tuple[torch.Tensor, ...], select: torch.Tensor, q_pos: torch.Tensor,
                     scale: float, *, window: int, sink: int, block: int,
                     cold_head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two key sources: `hot` (k, v, positions) exact, seen by token t at positions below `sink`
    or in its hot range hot_lo(t)..t (the last `window` positions extended down to a block boundary counted
    from `sink`), and `cold` (k, v (B, Hk, U * block, D) blocks in q's dtype, slot (N,) int64: where block j is,
    -1 if absent; or k, v int8 codes, k_scale, v_scale fp16 (B, Hk, U * block), slot): token t attends the blocks
    its `select` bitset (B, Hk, T, words) names among those wholly below hot_lo(t), packed in its own lanes; a
    selected block that is absent raises. Cold tensors hold the heads `cold_head` (Hk,) maps to (-1: a head with
    no cold tier; default: every head, in order). Returns the output (B, Hk, R, D) and the keys each row saw,
    (B, Hk, R, 2) int64 (hot, cold)."""
    if _loaded is None:
        load()
    k, v, *scales, slot = cold
    k_scale, v_scale = scales if scales else (None, None)
    if cold_head is None:
        cold_head = torch.arange(q.shape[1])
    return torch.ops.kakeya.sparse_attention(q, *hot, k, v, k_scale, v_scale, slot, cold_head, select, q_pos, window,
                                             sink, block, scale)


def block_select(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, q_pos: torch.Tensor, *, window: int,
                 sink: int, block: int, topk: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse policy's indexer: for each token (rows of q (B, Hk, R, D) ordered (group, token)) the top-k
    cold blocks by Quest's bound over the per-block key min/max (B, Hk, N, D), among the n(t) blocks wholly
    outside its window. `topk`: one for every head, or (Hk,) int64 per head (0: a streaming head, which has no
    summaries: kmin/kmax then hold only the heads with topk > 0). Returns (select (B, Hk, T, words) int64
    bitsets, scored (B, Hk, T) int64 = n(t), 0 for streaming heads); raises when a token could select a block
    that has no summary."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.block_select(q, kmin, kmax, q_pos, window, sink, block, _per_head(topk, q.shape[1]))


def sparse_check(seen: torch.Tensor, scored: torch.Tensor, q_pos: torch.Tensor, *, window: int, sink: int,
                 block: int, topk: int | torch.Tensor) -> torch.Tensor:
    """The sparse step's tripwire on sparse_attention's `seen` counts: raises unless every query row saw exactly
    its sinks and hot range and min(topk, scored) whole cold blocks. Returns int64 (6,): query tokens x KV heads,
    blocks scored, blocks selected, keys attended, keys visible, and the newest token's attended keys (summed
    over batch and KV heads)."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.sparse_check(seen, scored, q_pos, window, sink, block, _per_head(topk, seen.shape[1]))


def _per_head(topk: int | torch.Tensor, heads: int) -> torch.Tensor:
    return topk if isinstance(topk, torch.Tensor) else torch.full((heads,), topk, dtype=torch.long)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_fp32: bool = False) -> torch.Tensor:
    """y = x W^T (+ b) for x (M, K), W (N, K): each output element by one fixed sequence of operations,
    whatever M is (csrc/invariant_linear.cpp). `out_fp32`: the fp32 sums, not rounded to x's dtype."""
    if _loaded is None:
        load()
    return torch.ops.kakeya.linear(x, weight, bias, out_fp32)


def linear_path(dtype: torch.dtype, in_features: int, out_features: int) -> str:
    """Which code a weight of this shape runs on here: "amx", "avx512-bf16", "avx512" or "generic"."""
    load()
    return torch.ops.kakeya.linear_path(1 if dtype == torch.bfloat16 else 0, in_features, out_features)


def library_path() -> Path:
    """Where this machine's build lives: one file per (source, flags, torch, compiler, CPU features)."""
    from kakeya_runtime.models.loader import cache_root  # loader imports the model code, which imports us

    key = hashlib.sha256()
    for source in sorted(SOURCES[0].parent.iterdir()):  # the sources and the headers they share
        key.update(source.read_bytes())
    key.update(" ".join(CXXFLAGS).encode())
    key.update(torch.__version__.encode())
    key.update(_compiler_version().encode())
    key.update(_cpu_flags().encode())
    return cache_root() / "kernels" / key.hexdigest()[:16] / "cached_attention.so"


def load() -> Path:
    """Build (once per machine) and load the kernel library; idempotent and thread-safe."""
    global _loaded, _bf16_dot
    with _lock:
        if _loaded is not None:
            return _loaded
        path = library_path()
        if not path.exists():
            build(path)
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise NativeKernelError(f"loading {path} failed: {e}; delete it to rebuild, or set "
                                    f"{BACKEND_ENV}=sdpa") from None
        _register_fake()
        _bf16_dot = bool(torch.ops.kakeya.bf16_dot())
        _loaded = path
        return path


def build(path: Path) -> Path:
    """Compile the kernel to `path`; concurrent builders wait on a file lock and reuse the first result."""
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        lib_dir = cpp_extension.library_paths()[0]
        cmd = [
            os.environ.get("CXX", "g++"), *CXXFLAGS,
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            *(str(s) for s in SOURCES), "-o", str(tmp),
            f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}",
        ]
        print(f"kakeya: building the attention kernel for this CPU (once) -> {path}", file=sys.stderr)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise NativeKernelError(f"no C++ compiler ({e.filename}); install g++ or set {BACKEND_ENV}=sdpa") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise NativeKernelError(f"building the kernels failed (exit {done.returncode}); set "
                                    f"{BACKEND_ENV}=sdpa to run without it.\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
        return path


def _register_fake() -> None:
    """Shapes for torch.compile's tracing (engine.compiled): the op returns a tensor shaped like q."""
    if getattr(_register_fake, "done", False):
        return
    torch.library.register_fake("kakeya::cached_attention")(
        lambda q, k, v, q_pos, k_pos, window, sink, scale: q.new_empty(q.shape))
    torch.library.register_fake("kakeya::sparse_attention")(
        lambda q, *args: (q.new_empty(q.shape), q.new_empty(*q.shape[:3], 2, dtype=torch.long)))
    torch.library.register_fake("kakeya::linear")(
        lambda x, w, bias, out_fp32=False: x.new_empty(x.shape[0], w.shape[0],
                                                       dtype=torch.float32 if out_fp32 else x.dtype))
    _register_fake.done = True


def _compiler_version() -> str:
    try:
        return subprocess.run([os.environ.get("CXX", "g++"), "--version"], capture_output=True,
                              text=True).stdout.split("\n", 1)[0]
    except FileNotFoundError:
        return "no compiler"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


if __name__ == "__main__":  # `python -m kakeya_runtime.models.native`: build now (make setup does)
    print(load())
