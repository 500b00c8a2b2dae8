"""Stop strings in Generate, through the Python SDK (sync and asyncio) against a real runtime: where generation
ends, what the history holds, what a later Generate continues from, and the refusals."""

from __future__ import annotations

import asyncio

import pytest
from kakeya import AsyncClient, Client, FinishReason, InvalidArgument, KvPolicy
from kakeya.tokenization import Tokenizer

from kakeya_runtime.server.testing import running_server, tiny_served
from kakeya_runtime.sessions.stops import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, StopMatcher

PROMPT = "Once upon a time"
N = 60


@pytest.fixture(scope="module")
def tok(server) -> Tokenizer:
    with Client(server.address) as c:
        return Tokenizer.from_model_info(c.model_info())


@pytest.fixture(scope="module")
def reference(server, tok) -> tuple[list[int], list[int], str]:
    """The prompt, and what greedy decoding generates from it without stop strings (tokens, text)."""
    prompt = tok.encode(PROMPT)
    with Client(server.address) as c, c.create_session(initial_tokens=prompt) as s:
        ids = s.generate(max_tokens=N, ignore_eos=True).collect()
    return prompt, ids, tok.decode(ids)


def _ascii_stop(text: str, width: int) -> tuple[str, int]:
    """A printable ASCII stop string of `width` characters first occurring at index >= 2 of `text`."""
    for i in range(2, len(text) - width + 1):
        s = text[i:i + width]
        if all(ch.isascii() and ch.isprintable() for ch in s) and text.find(s) == i:
            return s, i
    raise AssertionError(f"no ASCII run of {width} in {text!r}: pick another PROMPT")


