"""engine.serving: the formats `kakeya serve` runs keep INV-3 (every row count through the int kernel), the
choice among them (fidelity, invariance, speed; the calibration cache), and the flag parsing."""

from __future__ import annotations

import pytest
import torch
from test_invariance import check_schedules, split  # tests/engine is on sys.path (rootdir-relative imports)

from kakeya_runtime.engine import serving
from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.serving import Candidate, Fidelity, ServingError, Speed


def test_parse_weights_accepts_formats_and_names_the_choices():
    assert serving.parse_weights("AUTO") == "auto"
    assert serving.parse_weights(" int4-mixed ") == "int4-mixed"
    for bad in ("int3", "", "q4_k_m", "bf16,int8"):
        with pytest.raises(ServingError, match="auto or one of bf16, fp32, int8, int4, int4-mixed"):
            serving.parse_weights(bad)


def test_int_kernels_are_row_invariant_here():
    """What makes a quantized format servable: on this machine's torch the int kernels give a row the same bits
    whatever rows share the call (checked again at every start; a machine where it fails refuses the format)."""
    for fmt in serving.FORMATS:
        assert serving.kernel_rows_invariant(fmt), fmt
        assert serving.check_requested(fmt)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-mixed"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_served_quantized_formats_keep_inv3(fmt, family, make_tiny_model):
    model = serving.apply_format(make_tiny_model(family, vocab_size=128), fmt)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    check_schedules(model, ids, {
        "turns": [37, 1, 90, 5, 67],
        "prefill then decode steps": [150] + ["d"] * 50,
        "decode steps from the first token": ["d"] * 200,
    }, chunks=(1, 7, 64, 512))


def test_quantized_prefill_through_dequantized_weights_would_break_inv3(make_tiny_model):
    """Why served formats run prefill through the kernel: the dequantize-then-matmul path (the bench's default,
    faster) writes other K/V than the kernel's decode steps, so turn-by-turn differs from one shot."""
    from kakeya_runtime.engine.weights import quantize_model

    model = make_tiny_model("llama", vocab_size=128)
    quantize_model(model, "int8", prefill="dequant", prefill_rows=16)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError):
        check_schedules(model, ids, {"prefill then decode steps": [40] + ["d"] * 24})


@pytest.mark.real_model
def test_smollm2_int4_served_form_keeps_inv3(english_text):
    from kakeya_runtime.models.loader import load_model

    loaded = load_model("smollm2", dtype=torch.float32)
    model = serving.apply_format(loaded.model, "int4")
    ids = torch.tensor([loaded.tokenizer.encode(english_text).ids[:600]])
    check_schedules(model, ids, {"turns": [130, 21, 300, 149], "chunks of 64": split(600, 64),
                                 "prefill then decode steps": [590] + ["d"] * 10}, chunks=(64,))


def test_compiled_decode_step_keeps_inv3_on_a_served_format(make_tiny_model):
    from kakeya_runtime.engine.compiled import CompiledDecode

    model = serving.apply_format(make_tiny_model("gemma3", vocab_size=128), "int4")
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    eager = Engine(model)
    ref = eager.new_cache()
    ref_logits = eager.prefill(ref, ids).logits
    engine = Engine(model)
    engine.decode_forward = CompiledDecode(model)
    cache = engine.new_cache()
    engine.prefill(cache, ids[:, :20])
    for t in range(20, 120):
        logits = engine.decode_step(cache, ids[:, t : t + 1]).logits
    assert torch.equal(logits, ref_logits)
    for x, y in zip(ref.state(), cache.state(), strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)


def _cand(fmt, kl=0.001, top1=0.99, invariant=True, speed=(1000.0, 50.0)):
    return Candidate(fmt, invariant, None if fmt == "bf16" else Fidelity(256, kl, kl * 4, top1),
                     None if speed is None else Speed(*speed))


def test_pick_takes_the_fastest_faithful_invariant_format():
    bf16 = _cand("bf16", speed=(2400.0, 56.0))
    int4 = _cand("int4", speed=(700.0, 80.0))  # decode faster, prefill slower: the reference turn decides
    unfaithful = _cand("int4-mixed", kl=0.2, top1=0.77, speed=(5000.0, 500.0))
    variant = _cand("int8", invariant=False, speed=(5000.0, 500.0))
    assert serving.pick([bf16, int4, unfaithful, variant], turn=(512, 128)) is int4  # 0.73 + 1.60 s vs 0.21 + 2.29 s
    assert serving.pick([bf16, int4, unfaithful, variant]) is bf16  # the default turn reads 1,024: 1.46 + 1.60 s vs 0.43 + 2.29 s
    assert serving.pick([bf16, int4, unfaithful, variant], turn=(4096, 128)) is bf16
    assert not unfaithful.eligible and "not faithful" in unfaithful.why_not()
    assert not variant.eligible and "depending on the rows beside it" in variant.why_not()
    assert serving.pick([bf16, unfaithful]) is bf16
    with pytest.raises(ServingError, match="no weight format"):
        serving.pick([unfaithful, variant])


