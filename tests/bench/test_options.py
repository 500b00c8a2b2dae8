"""The bench and calibrate commands answer bad input with one clear line and exit status 2, before any work and
without writing evidence: list options parsed strictly, counts bounded, and the runtime's typed errors (a bad policy
parameter, a model that does not load, an unknown configuration) caught at the command's boundary."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from kakeya_runtime.bench.options import answers_bad_input, floats_in, is_input_error, positive_ints
from kakeya_runtime.cli import app
from kakeya_runtime.kv.spec import PolicyError
from kakeya_runtime.sessions.errors import InvalidArgument


def test_list_options_parse_strictly():
    assert positive_ints("1024, 2048,,7680", "--lengths") == (1024, 2048, 7680)
    assert positive_ints("", "--prompts", allow_empty=True) == ()  # an optional run skipped
    with pytest.raises(typer.BadParameter, match="--lengths: give at least one value"):  # once: nothing measured, exit 0
        positive_ints(" , ", "--lengths")
    with pytest.raises(typer.BadParameter, match="--depths: give at least one value"):
        floats_in("", "--depths", 0.0, 1.0)
    with pytest.raises(typer.BadParameter, match="--lengths: expected comma-separated integers, got 'abc'"):
        positive_ints("abc", "--lengths")
    with pytest.raises(typer.BadParameter, match="--sessions: every value must be at least 1, got 0, -2"):
        positive_ints("1,0,-2", "--sessions")
    assert floats_in("0.1,0.9", "--depths", 0.0, 1.0) == (0.1, 0.9)
    with pytest.raises(typer.BadParameter, match=r"--depths: every value must lie in \[0, 1\], got 1.5"):
        floats_in("0.5,1.5", "--depths", 0.0, 1.0)


def test_only_the_runtimes_typed_errors_count_as_bad_input():
    assert is_input_error(PolicyError("window must be >= 1"))
    assert is_input_error(InvalidArgument("unknown KV policy"))
    assert not is_input_error(ValueError("a bug's ValueError keeps its traceback"))
    assert not is_input_error(RuntimeError("nor does anything else"))

    @answers_bad_input
    def typed() -> None:
        raise PolicyError("codec must be one of ...")

    @answers_bad_input
    def bug() -> None:
        raise ValueError("not ours")

    with pytest.raises(typer.Exit) as e:
        typed()
    assert e.value.exit_code == 2
    with pytest.raises(ValueError, match="not ours"):
        bug()


@pytest.mark.parametrize("args, message", [
    (["bench", "sparse", "--lengths", "0"], "--lengths: every value must be at least 1, got 0"),
    (["bench", "sparse", "--lengths", "2k"], "--lengths: expected comma-separated integers"),
    (["bench", "sparse", "--decode-tokens", "0"], "--decode-tokens"),
    (["bench", "niah", "--lengths", "0"], "--lengths: every value must be at least 1"),
    (["bench", "niah", "--depths", "0.5,2"], r"--depths: every value must lie in [0, 1]"),
    (["bench", "niah", "--configs", "full,bogus"], "unknown NIAH configuration(s) ['bogus']"),
    (["bench", "niah", "--lengths", "1024,9000", "--configs", "full"],  # past SmolLM2's 8,192: refused, not shortened
     "length 9000 does not fit smollm2's context of 8192 positions with 10 new tokens: at most 8174"),
    (["bench", "sparse", "--lengths", "9000", "--decode-tokens", "4"],
     "length 9000 does not fit smollm2's context of 8192 positions with these decode steps: at most 8178"),
    (["bench", "concurrent", "--sessions", "0,8"], "--sessions: every value must be at least 1, got 0"),
    (["bench", "concurrent", "--turns", "0"], "--turns"),
    (["bench", "attention", "--lengths", "-5"], "--lengths: every value must be at least 1, got -5"),
    (["bench", "engine", "--contexts", "0"], "--contexts: every value must be at least 1"),
    (["bench", "spec", "--ks", "0"], "--ks: every value must be at least 1"),
    (["bench", "spec", "--temperatures", "warm"], "--temperatures: expected comma-separated numbers"),
    (["bench", "session", "--policies", "full;sparse:topk=-1"], "KV policy parameter 'topk' must be >= 1, got -1"),
    (["bench", "session", "--policies", "sparse:topk"], "policy parameter 'topk' is not key=value"),
    (["bench", "session", "--attention", "native,bogus"], "attention backends ['bogus']"),
    (["calibrate", "heads", "--model", "no-such-model"], "no-such-model: no such file or directory"),
    (["calibrate", "heads", "--depths", "-0.1"], "--depths: every value must lie in [0, 1]"),
    # each of these once ran and wrote an empty result with exit 0, crashed, or hung
    (["bench", "engine", "--models", "nosuch"], "'nosuch': no such file or directory, and not a bundled model"),
    (["bench", "engine", "--formats", ""], "--formats: give at least one value"),
    (["bench", "engine", "--previous", "bogus"], "--previous: unknown bogus"),
    (["bench", "niah", "--lengths", ""], "--lengths: give at least one value"),
    (["bench", "niah", "--dtype", "fp16"], "--dtype 'fp16': one of bf16, fp32"),
    (["bench", "sparse", "--codec", ""], "--codec: give at least one value"),
    (["bench", "sparse", "--decode-tokens", "1"], "--decode-tokens"),
    (["bench", "spec", "--workloads", "bogus"], "--workloads: unknown bogus"),
    (["bench", "spec", "--proposers", ""], "--proposers: give at least one value"),
    (["bench", "spec", "--prompts", "bogus"], "--prompts: one of chat, completion"),
    (["bench", "attention", "--dtypes", "bogus"], "--dtypes: unknown bogus"),
    (["bench", "attention", "--lengths", "4", "--chunks", "8"], "--chunks: 8 new tokens do not fit a cache of 4 keys"),
    (["bench", "concurrent", "--schedulers", ""], "--schedulers: give at least one value"),
    (["bench", "concurrent", "--model", "nosuch"], "'nosuch': no such file or directory"),
    (["bench", "soak", "--model", "nosuch"], "'nosuch': no such file or directory"),
    (["bench", "soak", "--weights", "int3"], "--weights must be auto or one of"),
    (["bench", "concurrent", "--weights", "int3"], "--weights must be auto or one of"),
    (["bench", "concurrent", "--step-slowdown", "1"], "--step-slowdown must be a finite number > 1, got 1.0"),
    (["bench", "session", "--policies", ";"], "policies ';': give at least one"),
    (["calibrate", "heads", "--lengths", "100000"], "lengths [100000] do not fit smollm2's context"),
])
def test_bad_input_is_refused_before_any_work(args, message, tmp_path):
    out = tmp_path / ("out.json" if args[0] == "calibrate" else "out")  # each command's --out (a file or a folder)
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # answered, not a traceback
    assert message in " ".join(result.output.replace("\u2502", " ").split()), result.output
    assert not out.exists()  # no evidence written


def test_an_out_path_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args in (["bench", "sparse", "--lengths", "256"], ["bench", "engine", "--models", "tiny"]):
        out = blocker / "sub" / ("e.json" if "engine" in args else "dir")  # under a file: no folder can be made
        result = CliRunner().invoke(app, [*args, "--out", str(out)])
        assert result.exit_code == 2 and "cannot write there" in " ".join(result.output.split()), result.output
