"""Training the EAGLE-style draft head (engine.self_draft.DraftHead) by self-distillation: `kakeya train draft-head`.

The head is trained on what the served model itself writes, so a draft it proposes is the model's own greedy
continuation as often as it can be:

1. prompts: chat requests of two kinds, alternating: about the Python standard library's modules (explain one
   from its doc line, use it in an example, list its uses, fit it into an agent tool) and about words of the
   model's own vocabulary (a story, an explanation, an email, facts, pros and cons, a JSON object, an agent's
   plan...), rendered with the model's chat template (a base model gets plain completion prompts); local and
   deterministic for a given Python and tokenizer, nothing downloaded;
2. replies: the model's greedy continuation of each prompt, several prompts decoded together (`decode_rows`);
3. features: the model reads each prompt + reply once (`Engine.verify`, the chunk path, whose tokens and hidden
   states are a decode's, bit for bit), keeping the final hidden states the head drafts from at serve time;
4. training: at every reply position t the head takes the feature of t and the tokens t+1.. the model wrote and
   is unrolled `unroll` steps on its own outputs (as it drafts), each step's logits scored by cross-entropy
   against the model's next token; the target's embeddings, final norm and LM head stay frozen. With `vocab`,
   logits cover the `vocab` most frequent tokens of the training replies (the head then drafts only those);
5. held out: a tenth of the prompts; the report gives, per unrolled step, the share of positions where the head's
   greedy draft is the model's token given every earlier draft of the chain was (acceptance per drafted token
   at temperature 0, before the verifier's own costs).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kakeya_runtime.engine.generate import Engine
from kakeya_runtime.engine.self_draft import DraftHead
from kakeya_runtime.kv.policy import PolicySpec, make_policy_cache
from kakeya_runtime.models.base import DecoderModel, Logits

TEMPLATES = (
    "Explain what the Python module `{m}` is for. Its documentation begins: \"{d}\"",
    "Write a short Python example that uses the `{m}` module.",
    "List three common uses of Python's `{m}` module.",
    "I am writing an agent tool in Python. How could the `{m}` module help? ({d})",
)
# General requests about a word of the model's own vocabulary: replies on every kind of topic (stories,
# explanations, mail, facts, structured output, agent plans), not only the standard library's.
WORD_TEMPLATES = (
    "Tell me a short story about {w}.",
    "Explain what {w} means to a ten-year-old.",
    "Write a short email to a colleague about {w}.",
    "Give me three interesting facts about {w}.",
    "What are the pros and cons of {w}?",
    "How would you describe {w} to someone who has never heard of it?",
    "Summarize the history of {w} in a few sentences.",
    "Write a JSON object describing {w} with a name, a category and three properties.",
    "I am building an agent that deals with {w}. Which tools should it call, and in what order?",
    "Why is {w} important?",
    "Can you help me plan a project about {w}?",
    "Write a paragraph about {w}.",
    "Explain how {w} works, step by step.",
    "Write a short poem about {w}.",
    "What questions should I ask an expert on {w}?",
    "Give some advice to a beginner learning about {w}.",
    "Describe a day in the life of someone who works with {w}.",
    "What is a common misconception about {w}?",
)
SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})


class DraftTrainingError(ValueError):
    """Settings the training cannot run with (no prompts, no reply positions, a vocabulary larger than the
    model's)."""


@dataclass(slots=True)
class DraftTrainingConfig:
    prompts: int = 768  # requests to reply to (a tenth held out), half about stdlib modules, half general
    reply_tokens: int = 128  # greedy tokens per reply at most (a reply ends at the model's end of turn)
    rows: int = 8  # replies decoded together
    unroll: int = 3  # draft steps trained in a chain
    epochs: int = 4
    vocab: int = 8192  # tokens the head may draft (the replies' most frequent); 0: the whole vocabulary
    intermediate: int | None = None  # the head's MLP width (None: twice the hidden size)
    lr: float = 2e-3
    batch: int = 256
    seed: int = 0

    def check(self) -> None:
        for name in ("prompts", "reply_tokens", "rows", "unroll", "epochs", "batch"):
            if getattr(self, name) < 1:
                raise DraftTrainingError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompts < 2:
            raise DraftTrainingError("prompts must be at least 2 (one is held out)")
        if self.vocab < 0 or not self.lr > 0:
            raise DraftTrainingError(f"vocab must be >= 0 and lr > 0, got {self.vocab} and {self.lr}")


def training_prompts(n: int, seed: int, chat: bool, vocabulary: Iterable[str]) -> list[str]:
    """n prompts, alternately about standard library modules (`module_prompts`) and about words of the model's
    vocabulary (tokens that are a whole lowercase word of 5-12 letters after the tokenizer's word-start mark):
    chat requests, or completion prompts for a base model (not chat)."""
    words = sorted({t[1:] for t in vocabulary if len(t) > 5 and t[0] in "\u0120\u2581" and t[1:].isalpha()
                    and t[1:].islower() and t[1:].isascii() and len(t) <= 13})
    rng = random.Random(seed)
    rng.shuffle(words)
    if chat:
        general = [WORD_TEMPLATES[i % len(WORD_TEMPLATES)].format(w=w) for i, w in enumerate(words)]
    else:
        general = [f"An article about {w}." for w in words]
    modules = module_prompts(n, seed, chat)
    out: list[str] = []
    for pair in zip(modules, general, strict=False):
        out.extend(pair)
    out.extend(modules[len(out) // 2:] + general[len(out) // 2:])  # whichever is longer fills the rest
    return out[:n]


def module_prompts(n: int, seed: int, chat: bool) -> list[str]:
    """n requests about standard library modules (chat), or their doc lines as completion prompts (not chat)."""
    docs = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        doc = _source_docstring(name)
        lines = (doc or "").strip().splitlines()
        if lines and lines[0].strip():
            docs.append((name, lines[0].strip()))
    if chat:
        prompts = [t.format(m=m, d=d) for m, d in docs for t in TEMPLATES]
    else:
        prompts = [f"The Python module {m}: {d}" for m, d in docs]
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


def _source_docstring(name: str) -> str | None:
    """A pure-Python standard library module's docstring, read from its source (nothing is imported)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None  # built in or compiled: no source here
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return ast.get_docstring(ast.parse(f.read()))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def greedy_replies(engine: Engine, config, prompts: list[list[int]], reply_tokens: int, rows: int,
                   eos: set[int], log: Callable[[str], None]) -> list[tuple[list[int], int]]:
    """Each prompt's greedy reply, `rows` prompts decoded together: (prompt + reply ids, prompt length)."""
    out: list[tuple[list[int], int]] = []
    started = time.monotonic()
    for i in range(0, len(prompts), rows):
        batch = prompts[i:i + rows]
        caches, last, seqs, live = [], [], [], []
        for ids in batch:
            cache = make_policy_cache(config, PolicySpec.parse("full"), capacity=len(ids) + reply_tokens,
                                      dtype=engine.dtype)
            cache.reserve(cache.capacity)
            if len(ids) > 1:
                engine.prefill(cache, torch.tensor([ids[:-1]]))
            caches.append(cache)
            last.append(ids[-1])
            seqs.append(list(ids))
            live.append(True)
        for _ in range(reply_tokens):
            rows_now = [j for j in range(len(batch)) if live[j]]
            if not rows_now:
                break
            logits = engine.decode_rows([caches[j] for j in rows_now], [last[j] for j in rows_now])
            for j, tok in zip(rows_now, logits.argmax(-1).tolist(), strict=True):
                seqs[j].append(tok)
                last[j] = tok
                live[j] = tok not in eos
        out.extend((s, len(p)) for s, p in zip(seqs, batch, strict=True))
        log(f"replies {len(out)}/{len(prompts)}, {sum(len(s) - p for s, p in out)} tokens, "
            f"{time.monotonic() - started:.0f} s")
    return out


def reply_features(engine: Engine, config, seqs: list[tuple[list[int], int]]) -> list[Tensor]:
    """Each sequence's final hidden states (T, C), as the verifier hands them to a draft head."""
    feats = []
    for ids, _ in seqs:
        cache = make_policy_cache(config, PolicySpec.parse("full"), capacity=len(ids), dtype=engine.dtype)
        out = engine.verify(cache, torch.tensor([ids]), logits=Logits.LAST, return_hidden=True)
        feats.append(out.hidden[0].clone())
    return feats


def chain_examples(seqs: list[tuple[list[int], int]], feats: list[Tensor], which: list[int],
                   unroll: int) -> tuple[Tensor, Tensor, Tensor]:
    """For every reply position t with `unroll` more tokens after t + 1: the feature of t (N, C) fp32, the tokens
    t+1 .. t+unroll the chain reads (N, unroll) and the ones it should draft, t+2 .. t+unroll+1 (N, unroll)."""
    fs, xs, ys = [], [], []
    for i in which:
        ids, p = seqs[i]
        ids_t = torch.tensor(ids)
        for t in range(p - 1, len(ids) - 1 - unroll):
            fs.append(feats[i][t])
            xs.append(ids_t[t + 1:t + 1 + unroll])
            ys.append(ids_t[t + 2:t + 2 + unroll])
    if not fs:
        raise DraftTrainingError("no reply position to train on (replies too short for the unroll)")
    return torch.stack(fs).float(), torch.stack(xs), torch.stack(ys)


class _Chain:
    """The head's step (DraftHead.step's arithmetic) over a batch, differentiable in the head's own weights."""

    def __init__(self, model: DecoderModel, head: DraftHead, vocab: Tensor | None) -> None:
        self.model = model
        rows = model.head_weight().detach()
        self.rows = rows if vocab is None else rows[vocab].contiguous()
        self.norm_w = model.norm.weight.detach().float()
        self.unit_offset = bool(getattr(model.norm, "unit_offset", False))
        self.eps = float(model.norm.eps)
        self.params = {k: v.detach().float().clone() for k, v in head.state_dict().items() if k != "vocab"}
        c = self.params["norm_scale"].shape[0]
        with torch.no_grad():  # start from "the next feature is this one" with the block off (EAGLE's habit)
            self.params["fc.weight"][:, :c] = torch.eye(c)
            self.params["fc.weight"][:, c:] *= 0.1
            self.params["down.weight"].zero_()
        for p in self.params.values():
            p.requires_grad_(True)

    def __call__(self, feature: Tensor, tokens: Tensor) -> list[Tensor]:
        p = self.params
        scale = 1.0 + self.norm_w if self.unit_offset else self.norm_w
        with torch.no_grad():  # the target's own embedding (Gemma's scaled), frozen
            emb = self.model.embed(tokens).float()
        out, h_in = [], feature
        for k in range(tokens.shape[1]):
            h = torch.cat([h_in, emb[:, k]], -1) @ p["fc.weight"].t()
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * p["norm_scale"]
            h = h + F.silu(x @ p["up.weight"].t()) @ p["down.weight"].t()
            hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * scale
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.rows.dtype == torch.bfloat16):
                out.append((hn @ self.rows.t()).float())
            h_in = h
        return out


def chain_acceptance(chain: _Chain, feats: Tensor, tokens: Tensor, labels: Tensor) -> list[float]:
    """Per unrolled step k: P(draft k is the model's token | drafts 1..k-1 were), over the positions given."""
    with torch.no_grad():
        preds = torch.cat([torch.stack([lg.argmax(-1) for lg in chain(feats[i:i + 1024], tokens[i:i + 1024])], 1)
                           for i in range(0, len(feats), 1024)])
    alive = torch.ones(len(feats), dtype=torch.bool)
    rates = []
    for k in range(tokens.shape[1]):
        hit = preds[:, k] == labels[:, k]
        rates.append(round(float((hit & alive).sum()) / max(1, int(alive.sum())), 4))
        alive &= hit
    return rates


def train_draft_head(engine: Engine, loaded, cfg: DraftTrainingConfig, log: Callable[[str], None] = lambda _: None,
                     prompts: list[str] | None = None) -> tuple[DraftHead, dict]:
    """A draft head for `engine`'s model (the one `loaded` describes) trained as the module says, and a report.
    `prompts`: the requests to reply to instead of the built-in ones (a workload's own: the head learns what the
    model writes there), the first `cfg.prompts` of them after a seeded shuffle."""
    cfg.check()
    model, config = engine.model, loaded.config
    if cfg.vocab > config.vocab_size:
        raise DraftTrainingError(f"vocab {cfg.vocab} is larger than the model's {config.vocab_size} tokens")
    torch.manual_seed(cfg.seed)
    chat = bool(loaded.chat_template)
    if prompts is None:
        texts = training_prompts(cfg.prompts, cfg.seed, chat, loaded.tokenizer.get_vocab())
    else:
        texts = [p for p in prompts if p.strip()]
        random.Random(cfg.seed).shuffle(texts)
        texts = texts[:cfg.prompts]
    if len(texts) < 2:
        raise DraftTrainingError(f"only {len(texts)} prompts could be built here")
    encoded = [_encode(loaded, t, chat) for t in texts]
    for n, ids in enumerate(encoded):
        if len(ids) + cfg.reply_tokens > config.max_position_embeddings:
            raise DraftTrainingError(f"request {n + 1} of {len(encoded)} (after the shuffle) is {len(ids)} tokens: with "
                                     f"{cfg.reply_tokens} reply tokens it does not fit the model's context of "
                                     f"{config.max_position_embeddings}")
    started = time.monotonic()
    seqs = greedy_replies(engine, config, encoded, cfg.reply_tokens, cfg.rows, set(loaded.eos_ids), log)
    feats = reply_features(engine, config, seqs)
    gen_s = time.monotonic() - started
    order = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(order)
    n_val = max(1, len(order) // 10)
    f_tr, x_tr, y_tr = chain_examples(seqs, feats, order[n_val:], cfg.unroll)
    f_va, x_va, y_va = chain_examples(seqs, feats, order[:n_val], cfg.unroll)
    vocab = None
    if cfg.vocab:
        counts = torch.bincount(y_tr.flatten(), minlength=config.vocab_size)
        vocab = counts.argsort(descending=True, stable=True)[:cfg.vocab].sort().values
    remap = torch.arange(config.vocab_size) if vocab is None else \
        torch.full((config.vocab_size,), -100, dtype=torch.long).index_put_((vocab,), torch.arange(len(vocab)))
    head = DraftHead(model, intermediate=cfg.intermediate, seed=cfg.seed, vocab=vocab)
    chain = _Chain(model, head, vocab)
    yt, yv = remap[y_tr], remap[y_va]
    opt = torch.optim.AdamW(list(chain.params.values()), lr=cfg.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(f_tr) / cfg.batch)
    total, step, history = cfg.epochs * per_epoch, 0, []
    for epoch in range(cfg.epochs):
        perm = torch.randperm(len(f_tr), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        loss_sum = 0.0
        for i in range(0, len(f_tr), cfg.batch):
            b = perm[i:i + cfg.batch]
            for group in opt.param_groups:  # cosine decay to zero over the whole run
                group["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / total))
            step += 1
            logits = chain(f_tr[b], x_tr[b])
            loss = sum(F.cross_entropy(lg, yt[b][:, k], ignore_index=-100) * 0.8**k for k, lg in enumerate(logits))
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item()
        rates = chain_acceptance(chain, f_va, x_va, yv)
        history.append({"epoch": epoch, "loss": round(loss_sum / per_epoch, 4), "heldout_acceptance": rates})
        log(f"epoch {epoch + 1}/{cfg.epochs}: loss {loss_sum / per_epoch:.3f}, held-out acceptance per draft "
            f"step {rates}, {time.monotonic() - started:.0f} s")
    head.load_tensors({**{k: v.detach() for k, v in chain.params.items()},
                       **({"vocab": vocab} if vocab is not None else {})}, source="trained weights")
    covered = float(torch.isin(y_va, vocab).float().mean()) if vocab is not None else 1.0
    report = {
        "config": asdict(cfg), "chat_prompts": chat, "prompt_source": "built-in" if prompts is None else "given",
        "sequences": len(seqs), "heldout_sequences": n_val,
        "reply_tokens": sum(len(s) - p for s, p in seqs), "train_positions": len(f_tr),
        "heldout_positions": len(f_va), "heldout_vocab_coverage": round(covered, 4),
        "head_params": sum(p.numel() for p in head.parameters()), "epochs": history,
        "heldout_acceptance": history[-1]["heldout_acceptance"],
        "generate_and_features_s": round(gen_s, 1), "wall_s": round(time.monotonic() - started, 1),
    }
    return head, report


def _encode(loaded, text: str, chat: bool) -> list[int]:
    if not chat:
        ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
        return ([loaded.bos_id] if loaded.bos_id is not None else []) + ids
    from kakeya.tokenization import Tokenizer

    tok = Tokenizer(loaded.tokenizer_json, chat_template=loaded.chat_template, bos_token_id=loaded.bos_id,
                    eos_token_ids=loaded.eos_ids)
    rendered = tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    return loaded.tokenizer.encode(rendered, add_special_tokens=False).ids