def test_fidelity_thresholds_are_the_issue_s():
    assert Fidelity(256, 0.0099, 0.05, 0.95).faithful
    assert not Fidelity(256, 0.0101, 0.05, 0.99).faithful
    assert not Fidelity(256, 0.001, 0.05, 0.949).faithful


def test_fidelity_compared_chunk_by_chunk_is_the_whole_text_s(make_tiny_model):
    """KL (mean, max) and top-1 agreement from chunks of the text are what the whole text's logits at once give; a
    model against itself agrees exactly."""
    from kakeya_runtime.models.base import Logits

    ref = serving.apply_format(make_tiny_model("llama").to(serving.load_dtype("bf16")), "bf16")
    other = serving.apply_format(make_tiny_model("llama").to(serving.load_dtype("int4")), "int4")
    ids = torch.randint(0, ref.config.vocab_size, (50,), generator=torch.Generator().manual_seed(3)).tolist()

    def logprobs(model) -> torch.Tensor:
        engine = Engine(model, prefill_chunk=64)
        out = engine.prefill(engine.new_cache(capacity=64), torch.tensor([ids]), logits=Logits.ALL)
        return out.logits[0].float().log_softmax(-1)

    a, b = logprobs(ref), logprobs(other)
    kl = (a.exp() * (a - b)).sum(-1).clamp(min=0)
    got = serving.measure_fidelity(ref, other, ids, chunk=16)
    assert got.positions == 50 and got.kl_mean > 0
    assert got.kl_mean == pytest.approx(float(kl.mean()), rel=1e-5) and got.kl_max == float(kl.max())
    assert got.top1_agree == int((a.argmax(-1) == b.argmax(-1)).sum()) / 50
    same = serving.measure_fidelity(ref, ref, ids, chunk=16)
    assert same.kl_mean == 0.0 and same.top1_agree == 1.0


def test_calibrate_measures_once_then_reads_the_cache(tmp_path, make_tiny_model, monkeypatch):
    from kakeya_runtime.server.testing import TINY_VOCAB

    loads: list[str] = []

    def load(fmt):
        loads.append(fmt)
        model = make_tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024)
        return serving.apply_format(model.to(serving.load_dtype(fmt)), fmt)

    encode = lambda text: [b + 3 for b in text.encode()]  # noqa: E731 - a byte tokenizer for the tiny vocab
    path = tmp_path / "calibration.json"
    first = serving.calibrate(load, encode, "tiny", ("bf16", "int8", "int4"), calibration=serving.Calibration(path))
    assert [c.fmt for c in first] == ["bf16", "int8", "int4"] and not any(c.cached for c in first)
    assert first[0].fidelity is None and first[1].fidelity is not None and first[2].fidelity is not None
    assert first[2].fidelity.kl_mean > first[1].fidelity.kl_mean  # int4 is further from bf16 than int8
    for c in first:
        assert (c.speed is not None) == c.eligible
    assert path.is_file() and loads
    loads.clear()
    again = serving.calibrate(load, encode, "tiny", ("bf16", "int8", "int4"), calibration=serving.Calibration(path))
    assert loads == [] and all(c.cached for c in again)
    assert [(c.fidelity, c.speed) for c in again] == [(c.fidelity, c.speed) for c in first]
    # all cached: nothing is written, so a read-only cache directory serves (it once failed with a traceback);
    # a directory that refuses a write the calibration needs gets a warning, and the next start measures again
    import errno
    from pathlib import Path

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_text", refuse)
    assert all(c.cached for c in serving.calibrate(load, encode, "tiny", ("bf16", "int8", "int4"),
                                                   calibration=serving.Calibration(path)))
    unsaved = serving.Calibration(path)
    unsaved.put_speed("m", "tiny", "bf16", serving.Speed(1.0, 1.0))
    unsaved.save()
    monkeypatch.undo()
    # another model (or machine) is measured afresh
    serving.calibrate(load, encode, "tiny-2", ("bf16",), calibration=serving.Calibration(path))
    assert loads == ["bf16"]
    # fidelity and speed come through our kernels: a cache written by another build of them is not read
    built = serving.kernels_key()
    assert serving.machine_key().endswith(built)
    monkeypatch.setattr(serving, "kernels_key", lambda: built + "-rebuilt")
    loads.clear()
    rebuilt = serving.calibrate(load, encode, "tiny", ("bf16", "int8", "int4"), calibration=serving.Calibration(path))
    assert not any(c.cached for c in rebuilt) and "int8" in loads
    assert [c.fidelity for c in rebuilt] == [c.fidelity for c in first]  # the same numbers, measured again


