"""Prometheus metrics (seed 000 §2.9), one registry per server so in-process servers never collide.

Every metric is named `kakeya_*` and every series carries the served model as its `model` label. gRPC calls are
counted per RPC by `RpcMetricsInterceptor` (requests, and errors by status code); refusals for a limit by the
limit (`kakeya_limit_refusals_total{limit}`). The HTTP endpoint (`serve_http`) answers only `GET /metrics` (404
elsewhere) and, given a key, only with `authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from kakeya_runtime import __version__
from kakeya_runtime.engine.generate import FinishReason
from kakeya_runtime.kv.idle import IdleStats
from kakeya_runtime.kv.spec import POLICIES
from kakeya_runtime.sessions.batch import BatchScheduler, StepKind
from kakeya_runtime.sessions.errors import Invariant
from kakeya_runtime.sessions.service import GenerateStats
from kakeya_runtime.sessions.speculation import PROPOSERS as SPEC_PROPOSERS
from kakeya_runtime.sessions.store import EndReason, Outcome, SessionStore

_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
# The statuses the runtime answers with (server.boundary, server.auth): their series exist from the start.
REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.INTERNAL)
# What a RESOURCE_EXHAUSTED refusal names as exceeded (sessions.errors.ResourceExhausted.limit).
LIMITS = ("context", "model_positions", "sessions", "sessions_per_key", "kv_budget", "kv_budget_per_key", "request",
          "state_dir", "openai_queue", "imports")
UNKNOWN_RPC = "unknown"  # the rpc label of calls to methods the server does not serve (bounded cardinality)


class _PerPolicyCollector:
    """kakeya_session_active_by_policy{policy} and kakeya_session_kv_live_bytes_by_policy{policy}, read at scrape
    time."""

    def __init__(self, store: SessionStore, names: list[str]) -> None:
        self.store = store
        self.names = names

    def describe(self) -> list:
        return [GaugeMetricFamily("kakeya_session_active_by_policy", "Currently allocated sessions, by KV policy.",
                                  labels=["policy"]),
                GaugeMetricFamily("kakeya_session_kv_live_bytes_by_policy", "Bytes of K/V held by allocated "
                                  "sessions, by KV policy (sums to kakeya_session_kv_live_bytes).", labels=["policy"])]

    def collect(self):
        stats = self.store.by_policy()
        active, live = self.describe()
        for name in dict.fromkeys([*self.names, *stats]):
            n, b = stats.get(name, (0, 0))
            active.add_metric([name], n)
            live.add_metric([name], b)
        yield active
        yield live


class _WithLabels:
    """Every sample of `inner`'s metrics with constant labels added: the exposition's one collector."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield out


