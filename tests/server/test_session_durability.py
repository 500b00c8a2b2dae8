"""Durable sessions through a real gRPC server and the Python SDK: a restart with the same --state-dir brings every
session back (history, policy, owner), from a verified KV snapshot or by recomputing it, and a seeded Generate after
recovery equals the same Generate on a fresh session of that history; export/import moves a session between
servers; damaged snapshots and archives are refused, never trusted. Sessions belong to the checkpoint, not to the
weight format it is served in: another format (or build) keeps them and recomputes their caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kakeya import Client
from kakeya.errors import FailedPrecondition, InvalidArgument, SessionNotFound

from kakeya_runtime.server.testing import (
    metric_value,
    running_server,
    scrape_metrics,
    tiny_model,
    tiny_served,
)
from kakeya_runtime.sessions import archive as arc
from kakeya_runtime.sessions import records
from kakeya_runtime.sessions.journal import StateDirError
from kakeya_runtime.sessions.snapshot import metadata as snapshot_meta

POLICIES = [
    ("full", {}),
    ("sink_window", {"sink": 4, "window": 16}),
    ("restore", {"sink": 4, "window": 16}),
    ("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2, "codec": "int8"}),
]
SAMPLE = {"temperature": 0.8, "seed": 11, "ignore_eos": True}
KEYS = ("key-one-12345678", "key-two-12345678")


def _drive(client: Client, policy: tuple[str, dict]) -> tuple[str, list[int]]:
    """A session with two turns (one Generate, one append): returns its id and the history the client saw."""
    from kakeya import KvPolicy

    s = client.create_session([5, 6, 7, 8, 9] * 3, policy=KvPolicy(*policy))
    out = s.generate(24, **SAMPLE).collect()
    s.append([10, 11, 12])
    history = [5, 6, 7, 8, 9] * 3 + out + [10, 11, 12]
    assert list(s.info(include_history=True).history_token_ids) == history
    return s.id, history


def _continue(client: Client, sid: str, n: int = 12) -> list[int]:
    return client.session(sid).generate(n, temperature=0.7, seed=5, ignore_eos=True).collect()


def _reference(client: Client, history: list[int], policy: tuple[str, dict], n: int = 12) -> list[int]:
    from kakeya import KvPolicy

    with client.create_session(history, policy=KvPolicy(*policy)) as fresh:
        return fresh.generate(n, temperature=0.7, seed=5, ignore_eos=True).collect()


def test_restart_recovers_every_session_and_continues_exactly(tmp_path: Path):
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state), api_keys=KEYS) as thread:
        owned = {}
        for i, policy in enumerate(POLICIES):
            with Client(thread.address, api_key=KEYS[i % 2]) as client:
                sid, history = _drive(client, policy)
                owned[sid] = (KEYS[i % 2], policy, history)
        with Client(thread.address, api_key=KEYS[0]) as client:  # a closed session must not come back
            gone = client.create_session([1, 2, 3])
            gone.close()
            never_generated = client.create_session([4, 5, 6])  # no cache yet: recovered from the journal alone
            owned[never_generated.id] = (KEYS[0], ("full", {}), [4, 5, 6])
    assert len(list((state / "sessions").glob("*.kv"))) == len(POLICIES)  # snapshots written at shutdown

    with running_server(served, state_dir=str(state), api_keys=KEYS) as thread:
        assert thread.server.recovery.sessions == len(owned)
        assert thread.server.recovery.snapshots == len(POLICIES)
        for sid, (key, policy, history) in owned.items():
            with Client(thread.address, api_key=key) as client:
                info = client.session(sid).info(include_history=True)
                assert list(info.history_token_ids) == history
                assert info.policy.name == policy[0]
                assert _continue(client, sid) == _reference(client, history, policy)
            other = KEYS[1] if key == KEYS[0] else KEYS[0]
            with Client(thread.address, api_key=other) as client, pytest.raises(SessionNotFound):
                client.session(sid).info()  # ownership survives the restart
        with Client(thread.address, api_key=KEYS[0]) as client, pytest.raises(SessionNotFound):
            client.session(gone.id).info()
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_session_recovered_total") == len(owned)
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="snapshot"}') == len(POLICIES)
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="history"}') == 1  # never generated
        assert metric_value(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0


def test_a_damaged_snapshot_is_refused_and_the_cache_recomputed(tmp_path: Path):
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        sid, history = _drive(client, ("full", {}))
    snap = state / "sessions" / f"{sid}.kv"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit: the record's checksum no longer holds
    snap.write_bytes(bytes(data))
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert _continue(client, sid) == _reference(client, history, ("full", {}))
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="recompute"}') == 1
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="snapshot"}') == 0


def test_a_torn_journal_tail_is_cut_and_nothing_acknowledged_is_lost(tmp_path: Path):
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        sid, history = _drive(client, ("sink_window", {"sink": 4, "window": 16}))
    journal = state / "sessions" / f"{sid}.journal"
    good = journal.read_bytes()
    journal.write_bytes(good + records.tokens_record([1, 2, 3])[:-3])  # a record the kill cut short
    (state / "sessions" / f"{sid}.kv").unlink()
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert thread.server.recovery.dropped_bytes == len(records.tokens_record([1, 2, 3])) - 3
        assert list(client.session(sid).info(include_history=True).history_token_ids) == history
        client.session(sid).append([7])  # appends land after the cut, readable by the next recovery
    assert journal.read_bytes().startswith(good)
    # a crash's cut and damage at the end look alike: the file was kept before anything was cut
    assert (state / "sessions" / f"{sid}.journal.damaged").read_bytes() == good + records.tokens_record([1, 2, 3])[:-3]
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert list(client.session(sid).info(include_history=True).history_token_ids) == history + [7]


def test_a_state_dir_of_another_model_is_refused(tmp_path: Path):
    state = tmp_path / "state"
    with running_server(tiny_served(seed=0), state_dir=str(state)) as thread, Client(thread.address) as client:
        client.create_session([1, 2, 3])
    with pytest.raises(StateDirError, match="holds sessions of the model"), \
            running_server(tiny_served(seed=1), state_dir=str(state)):
        pass


@pytest.mark.parametrize("policy", POLICIES, ids=[p[0] for p in POLICIES])
def test_export_import_moves_a_session_with_its_cache(tmp_path: Path, policy):
    served = tiny_served()
    with running_server(served) as a, running_server(served) as b, Client(a.address) as ca, \
            Client(b.address) as cb:
        sid, history = _drive(ca, policy)
        archive = ca.session(sid).export(tmp_path / "s.kakeya", include_kv=True)
        assert (tmp_path / "s.kakeya").read_bytes() == archive
        # The same session exports the same bytes every time (the snapshot's header is written in one order).
        assert all(ca.session(sid).export(include_kv=True) == archive for _ in range(3))
        moved = cb.import_session(tmp_path / "s.kakeya")
        assert moved.kv_loaded and moved.id != sid
        info = moved.info(include_history=True)
        assert (info.sparse is not None) == (policy[0] == "sparse")  # its bytes shown before a first Generate
        assert list(info.history_token_ids) == history
        assert info.cached_length == len(history) - 4  # the 3 appended tokens and the last sampled one are pending
        moved_next = _continue(cb, moved.id)
        assert moved_next == _continue(ca, sid)
        light = cb.import_session(ca.session(sid).export())  # without KV: prefilled at the first Generate
        assert not light.kv_loaded and light.info().cached_length == 0
        untrusted = cb.import_session(archive, load_kv=False)  # its KV left out: recomputed from the history
        assert not untrusted.kv_loaded and untrusted.info().cached_length == 0
        assert _continue(cb, untrusted.id) == moved_next  # the same bits (turn by turn = one shot)
        with pytest.raises(InvalidArgument, match="load_kv"):
            cb.import_session(archive, load_kv="no")
        assert metric_value(scrape_metrics(b), "kakeya_session_kv_restored_total", '{source="snapshot"}') == 1


def test_import_refuses_damaged_or_foreign_archives(tmp_path: Path):
    served = tiny_served()
    with running_server(served) as a, Client(a.address) as client:
        sid, history = _drive(client, ("full", {}))
        archive = client.session(sid).export(include_kv=True)
        before = len(a.server.service.store)
        with pytest.raises(InvalidArgument, match="damaged|checksum"):
            client.import_session(archive[:-10])
        with pytest.raises(InvalidArgument, match="not a Kakeya session file"):
            client.import_session(b"hello")
        # A snapshot of another history: the records are whole, the snapshot does not match what it claims.
        parsed = arc.decode(archive)
        lie = arc.encode(parsed.model, "full", {}, parsed.context_length, [9] + parsed.history[1:], parsed.kv)
        with pytest.raises(InvalidArgument, match="not the session's first"):
            client.import_session(lie)
        assert len(a.server.service.store) == before  # a refused import leaves nothing behind
    with running_server(tiny_served(seed=3)) as b, Client(b.address) as other, \
            pytest.raises(FailedPrecondition, match="holds a session of the model"):
        other.import_session(archive)


def _in(dtype: torch.dtype):
    """The same checkpoint (tiny, seed 0) served in `dtype`: other weights' bits, the same model."""
    return tiny_served(model=tiny_model(dtype=dtype))