def _completing_prefix(tok: Tokenizer, ids: list[int], stop: str) -> int:
    """The number of tokens after which `stop` first appears in their text."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def test_generation_ends_on_the_token_completing_the_stop_string(client, tok, reference):
    prompt, ref_ids, ref_text = reference
    stop, at = _ascii_stop(ref_text, 2)  # two single-byte tokens: the match spans a token boundary
    k = _completing_prefix(tok, ref_ids, stop)
    with client.create_session(initial_tokens=prompt) as s:
        gen = s.generate(max_tokens=N, ignore_eos=True, stop=["never appears \u2603", stop])
        ids = gen.collect()
        assert ids == ref_ids[:k] and k < N  # everything up to and including the completing token, nothing after
        assert gen.finish_reason is FinishReason.STOP and gen.result.stop_string == stop
        assert gen.result.text_before_stop(tok.decode(ids)) == ref_text[:at]
        info = s.info(include_history=True)
        assert list(info.history_token_ids) == prompt + ids  # the history is exactly what was streamed
        assert gen.result.history_length == info.history_length == len(prompt) + k
        # A later Generate continues from that history exactly: greedy, it says what the unstopped run said next.
        more = s.generate(max_tokens=N - k, ignore_eos=True).collect()
        assert more == ref_ids[k:]
        assert s.last_result.stop_string is None and s.last_result.finish_reason is FinishReason.LENGTH


def test_streamed_text_stops_where_the_result_says(client, tok, reference):
    prompt, ref_ids, ref_text = reference
    stop, at = _ascii_stop(ref_text, 2)
    with client.create_session(initial_tokens=prompt) as s:
        gen = s.generate(max_tokens=N, ignore_eos=True, stop=stop)
        dec = tok.stream_decoder(stop=stop)
        shown = "".join(dec.push(t) for t in gen) + dec.flush()
        assert shown == gen.result.text_before_stop(tok.decode(gen.token_ids)) == ref_text[:at]
        assert dec.stop_string == gen.result.stop_string == stop


def test_a_single_string_and_an_unmatched_stop(client, tok, reference):
    prompt, ref_ids, ref_text = reference
    stop, at = _ascii_stop(ref_text, 1)
    with client.create_session(initial_tokens=prompt) as s:
        gen = s.generate(max_tokens=N, ignore_eos=True, stop=stop)  # a str is one stop string, not its characters
        ids = gen.collect()
        assert gen.result.stop_string == stop and ids == ref_ids[:_completing_prefix(tok, ref_ids, stop)]
    with client.create_session(initial_tokens=prompt) as s:
        gen = s.generate(max_tokens=N, ignore_eos=True, stop=["\u2603 not generated"])
        assert gen.collect() == ref_ids and gen.finish_reason is FinishReason.LENGTH
        assert gen.result.stop_string is None and gen.result.text_before_stop("abc") == "abc"


def test_history_before_the_call_is_never_matched(client, tok, reference):
    prompt, ref_ids, ref_text = reference
    prompt_text = tok.decode(prompt)
    straddling = prompt_text[-1] + ref_text[0]  # the prompt's last character and the reply's first
    assert straddling not in ref_text and PROMPT not in ref_text
    with client.create_session(initial_tokens=prompt) as s:
        gen = s.generate(max_tokens=N, ignore_eos=True, stop=[straddling, PROMPT])
        assert gen.collect() == ref_ids and gen.finish_reason is FinishReason.LENGTH


def test_bad_stop_strings_are_refused_and_change_nothing(client):
    bad = [[""], ["x" * (MAX_STOP_STRING_CHARS + 1)], [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], [b"bytes"], 5]
    with client.create_session(initial_tokens=[10, 11, 12]) as s:
        for stop in bad:
            with pytest.raises(InvalidArgument):
                s.generate(max_tokens=4, stop=stop).collect()
        info = s.info(include_history=True)
        assert list(info.history_token_ids) == [10, 11, 12] and info.generate_calls == 0
        ok = ["x" * MAX_STOP_STRING_CHARS] + [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)]
        assert len(s.generate(max_tokens=3, ignore_eos=True, stop=ok + ok).collect()) == 3  # at the limits: fine
        assert len(s.generate(max_tokens=2, ignore_eos=True, stop=None).collect()) == 2  # None: no stop strings


def test_a_server_without_a_tokenizer_refuses_stop_strings():
    with (running_server(tiny_served("llama", with_tokenizer=False)) as thread, Client(thread.address) as c,
          c.create_session(initial_tokens=[10, 11, 12]) as s):
        with pytest.raises(InvalidArgument, match="tokenizer"):
            s.generate(max_tokens=4, stop=["x"]).collect()
        assert len(s.generate(max_tokens=2, ignore_eos=True).collect()) == 2


def test_async_client_stop_strings(server, tok, reference):
    prompt, ref_ids, ref_text = reference
    stop, _ = _ascii_stop(ref_text, 2)

    async def main() -> tuple[list[int], str | None]:
        async with AsyncClient(server.address) as c, await c.create_session(initial_tokens=prompt) as s:
            gen = s.generate(max_tokens=N, ignore_eos=True, stop=[stop])
            ids = [t async for t in gen]
            return ids, gen.result.stop_string

    ids, matched = asyncio.run(main())
    assert ids == ref_ids[:_completing_prefix(tok, ref_ids, stop)] and matched == stop


def test_stop_matcher_holds_back_partial_matches_and_names_the_match():
    m = StopMatcher(("END",))
    assert [m.push(p) for p in ("abcE", "N", "x", "yE", "ND tail")] == ["abc", "", "ENx", "y", ""]
    assert m.stopped and m.matched == "END" and m.flush() == "" and m.push("more") == ""
    m = StopMatcher(("ab", "bcd"))
    assert m.push("xb") == "x" and m.push("c") == "" and m.push("d") == "" and m.matched == "bcd"
    m = StopMatcher(("zz",))
    assert m.push("az") == "a" and m.flush() == "z" and not m.stopped
    m = StopMatcher(("bcde", "cd"))  # the first to complete wins, however the text is split
    assert m.push("abcdef") == "ab" and m.matched == "cd"
    m = StopMatcher(("cd", "bcd"))  # both complete on the same character: the earlier start
    assert m.push("ab") == "a" and m.push("cdx") == "" and m.matched == "bcd"
    m = StopMatcher(("aab",))  # a partial match that fails falls back to the longest prefix still possible
    assert m.push("aaa") == "a" and m.held == "aa" and m.push("ab") == "a" and m.matched == "aab"
    m = StopMatcher(("e" * 255 + "A",))  # a long held tail costs no more per character
    assert m.push("e" * 1000) == "e" * 745 and m.push("A") == "" and m.stopped


@pytest.mark.parametrize("policy", [
    KvPolicy("sink_window", {"sink": 4, "window": 24}),
    KvPolicy("restore", {"sink": 4, "window": 24, "granularity": "per_step"}),
    KvPolicy("sparse", {"sink": 4, "window": 16, "block": 8, "topk": 2}),
])
def test_stopping_early_keeps_bounded_policies_consistent(client, tok, policy):
    """Ending the engine's stream on a stop string leaves the cache as a finished Generate does (the invariants are
    checked at every commit), and the next Generate continues as an uninterrupted one would."""
    prompt = tok.encode(PROMPT)
    with client.create_session(initial_tokens=prompt, policy=policy) as s:
        ref_ids = s.generate(max_tokens=N, ignore_eos=True).collect()
    stop, _ = _ascii_stop(tok.decode(ref_ids), 2)
    k = _completing_prefix(tok, ref_ids, stop)
    with client.create_session(initial_tokens=prompt, policy=policy) as s:
        assert s.generate(max_tokens=N, ignore_eos=True, stop=[stop]).collect() == ref_ids[:k]
        assert s.generate(max_tokens=N - k, ignore_eos=True).collect() == ref_ids[k:]
        info = s.info(include_history=True)
        assert list(info.history_token_ids) == prompt + ref_ids
        assert info.cached_length == len(prompt) + N - 1 and info.inv1_violations == info.inv2_violations == 0


@pytest.mark.real_model
def test_stop_strings_on_smollm2_with_and_without_speculation(smollm2_bf16):
    """The real model and tokenizer (multi-byte BPE pieces): a chat reply stops on the token completing a stop
    string picked from the unstopped reply, the same with history speculation, and continues exactly after it."""
    from kakeya_runtime.server.grpc_app import ServedModel

    served = ServedModel.from_loaded(smollm2_bf16, "smollm2")
    with running_server(served) as thread, Client(thread.address) as c:
        tok = c.tokenizer()
        prompt = tok.tokens_for_chat([{"role": "user", "content": "List three colours, one per line."}])
        with c.create_session(initial_tokens=prompt) as s:
            ref_ids = s.generate(max_tokens=40, ignore_eos=True).collect()
        ref_text = tok.decode(ref_ids)
        words = [w for w in ref_text.split() if w.isalpha() and len(w) > 3 and ref_text.find(w) > 0]
        assert words, ref_text
        stop = words[len(words) // 2]
        k = _completing_prefix(tok, ref_ids, stop)
        for speculation in (None, "history"):
            with c.create_session(initial_tokens=prompt) as s:
                gen = s.generate(max_tokens=40, ignore_eos=True, stop=stop, speculation=speculation)
                assert gen.collect() == ref_ids[:k] and gen.result.stop_string == stop
                assert gen.result.text_before_stop(tok.decode(ref_ids[:k])) == ref_text[: ref_text.find(stop)]
                assert s.generate(max_tokens=40 - k, ignore_eos=True).collect() == ref_ids[k:]