class RuntimeMetrics:
    """Implements the session service's observer; gauges read the store at scrape time. `registry` holds the
    metrics; `exposition` serves them with the served model's name as the `model` label of every series."""

    def __init__(self, model: str = "", rpcs: Iterable[str] = (), sparse_layers: Sequence[int] = ()) -> None:
        # The model's index of each layer the sparse policy governs (Gemma 3: its global layers only), in the order
        # a session's per-layer counters come: the `layer` label of kakeya_sparse_*_total.
        self.sparse_layers = list(sparse_layers)
        self.registry = r = CollectorRegistry()
        self.exposition = CollectorRegistry(auto_describe=False)
        self.exposition.register(_WithLabels(r, {"model": model}))
        Gauge("kakeya_build_info", "The runtime's version, always 1.", ["version"], registry=r).labels(
            __version__).set(1)
        self.session_active = Gauge("kakeya_session_active", "Currently allocated sessions.", registry=r)
        self.session_kv_live_bytes = Gauge(
            "kakeya_session_kv_live_bytes", "Bytes of K/V storage held by all allocated sessions.", registry=r
        )
        self.session_total = Counter(
            "kakeya_session_total", "Sessions that ended, by outcome.", ["outcome"], registry=r
        )
        self.session_evicted_total = Counter(
            "kakeya_session_evicted_total", "Session caches freed, by reason.", ["reason"], registry=r
        )
        self.cache_invariant_violations_total = Counter(
            "kakeya_cache_invariant_violations_total", "Invariant violations (must stay 0).", ["kind"], registry=r
        )
        self.session_history_tokens = Histogram(
            "kakeya_session_history_tokens", "Session history length at Generate time.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_tokens = Histogram(
            "kakeya_generate_prefill_tokens", "Tokens prefilled per Generate (only the delta since the last one).",
            buckets=_TOKEN_BUCKETS, registry=r,
        )
        self.generate_prefill_duration_seconds = Histogram(
            "kakeya_generate_prefill_duration_seconds", "Prefill wall time per Generate.", buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.generate_ttft_seconds = Histogram(
            "kakeya_generate_ttft_seconds", "Time to first token per Generate (engine start to first sample).",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.generate_decode_tokens_per_second = Histogram(
            "kakeya_generate_decode_tokens_per_second", "Decode rate per Generate (tokens after the first).",
            buckets=_TOKS_PER_S_BUCKETS, registry=r,
        )
        self.generate_queue_seconds = Histogram(
            "kakeya_generate_queue_seconds", "Time a Generate waited for its session turn and an engine slot.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.generate_effective_attention_fraction = Histogram(
            "kakeya_generate_effective_attention_fraction",
            "Share of the prefix the last query of a Generate attended to (1: everything; sink_window: less).",
            buckets=_FRACTION_BUCKETS, registry=r,
        )
        self.session_idle_compressed_total = Counter(
            "kakeya_session_idle_compressed_total", "Session KV caches compressed in place while idle.", registry=r
        )
        self.session_idle_compressed_bytes_saved_total = Counter(
            "kakeya_session_idle_compressed_bytes_saved_total", "K/V bytes freed by idle compression.", registry=r
        )
        self.rpc_requests_total = Counter(
            "kakeya_rpc_requests_total", "gRPC calls received, by RPC (calls to methods the server does not serve: "
            f"rpc={UNKNOWN_RPC!r}; requests over the receive limit, refused by gRPC unread, are not counted).", ["rpc"], registry=r,
        )
        self.rpc_errors_total = Counter(
            "kakeya_rpc_errors_total", "gRPC calls answered with an error status, by RPC and status code (requests "
            "over the receive limit are refused by gRPC before the server sees them and are not counted).",
            ["rpc", "code"], registry=r,
        )
        self.limit_refusals_total = Counter(
            "kakeya_limit_refusals_total", "Requests refused with RESOURCE_EXHAUSTED, by the limit they would have "
            "exceeded: " + ", ".join(LIMITS) + ".", ["limit"], registry=r,
        )
        self.generated_tokens_total = Counter(
            "kakeya_generated_tokens_total", "Tokens sampled by Generates that finished (stop, length or cancel).",
            registry=r,
        )
        self.generate_finished_total = Counter(
            "kakeya_generate_finished_total", "Generates that ended with a final event, by finish reason: stop (an "
            "end token or stop string), length (max_tokens or the context), cancelled (the client left, a deadline, a "
            "close or the server's shutdown; counted even before the turn began). Errors: kakeya_rpc_errors_total.",
            ["reason"], registry=r,
        )
        for reason in FinishReason:
            self.generate_finished_total.labels(reason.value)
        self.session_kv_reserved_bytes = Gauge(
            "kakeya_session_kv_reserved_bytes", "KV bytes sessions reserve against the budget (each its worst case).",
            registry=r,
        )
        self.session_recovered_total = Counter(
            "kakeya_session_recovered_total", "Sessions recovered from the state directory at start-up.", registry=r,
        )
        self.session_kv_restored_total = Counter(
            "kakeya_session_kv_restored_total", "Recovered or imported sessions whose cache was built at their first "
            "Generate or import, by source: snapshot (loaded after verification), recompute (a snapshot refused: "
            "the history was prefilled instead) or history (a recovered session with no snapshot, as after a crash or "
            "for one that had not generated yet: its history was prefilled).", ["source"], registry=r,
        )
        for source in ("snapshot", "recompute", "history"):
            self.session_kv_restored_total.labels(source)
        self.kv_budget_bytes = Gauge(
            "kakeya_kv_budget_bytes", "The KV byte budget all sessions share (0: none).", registry=r,
        )
        self.sparse_total = {
            name: Counter(f"kakeya_sparse_{name}_total", text, ["layer"], registry=r) for name, text in (
                ("blocks_scored", "Cold blocks the sparse policy's queries could select among (per query token "
                 "and KV head), by model layer."),
                ("blocks_selected", "Cold blocks the sparse policy's queries attended, by model layer."),
                ("positions_attended", "Keys the sparse policy's queries attended (hot + cold), by model layer."),
                ("positions_visible", "Keys causally visible to those queries (what full attention reads), by "
                 "model layer."),
            )}
        self.session_idle_resume_seconds = Histogram(
            "kakeya_session_idle_resume_seconds", "Decompressing an idle-compressed cache at the next Generate.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.spec_draft_tokens_total = Counter(
            "kakeya_speculation_draft_tokens_total", "Draft tokens the speculative verifier checked, by proposer.",
            ["proposer"], registry=r,
        )
        self.spec_accepted_tokens_total = Counter(
            "kakeya_speculation_accepted_tokens_total", "Draft tokens the verifier accepted, by proposer.",
            ["proposer"], registry=r,
        )
        self.spec_verifier_steps_total = Counter(
            "kakeya_speculation_verifier_steps_total", "Verifier forwards over at least one draft token, by proposer.",
            ["proposer"], registry=r,
        )
        self.spec_pauses_total = Counter(
            "kakeya_speculation_pauses_total", "Times the adaptive off-switch paused speculation because acceptance "
            "was too low to pay, by proposer.", ["proposer"], registry=r,
        )
        self.spec_acceptance_rate = Histogram(
            "kakeya_speculation_acceptance_rate", "Per Generate with drafts: accepted / drafted, by proposer.",
            ["proposer"], buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0), registry=r,
        )
        self.spec_tokens_per_verifier_step = Histogram(
            "kakeya_speculation_tokens_per_verifier_step", "Per Generate with drafts: tokens emitted per verifier "
            "forward (accepted drafts + 1), by proposer.", ["proposer"],
            buckets=(1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 17.0), registry=r,
        )
        # Every label value exists from the start, so dashboards see zeros rather than gaps.
        for name in SPEC_PROPOSERS:
            for c in (self.spec_draft_tokens_total, self.spec_accepted_tokens_total, self.spec_verifier_steps_total,
                      self.spec_pauses_total):
                c.labels(name)
        for o in Outcome:
            self.session_total.labels(o.value)
        for reason in EndReason:
            self.session_evicted_total.labels(reason.value)
        for inv in Invariant:
            self.cache_invariant_violations_total.labels(inv.value)
        for rpc in rpcs:
            self.rpc_requests_total.labels(rpc)
            for code in REFUSAL_CODES:
                self.rpc_errors_total.labels(rpc, code.name)
        for limit in LIMITS:
            self.limit_refusals_total.labels(limit)
        self.engine_queue_depth = Gauge(
            "kakeya_engine_queue_depth", "Generates (and other engine calls) waiting for the engine loop.", registry=r,
        )
        self.engine_batch_size = Gauge(
            "kakeya_engine_batch_size", "Generates running in the engine loop's batch now (at most --max-batch).",
            registry=r,
        )
        self.engine_prompt_chunk_tokens = Gauge(
            "kakeya_engine_prompt_chunk_tokens", "Prompt tokens a step may read beside decoding sessions now (sized "
            "from the steps' measured times unless --step-tokens fixes it).", registry=r,
        )
        self.engine_decode_batch_rows = Histogram(
            "kakeya_engine_decode_batch_rows", "Sessions decoded together per engine step (one batched forward).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r,
        )
        self.engine_step_seconds = Histogram(
            "kakeya_engine_step_seconds", "Wall time of each engine step, by what it carried: decode (sessions' "
            "decode rows only), mixed (decode rows and prompt tokens), prefill (prompt tokens only). The sums say "
            "where the engine's time went.", ["kind"],
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=r,
        )
        self._step_seconds = {kind: self.engine_step_seconds.labels(kind.value) for kind in StepKind}
        self.engine_parked_total = Counter(
            "kakeya_engine_parked", "Running Generates taken out of a full batch so another API key's waiting turn "
            "could start (each resumes where it left off).", registry=r,
        )
        self._http: ThreadingHTTPServer | None = None

    def bind_store(self, store: SessionStore, policies: list[str] | tuple[str, ...] = POLICIES) -> None:
        self.session_active.set_function(lambda: len(store))
        self.session_kv_live_bytes.set_function(store.kv_live_bytes)
        self.session_kv_reserved_bytes.set_function(store.kv_reserved_bytes)
        self.kv_budget_bytes.set(store.limits.kv_budget or 0)
        self.registry.register(_PerPolicyCollector(store, list(policies)))

    def bind_scheduler(self, scheduler: BatchScheduler) -> None:
        self.engine_queue_depth.set_function(lambda: scheduler.queued)
        self.engine_batch_size.set_function(lambda: scheduler.batch_size)
        self.engine_prompt_chunk_tokens.set_function(lambda: scheduler.prompt_chunk_tokens)
        scheduler.on_step = self.engine_decode_batch_rows.observe
        scheduler.on_step_seconds = lambda kind, seconds: self._step_seconds[kind].observe(seconds)
        scheduler.on_park = self.engine_parked_total.inc

    def serving(self, choice: Any) -> None:
        """kakeya_serving_info{weights, source, compiled, invariant} 1 (engine.serving.ServingChoice), and the
        start-up measurements as gauges (absent when not measured)."""
        Gauge("kakeya_serving_info", "The served configuration (kakeya serve --weights/--compile), always 1.",
              ["weights", "source", "compiled", "invariant"], registry=self.registry).labels(
            choice.weights, choice.source, str(bool(choice.compiled)).lower(),
            str(bool(choice.invariant)).lower()).set(1)
        values = {"kakeya_serving_decode_tokens_per_second": ("Decode rate of the served configuration measured at "
                                                              "start-up.", choice.decode_tok_s),
                  "kakeya_serving_fidelity_kl": ("Next-token KL (nats) of the served format vs bf16 on the bench "
                                                 "text.", None if choice.fidelity is None else choice.fidelity.kl_mean),
                  "kakeya_serving_fidelity_top1": ("Top-1 agreement of the served format with bf16 on the bench "
                                                   "text.", None if choice.fidelity is None
                                                   else choice.fidelity.top1_agree)}
        for name, (doc, value) in values.items():
            if value is not None:
                Gauge(name, doc, registry=self.registry).set(value)

    # ---- observer hooks (called from the loop and the engine thread; prometheus is thread-safe) ----

    def session_created(self) -> None:
        pass  # session_active is read from the store

    def session_ended(self, outcome: Outcome, reason: EndReason) -> None:
        self.session_total.labels(outcome.value).inc()
        self.session_evicted_total.labels(reason.value).inc()

    def invariant_violated(self, invariant: Invariant) -> None:
        self.cache_invariant_violations_total.labels(invariant.value).inc()

    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None:
        self.generated_tokens_total.inc(stats.decode_tokens)
        if stats.speculation:
            p = stats.speculation
            self.spec_draft_tokens_total.labels(p).inc(stats.draft_tokens)
            self.spec_accepted_tokens_total.labels(p).inc(stats.accepted_draft_tokens)
            self.spec_verifier_steps_total.labels(p).inc(stats.verifier_steps)
            self.spec_pauses_total.labels(p).inc(stats.speculation_pauses)
            if stats.draft_tokens:
                self.spec_acceptance_rate.labels(p).observe(stats.acceptance_rate)
            if stats.verifier_steps:
                self.spec_tokens_per_verifier_step.labels(p).observe(stats.tokens_per_verifier_step)
        self.session_history_tokens.observe(history_tokens)
        self.generate_prefill_tokens.observe(stats.prefill_tokens)
        self.generate_prefill_duration_seconds.observe(stats.prefill_s)
        self.generate_ttft_seconds.observe(stats.ttft_s)
        self.generate_queue_seconds.observe(stats.queue_s)
        self.generate_effective_attention_fraction.observe(stats.effective_attention_fraction)
        if stats.decode_tokens > 1:
            self.generate_decode_tokens_per_second.observe(stats.decode_tokens_per_s)
        if stats.resume_s > 0:
            self.session_idle_resume_seconds.observe(stats.resume_s)
        if stats.sparse:
            for i, layer in enumerate(stats.sparse["layers"]):
                index = self.sparse_layers[i] if i < len(self.sparse_layers) else i
                for name, counter in self.sparse_total.items():
                    counter.labels(str(index)).inc(layer[name])

    def generate_done(self, reason: FinishReason) -> None:
        self.generate_finished_total.labels(reason.value).inc()

    def rpc_finished(self, rpc: str, code: grpc.StatusCode) -> None:
        """A gRPC call ended (called on the server's event loop by RpcMetricsInterceptor)."""
        if code is not grpc.StatusCode.OK:
            self.rpc_errors_total.labels(rpc, code.name).inc()

    def limit_refused(self, limit: str) -> None:
        """A request was refused with RESOURCE_EXHAUSTED for `limit` (called by the status boundary)."""
        self.limit_refusals_total.labels(limit).inc()

    def sessions_recovered(self, n: int) -> None:
        self.session_recovered_total.inc(n)

    def kv_restored(self, source: str) -> None:
        self.session_kv_restored_total.labels(source).inc()

    def session_idle_compressed(self, stats: IdleStats) -> None:
        self.session_idle_compressed_total.inc()
        self.session_idle_compressed_bytes_saved_total.inc(max(0, stats.bytes_before - stats.bytes_after))

    # ---- exposition ------------------------------------------------------------------------------

    def text(self) -> str:
        return generate_latest(self.exposition).decode()

    def serve_http(self, host: str, port: int, key: str | None = None) -> int:
        """Serve GET /metrics on http://host:port in daemon threads (only that path; with `key`, only to
        `authorization: Bearer <key>`); returns the bound port."""
        handler = type("MetricsHandler", (_MetricsHandler,), {"metrics": self, "key": key})
        bare = host.strip("[]")
        family = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]  # IPv4 or 6
        server = type("MetricsServer", (_MetricsServer,), {"address_family": family})
        self._http = server((bare, port), handler)
        threading.Thread(target=self._http.serve_forever, name="kakeya-metrics", daemon=True).start()
        return self._http.server_address[1]

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