SESSIONS = [("full", {}), ("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2, "codec": "int8"})]


def test_a_restart_in_another_weight_format_keeps_every_session_and_recomputes_its_cache(tmp_path: Path):
    state = tmp_path / "state"
    with running_server(_in(torch.float32), state_dir=str(state)) as thread, Client(thread.address) as client:
        old_weights = thread.server.service.model_id
        owned = dict(_drive(client, policy) for policy in SESSIONS)
    assert len(list((state / "sessions").glob("*.kv"))) == len(SESSIONS)

    with running_server(_in(torch.bfloat16), state_dir=str(state)) as thread, Client(thread.address) as client:
        service = thread.server.service
        assert service.model_id != old_weights  # other weights: their snapshots cannot be used
        assert thread.server.recovery.sessions == len(SESSIONS)
        assert thread.server.recovery.previous_weights == old_weights
        saved = json.loads((state / "state.json").read_text())
        assert saved == {"format": 2, "checkpoint": service.checkpoint, "weights": service.model_id}
        for sid in owned:  # recovered, not yet generated: no KV of other weights goes out
            assert arc.decode(client.session(sid).export(include_kv=True)).kv is None
        for (sid, history), policy in zip(owned.items(), SESSIONS, strict=True):
            assert list(client.session(sid).info(include_history=True).history_token_ids) == history
            assert _continue(client, sid) == _reference(client, history, policy)
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="recompute"}') == len(SESSIONS)
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="snapshot"}') == 0
        assert metric_value(text, "kakeya_cache_invariant_violations_total", '{kind="inv1"}') == 0

    with running_server(_in(torch.bfloat16), state_dir=str(state)) as thread:  # the same weights again
        assert thread.server.recovery.previous_weights is None
        assert thread.server.recovery.snapshots == len(SESSIONS)


