"""The per-layer attention bench: both backends measured in the same run, the kernel's path recorded."""

from __future__ import annotations

import json

from kakeya_runtime.bench.attention import command
from kakeya_runtime.models import native


def test_attention_bench_writes_both_backends(tmp_path):
    doc = command(lengths=(300,), chunks=(1, 5), dtypes=("bfloat16", "float32"), out=tmp_path / "a.json")
    on_disk = json.loads((tmp_path / "a.json").read_text())
    assert on_disk["schema_version"] == doc["schema_version"] == 1
    assert len(on_disk["rows"]) == 4
    for row in on_disk["rows"]:
        assert row["native_us"] > 0 and row["sdpa_us"] > 0
        assert row["native_path"] == (row["new_tokens"] == 1 or (row["dtype"] == "bfloat16" and native.bf16_dot()))
    assert native.backend() == "native"  # the bench leaves the process on the default backend
