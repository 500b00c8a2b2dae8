"""Per-head profiles for the sparse policy (the DuoAttention / RazorAttention idea): each KV head of each governed
layer is `streaming` (sinks and its hot window only: no cold tier, nothing stored for it), `sparse` (the top-k
cold blocks) or `dense` (every cold block: heads whose attention the top-k does not capture). A profile may also
give each sparse head its own block count (`blocks`, fitted by the calibration: topk at least, more for heads whose
attention is spread); the policy's budget then grows each head's count in proportion as the history grows.

`kakeya calibrate heads` (kakeya_runtime.bench.heads) measures the modes on synthetic passkey prompts and writes a
profile; the policy loads it by model (`heads=profile`), found by the model's architecture fingerprint in the
user's cache dir (heads/) and then among the profiles shipped with the package (kv/profiles/). A session binds the
profile it was created with by digest, and a copy of that profile is kept under heads/bound/, so a recalibration
leaves the sessions made before it as they were (a restart, an import or a rebuilt cache finds their modes there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kakeya_runtime.models.config import ModelConfig

SCHEMA = "kakeya.heads"
SCHEMA_VERSION = 1
MODES = ("streaming", "sparse", "dense")
DIGEST_CHARS = 12
SHIPPED = Path(__file__).parent / "profiles"
SIZES = ("sink", "window", "block", "topk")  # the policy sizes a profile is measured for (its settings)

_log = logging.getLogger(__name__)


class HeadProfileError(ValueError):
    """No profile for this model, or one that does not fit it."""


def fingerprint(config: ModelConfig) -> str:
    """The architecture a profile belongs to (the weights' shapes and attention layout, not their values)."""
    key = (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
           config.head_dim, config.hidden_size, config.vocab_size, tuple(config.layer_types))
    return f"{config.model_type}-{hashlib.sha256(repr(key).encode()).hexdigest()[:12]}"


@dataclass(slots=True, frozen=True)
class HeadProfile:
    fingerprint: str
    layers: dict[int, tuple[str, ...]]  # governed layer index -> one mode per KV head
    sizes: dict[str, int] = field(default_factory=dict)  # SIZES it was measured for
    # governed layer index -> blocks per KV head (sparse heads >= 1, the others 0); None: every sparse head keeps topk
    blocks: dict[int, tuple[int, ...]] | None = None
    text: str = field(default="", compare=False)  # the file it was read from, as kept for bound sessions

    def head_topk(self, layer: int, topk: int, all_blocks: int) -> tuple[int, ...]:
        """Blocks each KV head keeps at `layer`: 0 streaming, all_blocks dense, a sparse head its fitted count
        (`blocks`) or topk."""
        if layer not in self.layers:
            raise HeadProfileError(f"the head profile has no entry for layer {layer}")
        counts = self.blocks[layer] if self.blocks is not None else (topk,) * len(self.layers[layer])
        return tuple({"streaming": 0, "sparse": k, "dense": all_blocks}[m]
                     for m, k in zip(self.layers[layer], counts, strict=True))

    @property
    def digest(self) -> str:
        """What a session built with this profile records (policy param heads=profile:<digest>): the same modes
        measured for the same sizes, the same digest, so a session is never rebuilt on another profile unnoticed."""
        blocks = {} if self.blocks is None else {"blocks": {str(k): list(v) for k, v in sorted(self.blocks.items())}}
        return self._digest_of({"sizes": self.sizes, **blocks})

    @property
    def legacy_digest(self) -> str:
        """The digest sessions recorded before it covered the sizes (modes alone)."""
        return self._digest_of({})

    def _digest_of(self, extra: dict) -> str:
        modes = {str(k): list(v) for k, v in sorted(self.layers.items())}
        text = json.dumps({"fingerprint": self.fingerprint, "modes": modes, **extra}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]

    @classmethod
    def from_json(cls, data: dict, text: str = "") -> HeadProfile:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
            raise HeadProfileError(f"not a {SCHEMA} v{SCHEMA_VERSION} profile")
        modes, settings = data.get("modes"), data.get("settings")
        if not isinstance(modes, dict) or not all(isinstance(v, list) for v in modes.values()):
            raise HeadProfileError("a damaged profile: `modes` must map each layer to a list of head modes")
        if not all(isinstance(k, str) and k.isascii() and k.isdigit() for k in modes):
            raise HeadProfileError(f"a damaged profile: layer keys must be layer numbers, got {sorted(map(repr, modes))}")
        bad = sorted({repr(m) for v in modes.values() for m in v if not isinstance(m, str) or m not in MODES})
        if bad:
            raise HeadProfileError(f"unknown head modes {', '.join(bad)} (known: {', '.join(MODES)})")
        if not isinstance(settings, dict) or not all(type(settings.get(k)) is int for k in SIZES):
            raise HeadProfileError(f"a damaged profile: its settings must record the {', '.join(SIZES)} it was "
                                   "measured for")
        if not isinstance(data.get("fingerprint"), str):
            raise HeadProfileError("a damaged profile: no model fingerprint")
        layers = {int(k): tuple(v) for k, v in modes.items()}
        return cls(data["fingerprint"], layers, {k: settings[k] for k in SIZES}, _blocks(data.get("blocks"), modes),
                   text)


def _blocks(blocks, modes: dict[str, list[str]]) -> dict[int, tuple[int, ...]] | None:
    """A profile's per-head block counts, checked against its modes (None when it has none)."""
    if blocks is None:
        return None
    if not isinstance(blocks, dict) or set(blocks) != set(modes) or not all(
            isinstance(v, list) and len(v) == len(modes[k]) and all(type(c) is int for c in v)
            for k, v in blocks.items()):
        raise HeadProfileError("a damaged profile: `blocks` must give every layer of `modes` one count per head")
    for k, counts in blocks.items():
        for h, (mode, c) in enumerate(zip(modes[k], counts, strict=True)):
            if (c >= 1) != (mode == "sparse") or c < 0:
                raise HeadProfileError(f"a damaged profile: layer {k} head {h} is {mode} with {c} blocks (a sparse "
                                       "head keeps at least one, the others none)")
    return {int(k): tuple(v) for k, v in blocks.items()}


def user_dir() -> Path:
    from kakeya_runtime.models.loader import cache_root

    return cache_root() / "heads"


def profile_path(config: ModelConfig) -> Path | None:
    """The profile for this model: the user's own calibration first, then the shipped one."""
    name = f"{fingerprint(config)}.json"
    for folder in (user_dir(), SHIPPED):
        if (folder / name).exists():
            return folder / name
    return None


def load_profile(config: ModelConfig) -> HeadProfile:
    """The model's current profile (the user's calibration, else the shipped one)."""
    path = profile_path(config)
    if path is None:
        raise HeadProfileError(f"no head profile for this model ({fingerprint(config)}); run `kakeya calibrate heads "
                               "--model ...` first, or use heads=all")
    return _read(path, config)


def _read(path: Path, config: ModelConfig) -> HeadProfile:
    try:
        text = path.read_text()
        profile = HeadProfile.from_json(json.loads(text), text)
    except (OSError, ValueError) as e:  # HeadProfileError is a ValueError: say which file
        raise HeadProfileError(f"{path}: {e}; run `kakeya calibrate heads` again or delete it") from None
    if profile.fingerprint != fingerprint(config):
        raise HeadProfileError(f"{path} is for {profile.fingerprint}, not {fingerprint(config)}")
    for layer, modes in profile.layers.items():
        if len(modes) != config.num_key_value_heads:
            raise HeadProfileError(f"{path}: layer {layer} has {len(modes)} heads, the model "
                                   f"{config.num_key_value_heads}")
    return profile


def _bound_path(config: ModelConfig, digest: str) -> Path:
    return user_dir() / "bound" / f"{fingerprint(config)}-{digest}.json"


def keep_bound(config: ModelConfig, profile: HeadProfile) -> None:
    """Keep a copy of a profile a session is bound to (once per digest; never removed: sessions and archives outlive
    calibrations). A cache dir that cannot be written only loses that: the session then needs the current file."""
    path = _bound_path(config, profile.digest)
    try:
        if load_bound(config, profile.digest) is not None:
            return
    except HeadProfileError:
        pass  # a damaged copy is replaced by this one, which has its digest
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(profile.text)
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("could not keep a copy of head profile %s (%s): sessions bound to it need the current profile "
                     "file to stay as it is", profile.digest, e)


def load_bound(config: ModelConfig, digest: str) -> HeadProfile | None:
    """The kept copy of the profile with this digest, if there is one and it still has that digest."""
    path = _bound_path(config, digest)
    if not path.exists():
        return None
    profile = _read(path, config)
    return profile if digest in (profile.digest, profile.legacy_digest) else None