def test_a_state_dir_written_before_checkpoint_ids_is_kept_by_model_name(tmp_path: Path):
    state = tmp_path / "state"
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        sid, history = _drive(client, ("full", {}))
    legacy = "tiny-llama:0123456789abcdef"  # the served weights' fingerprint, all a format-1 state dir names
    (state / "state.json").write_text(json.dumps({"format": 1, "model": legacy}))
    journal = state / "sessions" / f"{sid}.journal"
    parsed = records.parse(journal.read_bytes())
    header = {k: v for k, v in parsed.records[0].json().items() if k != "checkpoint"} | {"model": legacy}
    rest = b"".join(records.encode(r.kind, r.payload) for r in parsed.records[1:])
    journal.write_bytes(records.MAGIC + records.header_record(header) + rest)
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        assert thread.server.recovery.previous_weights == legacy
        assert list(client.session(sid).info(include_history=True).history_token_ids) == history
        assert _continue(client, sid) == _reference(client, history, ("full", {}))
    assert json.loads((state / "state.json").read_text())["format"] == 2
    (state / "state.json").write_text(json.dumps({"format": 1, "model": "another-model:0123456789abcdef"}))
    with pytest.raises(StateDirError, match="holds sessions of the model 'another-model'"), \
            running_server(tiny_served(), state_dir=str(state)):
        pass


def test_import_from_a_server_of_other_weights_keeps_the_history_and_recomputes_the_cache(tmp_path: Path):
    with running_server(_in(torch.float32)) as a, running_server(_in(torch.bfloat16)) as b, \
            Client(a.address) as ca, Client(b.address) as cb:
        sid, history = _drive(ca, ("full", {}))
        archive = ca.session(sid).export(include_kv=True)
        assert arc.decode(archive).kv is not None
        moved = cb.import_session(archive)
        assert not moved.kv_loaded and moved.info().cached_length == 0  # computed by the first Generate
        assert list(moved.info(include_history=True).history_token_ids) == history
        assert _continue(cb, moved.id) == _reference(cb, history, ("full", {}))
        # An archive written before checkpoint ids (the served weights' fingerprint alone) is matched by model name.
        old = arc.decode(archive)
        legacy = arc.encode(old.model, "full", {}, old.context_length, old.history, old.kv)
        assert arc.decode(legacy).checkpoint == ""
        assert not cb.import_session(legacy).kv_loaded
        assert ca.import_session(legacy).kv_loaded  # the weights that computed it: its snapshot is used


def test_speculative_tokens_are_journaled_and_the_default_survives(tmp_path: Path):
    """A speculative Generate commits several tokens per step: each step is journaled before it is streamed, and
    the session's default speculation comes back after a restart and through an archive."""
    from kakeya import Speculation

    served = tiny_served()
    state = tmp_path / "state"
    prompt = [5, 6, 7, 8, 9, 10, 11] * 6
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        s = client.create_session(prompt, speculation=Speculation("history", 4))
        out = s.generate(40, ignore_eos=True).collect()
        assert s.last_result.stats.verifier_steps > 0
        history = list(s.info(include_history=True).history_token_ids)
        assert history == prompt + out
        archive = s.export()
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        back = client.session(s.id).info(include_history=True)
        assert list(back.history_token_ids) == history and back.speculation == Speculation("history", 4)
        imported = client.import_session(archive)
        assert imported.info().speculation == Speculation("history", 4)
        assert client.session(s.id).generate(12, ignore_eos=True).collect() == \
            imported.generate(12, ignore_eos=True).collect()


