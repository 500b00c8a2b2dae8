"""KV snapshots: a session's cache as bytes, and back, verified against the history it claims to hold.

A snapshot is the cache's own `state()` (every policy has one: full, sink_window, restore, sparse; an idle-
compressed cache gives what decompressing it would give) written with safetensors, plus metadata: the number of
history tokens the cache holds (`cached_length`), a SHA-256 of those tokens, and the model it was computed by.
Loading checks all three before the cache is used, and then that every layer holds exactly `cached_length`
positions; any mismatch raises SnapshotError and the caller recomputes the cache from the history instead,
which is exact by construction (a position's K/V do not depend on how the prefill was chunked). The bytes
themselves are checksummed by their record (sessions.records).

Two identities: `model_fingerprint` names the weights as served (format and kernels' packing included), which a
snapshot must match; `checkpoint_id` names the checkpoint they were made from, whatever the format, dtype or build,
which token histories (journals, archives) must match: a restart in another weight format keeps its sessions and
recomputes their caches.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kakeya_runtime.kv.cache import CacheError, ModelKV
from kakeya_runtime.models.base import DecoderModel


class SnapshotError(ValueError):
    """A snapshot that does not belong to this model, history or cache."""


def history_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def model_fingerprint(name: str, model: DecoderModel, dtype: torch.dtype) -> str:
    """Which weights computed a cache: the model's name, dtype, parameter shapes and a sample of every parameter's
    values (its first and last 64), so a different checkpoint of the same architecture never matches."""
    h = hashlib.sha256(f"{name}|{dtype}".encode())
    for pname, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:]]).to(torch.float32).cpu().numpy().tobytes()
        h.update(f"{pname}|{tuple(p.shape)}|{p.dtype}|".encode() + sample)
    return f"{name}:{h.hexdigest()[:16]}"


# A checkpoint is identified by its files' contents: sizes and these many evenly spaced 4 KiB samples (and the last
# 4 KiB) of each, 256 KiB read a start; a fine-tune changes the bytes of every tensor. Not by its name or path: the
# bundled name and a path to the same file, or a moved or renamed copy, are the same checkpoint.
_FILE_SAMPLES, _SAMPLE_BYTES = 64, 4096
_WEIGHT_FILES = (".gguf", ".safetensors", ".bin")
_DIR_FILES = ("config.json", "tokenizer.json")
_ID_RE = re.compile(r"^(.*)([:@#])([0-9a-f]{16})$")  # name:weights, name@checkpoint (named), name#checkpoint


def checkpoint_id(name: str, source: str | Path) -> str:
    """The checkpoint at `source` (a GGUF file, or a model directory: its weight files, config.json and
    tokenizer.json), from sampled bytes: the same for every weight format and dtype it is served in, and for every
    name or path it is served by (`name` only labels the id)."""
    path = Path(source)
    single = path.is_file()
    files = [path] if single else sorted(
        p for p in path.iterdir() if p.is_file() and (p.suffix in _WEIGHT_FILES or p.name in _DIR_FILES))
    h = hashlib.sha256(b"checkpoint")
    for f in files:
        size = f.stat().st_size
        h.update(f"|{'' if single else f.name}|{size}|".encode())  # a directory's layout is content; a file's name not
        with f.open("rb") as fh:
            for i in range(_FILE_SAMPLES):
                fh.seek(size * i // _FILE_SAMPLES)
                h.update(fh.read(_SAMPLE_BYTES))
            fh.seek(max(0, size - _SAMPLE_BYTES))
            h.update(fh.read())
    return f"{name}#{h.hexdigest()[:16]}"


def checkpoint_id_of(name: str, model: DecoderModel) -> str:
    """checkpoint_id for a model with no file (built in memory): its parameters' shapes and samples in bf16, so
    the same for an fp32 and a bf16 copy of it (a quantized copy is another checkpoint here)."""
    h = hashlib.sha256(b"checkpoint")
    for pname, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:64], flat[-64:]]).to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
        h.update(f"{pname}|{tuple(p.shape)}|".encode() + sample)
    return f"{name}#{h.hexdigest()[:16]}"


def model_name(identity: str) -> str:
    """The model name inside a model_fingerprint or checkpoint_id (what an identity written before checkpoint ids
    existed can still be matched by)."""
    m = _ID_RE.match(identity)
    return m.group(1) if m else identity


def compared_checkpoints(ours: str, checkpoint: str | None, model: str) -> tuple[str, str]:
    """(theirs, ours), equal when a record belongs to our checkpoint: its checkpoint id's content hash against ours
    (whatever names label them), or for a record written before content-only ids (a named `@` id, or only the
    served weights' fingerprint `model`), the model names inside both."""
    theirs, mine = _ID_RE.match(checkpoint or ""), _ID_RE.match(ours)
    if theirs is not None and theirs.group(2) == "#":
        same = mine is not None and mine.group(2) == "#" and mine.group(3) == theirs.group(3)
        return (ours, ours) if same else (str(checkpoint), ours)
    return model_name(checkpoint or model), model_name(ours)


def dump(cache: ModelKV, history: Sequence[int], cached_length: int, model_id: str) -> bytes:
    """The snapshot of `cache`, which holds the K/V of history[:cached_length]."""
    lengths = cache.layer_lengths()
    if any(n != cached_length for n in lengths):
        raise SnapshotError(f"the cache holds {sorted(set(lengths))} positions, not the {cached_length} claimed")
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.state()):
        for key, t in layer.items():
            tensors[f"{i}/{key}"] = t.detach().contiguous().cpu()
    meta = {"cached_length": str(cached_length), "history_sha256": history_digest(history[:cached_length]),
            "model": model_id, "layers": str(len(lengths))}
    return _canonical_header(st_save(tensors, metadata=meta))


