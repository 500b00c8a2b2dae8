"""The framing shared by session journals, KV snapshots and exported archives: checksummed records.

A file (or an archive byte stream) is MAGIC followed by records, each

    u32 payload length | u32 crc32(kind byte + payload) | u8 kind | payload      (little-endian)

Kinds: HEADER (UTF-8 JSON: the session's id, owner, policy, context and the model it belongs to), TOKENS
(int32 token ids, appended to the history in order), KV (a snapshot of the session's cache: safetensors
bytes, sessions.snapshot) and ENDED (empty: the session was closed where its journal could not be deleted). A journal is HEADER then TOKENS records; a process killed mid-write leaves at most
one torn record at the end, which a reader detects (short or failing its checksum) and drops: it was never
acknowledged, because a record is written before the call that produced it answers.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"KAKEYA-SESSION\x00\x01"  # name + format version 1
_HEAD = struct.Struct("<IIB")  # payload length, crc32, kind
MAX_RECORD_BYTES = 2**31 - 1


class RecordKind(enum.IntEnum):
    HEADER = 1
    TOKENS = 2
    KV = 3
    ENDED = 4


class RecordError(ValueError):
    """Bytes that are not a well-formed record stream (bad magic, a record failing its checksum)."""


@dataclass(slots=True, frozen=True)
class Record:
    kind: RecordKind
    payload: bytes

    def json(self) -> dict[str, Any]:
        return json.loads(self.payload.decode("utf-8"))

    def tokens(self) -> list[int]:
        if len(self.payload) % 4:
            raise RecordError(f"a TOKENS record of {len(self.payload)} bytes is not a whole number of int32 ids")
        return np.frombuffer(self.payload, dtype="<i4").tolist()


def encode(kind: RecordKind, payload: bytes) -> bytes:
    if len(payload) > MAX_RECORD_BYTES:
        raise RecordError(f"a record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,))))
    return _HEAD.pack(len(payload), crc, kind) + payload


def header_record(fields: dict[str, Any]) -> bytes:
    return encode(RecordKind.HEADER, json.dumps(fields, sort_keys=True).encode("utf-8"))


def ended_record() -> bytes:
    return encode(RecordKind.ENDED, b"")


def tokens_record(tokens: list[int] | tuple[int, ...]) -> bytes:
    return encode(RecordKind.TOKENS, np.asarray(tokens, dtype="<i4").tobytes())


@dataclass(slots=True)
class Parsed:
    records: list[Record]
    good_bytes: int  # bytes up to the end of the last whole, valid record
    torn_bytes: int  # bytes after it (a torn or corrupt tail)
    problem: str | None  # why the tail was dropped (None: nothing was)
    # The bad record is the file's last (cut short, or bad up to the end): a write a crash interrupted. Otherwise
    # whole records follow a damaged one: the file was damaged after it was written.
    torn_write: bool = True


def parse(data: bytes | memoryview, *, classify_tail: bool = True) -> Parsed:
    """Every whole, valid record of `data` in order; a short or corrupt tail is reported, not raised.
    `classify_tail`: tell a torn last write from later damage (journals); it searches every later byte for a whole
    record, which a crafted file can make take hours, so what arrives over the network (archives) skips it."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise RecordError("not a Kakeya session file (bad magic or format version)")
    records: list[Record] = []
    at = len(MAGIC)
    problem, last = None, True
    for record, end, why in _walk(view, at):
        if record is None:
            # A crash tears only the last write, so a whole record anywhere after the bad one (a damaged length
            # field reads as a record running past the end) means the file was damaged after it was written.
            problem, last = why, end >= len(view) and classify_tail and not _record_starts_after(view, at + 1)
            break
        records.append(record)
        at = end
    return Parsed(records, at, len(view) - at, problem, last)


def _record_starts_after(view: memoryview, at: int) -> bool:
    """Whether a whole record with a valid checksum starts at any byte from `at` on."""
    kinds = {k.value for k in RecordKind}
    for start in range(at, len(view) - _HEAD.size + 1):
        length, crc, kind = _HEAD.unpack_from(view, start)
        end = start + _HEAD.size + length
        if kind in kinds and end <= len(view) and zlib.crc32(view[start + _HEAD.size:end],
                                                               zlib.crc32(bytes((kind,)))) == crc:
            return True
    return False


def _walk(view: memoryview, at: int) -> Iterator[tuple[Record | None, int, str | None]]:
    n = len(view)
    while at < n:
        if n - at < _HEAD.size:
            yield None, n, f"a record header cut short ({n - at} bytes)"
            return
        length, crc, kind = _HEAD.unpack_from(view, at)
        start, end = at + _HEAD.size, at + _HEAD.size + length
        if end > n:
            yield None, n, f"a record of {length} bytes cut short at {n - start}"
            return
        payload = bytes(view[start:end])
        # a bad record yields where it ends: parse tells a damaged last record from one with records after it
        if zlib.crc32(payload, zlib.crc32(bytes((kind,)))) != crc:
            yield None, end, f"a record failing its checksum at byte {at}"
            return
        try:
            record_kind = RecordKind(kind)
        except ValueError:
            yield None, end, f"a record of unknown kind {kind} at byte {at}"
            return
        yield Record(record_kind, payload), end, None
        at = end
