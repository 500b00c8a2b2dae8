"""`kakeya bench soak`: randomized valid and invalid requests against a real `kakeya serve`, with a kill -9 and a
restart in the middle; bounded in requests and time, loopback only.

Several API keys drive every RPC at once: valid calls (sessions under every policy, appends, Generates cancelled at
random points, exports and imports) and invalid ones (bad ids and tokens, NaN, deeply nested and oddly spelled params, undecodable
bytes, foreign and oversized session ids, wrong keys). The server runs with small per-key quotas (evictions), idle
compression after a second, and a state directory. Each worker keeps a ledger of what the server acknowledged to
it. Halfway, the workers pause, a long Generate starts, the ledger is checked against every live session, and the
server is killed with SIGKILL mid-stream; a new server on the same state directory must give every session back
with every acknowledged token. Then the workers go on against it.

The run fails (exit 1) on any UNKNOWN or INTERNAL status, an invalid request answered OK, a session or token lost
across the restart, an invariant violation on /metrics (read before the kill and at the end), a dead server, or a
server RSS above --max-rss.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2

from kakeya_runtime._proto import runtime_pb2 as pb
from kakeya_runtime._proto import runtime_pb2_grpc as pb_grpc
from kakeya_runtime.bench.machine import machine_info, machine_slug
from kakeya_runtime.bench.serve_process import ServeProcess
from kakeya_runtime.server.testing import metric_value

SCHEMA = "kakeya.bench.soak/1"
BAD_STATUSES = ("UNKNOWN", "INTERNAL")
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("sink_window", {"sink": 4, "window": 96}),
    ("sparse", {"sink": 4, "window": 64, "block": 32, "topk": 2, "codec": "int8"}),
]
SERVICE = "/kakeya.v1.RuntimeService/"
CHUNK = 512 * 1024  # archive chunks under the server's receive limit


@dataclass(slots=True)
class SoakConfig:
    model: str = "smollm2"
    weights: str = "auto"  # the server's --weights
    requests: int = 10_000
    max_seconds: float = 900.0
    keys: int = 3
    context: int = 1024
    seed: int = 0
    max_rss_bytes: int = 6 * 2**30
    kill: bool = True


@dataclass(slots=True)
class _Owned:
    key: int
    history: list[int]  # every token the server acknowledged, in order


@dataclass
class _Shared:
    """What the workers share with the controller (guarded by `lock`)."""

    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter = field(default_factory=Counter)  # (rpc, kind, code) -> count
    bad: list[str] = field(default_factory=list)  # UNKNOWN/INTERNAL answers and invalid requests answered OK
    sessions: dict[str, _Owned] = field(default_factory=dict)
    requests: int = 0
    budget: int = 0  # workers stop once this many requests ran
    stop: threading.Event = field(default_factory=threading.Event)
    archives: list[tuple[int, bytes]] = field(default_factory=list)  # (key, archive) kept for imports


def _key(i: int) -> str:
    return f"soak-key-{i:02d}-0123456789"


class _Worker(threading.Thread):
    def __init__(self, shared: _Shared, key: int, vocab: int, seed: int) -> None:
        super().__init__(daemon=True, name=f"soak-{key}")
        self.shared, self.key, self.vocab = shared, key, vocab
        self.rng = random.Random(seed)
        self.md = (("authorization", f"Bearer {_key(key)}"),)
        self.ops = [(w, getattr(self, f"op_{name}")) for name, w in (
            ("create", 8), ("append", 12), ("generate", 12), ("info", 8), ("model_info", 2), ("close", 3),
            ("export", 3), ("import", 2),
            ("bad_token", 2), ("empty_append", 1), ("nan_param", 2), ("unknown_policy", 1), ("bad_max_tokens", 2),
            ("unknown_session", 2), ("huge_session_id", 1), ("foreign_session", 2), ("garbage_bytes", 3),
            ("wrong_key", 1), ("deep_params", 1), ("bad_sampling", 2), ("big_window", 1), ("bad_archive", 1),
            ("bad_utf8_id", 1), ("odd_param_text", 1))]

    # ---- plumbing ----------------------------------------------------------------------------

    def run(self) -> None:
        self.channel = grpc.insecure_channel(self.shared.address)
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)
        while not self.shared.stop.is_set():
            with self.shared.lock:
                if self.shared.requests >= self.shared.budget:
                    break
                self.shared.requests += 1
            op = self.rng.choices([op for _, op in self.ops], weights=[w for w, _ in self.ops])[0]
            try:
                op()
            except Exception as e:  # a bug of the bench's own: reported, the run goes on
                with self.shared.lock:
                    self.shared.bad.append(f"client error in {op.__name__}: {type(e).__name__}: {e}"[:300])
        self.channel.close()

    def _record(self, rpc: str, kind: str, code: grpc.StatusCode, *, expect_error: bool = False) -> None:
        name = code.name
        with self.shared.lock:
            self.shared.statuses[(rpc, kind, name)] += 1
            if name in BAD_STATUSES:
                self.shared.bad.append(f"{rpc}/{kind} answered {name}")
            elif expect_error and code is grpc.StatusCode.OK:
                self.shared.bad.append(f"{rpc}/{kind}: an invalid request was accepted")

    def _call(self, rpc: str, kind: str, request: Any, *, expect_error: bool = False, md: Any = None) -> Any:
        try:
            response = getattr(self.stub, rpc)(request, metadata=self.md if md is None else md, timeout=120)
        except grpc.RpcError as e:
            self._record(rpc, kind, e.code(), expect_error=expect_error)
            if e.code() is grpc.StatusCode.NOT_FOUND and getattr(request, "session_id", None):
                self._forget(request.session_id)
            return None
        self._record(rpc, kind, grpc.StatusCode.OK, expect_error=expect_error)
        return response

    def _mine(self) -> str | None:
        with self.shared.lock:
            mine = [sid for sid, o in self.shared.sessions.items() if o.key == self.key]
        return self.rng.choice(mine) if mine else None

    def _forget(self, sid: str) -> None:
        with self.shared.lock:
            owned = self.shared.sessions.get(sid)
            if owned is not None and owned.key == self.key:
                del self.shared.sessions[sid]  # closed or evicted (our own quota makes room)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    # ---- valid calls -------------------------------------------------------------------------

    def op_create(self) -> None:
        name, params = self.rng.choice(POLICIES)
        initial = self._tokens(self.rng.randrange(0, 48))
        struct = struct_pb2.Struct()
        struct.update(params)
        r = self._call("CreateSession", "valid", pb.CreateSessionRequest(
            initial_token_ids=initial, policy=pb.KvPolicy(name=name, params=struct)))
        if r is not None:
            with self.shared.lock:
                self.shared.sessions[r.session_id] = _Owned(self.key, initial)

    def op_append(self) -> None:
        sid = self._mine()
        if sid is None:
            return self.op_create()
        tokens = self._tokens(self.rng.randrange(1, 40))
        r = self._call("AppendTokens", "valid", pb.AppendTokensRequest(session_id=sid, token_ids=tokens))
        if r is not None:
            with self.shared.lock:
                if sid in self.shared.sessions:
                    self.shared.sessions[sid].history.extend(tokens)

    def op_generate(self) -> None:
        sid = self._mine()
        if sid is None:
            return self.op_create()
        temperature = self.rng.choice([0.0, 0.7, 1.3, 1e-40])
        sampling = pb.SamplingParams(temperature=temperature, top_k=self.rng.choice([0, 20]), seed=self.rng.randrange(1000))
        request = pb.GenerateRequest(session_id=sid, max_tokens=self.rng.randrange(1, 7), sampling=sampling,
                                     ignore_eos=True)
        cancel_after = self.rng.randrange(1, 4) if self.rng.random() < 0.25 else None
        got: list[int] = []
        call = self.stub.Generate(request, metadata=self.md, timeout=120)
        code = grpc.StatusCode.OK
        try:
            for message in call:
                got.extend(message.tokens.token_ids)
                if cancel_after is not None and len(got) >= cancel_after:
                    call.cancel()
        except grpc.RpcError as e:
            code = e.code()
        kind = "valid" if cancel_after is None else "cancelled"
        self._record("Generate", kind, code)
        if code is grpc.StatusCode.NOT_FOUND:
            self._forget(sid)
            return
        with self.shared.lock:
            owned = self.shared.sessions.get(sid)
            if owned is None:
                return
            owned.history.extend(got)  # every token received is committed
            acknowledged = list(owned.history)
        if code is not grpc.StatusCode.OK:  # cancelled: the server may have committed tokens that never arrived
            info = self._settled(sid)
            if info is not None:
                server = list(info.history_token_ids)
                with self.shared.lock:
                    if server[: len(acknowledged)] != acknowledged:
                        self.shared.bad.append(f"Generate/{kind}: the history lost acknowledged tokens")
                    if sid in self.shared.sessions:
                        self.shared.sessions[sid].history = server

    def _settled(self, sid: str) -> Any:
        """GetSessionInfo once the session's cancelled Generate has finished its last step (it may commit one more
        token after the cancel: that token is the server's, and the ledger follows it)."""
        for _ in range(500):
            info = self._call("GetSessionInfo", "resync", pb.GetSessionInfoRequest(session_id=sid,
                                                                                    include_history=True))
            if info is None or not info.generating:
                return info
            time.sleep(0.01)
        return None

    def op_info(self) -> None:
        sid = self._mine()
        if sid is None:
            return self.op_model_info()
        r = self._call("GetSessionInfo", "valid", pb.GetSessionInfoRequest(session_id=sid, include_history=True))
        if r is not None:
            with self.shared.lock:
                owned = self.shared.sessions.get(sid)
                if owned is not None and list(r.history_token_ids) != owned.history:
                    self.shared.bad.append(f"GetSessionInfo: session {sid[:12]}… holds {len(r.history_token_ids)} "
                                           f"tokens, the client was acknowledged {len(owned.history)}")

    def op_model_info(self) -> None:
        self._call("GetModelInfo", "valid", pb.GetModelInfoRequest())

    def op_close(self) -> None:
        sid = self._mine()
        if sid is not None and self._call("CloseSession", "valid", pb.CloseSessionRequest(session_id=sid)):
            self._forget(sid)

    def op_export(self) -> None:
        sid = self._mine()
        if sid is None:
            return
        request = pb.ExportSessionRequest(session_id=sid, include_kv=self.rng.random() < 0.5)
        try:
            data = b"".join(c.data for c in self.stub.ExportSession(request, metadata=self.md, timeout=120))
        except grpc.RpcError as e:
            self._record("ExportSession", "valid", e.code())
            return
        self._record("ExportSession", "valid", grpc.StatusCode.OK)
        with self.shared.lock:
            self.shared.archives.append((self.key, data))
            del self.shared.archives[:-4]

    def op_import(self) -> None:
        with self.shared.lock:
            mine = [a for k, a in self.shared.archives if k == self.key]
        if not mine:
            return self.op_export()
        data = self.rng.choice(mine)
        chunks = [pb.ImportSessionRequest(data=data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
        try:
            r = self.stub.ImportSession(iter(chunks), metadata=self.md, timeout=120)
        except grpc.RpcError as e:
            self._record("ImportSession", "valid", e.code())
            return
        self._record("ImportSession", "valid", grpc.StatusCode.OK)
        info = self._call("GetSessionInfo", "valid", pb.GetSessionInfoRequest(session_id=r.session_id,
                                                                               include_history=True))
        if info is not None:
            with self.shared.lock:
                self.shared.sessions[r.session_id] = _Owned(self.key, list(info.history_token_ids))

    # ---- invalid calls (each must be refused with a typed status) --------------------------------

    def op_bad_token(self) -> None:
        sid = self._mine() or "ses_none"
        bad = self.rng.choice([-1, self.vocab, self.vocab + 1000, 2**31 - 1])
        self._call("AppendTokens", "bad_token", pb.AppendTokensRequest(session_id=sid, token_ids=[5, bad]),
                   expect_error=True)

    def op_empty_append(self) -> None:
        self._call("AppendTokens", "empty", pb.AppendTokensRequest(session_id=self._mine() or "x"), expect_error=True)

    def op_nan_param(self) -> None:
        struct = struct_pb2.Struct()
        struct.update({"window": self.rng.choice([math.nan, math.inf, -math.inf])})
        self._call("CreateSession", "nan_param", pb.CreateSessionRequest(
            policy=pb.KvPolicy(name="sink_window", params=struct)), expect_error=True)

    def op_odd_param_text(self) -> None:
        """An integer parameter as text Python's own isdigit() or int() would take: other scripts' digits, a doubled
        sign, an underscore (once an INTERNAL status)."""
        struct = struct_pb2.Struct()
        struct.update({self.rng.choice(["sink", "window"]): self.rng.choice(["\u00b2", "--5", "\u0663", "1_0"])})
        self._call("CreateSession", "odd_param_text", pb.CreateSessionRequest(
            policy=pb.KvPolicy(name="sink_window", params=struct)), expect_error=True)

    def op_unknown_policy(self) -> None:
        self._call("CreateSession", "unknown_policy", pb.CreateSessionRequest(policy=pb.KvPolicy(name="nope")),
                   expect_error=True)

    def op_bad_max_tokens(self) -> None:
        sid = self._mine() or "ses_none"
        request = pb.GenerateRequest(session_id=sid, max_tokens=self.rng.choice([0, 10**9]))
        try:
            list(self.stub.Generate(request, metadata=self.md, timeout=60))
            self._record("Generate", "bad_max_tokens", grpc.StatusCode.OK, expect_error=True)
        except grpc.RpcError as e:
            self._record("Generate", "bad_max_tokens", e.code(), expect_error=True)

    def op_unknown_session(self) -> None:
        self._call("GetSessionInfo", "unknown_session", pb.GetSessionInfoRequest(
            session_id="ses_" + "".join(self.rng.choices("abcdef0123456789", k=32))), expect_error=True)

    def op_huge_session_id(self) -> None:
        self._call("CloseSession", "huge_session_id", pb.CloseSessionRequest(session_id="x" * 10_240),
                   expect_error=True)

    def op_foreign_session(self) -> None:
        with self.shared.lock:
            foreign = [sid for sid, o in self.shared.sessions.items() if o.key != self.key]
        if foreign:
            self._call("GetSessionInfo", "foreign_session", pb.GetSessionInfoRequest(
                session_id=self.rng.choice(foreign)), expect_error=True)

    def op_garbage_bytes(self) -> None:
        rpc = self.rng.choice(["CreateSession", "AppendTokens", "CloseSession", "GetSessionInfo", "GetModelInfo"])
        garbage = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 64)))
        call = self.channel.unary_unary(SERVICE + rpc, request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        try:
            call(garbage, metadata=self.md, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        # Random bytes sometimes decode as a valid message (e.g. an empty GetModelInfoRequest): only the typed
        # statuses are checked here, not that every one is refused.
        self._record(rpc, "garbage_bytes", code)

    def op_wrong_key(self) -> None:
        self._call("GetModelInfo", "wrong_key", pb.GetModelInfoRequest(),
                   md=(("authorization", "Bearer not-a-key-at-all"),), expect_error=True)

    def op_deep_params(self) -> None:
        """Policy params nested past protobuf's recursion limit: built as wire bytes (the client's own protobuf
        refuses to build or parse them)."""
        value = b"\x11" + bytes(8)  # Value{number_value: 0.0}
        for _ in range(self.rng.randrange(101, 160)):
            entry = b"\x0a\x01x" + _field(2, value)  # map entry {key: "x", value: Value}
            value = _field(5, _field(1, entry))  # Value{struct_value: Struct{fields: [entry]}}
        params = _field(1, b"\x0a\x01x" + _field(2, value))
        policy = _field(1, b"sink_window") + _field(2, params)
        call = self.channel.unary_unary(SERVICE + "CreateSession", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        try:
            call(_field(2, policy), metadata=self.md, timeout=30)
            self._record("CreateSession", "deep_params", grpc.StatusCode.OK, expect_error=True)
        except grpc.RpcError as e:
            self._record("CreateSession", "deep_params", e.code(), expect_error=True)

    def op_bad_sampling(self) -> None:
        sid = self._mine() or "ses_none"
        sampling = self.rng.choice([pb.SamplingParams(temperature=math.nan), pb.SamplingParams(temperature=500.0),
                                    pb.SamplingParams(temperature=0.5, top_p=2.0),
                                    pb.SamplingParams(temperature=-1.0)])
        try:
            list(self.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=2, sampling=sampling),
                                    metadata=self.md, timeout=60))
            self._record("Generate", "bad_sampling", grpc.StatusCode.OK, expect_error=True)
        except grpc.RpcError as e:
            self._record("Generate", "bad_sampling", e.code(), expect_error=True)

    def op_big_window(self) -> None:
        struct = struct_pb2.Struct()
        struct.update({"sink": 4, "window": 10**6})
        self._call("CreateSession", "big_window", pb.CreateSessionRequest(
            policy=pb.KvPolicy(name="sink_window", params=struct)), expect_error=True)

    def op_bad_archive(self) -> None:
        data = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(0, 200)))
        try:
            self.stub.ImportSession(iter([pb.ImportSessionRequest(data=data)]), metadata=self.md, timeout=60)
            self._record("ImportSession", "bad_archive", grpc.StatusCode.OK, expect_error=True)
        except grpc.RpcError as e:
            self._record("ImportSession", "bad_archive", e.code(), expect_error=True)

    def op_bad_utf8_id(self) -> None:
        raw = pb.GetSessionInfoRequest(session_id="PLACEHOLDER").SerializeToString().replace(b"PLACEHOLDER",
                                                                                             b"\xff\xfe\xfdABCDEFGH")
        call = self.channel.unary_unary(SERVICE + "GetSessionInfo", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
        try:
            call(raw, metadata=self.md, timeout=30)
            self._record("GetSessionInfo", "bad_utf8_id", grpc.StatusCode.OK, expect_error=True)
        except grpc.RpcError as e:
            self._record("GetSessionInfo", "bad_utf8_id", e.code(), expect_error=True)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: tag, varint length, bytes."""
    out, n = bytearray([number << 3 | 2]), len(payload)
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out) + payload


def _violations(metrics: str) -> float:
    total = 0.0
    for kind in ("inv1", "inv2"):
        with contextlib.suppress(KeyError):
            total += metric_value(metrics, "kakeya_cache_invariant_violations_total", f'{{kind="{kind}"}}')
    return total


def _rpc_errors(metrics: str, code: str) -> float:
    try:
        return metric_value(metrics, "kakeya_rpc_errors_total", f'{{code="{code}"}}')
    except KeyError:
        return 0.0


def run_soak(config: SoakConfig, *, on_progress: Any = None) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="kakeya-soak-"))  # kept: a failed run can be inspected
    keys = [_key(i) for i in range(config.keys)]
    args = ["--model", config.model, "--weights", config.weights, "--state-dir", str(state / "state"),
            "--context", str(config.context),
            "--max-sessions", str(4 * config.keys), "--max-sessions-per-key", "4", "--idle-compress-after", "1",
            "--ttl", "3600", *[a for k in keys for a in ("--api-key", k)]]
    started = time.monotonic()
    server = ServeProcess(args)
    shared = _Shared(server.address)
    vocab = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(server.address)).GetModelInfo(
        pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {keys[0]}"),), timeout=60).vocab_size
    rss: list[tuple[float, int]] = []
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.is_set():
            rss.append((round(time.monotonic() - started, 1), server.rss_bytes()))
            sampling.wait(1.0)

    workers = [_Worker(shared, i, vocab, config.seed * 1000 + i) for i in range(config.keys)]
    shared.budget = config.requests // 2 if config.kill else config.requests
    threading.Thread(target=sample_rss, daemon=True).start()
    for w in workers:
        w.start()
    deadline = started + config.max_seconds
    crash: dict[str, Any] = {}
    phases: list[dict[str, Any]] = []

    def wait_phase() -> None:
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
            if on_progress is not None:
                on_progress(shared.requests, config.requests)

    wait_phase()
    if config.kill and time.monotonic() < deadline:
        first_metrics = server.metrics()
        phases.append({"server": 1, "violations": _violations(first_metrics),
                       "internal": _rpc_errors(first_metrics, "INTERNAL"),
                       "unknown": _rpc_errors(first_metrics, "UNKNOWN")})
        crash = _kill_and_recover(server, shared, keys, vocab)
        server = crash.pop("server")
        shared.address = server.address
        shared.budget = config.requests
        workers = [_Worker(shared, i, vocab, config.seed * 1000 + 100 + i) for i in range(config.keys)]
        for w in workers:
            w.start()
        wait_phase()
    shared.stop.set()
    for w in workers:
        w.join(timeout=150)
    alive = server.alive()
    end_metrics = server.metrics() if alive else ""
    phases.append({"server": 2 if crash else 1, "violations": _violations(end_metrics) if alive else None,
                   "internal": _rpc_errors(end_metrics, "INTERNAL"), "unknown": _rpc_errors(end_metrics, "UNKNOWN")})
    sampling.set()
    exit_status = server.stop()
    elapsed = time.monotonic() - started
    statuses: dict[str, dict[str, int]] = {}
    for (rpc, kind, code), n in sorted(shared.statuses.items()):
        statuses.setdefault(f"{rpc}/{kind}", {})[code] = n
    max_rss = max((b for _, b in rss), default=0)
    failures = list(dict.fromkeys(shared.bad))[:50]
    if not alive:
        failures.append("the server died")
    if any((p["violations"] or 0) > 0 for p in phases):
        failures.append("invariant violations on /metrics")
    if any(p["internal"] or p["unknown"] for p in phases):
        failures.append("INTERNAL/UNKNOWN statuses counted on /metrics")
    if crash and (crash["sessions_lost"] or crash["tokens_lost"]):
        failures.append(f"{crash['sessions_lost']} sessions and {crash['tokens_lost']} tokens lost across kill -9")
    if max_rss > config.max_rss_bytes:
        failures.append(f"server RSS reached {max_rss / 2**30:.2f} GiB (limit {config.max_rss_bytes / 2**30:.2f})")
    if shared.requests < config.requests:
        failures.append(f"only {shared.requests} of {config.requests} requests ran before the time limit")
    if not failures:
        shutil.rmtree(state, ignore_errors=True)
    return {
        "schema": SCHEMA,
        "config": {k: getattr(config, k) for k in config.__slots__},
        "server_args": args,
        "requests": shared.requests,  # operations drawn; one with nothing to act on sends no RPC (close: no session)
        "rpcs": sum(shared.statuses.values()),  # what status_totals counts
        "elapsed_s": round(elapsed, 1),
        "statuses": statuses,
        "status_totals": dict(sum((Counter({code: n}) for (_, _, code), n in shared.statuses.items()), Counter())),
        "crash": crash,
        "phases": phases,
        "rss": {"max_bytes": max_rss, "samples": rss[:: max(1, len(rss) // 200)]},
        "server_exit_status": exit_status,
        "failures": failures,
        "passed": not failures,
    }


def _kill_and_recover(server: ServeProcess, shared: _Shared, keys: list[str], vocab: int) -> dict[str, Any]:
    """With the first half's workers done: check the ledger against the server, start a long Generate, SIGKILL the
    server mid-stream, restart it on the same state dir and compare every session with what was acknowledged."""
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.RuntimeServiceStub(channel)
    md = lambda k: (("authorization", f"Bearer {keys[k]}"),)  # noqa: E731
    # The long Generate's session first: creating it may evict one of key 0's own (its quota), before the check.
    rng = random.Random(7)
    prompt = [rng.randrange(3, vocab) for _ in range(32)]
    sid = stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=prompt), metadata=md(0), timeout=60).session_id
    mismatched = 0
    expected: dict[str, tuple[int, list[int]]] = {}
    with shared.lock:
        ledger = {sid: (o.key, list(o.history)) for sid, o in shared.sessions.items()}
    for owned, (k, history) in ledger.items():
        try:
            info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=owned, include_history=True),
                                       metadata=md(k), timeout=60)
        except grpc.RpcError:
            continue  # evicted for its own key's quota before the check: not a session any more
        mismatched += list(info.history_token_ids) != history
        expected[owned] = (k, list(info.history_token_ids))
    received: list[int] = []
    streaming = threading.Event()

    def long_generate() -> None:
        call = stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=400, ignore_eos=True,
                                                sampling=pb.SamplingParams(temperature=0.8, seed=3)),
                             metadata=md(0))
        try:
            for message in call:
                received.extend(message.tokens.token_ids)
                if len(received) >= 8:
                    streaming.set()
        except grpc.RpcError:
            pass
        streaming.set()

    thread = threading.Thread(target=long_generate, daemon=True)
    thread.start()
    streaming.wait(300)
    server.kill9()
    thread.join(60)
    expected[sid] = (0, prompt + received)
    killed_at = len(received)
    restarted = ServeProcess(server.args)
    stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(restarted.address))
    recovered = lost_sessions = lost_tokens = extra_tokens = 0
    diverged: list[dict[str, Any]] = []
    for s, (k, history) in expected.items():
        try:
            info = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=s, include_history=True), metadata=md(k),
                                       timeout=60)
        except grpc.RpcError:
            lost_sessions += 1
            lost_tokens += len(history)
            continue
        recovered += 1
        got = list(info.history_token_ids)
        common = next((i for i, (a, b) in enumerate(zip(got, history, strict=False)) if a != b),
                      min(len(got), len(history)))
        lost_tokens += len(history) - common
        extra_tokens += len(got) - common  # only the killed stream may hold tokens sent but not yet received
        if common < len(history):
            diverged.append({"session": s[:12], "acknowledged": len(history), "recovered": len(got),
                             "common_prefix": common})
    with shared.lock:  # the ledger follows the server: the killed stream's session holds what was journaled
        for s in list(shared.sessions):
            if s not in expected:
                del shared.sessions[s]
    recovery_line = " ".join(restarted.log.split())  # rich wraps lines at 80 columns in a pipe
    recovery_line = recovery_line[recovery_line.find("State dir"):].split(" Kakeya serving")[0]
    return {"server": restarted, "sessions_before_kill": len(expected), "sessions_recovered": recovered,
            "sessions_lost": lost_sessions, "tokens_lost": lost_tokens, "tokens_beyond_acknowledged": extra_tokens,
            "ledger_mismatches_before_kill": mismatched, "killed_stream_tokens_received": killed_at,
            "recovery_log": recovery_line, "diverged": diverged}


def command(config: SoakConfig, out: Path) -> dict[str, Any]:
    import shlex
    import sys

    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    info = machine_info()
    with Progress(console=console) as progress:
        task = progress.add_task("soak", total=config.requests)
        result = run_soak(config, on_progress=lambda done, total: progress.update(task, completed=done))
    result["machine"] = info
    result["command"] = shlex.join(["kakeya", *sys.argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{config.model}_{machine_slug(info)}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    crash = result["crash"]
    console.print(f"{result['requests']} requests ({result['rpcs']} RPCs) in {result['elapsed_s']} s: "
                  f"{result['status_totals']}")
    if crash:
        console.print(f"kill -9: {crash['sessions_recovered']}/{crash['sessions_before_kill']} sessions recovered, "
                      f"{crash['tokens_lost']} tokens lost")
    console.print(f"max server RSS {result['rss']['max_bytes'] / 2**20:.0f} MiB; wrote {path}")
    for failure in result["failures"]:
        console.print(f"[red]FAIL[/] {failure}")
    return result
