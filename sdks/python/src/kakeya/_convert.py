"""protobuf <-> SDK dataclasses, shared by the sync and asyncio clients."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format, struct_pb2

from kakeya._proto import runtime_pb2 as pb
from kakeya.errors import InvalidArgument
from kakeya.types import (
    FinishReason,
    GenerateResult,
    GenerateStats,
    KvPolicy,
    ModelInfo,
    SessionInfo,
    SparseStats,
    Speculation,
)

_FINISH = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}


def token_list(ids: Iterable[int], what: str) -> list[int]:
    """Token ids as ints: Python or NumPy integers; floats, strings and bools are refused, never truncated."""
    try:
        out = [_token(t) for t in ids]
    except TypeError as e:
        raise InvalidArgument(f"{what} must be an iterable of integer token ids: {e}") from None
    if any(not -(2**31) <= t < 2**31 for t in out):
        raise InvalidArgument(f"{what}: token ids must fit in int32")
    return out


def _token(t: Any) -> int:
    if isinstance(t, bool):
        raise TypeError(f"{t!r} is a bool")
    return operator.index(t)  # int, numpy integers; not 2.5, "7"


def flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be True or False, not {value!r}")
    return value


def session_id(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"a session id is a string, not {type(value).__name__}")
    return value


def policy_pb(policy: KvPolicy | str | None) -> pb.KvPolicy | None:
    if policy is None:
        return None
    if isinstance(policy, str):
        policy = KvPolicy(policy)
    if not isinstance(policy, KvPolicy):
        raise InvalidArgument(f"policy must be a KvPolicy or a policy name, not {type(policy).__name__}")
    params = struct_pb2.Struct()
    try:
        params.update(dict(policy.params))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"policy params must be JSON-like: {e}") from None
    return pb.KvPolicy(name=str(policy.name), params=params)


def policy_from_pb(p: pb.KvPolicy) -> KvPolicy:
    params: Mapping[str, Any] = json_format.MessageToDict(p.params) if p.HasField("params") else {}
    return KvPolicy(p.name, {k: _int_if_whole(v) for k, v in params.items()})


def _int_if_whole(v: Any) -> Any:
    """Struct numbers are doubles: give integral ones back as ints ({"window": 1024}, not 1024.0)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def speculation_pb(speculation: Speculation | str | None) -> pb.Speculation | None:
    """None: unset (Generate: the session default; CreateSession: off); a str names the proposer ("off" too)."""
    if speculation is None:
        return None
    if isinstance(speculation, str):
        speculation = Speculation(speculation)
    if not isinstance(speculation, Speculation):
        raise InvalidArgument(f"speculation must be a Speculation or a proposer name, not {type(speculation).__name__}")
    try:
        return pb.Speculation(proposer=str(speculation.proposer), max_draft_tokens=int(speculation.max_draft_tokens))
    except (TypeError, ValueError) as e:  # e.g. a negative max_draft_tokens
        raise InvalidArgument(f"bad speculation: {e}") from None


def create_request(initial_tokens: Iterable[int] | None, policy: KvPolicy | str | None,
                   speculation: Speculation | str | None = None) -> pb.CreateSessionRequest:
    initial = () if initial_tokens is None else initial_tokens  # not `or`: an array has no truth value
    return pb.CreateSessionRequest(initial_token_ids=token_list(initial, "initial_tokens"),
                                   policy=policy_pb(policy), speculation=speculation_pb(speculation))


def generate_request(session_id: str, *, max_tokens: int, seed: int | None, temperature: float, top_k: int,
                     top_p: float | None, stop_tokens: Iterable[int], ignore_eos: bool,
                     stop: str | Iterable[str] | None = (),
                     speculation: Speculation | str | None = None) -> pb.GenerateRequest:
    try:  # one string is one stop string, not its characters; None is none, as for the other options
        stops = [stop] if isinstance(stop, str) else [] if stop is None else list(stop)
    except TypeError:  # not iterable (stop=5)
        stops = [stop]
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or an iterable of strings")
    spec = speculation_pb(speculation)
    try:
        sampling = pb.SamplingParams(temperature=float(temperature), top_k=int(top_k))
        if top_p is not None:
            sampling.top_p = float(top_p)
        if seed is not None:
            sampling.seed = int(seed)
        return pb.GenerateRequest(session_id=session_id, max_tokens=int(max_tokens), sampling=sampling,
                                  stop_token_ids=token_list(stop_tokens, "stop_tokens"), ignore_eos=ignore_eos,
                                  stop=stops, speculation=spec)
    except (TypeError, ValueError) as e:  # e.g. a negative seed or max_tokens beyond int32
        raise InvalidArgument(f"bad generate parameters: {e}") from None


def stats_from_pb(s: pb.GenerateStats) -> GenerateStats:
    return GenerateStats(
        prefill_tokens=s.prefill_tokens,
        prefill_s=s.prefill_seconds,
        ttft_s=s.ttft_seconds,
        decode_s=s.decode_seconds,
        decode_tokens=s.decode_tokens,
        decode_tokens_per_s=s.decode_tokens_per_second,
        queue_s=s.queue_seconds,
        resume_s=s.resume_seconds,
        speculation=s.speculation_proposer,
        draft_tokens=s.draft_tokens,
        accepted_draft_tokens=s.accepted_draft_tokens,
        acceptance_rate=s.acceptance_rate,
        tokens_per_verifier_step=s.tokens_per_verifier_step,
        verifier_steps=s.verifier_steps,
        speculation_pauses=s.speculation_pauses,
    )