def test_a_state_dir_serves_one_server_at_a_time(tmp_path: Path):
    """Two servers on one directory would journal the same sessions apart (each appending what the other never
    saw, one's CloseSession deleting the other's journal): the second is refused while the first runs."""
    state = tmp_path / "state"
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        sid, history = _drive(client, ("full", {}))
        with pytest.raises(StateDirError, match=r"in use by another server \(pid \d+\)"), \
                running_server(tiny_served(), state_dir=str(state)):
            pass
        client.session(sid).append([7])  # the first server goes on, alone
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        assert list(client.session(sid).info(include_history=True).history_token_ids) == history + [7]
    with pytest.raises(StateDirError, match="holds sessions of the model"), \
            running_server(tiny_served(seed=1), state_dir=str(state)):  # a refused start releases the directory
        pass
    with running_server(tiny_served(), state_dir=str(state)) as thread:
        assert thread.server.recovery.sessions == 1


def test_journals_damaged_on_disk_are_kept_aside_and_stray_snapshots_removed(tmp_path: Path):
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        damaged, history = _drive(client, ("full", {}))  # header, tokens, tokens
        headless, _ = _drive(client, ("full", {}))
    sessions = state / "sessions"
    path = sessions / f"{damaged}.journal"
    data = bytearray(path.read_bytes())
    first = len(records.MAGIC) + len(records.parse(bytes(data)).records[0].payload) + 9  # after the header record
    data[first + 12] ^= 0xFF  # inside the first TOKENS record: whole records follow it
    path.write_bytes(bytes(data))
    headless_path = sessions / f"{headless}.journal"
    headless_path.write_bytes(records.MAGIC + b"\x00" * 9 + headless_path.read_bytes()[len(records.MAGIC) + 9:])
    (sessions / "ses_gone.kv").write_bytes(b"stray")
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert thread.server.recovery.sessions == 1  # the one with a readable header, up to the damage
        assert list(client.session(damaged).info(include_history=True).history_token_ids) == []
        with pytest.raises(SessionNotFound):
            client.session(headless).info()
    assert (sessions / f"{damaged}.journal.damaged").read_bytes() == bytes(data)  # nothing destroyed
    assert (sessions / f"{damaged}.journal.damaged").stat().st_mode & 0o777 == 0o600  # a journal's mode, not umask's
    assert (sessions / f"{headless}.journal.damaged").exists() and not headless_path.exists()
    assert not (sessions / "ses_gone.kv").exists() and not (sessions / f"{headless}.kv").exists()


def test_strays_among_the_journals_are_set_aside_and_the_rest_recovered(tmp_path: Path):
    """A FIFO named like a journal hung the start (its read blocked), and a directory, a dangling link or a copy of a
    journal under another session's name refused it; a second damage to one session overwrote the copy the first
    one kept. Each stray is now moved aside and every other session recovered; copies are never overwritten."""
    import os

    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        sid, history = _drive(client, ("full", {}))
    sessions = state / "sessions"
    journal = sessions / f"{sid}.journal"
    os.mkfifo(sessions / "ses_fifo.journal")
    (sessions / "ses_dir.journal").mkdir()
    (sessions / "ses_dangling.journal").symlink_to(sessions / "nowhere")
    (sessions / "ses_backup.journal").write_bytes(journal.read_bytes())  # a copy under another name
    good = journal.read_bytes()
    for _ in range(2):  # the same session damaged at its end twice, restarting in between: its last record goes
        journal.write_bytes(journal.read_bytes()[:-2])
        with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
            assert thread.server.recovery.sessions == 1
            got = list(client.session(sid).info(include_history=True).history_token_ids)
            assert got == history[: len(got)] and len(got) < len(history)
            history = got
    for name in ("ses_fifo", "ses_dir", "ses_dangling", "ses_backup"):
        assert (sessions / f"{name}.journal.damaged").exists() or (sessions / f"{name}.journal.damaged").is_symlink()
        assert not (sessions / f"{name}.journal").exists() and not (sessions / f"{name}.journal").is_symlink()
    assert (sessions / f"{sid}.journal.damaged").read_bytes() == good[:-2]
    assert (sessions / f"{sid}.journal.damaged.2").exists()  # the first copy kept


