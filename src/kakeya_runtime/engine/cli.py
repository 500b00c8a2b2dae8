"""`kakeya generate`: one prompt through the engine in-process, text streamed to stdout as it is sampled.

Timings go to stderr so stdout is only the generated text. By default (and with `--chat`) PROMPT is one
user message rendered with the model's chat template, client-side through the SDK's tokenization helper
(the runtime itself never renders templates); `--raw` sends it as plain text.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import typer

from kakeya_runtime.engine.dtypes import DTYPE_HELP, parse_dtype
from kakeya_runtime.sdk import sdk_missing

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from kakeya_runtime.models.loader import LoadedModel

def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    train = typer.Typer(help="Train what the runtime can load (draft heads for speculative decoding).",
                        no_args_is_help=True)
    train.command("draft-head")(train_draft_head)
    app.add_typer(train, name="train")


def train_draft_head(
    out: str = typer.Option(..., "--out", "-o", help="Where to write the head (safetensors), for `kakeya serve "
                            "--draft-head`; a report JSON is written beside it (.json)."),
    model: str = typer.Option("smollm2", "--model", "-m",
                              help="Bundled name (smollm2, gemma3-270m), .gguf file or HF-style directory."),
    prompts: int = typer.Option(768, "--prompts", min=2, help="Requests the model replies to (a tenth held out)."),
    reply_tokens: int = typer.Option(128, "--reply-tokens", min=1, help="Greedy tokens per reply at most."),
    epochs: int = typer.Option(4, "--epochs", min=1),
    unroll: int = typer.Option(3, "--unroll", min=1, help="Draft steps trained in a chain."),
    vocab: int = typer.Option(8192, "--vocab", min=0, help="Tokens the head may draft (the replies' most "
                              "frequent); a draft then reads only their rows of the LM head. 0: every token."),
    prompts_file: str | None = typer.Option(None, "--prompts-file", metavar="PATH",
                                            help="Requests to train on, one per line (your workload's own: the head "
                                                 "learns what the model writes there); default: built-in ones about "
                                                 "the Python standard library and general topics."),
    seed: int = typer.Option(0, "--seed", min=0),
    threads: int | None = typer.Option(None, "--threads", min=1, help="CPU threads for torch (default: torch's)."),
) -> None:
    """Train an EAGLE-style draft head on the model's own greedy replies (self-distillation, minutes on a CPU)."""
    import json
    import shlex
    from pathlib import Path

    import torch

    from kakeya_runtime.engine.draft_training import DraftTrainingConfig, DraftTrainingError
    from kakeya_runtime.engine.draft_training import train_draft_head as train
    from kakeya_runtime.engine.generate import Engine
    from kakeya_runtime.models.loader import ModelLoadError, load_model

    target = Path(out)
    if target.suffix != ".safetensors":
        raise typer.BadParameter(f"{out}: the head is written as safetensors (name it *.safetensors)")
    if not target.parent.is_dir():
        raise typer.BadParameter(f"{target.parent}: no such directory")
    given = None
    if prompts_file is not None:
        try:
            given = [line for line in Path(prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise typer.BadParameter(f"--prompts-file {prompts_file}: {e}") from None
        if len(given) < 2:
            raise typer.BadParameter(f"--prompts-file {prompts_file}: at least 2 non-empty lines (one is held out)")
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = DraftTrainingConfig(prompts=prompts, reply_tokens=reply_tokens, epochs=epochs, unroll=unroll,
                              vocab=vocab, seed=seed)
    try:
        cfg.check()
        loaded = load_model(model, dtype=torch.bfloat16)
    except (DraftTrainingError, ModelLoadError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if loaded.chat_template and (problem := sdk_missing("the chat template the training prompts use")):
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    try:
        head, report = train(Engine(loaded.model), loaded, cfg, log=lambda line: typer.echo(line, err=True),
                             prompts=given)
    except DraftTrainingError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    head.save(target)
    report.update(model=model, model_name=loaded.name, command="kakeya train draft-head " + shlex.join(sys.argv[3:]),
                  torch_threads=torch.get_num_threads(), created_unix=int(time.time()))
    target.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    typer.echo(f"wrote {target} (held-out acceptance per draft step {report['heldout_acceptance']}) and "
               f"{target.with_suffix('.json')}")


def generate(
    prompt: str = typer.Argument(..., help="Prompt text: one user message in the chat template (plain text with --raw)."),
    model: str = typer.Option("smollm2", "--model", "-m",
                              help="Bundled name (smollm2, gemma3-270m), .gguf file or HF-style directory."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, "--temperature", "-t", min=0.0, help="0 = greedy."),
    top_k: int | None = typer.Option(None, "--top-k", min=0),
    top_p: float | None = typer.Option(None, "--top-p"),
    seed: int | None = typer.Option(None, "--seed", min=0),
    dtype: str = typer.Option("bf16", "--dtype", help=f"Weights and activations: {DTYPE_HELP}."),
    chat: bool | None = typer.Option(None, "--chat/--raw",
                                     help="Chat templating is on by default whenever the model has a template; "
                                          "--raw sends PROMPT as plain text (base models)."),
    cache_dir: str | None = typer.Option(None, "--cache-dir", help="Conversion cache (default: $KAKEYA_CACHE_DIR "
                                         "or the user cache dir)."),
    threads: int | None = typer.Option(None, "--threads", min=1,
                                       help="CPU threads for torch (default: torch's; 1 is faster on a busy machine)."),
) -> None:
    """Generate a continuation of PROMPT, streaming text to stdout and timings to stderr."""
    import torch

    from kakeya_runtime.engine.generate import Engine, GenerateRequest, GenerationError
    from kakeya_runtime.engine.sampling import SamplingError, SamplingParams
    from kakeya_runtime.models.loader import ModelLoadError, load_model

    try:
        torch_dtype = parse_dtype(dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except SamplingError as e:
        raise typer.BadParameter(str(e)) from None
    problem = None if chat is False else sdk_missing("the chat template (on by default; --raw sends plain text)")
    if problem:  # before the model load, not after it
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    try:
        loaded = load_model(model, dtype=torch_dtype, cache_dir=cache_dir)
    except ModelLoadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"[{loaded.name}: {loaded.config.model_type}, {dtype}, loaded in {loaded.load_s:.2f} s]",
               err=True)

    use_chat = bool(loaded.chat_template) if chat is None else chat
    # Raw text gets BOS from the tokenizer when the model wants one (Gemma); a template writes its own.
    ids = _chat_prompt_ids(loaded, prompt) if use_chat else loaded.tokenizer.encode(prompt).ids
    if not ids:
        typer.echo("error: the prompt encodes to no tokens", err=True)
        raise typer.Exit(2)

    engine = Engine(loaded.model)
    limit = loaded.config.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        typer.echo(f"error: prompt {len(ids)} + max_new_tokens {max_new_tokens} exceeds the context {limit}",
                   err=True)
        raise typer.Exit(2)
    cache = engine.new_cache(capacity=len(ids) + max_new_tokens)
    request = GenerateRequest(max_new_tokens, sampling=sampling, stop_ids=loaded.eos_ids)
    try:
        stream = engine.stream(cache, torch.tensor([ids], dtype=torch.long), request)
    except GenerationError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    out = sys.stdout
    t0 = time.perf_counter()
    for piece in iter_text(loaded.tokenizer, (step[0] for step in stream)):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    result = stream.result
    assert result is not None
    total_s = time.perf_counter() - t0
    # The first sampled token comes from the prefill logits; decode rate counts the tokens after it.
    decode_rate = (result.decode_tokens - 1) / result.decode_s if result.decode_s > 0 else 0.0
    prefill_rate = result.prefill_tokens / result.prefill_s if result.prefill_s > 0 else 0.0
    typer.echo(
        f"[prefill {result.prefill_tokens} tok in {result.prefill_s:.3f} s ({prefill_rate:.0f} tok/s) · "
        f"TTFT {result.ttft_s * 1000:.0f} ms · decode {result.decode_tokens} tok, {decode_rate:.1f} tok/s · "
        f"finish {result.finish_reason.value} · total {total_s:.2f} s]",
        err=True,
    )


def iter_text(tokenizer: Tokenizer, token_ids: Iterable[int]) -> Iterator[str]:
    """Text pieces as tokens arrive. A token that ends part-way through a UTF-8 character (byte-level BPE,
    byte-fallback pieces) yields nothing until the character is complete, so multi-byte text never comes
    out as U+FFFD halves; special tokens are skipped. A character still incomplete when the tokens end comes out
    as the whole decode spells it (U+FFFD), as the server and the SDKs show it, rather than being dropped."""
    from tokenizers.decoders import DecodeStream

    decoder = DecodeStream(skip_special_tokens=True)
    ids: list[int] = []
    emitted = 0
    for token_id in token_ids:
        ids.append(token_id)
        piece = decoder.step(tokenizer, token_id)
        if piece:
            emitted += len(piece)
            yield piece
    rest = tokenizer.decode(ids, skip_special_tokens=True)[emitted:]
    if rest:
        yield rest


def _chat_prompt_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    """One user turn rendered with the model's template (client-side, via the SDK) and tokenized without
    extra special tokens: the template writes BOS itself where the model wants it."""
    if not loaded.chat_template:
        typer.echo(f"error: {loaded.name} has no chat template; use --raw", err=True)
        raise typer.Exit(2)
    from kakeya.tokenization import ChatTemplateError, Tokenizer  # checked before the load (sdk_missing)

    tok = Tokenizer(loaded.tokenizer_json, chat_template=loaded.chat_template, bos_token_id=loaded.bos_id,
                    eos_token_ids=loaded.eos_ids)
    try:
        text = tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    except ChatTemplateError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    return loaded.tokenizer.encode(text, add_special_tokens=False).ids