def result_from_pb(done: pb.GenerateDone, tokens: list[int]) -> GenerateResult:
    return GenerateResult(tuple(tokens), _FINISH.get(done.finish_reason, FinishReason.UNSPECIFIED),
                          stats_from_pb(done.stats), done.history_length, done.stop_string or None)


def session_info_from_pb(r: pb.GetSessionInfoResponse, with_history: bool) -> SessionInfo:
    inv = r.invariants
    return SessionInfo(
        session_id=r.session_id,
        history_length=r.history_length,
        cached_length=r.cached_length,
        kv_live_bytes=r.kv_live_bytes,
        policy=policy_from_pb(r.policy),
        inv1_checks=inv.inv1_checks,
        inv2_checks=inv.inv2_checks,
        inv1_violations=inv.inv1_violations,
        inv2_violations=inv.inv2_violations,
        generate_calls=r.generate_calls,
        idle_s=r.idle_seconds,
        context_length=r.context_length,
        generating=r.generating,
        history_token_ids=tuple(r.history_token_ids) if with_history else None,
        policy_label=r.policy_label,
        kv_resident_bytes=r.kv_resident_bytes,
        kv_history_bytes=r.kv_history_bytes,
        effective_attention_fraction=r.effective_attention_fraction or 1.0,  # unset (older servers): full
        kv_compressed=r.kv_compressed,
        idle_compressions=r.idle_compressions,
        sparse=_sparse_from_pb(r.sparse) if r.HasField("sparse") else None,
        speculation=Speculation(r.speculation.proposer, r.speculation.max_draft_tokens)
        if r.HasField("speculation") else None,
    )


_SPARSE_FIELDS = ("steps", "queries", "blocks_scored", "blocks_selected", "positions_attended", "positions_visible")


def _sparse_from_pb(r: pb.SparseStats) -> SparseStats:
    counters = lambda c: {f: getattr(c, f) for f in _SPARSE_FIELDS}  # noqa: E731
    return SparseStats(total=counters(r.total), layers=tuple(counters(x) for x in r.layers), hot_bytes=r.hot_bytes,
                       cold_bytes=r.cold_bytes, index_bytes=r.index_bytes)


def model_info_from_pb(r: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=r.model_name,
        model_type=r.model_type,
        vocab_size=r.vocab_size,
        eos_token_ids=tuple(r.eos_token_ids),
        bos_token_id=r.bos_token_id if r.HasField("bos_token_id") else None,
        context_length=r.context_length,
        tokenizer_json=r.tokenizer_json,
        chat_template=r.chat_template if r.HasField("chat_template") else None,
        max_sessions=r.max_sessions,
        max_concurrent=r.max_concurrent,
        session_idle_ttl_s=r.session_idle_ttl_seconds,
        kv_policies=tuple(r.kv_policies),
        idle_compress_after_s=r.idle_compress_after_seconds or None,
        idle_codec=r.idle_codec or None,
        weight_format=r.weight_format,
        weight_format_source=r.weight_format_source,
        compiled_decode=r.compiled_decode,
        fidelity_kl=r.fidelity_kl if r.HasField("fidelity_kl") else None,
        fidelity_top1=r.fidelity_top1 if r.HasField("fidelity_top1") else None,
        invariant_numerics=r.invariant_numerics,
        measured_decode_tok_s=r.measured_decode_tokens_per_second or None,
        max_sessions_per_key=r.max_sessions_per_key or None,
        kv_budget_bytes=r.kv_budget_bytes or None,
        kv_budget_per_key_bytes=r.kv_budget_per_key_bytes or None,
        runtime_version=r.runtime_version or None,
    )


# Gemma 3's tokenizer.json is ~33 MB; the default 4 MB receive limit would refuse GetModelInfo.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The key as gRPC metadata; checked here, since gRPC would refuse the call with an opaque INTERNAL."""
    if api_key is None or api_key == "":
        return ()
    if not isinstance(api_key, str) or not (api_key.isascii() and api_key.isprintable()) or api_key != api_key.strip():
        raise InvalidArgument("api_key must be a string of printable ASCII characters without surrounding spaces")
    return (("authorization", f"Bearer {api_key}"),)


ARCHIVE_CHUNK_BYTES = 512 * 1024  # ImportSession's chunks stay under any server's receive limit


def archive_bytes(archive: bytes | str | os.PathLike[str]) -> bytes:
    """An archive given as bytes or as the path of a file Session.export wrote."""
    if isinstance(archive, bytes | bytearray | memoryview):
        return bytes(archive)
    return Path(archive).read_bytes()


def archive_chunks(data: bytes, load_kv: bool = True) -> Iterator[pb.ImportSessionRequest]:
    """The ImportSession request stream (`load_kv` checked now, before any call)."""
    flag(load_kv, "load_kv")
    return (pb.ImportSessionRequest(data=data[at : at + ARCHIVE_CHUNK_BYTES], ignore_kv=not load_kv)
            for at in range(0, max(len(data), 1), ARCHIVE_CHUNK_BYTES))


def save_archive(data: bytes, path: str | os.PathLike[str] | None) -> None:
    if path is not None:
        Path(path).write_bytes(data)