def _with_kv(archive: bytes, edit) -> bytes:
    """The archive with its snapshot's tensors replaced by edit(name, tensor), metadata and records kept whole."""
    from safetensors.torch import load, save

    parsed = arc.decode(archive)
    tensors = {k: edit(k, v) for k, v in load(parsed.kv).items()}
    kv = save(tensors, metadata=snapshot_meta(parsed.kv))
    return arc.encode(parsed.model, parsed.policy_name, parsed.policy_params, parsed.context_length, parsed.history,
                      kv, parsed.settings, checkpoint=parsed.checkpoint)


def test_import_refuses_snapshots_a_generate_could_not_use(tmp_path: Path):
    served = tiny_served()
    with running_server(served) as a, Client(a.address) as client:
        sid, history = _drive(client, ("full", {}))
        archive = client.session(sid).export(include_kv=True)
        before = len(a.server.service.store)
        parsed = arc.decode(archive)
        cached = int(snapshot_meta(parsed.kv)["cached_length"])
        whole = arc.encode(parsed.model, "full", {}, parsed.context_length, parsed.history[:cached], parsed.kv,
                           checkpoint=parsed.checkpoint)  # the snapshot holds every history token: none left to read
        with pytest.raises(InvalidArgument, match="all but the last one at most"):
            client.import_session(whole)
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            client.import_session(_with_kv(archive, lambda k, t: t * float("nan") if k.endswith("k") else t))
        with pytest.raises(InvalidArgument, match="this cache keeps"):
            client.import_session(_with_kv(archive, lambda k, t: t.half() if t.is_floating_point() else t))
        cut = archive[: len(archive) - len(records.encode(records.RecordKind.KV, parsed.kv))]
        with pytest.raises(InvalidArgument, match="KV snapshot is missing"):
            client.import_session(cut)  # cut exactly between records: whole, but not what was exported
        assert len(a.server.service.store) == before
        assert client.import_session(archive).kv_loaded  # the archive as exported still imports


def test_a_crash_inside_an_evicting_create_is_finished_at_restart(tmp_path: Path):
    """A create at the limit journals the new session, then deletes its victim's journal; a crash between left one
    session too many, and the next start with the same limits refused to serve. The new journal names its victims,
    so recovery finishes the eviction."""
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state), max_sessions=2) as thread, Client(thread.address) as client:
        first, second = (client.create_session([5, 6, 7 + i]).id for i in range(2))
        state_dir = thread.server.service.state
        ended = state_dir.ended
        state_dir.ended = lambda session_id: None  # the crash: the victim's journal is never deleted
        third = client.create_session([9, 9]).id
        state_dir.ended = ended
        assert len(list((state / "sessions").glob("*.journal"))) == 3
    with running_server(served, state_dir=str(state), max_sessions=2) as thread, Client(thread.address) as client:
        assert thread.server.recovery.sessions == 2
        with pytest.raises(SessionNotFound):
            client.session(first).info()
        assert client.session(second).info().history_length == 3 and client.session(third).info().history_length == 2
        assert not (state / "sessions" / f"{first}.journal").exists()


def test_a_create_cut_before_its_magic_is_deleted_not_kept_as_damaged(tmp_path: Path):
    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        kept, history = _drive(client, ("full", {}))
    sessions = state / "sessions"
    (sessions / "ses_empty.journal").write_bytes(b"")
    (sessions / "ses_short.journal").write_bytes(records.MAGIC[:3])
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert thread.server.recovery.sessions == 1
        assert list(client.session(kept).info(include_history=True).history_token_ids) == history
    assert sorted(p.name for p in sessions.iterdir() if "ses_empty" in p.name or "ses_short" in p.name) == []


def test_a_restart_keeps_each_sessions_idle_time(tmp_path: Path):
    """Idle time counts while a server runs: from the session's last write to when the last server was last seen
    alive (its lock file's heartbeat), so a restart does not reset it (a server restarted more often than its idle
    TTL never reclaimed a session nobody used, or one whose create never answered) and downtime does not add to it."""
    import os

    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        old, _ = _drive(client, ("full", {}))
        fresh, _ = _drive(client, ("full", {}))
    alive = (state / "lock").stat().st_mtime
    for path, when in ((state / "sessions" / f"{old}.journal", alive - 120), (state / "lock", alive)):
        os.utime(path, (when, when))
    with running_server(served, state_dir=str(state)) as thread, Client(thread.address) as client:
        assert client.session(old).info().idle_s >= 119 and client.session(fresh).info().idle_s < 60
    down = (state / "lock").stat().st_mtime - 5000  # the last server was last seen 5,000 s ago: downtime
    for path in (state / "sessions" / f"{fresh}.journal", state / "lock"):
        os.utime(path, (down, down))
    os.utime(state / "sessions" / f"{old}.journal", (down - 120, down - 120))
    with running_server(served, state_dir=str(state), idle_ttl_s=60) as thread, Client(thread.address) as client:
        with pytest.raises(SessionNotFound):  # idle 120 s while a server ran: past the TTL
            client.session(old).info()
        assert client.session(fresh).info().idle_s < 60  # the 5,000 s without a server do not count


