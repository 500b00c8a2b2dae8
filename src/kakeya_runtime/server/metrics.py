"""Prometheus metrics (seed 000 §2.9), one registry per server so in-process servers never collide."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kakeya_runtime.kv.idle import IdleStats
from kakeya_runtime.kv.spec import POLICIES
from kakeya_runtime.sessions.errors import Invariant
from kakeya_runtime.sessions.service import GenerateStats
from kakeya_runtime.sessions.store import EndReason, Outcome, SessionStore

_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
# The statuses the runtime answers with (server.boundary, server.auth): their series exist from the start.
REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.INTERNAL)


class _PerPolicyCollector:
    """session_active_by_policy{policy} and session_kv_live_bytes_by_policy{policy}, read at scrape time."""

    def __init__(self, store: SessionStore, names: list[str]) -> None:
        self.store = store
        self.names = names

    def describe(self) -> list:
        return [GaugeMetricFamily("session_active_by_policy", "Currently allocated sessions, by KV policy.",
                                  labels=["policy"]),
                GaugeMetricFamily("session_kv_live_bytes_by_policy", "Bytes of K/V held by allocated sessions, "
                                  "by KV policy (sums to session_kv_live_bytes).", labels=["policy"])]

    def collect(self):
        stats = self.store.by_policy()
        active, live = self.describe()
        for name in dict.fromkeys([*self.names, *stats]):
            n, b = stats.get(name, (0, 0))
            active.add_metric([name], n)
            live.add_metric([name], b)
        yield active
        yield live


class RuntimeMetrics:
    """Implements the session service's observer; gauges read the store at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.session_active = Gauge("session_active", "Currently allocated sessions.", registry=r)
        self.session_kv_live_bytes = Gauge(
            "session_kv_live_bytes", "Bytes of K/V storage held by all allocated sessions.", registry=r
        )
        self.session_total = Counter(
            "session_total", "Sessions that ended, by outcome.", ["outcome"], registry=r
        )
        self.session_evicted_total = Counter(
            "session_evicted_total", "Session caches freed, by reason.", ["reason"], registry=r
        )
        self.cache_invariant_violations_total = Counter(
            "cache_invariant_violations_total", "Invariant violations (must stay 0).", ["kind"], registry=r
        )
        self.session_history_tokens = Histogram(
            "session_history_tokens", "Session history length at Generate time.", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.generate_prefill_tokens = Histogram(
            "generate_prefill_tokens", "Tokens prefilled per Generate (only the delta since the last one).",
            buckets=_TOKEN_BUCKETS, registry=r,
        )
        self.generate_prefill_duration_seconds = Histogram(
            "generate_prefill_duration_seconds", "Prefill wall time per Generate.", buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.generate_ttft_seconds = Histogram(
            "generate_ttft_seconds", "Time to first token per Generate (engine start to first sample).",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.generate_decode_tokens_per_second = Histogram(
            "generate_decode_tokens_per_second", "Decode rate per Generate (tokens after the first).",
            buckets=_TOKS_PER_S_BUCKETS, registry=r,
        )
        self.generate_queue_seconds = Histogram(
            "generate_queue_seconds", "Time a Generate waited for its session turn and an engine slot.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.generate_effective_attention_fraction = Histogram(
            "generate_effective_attention_fraction",
            "Share of the prefix the last query of a Generate attended to (1: everything; sink_window: less).",
            buckets=_FRACTION_BUCKETS, registry=r,
        )
        self.session_idle_compressed_total = Counter(
            "session_idle_compressed_total", "Session KV caches compressed in place while idle.", registry=r
        )
        self.session_idle_compressed_bytes_saved_total = Counter(
            "session_idle_compressed_bytes_saved_total", "K/V bytes freed by idle compression.", registry=r
        )
        self.rpc_refusals_total = Counter(
            "rpc_refusals_total", "RPCs the server answered with an error status, by gRPC status code (requests "
            "over the receive limit are refused by gRPC before the server sees them and are not counted).",
            ["code"], registry=r,
        )
        self.sparse_total = {
            name: Counter(f"sparse_{name}_total", text, ["layer"], registry=r) for name, text in (
                ("blocks_scored", "Cold blocks the sparse policy's queries could select among (per query token "
                 "and KV head), by governed layer."),
                ("blocks_selected", "Cold blocks the sparse policy's queries attended, by governed layer."),
                ("positions_attended", "Keys the sparse policy's queries attended (hot + cold), by governed layer."),
                ("positions_visible", "Keys causally visible to those queries (what full attention reads), by "
                 "governed layer."),
            )}
        self.session_idle_resume_seconds = Histogram(
            "session_idle_resume_seconds", "Decompressing an idle-compressed cache at the next Generate.",
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        # Every label value exists from the start, so dashboards see zeros rather than gaps.
        for o in Outcome:
            self.session_total.labels(o.value)
        for reason in EndReason:
            self.session_evicted_total.labels(reason.value)
        for inv in Invariant:
            self.cache_invariant_violations_total.labels(inv.value)
        for code in REFUSAL_CODES:
            self.rpc_refusals_total.labels(code.name)
        self._http: WSGIServer | None = None

    def bind_store(self, store: SessionStore, policies: list[str] | tuple[str, ...] = POLICIES) -> None:
        self.session_active.set_function(lambda: len(store))
        self.session_kv_live_bytes.set_function(store.kv_live_bytes)
        self.registry.register(_PerPolicyCollector(store, list(policies)))

    # ---- observer hooks (called from the loop and the engine thread; prometheus is thread-safe) ----

    def session_created(self) -> None:
        pass  # session_active is read from the store

    def session_ended(self, outcome: Outcome, reason: EndReason) -> None:
        self.session_total.labels(outcome.value).inc()
        self.session_evicted_total.labels(reason.value).inc()

    def invariant_violated(self, invariant: Invariant) -> None:
        self.cache_invariant_violations_total.labels(invariant.value).inc()

    def generate_finished(self, stats: GenerateStats, history_tokens: int) -> None:
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
                for name, counter in self.sparse_total.items():
                    counter.labels(str(i)).inc(layer[name])

    def request_refused(self, code: grpc.StatusCode) -> None:
        """An RPC answered with an error status (called on the server's event loop)."""
        self.rpc_refusals_total.labels(code.name).inc()

    def session_idle_compressed(self, stats: IdleStats) -> None:
        self.session_idle_compressed_total.inc()
        self.session_idle_compressed_bytes_saved_total.inc(max(0, stats.bytes_before - stats.bytes_after))

    # ---- exposition ------------------------------------------------------------------------------

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve_http(self, host: str, port: int) -> int:
        """Serve the text format on http://host:port/metrics in a daemon thread; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
