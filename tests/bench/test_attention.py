"""The per-layer attention bench: both backends measured in the same run (decode, chunks, a fresh prompt)."""

from __future__ import annotations

import json

from kakeya_runtime.bench.attention import command
from kakeya_runtime.models import native


def test_attention_bench_writes_both_backends(tmp_path):
    doc = command(lengths=(300,), chunks=(1, 5), dtypes=("bfloat16", "float32"), prompts=(40,),
                  out=tmp_path / "a.json")
    on_disk = json.loads((tmp_path / "a.json").read_text())
    assert on_disk["schema_version"] == doc["schema_version"] == 1
    assert [(r["keys"], r["new_tokens"]) for r in on_disk["rows"]] == [(300, 1), (300, 5), (40, 40)] * 2
    for row in on_disk["rows"]:
        assert row["native_us"] > 0 and row["sdpa_us"] > 0
    assert native.backend() == "native"  # the bench leaves the process on the default backend