def test_a_session_kept_alive_by_reads_keeps_its_idle_time_across_a_restart(tmp_path: Path):
    """An ExportSession uses a session (keeps it alive) but writes nothing: a restart measured its idle time from the
    last journal write, so a session exported a moment before a restart came back long idle (or TTL-evicted). The
    journal now carries the last use. (GetSessionInfo is a read, not a use: it keeps nothing alive.)"""
    import time

    served = tiny_served()
    state = tmp_path / "state"
    with running_server(served, state_dir=str(state), idle_ttl_s=4.0) as thread, Client(thread.address) as client:
        sid, _ = _drive(client, ("full", {}))  # its last write
        for _ in range(2):  # exports keep it alive past the TTL; the server's heartbeat runs every 2 s
            time.sleep(1.6)
            client.session(sid).export()
        time.sleep(1.2)
    with running_server(served, state_dir=str(state), idle_ttl_s=4.0) as thread, Client(thread.address) as client:
        assert client.session(sid).info().idle_s < 2.5  # idle since the last export, not since the last write


def test_a_shutdown_mid_generate_streams_every_committed_token_then_fails_unavailable(tmp_path: Path):
    """A Generate still running when the shutdown's grace period ends stops at a step boundary, streams every token
    it committed and fails UNAVAILABLE: the journaled history is exactly what the client received (a stream cut
    by the gRPC server's own cancel left a committed token the client never saw)."""
    import threading

    from kakeya.errors import Unavailable

    from kakeya_runtime.server.grpc_app import ServedModel
    from kakeya_runtime.server.testing import SlowModel

    def served(delay_s: float) -> ServedModel:
        return ServedModel("tiny-llama", SlowModel(tiny_model("llama"), delay_s=delay_s),
                           tiny_served("llama").tokenizer_json, eos_ids=(2,))

    state = tmp_path / "state"
    got: list[int] = []
    with running_server(served(0.02), state_dir=str(state), grace_s=0.3) as thread, \
            Client(thread.address) as client:
        s = client.create_session([5, 6, 7])
        stopper = threading.Timer(0.5, thread.stop)
        stopper.start()
        with pytest.raises(Unavailable, match="shutting down"):
            for token in s.generate(500, ignore_eos=True):
                got.append(token)
        stopper.join()
    assert 5 < len(got) < 500
    with running_server(served(0.0), state_dir=str(state)) as thread, Client(thread.address) as client:
        assert list(client.session(s.id).info(include_history=True).history_token_ids) == [5, 6, 7, *got]


def test_a_close_stays_closed_when_the_journal_cannot_be_deleted(tmp_path: Path, monkeypatch):
    """CloseSession answers OK and the session must not come back, even where the directory refuses the delete
    (read-only, immutable: here the OS error is injected, as root could delete anyway): an ENDED record goes
    through the journal's open file, and recovery deletes that journal."""
    state = tmp_path / "state"
    unlink = Path.unlink

    def refusing(self: Path, missing_ok: bool = False) -> None:
        if self.suffix == ".journal":
            raise PermissionError(1, "Operation not permitted", str(self))
        unlink(self, missing_ok=missing_ok)

    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        closed, _ = _drive(client, ("full", {}))
        kept, history = _drive(client, ("full", {}))
        monkeypatch.setattr(Path, "unlink", refusing)
        client.session(closed).close()
        monkeypatch.setattr(Path, "unlink", unlink)
        assert (state / "sessions" / f"{closed}.journal").exists()  # the delete was refused
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        assert thread.server.recovery.sessions == 1
        with pytest.raises(SessionNotFound):
            client.session(closed).info()
        assert list(client.session(kept).info(include_history=True).history_token_ids) == history
    assert not (state / "sessions" / f"{closed}.journal").exists()


def _archive_with(archive: bytes, header: object = None, edit_kv=None, meta: dict | None = None) -> bytes:
    """The archive re-framed with its header replaced (any JSON value), or its snapshot's tensors edited by
    edit_kv(name, tensor) / its snapshot metadata updated with `meta`."""
    import json as _json

    from safetensors.torch import load, save

    parsed = records.parse(archive)
    hdr, toks = parsed.records[0], parsed.records[1]
    kv = parsed.records[2].payload if len(parsed.records) == 3 else None
    if edit_kv is not None or meta is not None:
        tensors = {k: (edit_kv(k, v) if edit_kv else v) for k, v in load(kv).items()}
        kv = save(tensors, metadata={**snapshot_meta(kv), **(meta or {})})
    head = hdr.payload if header is None else _json.dumps(header).encode()
    body = records.encode(records.RecordKind.HEADER, head) + records.encode(records.RecordKind.TOKENS, toks.payload)
    if kv is not None:
        body += records.encode(records.RecordKind.KV, kv)
    return records.MAGIC + body


