"""Stream decoding under stop strings, server and Python SDK alike: a token that ends complete characters and
begins an incomplete one (real BPE vocabularies have them: SmolLM2's " " + an emoji's first three bytes) shows the
complete ones at once, so a stop string ending in them completes on that token, not one token late."""

from __future__ import annotations

import json

import pytest
from kakeya.tokenization import Tokenizer
from tokenizers import Tokenizer as HFTokenizer

from kakeya_runtime.server.testing import byte_tokenizer_json
from kakeya_runtime.sessions.stops import StopWatch, StreamDecoder, detokenizer


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    """The tests' byte-level vocabulary plus one merge: a space with the first byte of a 4-byte character."""
    spec = json.loads(byte_tokenizer_json())
    vocab = spec["model"]["vocab"]
    vocab["Ġð"] = len(vocab)
    spec["model"]["merges"] = [["Ġ", "ð"]]
    return json.dumps(spec)


def test_the_complete_characters_of_a_token_are_shown_on_it(tokenizer_json):
    hf, sdk = HFTokenizer.from_str(tokenizer_json), Tokenizer(tokenizer_json)
    ids = hf.encode("a 😀 b").ids
    first = ids.index(hf.token_to_id("Ġð"))
    assert hf.decode(ids[first:first + 1]) == " \ufffd"  # the case: a space, then an incomplete character
    server = StreamDecoder(detokenizer(tokenizer_json))
    pieces = [server.push(i) for i in ids]
    assert pieces[first] == " " and "".join(pieces) + server.flush() == "a 😀 b"
    client = sdk.stream_decoder()
    assert [client.push(i) for i in ids] == pieces and client.flush() == ""
    cut = StreamDecoder(detokenizer(tokenizer_json))  # the stream ends inside the emoji: as a whole decode spells it
    assert "".join(cut.push(i) for i in ids[:first + 1]) + cut.flush() == hf.decode(ids[:first + 1])


def test_a_stop_string_completes_on_the_token_that_completes_its_text(tokenizer_json):
    ids = HFTokenizer.from_str(tokenizer_json).encode("a 😀 b").ids
    first = ids.index(HFTokenizer.from_str(tokenizer_json).token_to_id("Ġð"))
    watch = StopWatch.new(detokenizer(tokenizer_json), ("a ",))
    assert [watch.push(i) for i in ids[:first + 1]] == [False] * first + [True]
    shown = Tokenizer(tokenizer_json).stream_decoder(stop="a ")
    assert "".join(shown.push(i) for i in ids[:first + 1]) == "" and shown.stop_string == "a "
