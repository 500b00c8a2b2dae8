"""Session archives: a session as one file, to move it between servers (ExportSession / ImportSession).

An archive is a record stream (sessions.records): a HEADER (the model, the policy and context the session had,
whether a KV record follows), one TOKENS record with the whole history, and optionally a KV record (a snapshot,
sessions.snapshot). Unlike a journal, an archive must be whole: a torn or corrupt record is refused, never dropped,
and so is an archive cut between whole records (the header says whether the KV record belongs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kakeya_runtime.sessions import records
from kakeya_runtime.sessions.records import RecordKind

ARCHIVE_FORMAT = 1


class ArchiveError(ValueError):
    """Bytes that are not a whole session archive."""


@dataclass(slots=True)
class SessionArchive:
    model: str  # the served weights' fingerprint (sessions.snapshot.model_fingerprint) it was exported from
    policy_name: str
    policy_params: dict[str, Any]
    context_length: int
    history: list[int]
    kv: bytes | None  # a KV snapshot of a prefix of the history, or None
    settings: dict[str, Any]  # what else the session was created with (its default speculation)
    checkpoint: str = ""  # the checkpoint of those weights (sessions.snapshot.checkpoint_id); "" in older archives


def encode(model: str, policy_name: str, policy_params: dict[str, Any], context_length: int,
           history: Sequence[int], kv: bytes | None = None, settings: dict[str, Any] | None = None, *,
           checkpoint: str = "") -> bytes:
    header = records.header_record({"format": ARCHIVE_FORMAT, "kind": "session-archive", "model": model,
                                    "checkpoint": checkpoint, "kv": kv is not None,
                                    "policy": {"name": policy_name, "params": policy_params},
                                    "context_length": context_length, "settings": settings or {}})
    parts = [records.MAGIC, header, records.tokens_record(list(history))]
    if kv is not None:
        parts.append(records.encode(RecordKind.KV, kv))
    return b"".join(parts)


def decode(data: bytes) -> SessionArchive:
    try:
        parsed = records.parse(data, classify_tail=False)  # refused either way: how it was damaged does not matter
    except records.RecordError as e:
        raise ArchiveError(str(e)) from None
    if parsed.problem is not None:
        raise ArchiveError(f"the archive is damaged: {parsed.problem}")
    kinds = [r.kind for r in parsed.records]
    if kinds not in ([RecordKind.HEADER, RecordKind.TOKENS], [RecordKind.HEADER, RecordKind.TOKENS, RecordKind.KV]):
        raise ArchiveError(f"a session archive is a header, the history and an optional KV snapshot; found "
                           f"{[k.name for k in kinds][:8]}")
    try:
        header = parsed.records[0].json()
        if not isinstance(header, dict):
            raise ArchiveError("the archive's header is not a JSON object")
        if header.get("kind") != "session-archive" or header.get("format") != ARCHIVE_FORMAT:
            raise ArchiveError(f"not a session archive of format {ARCHIVE_FORMAT}")
        announced = header.get("kv")  # absent in archives written before it was recorded
        if announced is not None and bool(announced) != (len(kinds) == 3):
            raise ArchiveError("the archive is damaged: its KV snapshot is " + ("missing (cut off?)" if announced
                                                                                 else "not announced by its header"))
        policy = header["policy"]
        name, params = policy["name"], policy.get("params") or {}
        if not isinstance(name, str) or not isinstance(params, dict):
            raise ArchiveError("the archive's policy is not a name and a parameter map")
        return SessionArchive(str(header["model"]), name, params, int(header["context_length"]),
                              parsed.records[1].tokens(), parsed.records[2].payload if len(kinds) == 3 else None,
                              dict(header.get("settings") or {}), str(header.get("checkpoint") or ""))
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, OverflowError, RecursionError) as e:
        if isinstance(e, ArchiveError):
            raise
        raise ArchiveError(f"the archive's header is unreadable ({type(e).__name__})") from None