def test_import_refuses_hostile_archives_with_typed_errors(tmp_path: Path):
    """Found by a hostile-input audit: each answered INTERNAL, or was accepted as 'verified' and then gave other
    tokens (a restore cache's own history swapped) or failed every Generate (ring positions out of range)."""
    import json as _json

    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        for policy in (("restore", {"sink": 4, "window": 16}), ("sparse", POLICIES[3][1])):
            sid, _ = _drive(client, policy if policy[0] == "restore" else ("sparse", policy[1]))
            archive = client.session(sid).export(include_kv=True)
            header = _json.loads(records.parse(archive).records[0].payload)
            hostile = [_archive_with(archive, header=[1, 2]),
                       _archive_with(archive, header={**header, "context_length": float("inf")}),
                       _archive_with(archive, meta={"cached_length": "many"})]
            key = "0/restore.history" if policy[0] == "restore" else "0/hot_pos"
            if policy[0] == "restore":
                hostile.append(_archive_with(archive, edit_kv=lambda k, t, key=key: (t + 1) % 200 if k == key else t))
                hostile.append(_archive_with(archive, edit_kv=lambda k, t: torch.full_like(t, 2**31 - 1)
                                             if k == "0/slot_positions" else t))
            else:
                hostile.append(_archive_with(archive, edit_kv=lambda k, t, key=key: torch.full_like(t, 2**31 - 1)
                                             if k == key else t))
            before = len(thread.server.service.store)
            for data in hostile:
                with pytest.raises(InvalidArgument):
                    client.import_session(data)
            assert len(thread.server.service.store) == before
            assert client.import_session(archive).kv_loaded  # the genuine one still loads
        from kakeya import KvPolicy

        with pytest.raises(InvalidArgument, match="must be an integer"):
            client.create_session([1, 2], policy=KvPolicy("sink_window", {"sink": "9" * 5000}))


def test_a_refused_import_evicts_nothing(tmp_path: Path):
    """At the session limit an import makes room like a create does; one whose KV snapshot does not match its
    history is refused before that (it evicted the key's least recently used session, and counted a close)."""
    with running_server(tiny_served(), max_sessions=2) as thread, Client(thread.address) as client:
        first, history = _drive(client, ("full", {}))
        second, _ = _drive(client, ("full", {}))
        parsed = arc.decode(client.session(second).export(include_kv=True))
        lie = arc.encode(parsed.model, "full", {}, parsed.context_length, [9] + parsed.history[1:], parsed.kv,
                         checkpoint=parsed.checkpoint)
        with pytest.raises(InvalidArgument, match="not the session's first"):
            client.import_session(lie)
        assert list(client.session(first).info(include_history=True).history_token_ids) == history
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_session_evicted_total", '{reason="lru"}') == 0
        assert metric_value(text, "kakeya_session_evicted_total", '{reason="close"}') == 0


@pytest.mark.parametrize("cut_fails", [False, True])
def test_an_append_whose_flush_fails_is_undone_or_says_it_was_applied(tmp_path: Path, monkeypatch, cut_fails):
    """AppendTokens wrote its record, then fsync failed: the call answers UNAVAILABLE. A client that retries must not
    duplicate the tokens, so the record is cut and the tokens dropped; where the journal cannot be cut either, the
    tokens stay (memory = journal) and the error says they were appended."""
    import os

    from kakeya.errors import Unavailable

    state = tmp_path / "state"
    fsync, ftruncate = os.fsync, os.ftruncate

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    def refusing(fd: int, size: int) -> None:
        raise OSError(5, "Input/output error")

    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        s = client.create_session([5, 6, 7])
        monkeypatch.setattr(os, "fsync", failing)
        if cut_fails:
            monkeypatch.setattr(os, "ftruncate", refusing)
        with pytest.raises(Unavailable, match="were appended" if cut_fails else "flush"):
            s.append([8, 9])
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "ftruncate", ftruncate)
        expected = [5, 6, 7, 8, 9] if cut_fails else [5, 6, 7]
        assert list(s.info(include_history=True).history_token_ids) == expected
        s.append([10])
        expected.append(10)
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        assert list(client.session(s.id).info(include_history=True).history_token_ids) == expected


