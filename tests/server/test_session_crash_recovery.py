"""`kill -9` during a Generate on a real `kakeya serve` (SmolLM2), then a restart with the same --state-dir: every
session that existed comes back, its history holds every token the client received (and nothing that the same
seeded generation would not have produced), and a seeded Generate after recovery equals the same Generate on a
fresh session of that history. Invariant violations are read from /metrics."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from kakeya import Client, KvPolicy
from kakeya.errors import KakeyaError

from kakeya_runtime.server.testing import metric_value

pytestmark = pytest.mark.real_model


class Served:
    """`kakeya serve` in a child process; the address is its last stdout line, the metrics port on stderr."""

    def __init__(self, state: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kakeya_runtime.cli", "serve", "--model", "smollm2", "--port", "0",
             "--metrics-port", "0", "--state-dir", str(state)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.address = ""
        for line in self.proc.stdout:
            if re.fullmatch(r"127\.0\.0\.1:\d+", line.strip()):
                self.address = line.strip()
                break
        assert self.address, f"kakeya serve did not start: {''.join(self.stderr)[-2000:]}"
        deadline = time.monotonic() + 10  # stderr is read by another thread: its lines may trail stdout's
        while not (port := re.search(r"Metrics on http://127\.0\.0\.1:(\d+)/metrics", "".join(self.stderr))):
            assert time.monotonic() < deadline, "".join(self.stderr)
            time.sleep(0.05)
        self.metrics_port = int(port.group(1))

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


SAMPLED = {"temperature": 0.7, "seed": 1234, "ignore_eos": True}


def test_kill_9_during_generation_loses_nothing_acknowledged(tmp_path: Path):
    state = tmp_path / "state"
    first = Served(state)
    try:
        with Client(first.address) as client:
            tok = client.tokenizer()
            prompt = tok.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
            done = client.create_session(prompt)
            done.generate(16, **SAMPLED).collect()
            windowed = client.create_session(prompt, policy=KvPolicy("sink_window", {"sink": 4, "window": 64}))
            windowed.generate(8).collect()
            windowed.append(tok.encode(" Continue."))
            expected = {s.id: list(s.info(include_history=True).history_token_ids) for s in (done, windowed)}
            killed = client.create_session(prompt)
            received: list[int] = []
            with pytest.raises((KakeyaError, grpc.RpcError)):  # the server dies under the stream
                for token in killed.generate(300, **SAMPLED):
                    received.append(token)
                    if len(received) == 20:
                        first.kill()
    finally:
        first.stop()
    assert len(received) >= 20

    second = Served(state)
    try:
        assert "recovered 3 session(s)" in "".join(second.stderr)
        with Client(second.address) as client:
            for sid, history in expected.items():
                assert list(client.session(sid).info(include_history=True).history_token_ids) == history
            history = list(client.session(killed.id).info(include_history=True).history_token_ids)
            n = len(history) - len(prompt)
            assert history[: len(prompt) + len(received)] == prompt + received  # every received token is there
            with client.create_session(prompt) as fresh:  # and what else is there is what this generation made
                reference = fresh.generate(300, **SAMPLED).collect()
            assert history == prompt + reference[:n]
            # A seeded Generate after recovery equals the same Generate on a session created from that history.
            for sid in (killed.id, windowed.id):
                info = client.session(sid).info(include_history=True)
                policy = info.policy
                after = client.session(sid).generate(24, **SAMPLED).collect()
                with client.create_session(list(info.history_token_ids), policy=policy) as fresh:
                    assert fresh.generate(24, **SAMPLED).collect() == after
        text = second.metrics()
        assert metric_value(text, "kakeya_session_recovered_total") == 3
        for kind in ("inv1", "inv2"):
            assert metric_value(text, "kakeya_cache_invariant_violations_total", f'{{kind="{kind}"}}') == 0
    finally:
        second.stop()