METRICS_CONNECTIONS = 32  # connections /metrics serves at once; more are closed unread
METRICS_IDLE_S = 10.0  # a connection that sends nothing this long is closed
METRICS_READ_S = 5.0  # ... and one whose request is not whole this soon after it opened (a trickle of headers)


class _MetricsServer(ThreadingHTTPServer):
    """A thread per connection, as many as METRICS_CONNECTIONS at once: connections that never send a request
    (or a key) must not hold a thread each for ever."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _MetricsHandler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0), which must arrive whole within METRICS_READ_S: the idle timeout alone
    let 32 clients sending a header line every few seconds hold every slot, and no scrape got through."""

    metrics: RuntimeMetrics
    key: str | None = None
    timeout = METRICS_IDLE_S

    def setup(self) -> None:
        super().setup()
        self._cut = False
        self._deadline = threading.Timer(METRICS_READ_S, self._too_slow)
        self._deadline.daemon = True
        self._deadline.start()

    def _too_slow(self) -> None:
        self._cut = True  # (the headers' read ends at the cut as if they were whole: nobody to answer)
        with contextlib.suppress(OSError):  # the blocked read sees the end of the stream and the handler ends
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        self._deadline.cancel()  # the request is read: the answer may take its time
        if self._cut:
            self.close_connection = True
            return
        if self.path.split("?", 1)[0] != "/metrics":
            self._send(404, b"not found: metrics are served at /metrics\n", "text/plain; charset=utf-8", body)
        elif self.key is not None and not _bearer_ok(self.headers.get("authorization", ""), self.key):
            self._send(401, b"missing or invalid key (authorization: Bearer ...)\n", "text/plain; charset=utf-8",
                       body, {"WWW-Authenticate": 'Bearer realm="kakeya metrics"'})
        else:
            self._send(200, self.metrics.text().encode(), CONTENT_TYPE_LATEST, body)

    def _send(self, status: int, payload: bytes, content_type: str, body: bool,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not worth a log line
        pass


def _bearer_ok(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """The outermost interceptor: counts every call by RPC and, when it ends with an error status, by code (a
    refusal by the auth interceptor or the status boundary alike)."""

    def __init__(self, metrics: RuntimeMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # gRPC answers UNIMPLEMENTED; the method name is the client's, so not a label
            self.metrics.rpc_requests_total.labels(UNKNOWN_RPC).inc()
            self.metrics.rpc_finished(UNKNOWN_RPC, grpc.StatusCode.UNIMPLEMENTED)
            return handler
        rpc = handler_call_details.method.rsplit("/", 1)[-1]
        # Requests are counted as their handler starts, where their finish is counted too: one gRPC refuses before
        # (larger than the receive limit) is neither (it read as a request that never finished).
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, rpc), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, rpc), **kw)
        if handler.stream_unary:  # ImportSession: the same wrapper, its first argument the request iterator
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, rpc), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, rpc), **kw)

    def _unary(self, behavior: Callable[..., Awaitable[Any]], rpc: str) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            code = grpc.StatusCode.UNKNOWN  # an exception that escapes every layer answers UNKNOWN
            budget = context.time_remaining()
            self.metrics.rpc_requests_total.labels(rpc).inc()
            counting = _CountingContext(context, lambda c: self.metrics.rpc_finished(rpc, c))
            try:
                response = await behavior(request, counting)
                code = grpc.StatusCode.OK
                return response
            except grpc.aio.AbortError:
                code = _code(context)
                raise
            except asyncio.CancelledError:
                code = _cancelled_code(context, budget)
                raise
            finally:
                if not counting.counted:
                    self.metrics.rpc_finished(rpc, code)

        return handle

    def _stream(self, behavior: Callable[..., Any], rpc: str) -> Callable[..., AsyncIterator[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            code = grpc.StatusCode.UNKNOWN
            budget = context.time_remaining()
            self.metrics.rpc_requests_total.labels(rpc).inc()
            counting = _CountingContext(context, lambda c: self.metrics.rpc_finished(rpc, c))
            try:
                produced = behavior(request, counting)
                if hasattr(produced, "__aiter__"):
                    async with contextlib.aclosing(produced):  # a client that leaves closes the inner stream
                        async for message in produced:
                            yield message
                else:  # a coroutine that writes through context.write
                    await produced
                code = grpc.StatusCode.OK
            except grpc.aio.AbortError:
                code = _code(context)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = _cancelled_code(context, budget)
                raise
            finally:
                if not counting.counted:
                    self.metrics.rpc_finished(rpc, code)

        return handle


class _CountingContext:
    """The servicer's context with `abort` counted before the status goes out: grpc sends an abort's status to
    the client inside `abort`, so a count taken after it could be read from /metrics before it lands."""

    def __init__(self, context: grpc.aio.ServicerContext, count: Callable[[grpc.StatusCode], None]) -> None:
        self._context = context
        self._count = count
        self.counted = False

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        if not self.counted:
            self.counted = True
            self._count(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN)
        await self._context.abort(code, details, trailing_metadata)
        raise AssertionError("unreachable: abort raises")  # grpc's abort always raises AbortError

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


DEADLINE_SLACK_S = 0.25  # a cancel this close to the deadline is the caller's deadline (its clock started earlier)


def _cancelled_code(context: grpc.aio.ServicerContext, budget: float | None) -> grpc.StatusCode:
    """A call gRPC cancelled: DEADLINE_EXCEEDED when the caller's deadline passed (what the client is told), else
    CANCELLED (the client went away). The client cancels at its own deadline, which comes before the server's copy
    of it by the time the request took to arrive: every deadline was counted as CANCELLED. The slack is at most a
    quarter of the time the call had (`budget`, at its start): with a fixed one, every cancel of a call whose
    deadline was that short counted as a deadline."""
    remaining = context.time_remaining()
    slack = DEADLINE_SLACK_S if budget is None else min(DEADLINE_SLACK_S, budget / 4)
    passed = remaining is not None and remaining <= slack
    return grpc.StatusCode.DEADLINE_EXCEEDED if passed else grpc.StatusCode.CANCELLED


def _code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
