"""What machine a benchmark ran on, for the evidence JSON (and a short slug for file names)."""

from __future__ import annotations

import os
import platform
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info() -> dict[str, Any]:
    """CPU, cores, threads torch uses, RAM, how fast memory reads now, and library versions."""
    import psutil
    import torch

    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cpus": psutil.cpu_count(logical=True),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "isa": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                                                  "amx_int8", "avx_vnni"}),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "nice": os.nice(0),
        "autogroup": _read("/proc/self/autogroup"),  # Linux groups a session's processes; its nice applies
        "memory_read_gb_s": memory_read_gb_s(),
    }
    for pkg in ("transformers", "llama_cpp"):
        info[pkg] = package_version(pkg)
    return info


def memory_read_gb_s(mib: int = 256, repeats: int = 5) -> float:
    """How fast this machine reads memory right now, GB/s: the best of `repeats` sums of a `mib` MiB fp32 tensor
    (far larger than any cache here), on torch's threads. A decode step streams its weights and K/V, so its speed
    follows this number, which a neighbour's memory traffic lowers while the CPU still reads idle."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # pages touched, threads up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return round(x.nbytes / best / 1e9, 2)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def package_version(module: str) -> str | None:
    from importlib import metadata

    dist = {"llama_cpp": "llama-cpp-python"}.get(module, module)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_slug(info: dict[str, Any] | None = None) -> str:
    """Short file-name-safe id, e.g. `xeon-2.10ghz-2c`."""
    info = info or machine_info()
    model = info["cpu_model"].lower()
    model = re.sub(r"\(r\)|\(tm\)|cpu|processor|intel|@", " ", model)
    words = [w for w in re.split(r"[^a-z0-9.]+", model) if w][:3]
    return "-".join([*words, f"{info['affinity_cpus'] or info['logical_cpus']}c"])


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux `clear_refs` 5), so a later peak covers only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
