"""Durable sessions: a state directory with one append-only journal (and at most one KV snapshot) per session.

Layout of `--state-dir DIR`:

    DIR/state.json             the checkpoint every session here belongs to (a server of another one refuses it)
                               and the served weights that wrote the snapshots
    DIR/sessions/<id>.journal  HEADER (id, owner key hash, checkpoint, policy, context) then TOKENS records
                               (sessions.records)
    DIR/sessions/<id>.kv       a KV snapshot record (sessions.snapshot), replaced atomically

A server of the same checkpoint in another weight format (or after an upgrade that changed the kernels' packing)
keeps every session: their histories are what they were, and their snapshots, computed by the other weights, are
refused at the first Generate, which recomputes the cache from the history.

What is written when: a session's header and initial tokens before CreateSession answers; appended tokens
before AppendTokens answers; each generated token before it is streamed to the client. So whatever a client
was told is in the journal, and a process killed at any point loses nothing acknowledged (at most a torn
last record, which recovery drops). When the bytes reach the disk is the fsync policy:

* `always`: every record is fsynced before it is acknowledged (each streamed token costs a disk flush);
* `call` (default): records are written at once and fsynced when a call ends (CreateSession, AppendTokens, the
  end of a Generate): a killed process loses nothing; a power cut may lose the tokens of the Generate running;
* `never`: the OS flushes when it likes: a killed process still loses nothing, a power cut may lose more.

Ending a session (close, eviction, failure) deletes its files. Recovery (`recover`) reads every journal, drops a
torn tail, and hands back each session's history with its snapshot, if any; the service decides what to do with
them (sessions.service.SessionService.recover).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kakeya_runtime.sessions import records
from kakeya_runtime.sessions.records import RecordKind
from kakeya_runtime.sessions.snapshot import compared_checkpoints

_log = logging.getLogger(__name__)

STATE_FORMAT = 2  # 1: {"model": the served weights' fingerprint} alone, matched by model name since 2
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class FsyncPolicy(enum.Enum):
    ALWAYS = "always"
    CALL = "call"
    NEVER = "never"


class StateDirError(RuntimeError):
    """A state directory this server cannot use (another model's, an unreadable journal header)."""


class JournalWriteError(OSError):
    """A journal record could not be written; nothing of it counts (the file was cut back to its last record)."""


@dataclass(slots=True)
class RecoveredSession:
    id: str
    owner: str
    policy_name: str
    policy_params: dict[str, Any]
    context_length: int
    history: list[int]
    snapshot: Path | None  # its KV snapshot file, when one was written
    settings: dict[str, Any]  # what else the session was created with (its default speculation)
    mtime: float  # the session's last use (its journal's last write, or `accessed`): its idle time and LRU order
    dropped_bytes: int  # a torn or corrupt tail cut off the journal (never an acknowledged record)
    evicts: tuple[str, ...] = ()  # sessions its creation evicted (see StateDir.created)


@dataclass(slots=True)
class _Writer:
    fd: int
    size: int  # bytes of whole records: a failed write is cut back to this


class StateDir:
    """One server's state directory. Thread-safe; the store calls it under its own lock."""

    def __init__(self, root: str | Path, model_id: str, checkpoint: str, fsync: FsyncPolicy = FsyncPolicy.CALL) -> None:
        """`model_id`: the served weights (snapshot.model_fingerprint); `checkpoint`: what they were made from
        (snapshot.checkpoint_id), which every session here must share."""
        self.root = Path(root)
        self.model_id = model_id
        self.checkpoint = checkpoint
        self.fsync = fsync
        self.sessions_dir = self.root / "sessions"
        self._writers: dict[str, _Writer] = {}
        self._lock = threading.Lock()
        self.previous_weights: str | None = None  # the served weights of the last start, where they differ
        self.sessions_dir.mkdir(parents=True, exist_ok=True)
        lock = self.root / "lock"
        # When the last server here was last seen alive (its lock file's heartbeat, see `heartbeat`): a session's
        # idle time at recovery counts up to then, not through the time no server ran
        self.last_alive: float | None = lock.stat().st_mtime if lock.exists() else None
        self._lock_fd: int | None = self._take_lock()
        try:
            self._check_state()
        except BaseException:
            self._release_lock()
            raise

    @staticmethod
    def check_free(root: str | Path) -> None:
        """Raise StateDirError when another server holds `root` now (creates nothing): `kakeya serve` asks before its
        model load, so a second server on the same directory is refused at once (and one it could not write). The lock
        taken at start-up decides."""
        existing = Path(root)
        while not existing.exists() and existing != existing.parent:  # created at start-up: its parent must allow it
            existing = existing.parent
        if not existing.is_dir():
            raise StateDirError(f"the state directory {root} cannot be made: {existing} is not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StateDirError(f"the state directory {root} is not writable ({existing}): sessions could not be kept")
        path = Path(root) / "lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # no lock file (a new directory) or unreadable: the start-up lock answers
            return
        try:
            StateDir._flock_or_refuse(fd, Path(root))
        finally:
            os.close(fd)  # releases the probe's lock

    @staticmethod
    def _flock_or_refuse(fd: int, root: Path) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise StateDirError(f"the state directory {root} is in use by another server (pid {holder}); stop "
                                "it, or pass another --state-dir") from None

    def _take_lock(self) -> int:
        """An exclusive lock on DIR/lock for this server's life: two servers journaling the same sessions would each
        append what the other never saw, and one's CloseSession would delete the other's journals."""
        path = self.root / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._flock_or_refuse(fd, self.root)
        except StateDirError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def accessed(self, session_id: str, at: float) -> None:
        """The session was last used at `at` (wall clock) by calls that write nothing (reads, exports): its journal's
        mtime says so, so a restart counts its idle time (and orders it for eviction) from its last use."""
        with contextlib.suppress(OSError):
            os.utime(self.journal_path(session_id), (at, at))

    def heartbeat(self) -> None:
        """This server is alive now (the lock file's mtime; the service's sweeper calls it)."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._lock_fd)

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock

    def _check_state(self) -> None:
        """state.json: the checkpoint these sessions belong to (another one's are refused) and the weights that
        served them last (recorded anew when they are others)."""
        model_id = self.model_id
        state = self.root / "state.json"
        fmt, found = None, {}
        if state.exists():
            try:
                found = json.loads(state.read_text())
            except (OSError, ValueError) as e:
                raise StateDirError(f"{state} is unreadable ({e})") from None
            fmt = found.get("format")
            if fmt not in (1, STATE_FORMAT):
                raise StateDirError(f"{state} has format {fmt!r}; this server reads {STATE_FORMAT} (and 1)")
            # format 1 holds the served weights' fingerprint alone, under "model"
            weights = found.get("weights") if fmt == STATE_FORMAT else found.get("model")
            theirs, ours = compared_checkpoints(self.checkpoint, found.get("checkpoint"), str(found.get("model")))
            if theirs != ours:
                raise StateDirError(
                    f"the state directory {self.root} holds sessions of the model {theirs!r}, not {ours!r}: serve "
                    "that model, or pass another --state-dir")
            if weights != model_id:  # reported by the recovery (sessions.service.RecoveryStats)
                self.previous_weights = str(weights)
        # new, older, last served by other weights, or bound to an older form of the checkpoint id
        if fmt != STATE_FORMAT or self.previous_weights is not None or found.get("checkpoint") != self.checkpoint:
            _atomic_write(state, json.dumps({"format": STATE_FORMAT, "checkpoint": self.checkpoint,
                                             "weights": model_id}).encode())

    # ---- paths -------------------------------------------------------------------------------

    def journal_path(self, session_id: str) -> Path:
        return self.sessions_dir / f"{_safe_id(session_id)}.journal"

    def snapshot_path(self, session_id: str) -> Path:
        return self.sessions_dir / f"{_safe_id(session_id)}.kv"

    # ---- the store's hooks (sessions.store.Journal) --------------------------------------------

    def created(self, session_id: str, owner: str, policy_name: str, policy_params: dict[str, Any],
                context_length: int, history: Sequence[int], settings: dict[str, Any] | None = None,
                evicts: Sequence[str] = ()) -> None:
        """A new session: its header and initial history, durable per the policy before this returns. `evicts`: the
        sessions its admission ends (their journals are deleted next; a crash in between leaves them, and recovery
        finishes the eviction instead of finding one session too many for the limits)."""
        header = records.header_record({"id": session_id, "owner": owner, "model": self.model_id,
                                        "checkpoint": self.checkpoint,
                                        "policy": {"name": policy_name, "params": policy_params},
                                        "context_length": context_length, "settings": settings or {},
                                        **({"evicts": list(evicts)} if evicts else {})})
        body = header + (records.tokens_record(list(history)) if history else b"")
        path = self.journal_path(session_id)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        except OSError as e:
            raise JournalWriteError(e.errno, f"the new session's journal cannot be created ({e.strerror})") from None
        writer = _Writer(fd, 0)
        try:
            self._write(writer, records.MAGIC + body, sync=self.fsync is not FsyncPolicy.NEVER)
            if self.fsync is not FsyncPolicy.NEVER:
                _fsync_dir(self.sessions_dir)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        with self._lock:
            self._writers[session_id] = writer

    def appended(self, session_id: str, tokens: Sequence[int]) -> None:
        """Tokens about to join the history: written (and under `always` fsynced) before they count."""
        writer = self._writer(session_id)
        self._write(writer, records.tokens_record(list(tokens)), sync=self.fsync is FsyncPolicy.ALWAYS)

    def size(self, session_id: str) -> int:
        """Bytes of whole records in the session's journal (a mark `cut` returns to)."""
        return self._writer(session_id).size

    def cut(self, session_id: str, size: int) -> None:
        """Drop the records written after `size` (a call that failed after writing them: it answers as never made,
        so its records must not come back at recovery). OSError when the file cannot be cut."""
        writer = self._writer(session_id)
        os.ftruncate(writer.fd, size)
        writer.size = size
        if self.fsync is not FsyncPolicy.NEVER:  # best effort: the flush that failed just now may fail again
            with contextlib.suppress(OSError):
                os.fsync(writer.fd)

    def call_ended(self, session_id: str) -> None:
        """A call that wrote records is about to answer: under `call`, make them durable now."""
        if self.fsync is not FsyncPolicy.CALL:
            return
        with self._lock:
            writer = self._writers.get(session_id)
        if writer is not None:
            try:
                os.fsync(writer.fd)
            except OSError as e:
                raise JournalWriteError(e.errno, f"flushing it failed ({e.strerror})") from None

    def ended(self, session_id: str) -> None:
        """The session is gone (closed, evicted or failed): its files go too, durably (the directory is synced, so a
        power cut does not bring it back). Where the directory refuses (read-only, immutable), an ENDED record
        through the journal's open file keeps it from coming back; OSError when neither is possible."""
        with self._lock:
            writer = self._writers.pop(session_id, None)
        try:
            try:
                for path in (self.journal_path(session_id), self.snapshot_path(session_id)):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                if self.fsync is not FsyncPolicy.NEVER:
                    _fsync_dir(self.sessions_dir)
            except OSError:
                if writer is None or not self.journal_path(session_id).exists():
                    raise
                self._write(writer, records.ended_record(), sync=True)
        finally:
            if writer is not None:
                with contextlib.suppress(OSError):
                    os.close(writer.fd)

    # ---- snapshots -----------------------------------------------------------------------------

    def write_snapshot(self, session_id: str, snapshot: bytes) -> Path:
        """Replace the session's KV snapshot atomically (a reader sees the old one or the new one, whole)."""
        path = self.snapshot_path(session_id)
        with self._lock:
            if session_id not in self._writers:
                raise StateDirError(f"session {session_id} has no journal here")
        _atomic_write(path, records.MAGIC + records.encode(RecordKind.KV, snapshot))
        return path

    def read_snapshot(self, path: Path) -> bytes:
        """The snapshot bytes of a .kv file; RecordError when it is torn or corrupt."""
        parsed = records.parse(path.read_bytes())
        if parsed.problem or len(parsed.records) != 1 or parsed.records[0].kind is not RecordKind.KV:
            raise records.RecordError(f"{path.name}: {parsed.problem or 'not a single KV record'}")
        return parsed.records[0].payload

    # ---- recovery ------------------------------------------------------------------------------

    def recover(self) -> list[RecoveredSession]:
        """Every journaled session, least recently written first; journals cut back to their last whole record
        and reopened for appending. Nothing is destroyed: a journal cut back, or not recovered (no whole header,
        not a regular file, not its session's), is kept whole as <file>.damaged (.damaged.2 ...; see _set_aside).
        KV snapshots without a journal are deleted."""
        found: list[RecoveredSession] = []
        for path in sorted(self.sessions_dir.glob("*.journal")):
            if not stat.S_ISREG(path.lstat().st_mode):  # a directory, link or FIFO (reading one would block start-up)
                _log.error("state dir: %s is not a regular file; not recovered, moved to %s", path.name,
                           _set_aside(path, move=True).name)
                continue
            try:
                session = self._recover_one(path)
            except _NotThisSessions as e:  # (a copy under another name, an unreadable header): the others go on
                _log.error("state dir: %s; not recovered, moved to %s", e, _set_aside(path, move=True).name)
                continue
            if session is not None:
                found.append(session)
        for tmp in self.sessions_dir.glob("*.tmp"):  # an interrupted snapshot write
            with contextlib.suppress(OSError):
                tmp.unlink()
        for kv in self.sessions_dir.glob("*.kv"):  # its session ended while another process held the file, or
            if not kv.with_suffix(".journal").exists():  # its journal was set aside or removed by hand
                _log.warning("state dir: %s belongs to no journal; deleted", kv.name)
                with contextlib.suppress(OSError):
                    kv.unlink()
        found.sort(key=lambda s: s.mtime)
        # A create that evicted sessions wrote its journal first; a crash before their journals were deleted
        # leaves them here: finish the eviction (the limits counted on it)
        evicted = {v for s in found for v in s.evicts}
        for session in [s for s in found if s.id in evicted]:
            _log.warning("state dir: session %s was being evicted to make room for a new one when the server "
                         "stopped; its eviction is finished now", session.id)
            self.ended(session.id)
        return [s for s in found if s.id not in evicted]

    def _recover_one(self, path: Path) -> RecoveredSession | None:
        data = path.read_bytes()
        if len(data) < len(records.MAGIC) and records.MAGIC.startswith(data):  # not even the magic: a torn create
            _log.warning("state dir: %s has no whole header (a CreateSession that never answered); deleted", path.name)
            path.unlink()
            return None
        try:
            parsed = records.parse(data)
        except records.RecordError:
            parsed = None
        if parsed is None or not parsed.records or parsed.records[0].kind is not RecordKind.HEADER:
            # (a header cut short by a crash is a create that never answered, but a damaged one looks the same:
            # the file is kept either way)
            problem = "bad magic" if parsed is None else parsed.problem or "no header"
            _log.error("state dir: %s has no whole header (%s: a CreateSession a crash cut short, or damage); its "
                       "session is not recovered, and the file is kept as %s", path.name, problem,
                       _set_aside(path, move=True).name)
            return None
        if parsed.records[-1].kind is RecordKind.ENDED:  # closed where the file could not be deleted then
            _log.info("state dir: %s belongs to a session that was closed; deleted", path.name)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        try:
            header = parsed.records[0].json()
            sid, owner, policy = header["id"], header["owner"], header["policy"]
            context = int(header["context_length"])
            history = [t for r in parsed.records[1:] if r.kind is RecordKind.TOKENS for t in r.tokens()]
        except (KeyError, TypeError, ValueError) as e:
            raise _NotThisSessions(f"{path.name} has an unreadable header or records ({e})") from None
        theirs, ours = compared_checkpoints(self.checkpoint, header.get("checkpoint"), str(header.get("model")))
        if theirs != ours:
            raise StateDirError(f"{path} belongs to the model {theirs!r}, not {ours!r}")
        if not isinstance(sid, str) or not sid or not set(sid) <= _ID_CHARS or path.name != f"{sid}.journal":
            raise _NotThisSessions(f"{path.name} holds the journal of session {sid!r} (a copy under another name?)")
        if parsed.torn_bytes and parsed.torn_write:  # a crash mid-write, or damage at the end after a clean stop:
            # either way the file is kept before anything is cut
            _log.warning("state dir: %s ends with %s (%d bytes: a write a crash cut short, or damage); cut off, the "
                         "whole file kept as %s", path.name, parsed.problem, parsed.torn_bytes,
                         _set_aside(path, move=False).name)
        elif parsed.torn_bytes:  # whole records after a bad one: damaged on disk, and some of it was acknowledged
            _log.error("state dir: %s has %s with whole records after it (damaged on disk); session %s is recovered "
                       "up to it (%d bytes cut), and the whole file is kept as %s", path.name, parsed.problem,
                       sid, parsed.torn_bytes, _set_aside(path, move=False).name)
        if parsed.torn_bytes:
            os.truncate(path, parsed.good_bytes)
        mtime = path.stat().st_mtime
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        with self._lock:
            self._writers[sid] = _Writer(fd, parsed.good_bytes)
        snapshot = self.snapshot_path(sid)
        return RecoveredSession(sid, owner, str(policy["name"]), dict(policy.get("params") or {}), context, history,
                                snapshot if snapshot.exists() else None, dict(header.get("settings") or {}), mtime,
                                parsed.torn_bytes, tuple(str(v) for v in header.get("evicts") or ()))

    def close(self) -> None:
        """Close every journal (the server is stopping) and release the directory; the files stay for the next start."""
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            with contextlib.suppress(OSError):
                if self.fsync is not FsyncPolicy.NEVER:
                    os.fsync(writer.fd)
                os.close(writer.fd)
        self._release_lock()

    # ---- internals -----------------------------------------------------------------------------

    def _writer(self, session_id: str) -> _Writer:
        with self._lock:
            writer = self._writers.get(session_id)
        if writer is None:
            raise JournalWriteError(0, f"session {session_id} has no open journal")
        return writer

    @staticmethod
    def _write(writer: _Writer, data: bytes, *, sync: bool) -> None:
        """(A JournalWriteError's message is the cause alone: the caller says which write failed.)"""
        try:
            removed = os.fstat(writer.fd).st_nlink == 0
        except OSError:
            removed = False  # the write below reports what is wrong
        if removed:  # the file was removed (or its directory): what is written now would be lost at a restart
            _log.error("state dir: a session's journal was removed while the server ran; its calls are refused")
            raise JournalWriteError(errno.ENOENT, "it was removed from the state directory while the server ran")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(writer.fd, view):]
            if sync:
                os.fsync(writer.fd)
        except OSError as e:
            with contextlib.suppress(OSError):  # a partial record must not sit before the next good one
                os.ftruncate(writer.fd, writer.size)
            raise JournalWriteError(e.errno, e.strerror or str(e)) from None
        writer.size += len(data)


class _NotThisSessions(Exception):
    """A journal file that cannot be its session's (set aside; the other sessions are recovered)."""


def _set_aside(path: Path, *, move: bool) -> Path:
    """Keep `path` as <name>.damaged (.damaged.2, .3 ... when that exists: an earlier damage's copy is never
    overwritten), moved or copied (mode and times too: it holds a conversation). Returns the new path."""
    for n in range(1, 10_000):
        target = path.with_name(path.name + ".damaged" + ("" if n == 1 else f".{n}"))
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # claims the name
        except FileExistsError:
            continue
        os.close(fd)
        if move:  # (a directory cannot replace the placeholder: the name is released, then taken)
            os.unlink(target)
            os.rename(path, target)
        else:
            shutil.copy2(path, target)
        return target
    raise StateDirError(f"{path}: too many damaged copies beside it")


def _safe_id(session_id: str) -> str:
    if not session_id or len(session_id) > 128 or not set(session_id) <= _ID_CHARS:
        raise StateDirError(f"session id {session_id[:40]!r} cannot name a file")
    return session_id


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