def _canonical_header(data: bytes) -> bytes:
    """`data` with its safetensors header written in one order (keys sorted, no spaces, padded to 8 bytes):
    safetensors writes the metadata map in a hash map's order, different every process, so the same cache gave
    different snapshot (and export archive) bytes. The tensors' offsets are relative to the data, which stays."""
    (n,) = struct.unpack_from("<Q", data)
    header = json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data[8 + n :]


def metadata(data: bytes) -> dict[str, str]:
    """The snapshot's metadata, read from the safetensors header alone."""
    if len(data) < 8:
        raise SnapshotError("a KV snapshot of fewer than 8 bytes")
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8:
        raise SnapshotError("a KV snapshot whose header runs past its end")
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
        raise SnapshotError("a KV snapshot with an unreadable header") from None
    if not isinstance(meta, dict):
        raise SnapshotError("a KV snapshot whose metadata is not a map")
    missing = {"cached_length", "history_sha256", "model", "layers"} - set(meta)
    if missing:
        raise SnapshotError(f"a KV snapshot without {', '.join(sorted(missing))}")
    for key in ("cached_length", "layers"):
        if not (isinstance(meta[key], str) and meta[key].isascii() and meta[key].isdigit() and len(meta[key]) < 19):
            raise SnapshotError(f"a KV snapshot whose {key} is not a count: {str(meta[key])[:40]!r}")
    return meta


POSITION_KEYS = ("slot_positions", "hot_pos")  # which position each ring slot holds (-1: none)


def _check_structure(states: list[dict[str, torch.Tensor]], history: Sequence[int], n: int) -> None:
    """What the history digest does not cover, checked against the history: a restore cache's own copy of the
    tokens it recomputes from, and the positions each ring slot claims (in [0, n) or -1 for none, none twice).
    A snapshot failing them would attend to the wrong positions or fail every Generate after a 'verified' load."""
    for i, state in enumerate(states):
        own = state.get("restore.history")
        if own is not None and (own.dim() != 2 or own.shape[1] != n
                                or own.reshape(-1, n).ne(torch.tensor(history[:n], dtype=own.dtype)).any()):
            raise SnapshotError(f"the KV snapshot's layer {i} restore history is not the session's first {n} tokens")
        for key in POSITION_KEYS:
            pos = state.get(key)
            if pos is None:
                continue
            if pos.is_floating_point() or pos.dim() != 1:
                raise SnapshotError(f"the KV snapshot's layer {i} {key} is not a list of positions")
            held = pos[pos >= 0]
            if bool((pos < -1).any()) or bool((held >= n).any()) or held.unique().numel() != held.numel():
                raise SnapshotError(f"the KV snapshot's layer {i} {key} names positions outside 0..{n - 1} or one "
                                    "twice")


def check_header(data: bytes, history: Sequence[int], model_id: str, layers: int) -> int:
    """What a snapshot's header alone says, checked before anything is built for it (an import checks it before
    admitting the session, so a refused one evicts nothing): these weights, a prefix of `history` (returns its
    length), `layers` layers. SnapshotError otherwise."""
    meta = metadata(data)
    if meta["model"] != model_id:
        raise SnapshotError(f"the KV snapshot was computed by {meta['model']}, not {model_id}")
    n = int(meta["cached_length"])
    if not 0 <= n < len(history):  # a session's next Generate always has a token to read (else its cache is short)
        raise SnapshotError(f"the KV snapshot holds {n} positions of a history of {len(history)} tokens (it may hold "
                            "all but the last one at most)")
    if meta["history_sha256"] != history_digest(history[:n]):
        raise SnapshotError(f"the KV snapshot's {n} tokens are not the session's first {n}")
    if int(meta["layers"]) != layers:
        raise SnapshotError(f"the KV snapshot has {meta['layers']} layers, the model {layers}")
    return n


def load(cache: ModelKV, data: bytes, history: Sequence[int], model_id: str) -> int:
    """Fill the fresh `cache` from a snapshot of this model's K/V of a prefix of `history`; returns that prefix's
    length. SnapshotError (the cache then holds nothing usable: rebuild it) when anything disagrees."""
    n = check_header(data, history, model_id, len(cache))
    layers = len(cache)
    try:
        flat = st_load(data)
    except Exception as e:  # safetensors raises its own error types on malformed bytes
        raise SnapshotError(f"the KV snapshot's tensors do not load ({type(e).__name__})") from None
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
    for key, t in flat.items():
        i, _, name = key.partition("/")
        if not i.isdigit() or int(i) >= layers:
            raise SnapshotError(f"the KV snapshot has a tensor {key!r} for no layer")
        states[int(i)][name] = t
    for i, (want, got) in enumerate(zip(cache.state(), states, strict=True)):  # the fresh cache's own dtypes
        for key, t in got.items():
            if key in want and t.dtype != want[key].dtype:
                raise SnapshotError(f"the KV snapshot's layer {i} {key} is {t.dtype}, this cache keeps {want[key].dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise SnapshotError(f"the KV snapshot's layer {i} {key} holds NaN or infinite values")
    _check_structure(states, history, n)
    try:
        cache.load_state(states)
    except (CacheError, ValueError, KeyError, RuntimeError, IndexError) as e:
        raise SnapshotError(f"the KV snapshot does not fit this cache ({type(e).__name__}: {e})") from None
    lengths = cache.layer_lengths()
    if any(x != n for x in lengths):
        raise SnapshotError(f"after loading, the cache holds {sorted(set(lengths))} positions, not {n}")
    return n