def test_calibrate_keeps_each_format_s_best_of_two_interleaved_rounds(tmp_path, make_tiny_model, monkeypatch):
    """Speeds are measured in two rounds, the second in reverse order, and each format keeps its best: a format
    measured while the machine ran slow is not cached as slow (int4 first measured slower than bf16 here)."""
    from kakeya_runtime.server.testing import TINY_VOCAB

    order: list[str] = []
    loads: list[str] = []
    scripted = {"bf16": [(100.0, 60.0), (90.0, 50.0)], "int4": [(80.0, 40.0), (95.0, 130.0)]}

    def load(fmt):
        loads.append(fmt)
        model = make_tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024)
        model.fmt_for_test = fmt
        return serving.apply_format(model.to(serving.load_dtype(fmt)), fmt)

    def fake_speed(engine, ids, *, steps=serving.SPEED_DECODE_STEPS):
        fmt = engine.model.fmt_for_test
        order.append(fmt)
        prefill, decode = scripted[fmt].pop(0)
        return serving.Speed(prefill_tok_s=prefill, decode_tok_s=decode)

    monkeypatch.setattr(serving, "measure_speed", fake_speed)
    monkeypatch.setattr(serving, "measure_fidelity", lambda ref, model, ids: Fidelity(1024, 0.0, 0.0, 1.0))  # both faithful
    encode = lambda text: [b + 3 for b in text.encode()]  # noqa: E731 - a byte tokenizer for the tiny vocab
    path = tmp_path / "calibration.json"
    got = {c.fmt: c for c in serving.calibrate(load, encode, "tiny", ("bf16", "int4"),
                                               calibration=serving.Calibration(path))}
    assert order == ["bf16", "int4", "int4", "bf16"]
    assert loads.count("int4") == 1  # the last format's model is measured again without a reload
    assert got["bf16"].speed == serving.Speed(100.0, 60.0) and got["int4"].speed == serving.Speed(95.0, 130.0)
    assert serving.pick(list(got.values())).fmt == "int4"  # one round would have picked bf16
    cached = serving.calibrate(load, encode, "tiny", ("bf16", "int4"), calibration=serving.Calibration(path))
    assert [c.speed for c in cached] == [got["bf16"].speed, got["int4"].speed] and order == ["bf16", "int4", "int4", "bf16"]


def test_compiled_step_probe_passes_an_exact_step_and_catches_an_inexact_one(make_tiny_model):
    from kakeya_runtime.engine.compiled import CompiledDecode

    model = serving.apply_format(make_tiny_model("llama", vocab_size=128, max_position_embeddings=512), "int8")
    ids = torch.randint(0, 128, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    compiled = CompiledDecode(model)
    assert serving.compiled_step_invariant(model, compiled, ids)

    def off_by_a_bit(token_ids, positions, cache, **kw):  # what a step rounding differently from prefill does
        out = model(token_ids, positions, cache, **kw)
        out.logits = out.logits + 1e-6
        return out

    assert not serving.compiled_step_invariant(model, off_by_a_bit, ids)


def test_damaged_calibration_files_are_measured_again(tmp_path):
    path = tmp_path / "calibration.json"
    v = serving.CALIBRATION_VERSION
    for text in ("null", "[]", f'{{"version": {v}}}', f'{{"version": {v}, "fidelity": {{"x": 1}}, "speed": []}}', "{"):
        path.write_text(text)
        cal = serving.Calibration(path)
        assert cal.fidelity("m", "int8") is None and cal.speed("machine", "m", "int8") is None, text


def test_a_model_directory_is_measured_again_when_a_file_in_it_changes(tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    before = serving.model_key(model, "m")
    assert serving.model_key(model, "m") == before
    import os

    st = weights.stat()
    weights.write_bytes(b"b" * 64)  # the same size, another file: the directory's own stat does not move
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert serving.model_key(model, "m") != before


def test_calibration_says_whether_every_format_is_measured_already():
    """`kakeya serve` to a log file announced minutes of measuring even when every result was kept: it now asks."""
    from kakeya_runtime.engine.serving import Calibration, Fidelity, Speed, machine_key

    cal = Calibration(None)
    assert not cal.measured("m", ["bf16", "int4"])
    for fmt in ("bf16", "int4"):
        cal.put_speed(machine_key(), "m", fmt, Speed(1000.0, 50.0))
    assert not cal.measured("m", ["bf16", "int4"])  # int4's fidelity is missing (bf16 is the reference)
    cal.put_fidelity("m", "int4", Fidelity(1024, 0.001, 0.01, 0.98))
    assert cal.measured("m", ["bf16", "int4"]) and not cal.measured("other", ["bf16"])
    # a format kept as unfaithful never gets a speed (calibrate measures none for it): nothing left to measure
    cal.put_fidelity("m", "int8", Fidelity(1024, 0.5, 2.0, 0.6))
    assert cal.measured("m", ["bf16", "int4", "int8"])
    cal.put_fidelity("m", "int8", Fidelity(1024, 0.001, 0.01, 0.98))  # faithful: its speed is missing
    assert not cal.measured("m", ["bf16", "int4", "int8"])
