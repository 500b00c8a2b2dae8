"""Draft-head training (`kakeya train draft-head`, engine.draft_training) and the head's draft vocabulary: the
prompts are deterministic, training on the real SmolLM2's own replies beats the untrained head on held-out replies,
the file it writes is what `kakeya serve --draft-head` loads, and a head restricted to a vocabulary drafts only
those tokens while speculation stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kakeya_runtime.engine.draft_training import (
    DraftTrainingConfig,
    DraftTrainingError,
    _Chain,
    _encode,
    chain_acceptance,
    chain_examples,
    greedy_replies,
    module_prompts,
    reply_features,
    train_draft_head,
    training_prompts,
)
from kakeya_runtime.engine.generate import Engine, GenerateRequest
from kakeya_runtime.engine.sampling import SamplingParams
from kakeya_runtime.engine.self_draft import DraftHead, DraftHeadError, DraftHeadProposer
from kakeya_runtime.engine.speculative import SpeculativeStream

PROMPT = [3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]


def test_training_prompts_are_deterministic_and_mixed() -> None:
    chat = module_prompts(24, 0, chat=True)
    assert chat == module_prompts(24, 0, chat=True) and len(chat) == 24 == len(set(chat))
    assert chat != module_prompts(24, 1, chat=True)
    assert any("`json`" in p for p in module_prompts(10_000, 0, chat=True))
    plain = module_prompts(5, 0, chat=False)
    assert all(p.startswith("The Python module ") for p in plain)
    vocab = ["\u0120garden", "\u0120rivers", "\u0120the", "\u0120Paris", "\u2581castle", "garden", "\u0120ab1cde"]
    mixed = training_prompts(8, 0, chat=True, vocabulary=vocab)
    assert mixed == training_prompts(8, 0, chat=True, vocabulary=vocab) and len(mixed) == 8
    assert mixed[:6:2] == chat[:3] and mixed[6:] == chat[3:5]  # alternating, then the longer list goes on
    general = mixed[1:6:2]  # the three lowercase words of 5+ letters after a word-start mark
    assert sorted(w for w in ("garden", "rivers", "castle") if any(w in p for p in general)) == \
        ["castle", "garden", "rivers"]
    assert not any("Paris" in p or "the." in p or "ab1cde" in p for p in mixed)
    assert training_prompts(4, 0, chat=False, vocabulary=vocab)[1].startswith("An article about ")


def test_training_settings_are_checked() -> None:
    for bad in (dict(prompts=1), dict(unroll=0), dict(epochs=0), dict(vocab=-1), dict(lr=0.0)):
        with pytest.raises(DraftTrainingError):
            DraftTrainingConfig(**bad).check()


@pytest.mark.usefixtures("single_thread")
def test_a_trained_head_drafts_the_models_replies_better_than_an_untrained_one(smollm2_bf16) -> None:
    """On held-out replies of the real model, the trained head's first draft is the model's token far more often
    than the untrained head's; the report says so, and the head drafts only its vocabulary."""
    loaded = smollm2_bf16
    engine = Engine(loaded.model)
    cfg = DraftTrainingConfig(prompts=48, reply_tokens=32, epochs=3, vocab=2048, unroll=2)
    head, report = train_draft_head(engine, loaded, cfg)
    assert report["sequences"] == 48 and report["heldout_sequences"] == 4 and report["prompt_source"] == "built-in"
    assert len(report["heldout_acceptance"]) == 2 and len(report["epochs"]) == 3
    assert head.vocab.numel() == 2048 and bool((head.vocab[1:] > head.vocab[:-1]).all())
    # Replies to 4 prompts the training never saw, scored by the untrained chain (the training's starting point)
    # and by the trained head.
    unseen = module_prompts(52, 0, chat=True)[48:]
    seqs = greedy_replies(engine, loaded.config, [_encode(loaded, p, True) for p in unseen], 32, 4,
                          set(loaded.eos_ids), lambda _: None)
    feats = reply_features(engine, loaded.config, seqs)
    f, x, y = chain_examples(seqs, feats, list(range(4)), 2)
    remap = torch.full((loaded.config.vocab_size,), -100, dtype=torch.long)
    remap[head.vocab] = torch.arange(head.vocab.numel())
    untrained = chain_acceptance(_Chain(loaded.model, DraftHead(loaded.model), head.vocab), f, x, remap[y])
    trained = _Chain(loaded.model, head, head.vocab)
    trained.params = {k: v.float() for k, v in head.state_dict().items() if k != "vocab"}
    got = chain_acceptance(trained, f, x, remap[y])
    assert got[0] > untrained[0] + 0.15, (got, untrained)
    assert report["heldout_acceptance"][0] > 0.05  # its own held-out replies (a quarter of them general topics)
    # Drafting through the head itself (DraftHead.step, bf16): only vocabulary tokens, most often the model's.
    proposer = DraftHeadProposer(head)
    ids, p = seqs[0]
    proposer.accepted(ids[:p], 0, feats[0][p - 1:p])
    drafted = proposer.propose(ids[:p], 4, SamplingParams(), None).tokens
    assert len(drafted) == 4 and all(int(t) in set(head.vocab.tolist()) for t in drafted)


