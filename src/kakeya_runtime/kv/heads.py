"""Per-head profiles for the sparse policy (the DuoAttention / RazorAttention idea): each KV head of each governed
layer is `streaming` (sinks and its hot window only: no cold tier, nothing stored for it), `sparse` (the top-k
cold blocks) or `dense` (every cold block: heads whose attention the top-k does not capture).

`kakeya calibrate heads` (kakeya_runtime.bench.heads) measures the modes on synthetic passkey prompts and writes a
profile; the policy loads it by model (`heads=profile`), found by the model's architecture fingerprint in the
user's cache dir (heads/) and then among the profiles shipped with the package (kv/profiles/).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kakeya_runtime.models.config import ModelConfig

SCHEMA = "kakeya.heads"
SCHEMA_VERSION = 1
MODES = ("streaming", "sparse", "dense")
DIGEST_CHARS = 12
SHIPPED = Path(__file__).parent / "profiles"


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

    def head_topk(self, layer: int, topk: int, all_blocks: int) -> tuple[int, ...]:
        """Blocks each KV head keeps at `layer`: 0 streaming, topk sparse, all_blocks dense."""
        if layer not in self.layers:
            raise HeadProfileError(f"the head profile has no entry for layer {layer}")
        return tuple({"streaming": 0, "sparse": topk, "dense": all_blocks}[m] for m in self.layers[layer])

    @property
    def digest(self) -> str:
        """What a session built with this profile records (policy param heads=profile:<digest>): the same modes, the
        same digest, so a session is never rebuilt on another profile's modes unnoticed."""
        text = json.dumps({"fingerprint": self.fingerprint, "modes": {str(k): list(v) for k, v in
                                                                      sorted(self.layers.items())}}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]

    @classmethod
    def from_json(cls, data: dict) -> HeadProfile:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
            raise HeadProfileError(f"not a {SCHEMA} v{SCHEMA_VERSION} profile")
        try:
            layers = {int(k): tuple(v) for k, v in data["modes"].items()}
            fp = str(data["fingerprint"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HeadProfileError(f"a damaged {SCHEMA} profile ({type(e).__name__}: {e})") from None
        bad = sorted({m for modes in layers.values() for m in modes} - set(MODES))
        if bad:
            raise HeadProfileError(f"unknown head modes {bad} (known: {', '.join(MODES)})")
        return cls(fp, layers)


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
    path = profile_path(config)
    if path is None:
        raise HeadProfileError(f"no head profile for this model ({fingerprint(config)}); run `kakeya calibrate heads "
                               "--model ...` first, or use heads=all")
    try:
        profile = HeadProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as e:  # HeadProfileError is a ValueError: say which file
        raise HeadProfileError(f"{path}: {e}; run `kakeya calibrate heads` again or delete it") from None
    if profile.fingerprint != fingerprint(config):
        raise HeadProfileError(f"{path} is for {profile.fingerprint}, not {fingerprint(config)}")
    for layer, modes in profile.layers.items():
        if len(modes) != config.num_key_value_heads:
            raise HeadProfileError(f"{path}: layer {layer} has {len(modes)} heads, the model "
                                   f"{config.num_key_value_heads}")
    return profile
