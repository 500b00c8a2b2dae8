"""`kill -9` during a Generate on a real `kakeya serve` (SmolLM2), then a restart with the same --state-dir: every
session that existed comes back, its history holds every token the client received (and nothing that the same
seeded generation would not have produced), and a seeded Generate after recovery equals the same Generate on a
fresh session of that history. Invariant violations are read from /metrics."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from kakeya import Client, KvPolicy
from kakeya.errors import KakeyaError

from kakeya_runtime.bench.serve_process import ServeProcess
from kakeya_runtime.server.testing import metric_value

pytestmark = pytest.mark.real_model


SAMPLED = {"temperature": 0.7, "seed": 1234, "ignore_eos": True}


def test_kill_9_during_generation_loses_nothing_acknowledged(tmp_path: Path):
    state = tmp_path / "state"
    first = ServeProcess(["--model", "smollm2", "--weights", "bf16", "--no-compile", "--state-dir", str(state)])
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
                        first.kill9()
    finally:
        first.stop()
    assert len(received) >= 20

    second = ServeProcess(["--model", "smollm2", "--weights", "bf16", "--no-compile", "--state-dir", str(state)])
    try:
        assert "recovered 3 session(s)" in second.log
        with Client(second.address) as client:
            for sid, history in expected.items():
                assert list(client.session(sid).info(include_history=True).history_token_ids) == history
            history = list(client.session(killed.id).info(include_history=True).history_token_ids)
            n = len(history) - len(prompt)
            assert history[: len(prompt) + len(received)] == prompt + received  # every received token is there
            with client.create_session(prompt) as fresh:  # and what else is there is what this generation made
                reference = fresh.generate(n, **SAMPLED).collect()  # a seeded stream's first n tokens
            assert history == prompt + reference
            # A seeded Generate after recovery equals the same Generate on a session created from that history.
            for sid in (killed.id, windowed.id):
                info = client.session(sid).info(include_history=True)
                policy = info.policy
                after = client.session(sid).generate(24, **SAMPLED).collect()
                with client.create_session(list(info.history_token_ids), policy=policy) as fresh:
                    assert fresh.generate(24, **SAMPLED).collect() == after
        text = second.metrics()
        assert metric_value(text, "kakeya_session_recovered_total") == 3
        # a crash writes no snapshot: the two sessions generated on were rebuilt from their histories
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="history"}') == 2
        assert metric_value(text, "kakeya_session_kv_restored_total", '{source="snapshot"}') == 0
        for kind in ("inv1", "inv2"):
            assert metric_value(text, "kakeya_cache_invariant_violations_total", f'{{kind="{kind}"}}') == 0
    finally:
        second.stop()