def test_train_draft_head_cli_writes_a_head_serve_loads(tmp_path, smollm2_bf16) -> None:
    from kakeya_runtime.cli import app

    out = tmp_path / "head.safetensors"
    lines = tmp_path / "prompts.txt"
    lines.write_text("Name a fruit.\n\nName a colour.\nName a city.\nName a river.\nName a tree.\n")
    runner = CliRunner(env={"COLUMNS": "400"})  # error boxes unwrapped
    res = runner.invoke(app, ["train", "draft-head", "--out", str(out), "--prompts", "4", "--reply-tokens", "8",
                              "--epochs", "1", "--vocab", "64", "--threads", "1", "--prompts-file", str(lines)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["model"] == "smollm2" and report["config"]["vocab"] == 64 and report["prompt_source"] == "given"
    assert report["command"].startswith("kakeya train draft-head") and report["sequences"] == 4
    head = DraftHead.from_file(smollm2_bf16.model, out)  # what `kakeya serve --draft-head` does
    assert head.vocab.numel() == 64
    res = runner.invoke(app, ["train", "draft-head", "--out", str(tmp_path / "head.bin")])
    assert res.exit_code == 2 and "safetensors" in res.output
    res = runner.invoke(app, ["train", "draft-head", "--out", str(tmp_path / "no" / "h.safetensors")])
    assert res.exit_code == 2 and "no such directory" in res.output
    lines.write_text("Name a fruit.\n" + "word " * 9000 + "\n")
    res = runner.invoke(app, ["train", "draft-head", "--out", str(out), "--prompts-file", str(lines)])
    assert res.exit_code == 1 and "does not fit the model's context" in res.output
    lines.write_text("only one\n")
    res = runner.invoke(app, ["train", "draft-head", "--out", str(out), "--prompts-file", str(lines)])
    assert res.exit_code == 2 and "at least 2" in res.output


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_vocabulary_head_drafts_only_its_tokens_and_stays_exact(make_tiny_model, family: str) -> None:
    model = make_tiny_model(family)
    engine = Engine(model)
    vocab = torch.arange(0, model.config.vocab_size, 3)
    head = DraftHead(model, seed=5, vocab=vocab)
    logits, _ = head.step(torch.randn(model.config.hidden_size, dtype=next(model.parameters()).dtype), 5)
    assert torch.isinf(logits[1::3]).all() and torch.isfinite(logits[vocab]).all()
    full = DraftHead(model, seed=5)
    ref, _ = full.step(torch.ones(model.config.hidden_size, dtype=next(model.parameters()).dtype), 5)
    got, _ = head.step(torch.ones(model.config.hidden_size, dtype=next(model.parameters()).dtype), 5)
    torch.testing.assert_close(got[vocab], ref[vocab])  # the head's rows of the same logits
    req = GenerateRequest(40, SamplingParams())
    plain = engine.generate(engine.new_cache(capacity=128), torch.tensor([PROMPT]), req).token_ids[0]
    drafted: list[int] = []

    class Watch(DraftHeadProposer):
        def propose(self, context, max_tokens, sampling, generator):
            draft = super().propose(context, max_tokens, sampling, generator)
            drafted.extend(draft.tokens)
            return draft

    stream = SpeculativeStream(engine, engine.new_cache(capacity=128), torch.tensor([PROMPT]), req, Watch(head),
                               PROMPT, 4)
    assert [t for step in stream for t in step] == plain
    assert drafted and all(t % 3 == 0 for t in drafted)
    # cheaper to draft than the whole head: the cost the off-switch charges counts its rows only
    assert DraftHeadProposer(head).draft_cost < DraftHeadProposer(full).draft_cost


def test_a_vocabulary_round_trips_and_bad_ones_are_refused(make_tiny_model, tmp_path) -> None:
    from safetensors.torch import save_file

    model = make_tiny_model("llama")
    v = model.config.vocab_size
    head = DraftHead(model, seed=2, vocab=torch.tensor([1, 4, 9, v - 1]))
    head.save(tmp_path / "h.safetensors")
    back = DraftHead.from_file(model, tmp_path / "h.safetensors")
    assert torch.equal(back.vocab, head.vocab) and torch.equal(back.fc.weight, head.fc.weight)
    sd = {k: t.clone() for k, t in head.state_dict().items()}
    for bad, match in ((torch.tensor([4, 1]), "increasing"), (torch.tensor([1, 1]), "distinct"),
                       (torch.tensor([1, v]), "outside"), (torch.tensor([-1, 2]), "outside"),
                       (torch.tensor([1.0, 2.0]), "token ids"), (torch.tensor([[1, 2]]), "1-D"),
                       (torch.tensor([], dtype=torch.long), "non-empty")):
        save_file({**sd, "vocab": bad}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(DraftHeadError, match=match):
            DraftHead.from_file(model, tmp_path / "bad.safetensors")
        with pytest.raises(DraftHeadError, match=match):
            DraftHead(model, vocab=bad)
    # a file's vocabulary must be the head's own when loaded into an existing head
    with pytest.raises(DraftHeadError, match="vocab"):
        head.load_tensors({**sd, "vocab": torch.tensor([1, 4, 9, 10])})


def test_draft_costs_are_the_same_in_every_weight_format(make_tiny_model) -> None:
    """What the off-switch charges a drafted token (a share of a decode step's weights) counts int layers too: their
    weights are buffers, and counting only parameters made every draft on int weights look several times dearer."""
    from kakeya_runtime.engine.self_draft import LayerSkipDraft
    from kakeya_runtime.engine.weights import WeightFormat, quantize_model

    dense = make_tiny_model("llama")
    quant = make_tiny_model("llama")
    quantize_model(quant, WeightFormat.INT8)
    for make in (lambda m: LayerSkipDraft(m, layers=1), lambda m: DraftHeadProposer(DraftHead(m, seed=1)),
                 lambda m: DraftHeadProposer(DraftHead(m, seed=1, vocab=torch.arange(8)))):
        a, b = make(dense).draft_cost, make(quant).draft_cost
        assert 0.0 < a < 1.0 and a == pytest.approx(b, rel=1e-6), (a, b)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_training_chain_computes_what_the_head_drafts_with(make_tiny_model, family: str) -> None:
    """The trainer's batched, differentiable step (_Chain) is DraftHead.step's arithmetic: the same weights give the
    same logits (a chain of two steps on its own features), so what is trained is what drafts."""
    model = make_tiny_model(family)
    vocab = torch.arange(1, model.config.vocab_size, 2)
    head = DraftHead(model, seed=4, vocab=vocab)
    chain = _Chain(model, head, vocab)
    chain.params = {k: v.float() for k, v in head.state_dict().items() if k != "vocab"}
    feature = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[5, 9]])
    got = chain(feature[None].float(), tokens)
    h = feature.to(next(model.parameters()).dtype)
    for k in range(2):
        ref, h = head.step(h, int(tokens[0, k]))
        torch.testing.assert_close(got[k][0], ref[vocab], rtol=2e-2, atol=2e-2)
