"""sessions.records: a torn last write is told apart from a file damaged after it was written."""

from __future__ import annotations

import struct

from kakeya_runtime.sessions import records


def _journal() -> tuple[bytes, list[int]]:
    parts = [records.header_record({"id": "s"}), records.tokens_record([1, 2, 3]), records.tokens_record([4, 5]),
             records.tokens_record([6, 7, 8, 9])]
    offsets, at = [], len(records.MAGIC)
    for part in parts:
        offsets.append(at)
        at += len(part)
    return records.MAGIC + b"".join(parts), offsets


def test_a_torn_last_record_is_a_torn_write():
    data, offsets = _journal()
    for cut in (offsets[3] + 4, offsets[3] + 12, len(data) - 1):  # in the last record's header, in its payload
        parsed = records.parse(data[:cut])
        assert parsed.torn_write and parsed.good_bytes == offsets[3] and len(parsed.records) == 3


def test_a_damaged_length_with_records_after_it_is_damage_not_a_torn_write():
    data, offsets = _journal()
    for length in (0xFFFFFF04, 4):  # past the end of the file (once read as a torn write), or short of the record
        damaged = bytearray(data)
        struct.pack_into("<I", damaged, offsets[2], length)
        parsed = records.parse(bytes(damaged))
        assert not parsed.torn_write, length
        assert parsed.good_bytes == offsets[2] and [r.tokens() for r in parsed.records[1:]] == [[1, 2, 3]]
    damaged = bytearray(data)
    damaged[offsets[3] + 10] ^= 0xFF  # the last record's payload: nothing whole follows it
    assert records.parse(bytes(damaged)).torn_write


def test_an_archive_is_refused_without_searching_its_tail(monkeypatch):
    """Telling a torn write from damage searches every later byte for a whole record: a crafted or cut-short
    archive sent to ImportSession held the server for seconds to hours. Archives skip it: damaged either way."""
    from kakeya_runtime.sessions import archive

    data = archive.encode("m", "full", {}, 64, list(range(20)), None)

    def searched(*args):
        raise AssertionError("the tail was searched")

    monkeypatch.setattr(records, "_record_starts_after", searched)
    for cut in (len(data) - 1, len(data) - 30):
        try:
            archive.decode(data[:cut])
        except archive.ArchiveError as e:
            assert "damaged" in str(e) or "cut short" in str(e)
        else:
            raise AssertionError("a cut-short archive was accepted")