def test_a_journal_removed_while_the_server_runs_refuses_writes(tmp_path: Path):
    """Writes went on through the open descriptor of an unlinked journal, acknowledged and lost at the restart; now
    the call is refused UNAVAILABLE and the session keeps what it had."""
    from kakeya.errors import Unavailable

    state = tmp_path / "state"
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        s = client.create_session([5, 6, 7])
        (state / "sessions" / f"{s.id}.journal").unlink()
        with pytest.raises(Unavailable, match="removed from the state directory"):
            s.append([8])
        with pytest.raises(Unavailable, match="removed from the state directory"):
            s.generate(max_tokens=3, ignore_eos=True).collect()
        assert list(s.info(include_history=True).history_token_ids) == [5, 6, 7]
        assert len(client.create_session([1]).generate(max_tokens=2, ignore_eos=True).collect()) == 2  # others go on


def _as_written_before_2026_12_01(path: Path) -> None:
    """Rewrite a journal's header as Kakeya wrote an int8 session's policy until 2026-12-01: with "q": 38."""
    parsed = records.parse(path.read_bytes())
    out = records.MAGIC
    for r in parsed.records:
        if r.kind is records.RecordKind.HEADER:
            header = r.json()
            header["policy"]["params"]["q"] = 38
            out += records.header_record(header)
        else:
            out += records.encode(r.kind, r.payload)
    path.write_bytes(out)


def test_sessions_stored_with_a_q_their_codec_ignores_still_come_back(tmp_path: Path):
    """Until 2026-12-01 a journal or an archive held "q" beside an int8 codec; a request with one is now refused,
    and so was the restart of a state dir holding one (no setting could start it) and the import of such an
    archive. Stored policies drop what their codec does not use."""
    from kakeya import KvPolicy

    state = tmp_path / "state"
    policy = KvPolicy("sparse", {"sink": 2, "window": 16, "block": 8, "topk": 2, "codec": "int8"})
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        s = client.create_session([5, 6, 7], policy=policy)
        s.generate(max_tokens=3, ignore_eos=True).collect()
        sid = s.id
    _as_written_before_2026_12_01(state / "sessions" / f"{sid}.journal")
    with running_server(tiny_served(), state_dir=str(state)) as thread, Client(thread.address) as client:
        restored = client.session(sid)
        assert restored.info().policy.params["codec"] == "int8" and "q" not in restored.info().policy.params
        archive = restored.export()
    old = arc.decode(archive)
    stale = arc.encode(old.model, old.policy_name, {**old.policy_params, "q": 38}, old.context_length, old.history,
                       old.kv, old.settings, checkpoint=old.checkpoint)
    with running_server(tiny_served()) as thread, Client(thread.address) as client:
        assert client.import_session(stale).info().policy.params["codec"] == "int8"


def test_an_import_being_checked_holds_up_no_other_call(monkeypatch):
    """An archive is decoded off the event loop: while one was checked (seconds for a large or crafted one), every
    other call, the health service's included, waited, and other imports were refused as stalled."""
    import threading

    checking, release = threading.Event(), threading.Event()
    real = arc.decode

    def slow_decode(data):
        checking.set()
        release.wait(30)
        return real(data)

    monkeypatch.setattr(arc, "decode", slow_decode)
    with running_server(tiny_served()) as thread, Client(thread.address, timeout=30) as client:
        archive = client.create_session([1, 2, 3]).export()
        result: list = []
        importer = threading.Thread(target=lambda: result.append(client.import_session(archive)))
        importer.start()
        try:
            assert checking.wait(10)
            with Client(thread.address, timeout=5) as other:  # answered while the import is still being checked
                assert other.create_session([4, 5]).info().history_length == 2
        finally:
            release.set()
            importer.join(30)
        assert result and result[0].info().history_length == 3


def test_a_recovered_session_reserves_its_worst_case_at_its_own_context(tmp_path: Path):
    """A session keeps the context it was created with across a restart with a shorter --context, and may grow to
    it: it reserved its worst case at the new server's context, half of what it could hold."""
    from kakeya import KvPolicy

    from kakeya_runtime.sessions.budget import kv_worst_case_bytes

    state = tmp_path / "state"
    with running_server(tiny_served(), state_dir=str(state), context_length=512) as thread, \
            Client(thread.address) as client:
        sid = client.create_session([1, 2, 3], policy=KvPolicy("restore", {"sink": 4, "window": 16})).id
    with running_server(tiny_served(), state_dir=str(state), context_length=256) as thread:
        service = thread.server.service
        session = service.store.get("", sid)
        assert session.context_length == 512
        want = kv_worst_case_bytes(service.engine.config, session.policy, 512, service.engine.dtype)
        assert service.store.kv_reserved_bytes() == want > service.kv_reserve(session.policy)
