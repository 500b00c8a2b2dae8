"""`kakeya bench soak` on a real `kakeya serve` (SmolLM2), small: every RPC answered with typed statuses, invalid
requests refused, a kill -9 halfway that loses no session and no acknowledged token, no violations on /metrics."""

from __future__ import annotations

import pytest

from kakeya_runtime.bench.soak import SoakConfig, run_soak

pytestmark = pytest.mark.real_model


def test_a_short_soak_passes_and_counts_what_it_claims():
    # bf16 named: `auto` would calibrate every format on the real model at the server's first start (2+ minutes)
    result = run_soak(SoakConfig(weights="bf16", requests=300, max_seconds=240, keys=3, seed=5))
    assert result["passed"], result["failures"]
    assert result["requests"] == 300
    rpcs = {name.split("/")[0] for name in result["statuses"]}
    assert rpcs >= {"CreateSession", "AppendTokens", "Generate", "CloseSession", "GetSessionInfo", "GetModelInfo",
                    "ExportSession", "ImportSession"}
    totals = result["status_totals"]
    assert "UNKNOWN" not in totals and "INTERNAL" not in totals
    assert totals.get("INVALID_ARGUMENT", 0) > 0 and totals.get("OK", 0) > 0
    crash = result["crash"]
    assert crash["sessions_before_kill"] > 0 and crash["sessions_recovered"] == crash["sessions_before_kill"]
    assert crash["tokens_lost"] == 0 and crash["killed_stream_tokens_received"] >= 8
    assert [p["violations"] for p in result["phases"]] == [0.0, 0.0]
    assert 0 < result["rss"]["max_bytes"] < 6 * 2**30
