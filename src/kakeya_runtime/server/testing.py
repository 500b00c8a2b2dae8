"""Test and demo helpers: tiny random-config models, a byte-level ChatML tokenizer, an in-process server.

Used by tests/server, tests/sdk and tests/sessions (and usable by benchmarks that need a server
without real weights). Nothing here is on the serving path.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kakeya_runtime.models.base import DecoderModel
from kakeya_runtime.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kakeya_runtime.models.registry import build_model
from kakeya_runtime.server.grpc_app import RuntimeServer, ServedModel, ServerConfig, ServerThread
from kakeya_runtime.sessions.policy import PolicyRegistry

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
TINY_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials plus one token per byte

# SmolLM2-Instruct's ChatML template (the runtime never renders it; the SDK does).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_config(kind: str = "llama", *, vocab_size: int = TINY_VOCAB, context: int = 512) -> ModelConfig:
    """A few-layer config of each family; Gemma 3 gets sliding layers so ring caches are exercised."""
    # Untied embeddings: see tiny_model.
    if kind == "llama":
        return ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=context, rms_norm_eps=1e-6, rope_theta=10000.0,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(2,))
    if kind == "gemma3":
        return ModelConfig(model_type="gemma3_text", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           max_position_embeddings=context, rms_norm_eps=1e-6, rope_theta=1e6,
                           hidden_act="gelu_pytorch_tanh",
                           layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=16,
                           rope_local_base_freq=1e4, query_pre_attn_scalar=16, tie_word_embeddings=False,
                           bos_token_id=None, eos_token_ids=(2,))
    raise ValueError(f"unknown tiny model kind {kind!r}")


def tiny_model(kind: str = "llama", *, seed: int = 0, context: int = 512,
               dtype: torch.dtype = torch.float32) -> DecoderModel:
    torch.manual_seed(seed)
    model = build_model(tiny_config(kind, context=context))
    with torch.no_grad():
        # An untied random head gives varied greedy continuations (a tied one mostly repeats the input
        # token); scaling it sharpens the near-uniform distribution so seeds visibly matter.
        model.lm_head.weight.mul_(4.0)
    return model.to(dtype).eval()


def byte_tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json (no merges) with ChatML special tokens, TINY_VOCAB ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def tiny_served(kind: str = "llama", *, seed: int = 0, context: int = 512, model: DecoderModel | None = None,
                with_tokenizer: bool = True) -> ServedModel:
    model = model if model is not None else tiny_model(kind, seed=seed, context=context)
    return ServedModel(
        name=f"tiny-{kind}",
        model=model,
        tokenizer_json=byte_tokenizer_json() if with_tokenizer else "",
        chat_template=CHATML_TEMPLATE if with_tokenizer else None,
        eos_ids=(2,),
        bos_id=None,
    )


@contextlib.contextmanager
def running_server(served: ServedModel, *, policies: PolicyRegistry | None = None,
                   **config: Any) -> Iterator[ServerThread]:
    """A real gRPC server on 127.0.0.1, port 0 (and /metrics on port 0), for the `with` block."""
    config.setdefault("port", 0)
    config.setdefault("metrics_port", 0)
    server = RuntimeServer(served, ServerConfig(**config), policies=policies)
    thread = ServerThread(server).start()
    try:
        yield thread
    finally:
        thread.stop()


class SlowModel(torch.nn.Module):
    """Wraps a model so every forward takes at least `delay_s` (plus `token_s` per token it reads: a CPU's compute
    per row), and records overlapping forwards.

    Lets tests observe cancellation, queueing, max_concurrent and step sizing without a big model.
    """

    def __init__(self, inner: DecoderModel, delay_s: float, token_s: float = 0.0) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.delay_s = delay_s
        self.token_s = token_s
        self._lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.forwards = 0
        self.max_rows = 0  # the most sessions one batched decode forward carried (1 for a plain forward)

    def forward(self, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.inner, 1, input_ids.numel(), input_ids, *args, **kwargs)

    def forward_rows(self, input_ids: Any, positions: Any, caches: Any, chunks: Any = ()) -> Any:
        # rows: the sessions decoded (a fused prefill chunk's tokens are one more sequence, not rows)
        fused = chunks if isinstance(chunks, int) else sum(chunks)
        return self._timed(self.inner.forward_rows, input_ids.shape[0] - fused, input_ids.shape[0], input_ids,
                           positions, caches, chunks)

    def _timed(self, fn: Any, rows: int, tokens: int, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.active += 1
            self.forwards += 1
            self.max_active = max(self.max_active, self.active)
            self.max_rows = max(self.max_rows, rows)
        try:
            time.sleep(self.delay_s + self.token_s * tokens)
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.active -= 1


def self_signed_cert(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A throwaway self-signed certificate for `host` and localhost, and its key, as PEM files: (cert, key).
    Needs the `cryptography` package (the dev extra)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kakeya test server")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = Path(directory) / "server.crt", Path(directory) / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def scrape_metrics(thread: ServerThread, key: str | None = None) -> str:
    """GET /metrics of a running server (started with a metrics port), with `key` as a bearer token if given."""
    import urllib.request

    port = thread.server.metrics_port
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The sum of the samples named `name` whose labels include `labels`, from Prometheus text, e.g.
    metric_value(t, "kakeya_session_total", '{outcome="closed"}'); KeyError when there is none."""
    import re

    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    values = []
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in want.items()):
            values.append(float(m.group(2)))
    if not values:
        raise KeyError(f"{name}{labels} not in the metrics text")
    return sum(values)
