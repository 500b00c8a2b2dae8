"""sessions.snapshot's checkpoint ids: a checkpoint is its files' contents, whatever name or path serves it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kakeya_runtime.sessions.snapshot import checkpoint_id, compared_checkpoints


def _same(ours: str, theirs: str) -> bool:
    a, b = compared_checkpoints(ours, theirs, "")
    return a == b


def test_the_same_file_by_another_name_or_path_is_the_same_checkpoint(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = tmp_path / "a" / "model.gguf"
    first.write_bytes(os.urandom(1 << 20))
    renamed = tmp_path / "b" / "copy.gguf"
    shutil.copyfile(first, renamed)
    bundled, by_path = checkpoint_id("gemma3-270m", first), checkpoint_id(str(renamed), renamed)
    assert bundled.startswith("gemma3-270m#") and _same(bundled, by_path)  # once refused: name and file name hashed
    data = bytearray(renamed.read_bytes())
    data[-10] ^= 1
    renamed.write_bytes(bytes(data))
    assert not _same(bundled, checkpoint_id("gemma3-270m", renamed))  # other bytes: another checkpoint


def test_a_directory_checkpoint_and_ids_written_before_content_only_ids(tmp_path: Path):
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(4096))
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    assert _same(checkpoint_id(str(model), model), checkpoint_id("other", moved))
    ours = checkpoint_id("smollm2", model)
    assert _same(ours, "smollm2@0123456789abcdef")  # a named id of the previous form: matched by model name
    assert _same(checkpoint_id("/a#b/m.gguf", model), checkpoint_id("x", model))  # a "#" in a name is a name
    assert not _same(ours, "gemma3-270m@0123456789abcdef")
