"""The planner's profile cache: atomic writes, and damaged cache files ignored with a warning and re-measured."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import warnings
from pathlib import Path

import pytest

from lightning_app_rlhf.core.files import write_atomically
from lightning_app_rlhf.planner import Workload, profile_workload, role_shape
from lightning_app_rlhf.planner.cluster import DEVICE_TYPES
from lightning_app_rlhf.planner.profiler import (
    Profile,
    ProfileFileError,
    _load_cached,
    cache_path,
)

# The smallest GPT-2 the profiler runs: one layer, h=32, so a measurement takes well under a second.
TINY = {
    "model_type": "gpt2",
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 128,
    "n_positions": 32,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_workload() -> Workload:
    """A critic-free workload: one shape (actor = reference), so one cache file."""
    actor = role_shape(TINY)
    return Workload(actor=actor, critic=None, reference=actor, reward=None, batch_size=2, prompt_length=4,
                    generation_length=4, num_samples=2, algorithm="grpo")


def profile(workload: Workload, cache_dir: Path) -> Profile:
    # Known device ceilings: only the per-shape measurements (the cached part) are under test.
    return profile_workload(workload, batches=(1, 2), repeats=1, cache_dir=cache_dir, device=DEVICE_TYPES["cpu"])


def grid(points: list[list[float]]) -> list[tuple[float, float]]:
    """The (batch, length) points measured, without the times."""
    return sorted((b, n) for b, n, _ in points)


def test_truncated_cache_file_warns_naming_it_is_remeasured_and_rewritten(tmp_path):
    workload = tiny_workload()
    key = workload.actor.key
    first = profile(workload, tmp_path)
    path = cache_path(workload.actor, workload, tmp_path)
    assert list((tmp_path / "profiles").iterdir()) == [path]  # one shape, one file, no temporary left behind
    assert Profile.load(path).ops == {key: first.ops[key]}

    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # what a killed non-atomic write left behind
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())

    with pytest.warns(UserWarning, match=re.escape(str(path))) as record:
        again = profile(workload, tmp_path)
    message = str(next(w.message for w in record if str(path) in str(w.message)))
    assert "re-measured" in message and "not valid JSON" in message and str(path.parent) in message

    # A fresh measurement of the same ops over the same grid, with positive times.
    assert set(again.ops) == set(first.ops) == {key}
    assert set(again.ops[key]) == set(first.ops[key]) == {"forward", "train", "prefill", "decode", "optimizer"}
    for op, points in again.ops[key].items():
        assert grid(points) == grid(first.ops[key][op])
        assert all(seconds > 0 for _, _, seconds in points)

    # The file is whole again, holds exactly the new measurement, and the next run reads it without a warning.
    assert json.loads(path.read_text())["ops"] == {key: again.ops[key]}
    assert list((tmp_path / "profiles").iterdir()) == [path]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = profile(workload, tmp_path)
    assert third.ops[key] == again.ops[key]  # read back, not measured a third time


DAMAGED = {
    "empty": b"",
    "truncated": b'{"hardware": "cpu", "device": null, "ops": {"a": {"forward": [[1, 4, 0.',
    "binary": b"\xff\xfe\x00garbage",
    "not an object": b"[1, 2, 3]",
    "missing ops": b'{"hardware": "cpu", "device": null}',
    "hardware not a string": b'{"hardware": 3, "device": null, "ops": {}}',
    "device missing fields": b'{"hardware": "cpu", "device": {"name": "cpu"}, "ops": {}}',
    "ops not an object": b'{"hardware": "cpu", "device": null, "ops": [1]}',
    "point of two numbers": b'{"hardware": "cpu", "device": null, "ops": {"a": {"forward": [[1, 4]]}}}',
    "point with a string": b'{"hardware": "cpu", "device": null, "ops": {"a": {"forward": [[1, 4, "x"]]}}}',
    "no points": b'{"hardware": "cpu", "device": null, "ops": {"a": {"forward": []}}}',
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED.keys())
def test_damaged_file_raises_naming_it_when_loaded_and_is_skipped_when_cached(tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    # A file the user names: a clear error that names it (no silent re-measuring).
    with pytest.raises(ProfileFileError, match=re.escape(str(path))) as error:
        Profile.load(path)
    assert isinstance(error.value, ValueError) and error.value.path == path
    # The same file in the cache: a warning that names it, and no profile (the caller measures again).
    with pytest.warns(UserWarning, match=re.escape(str(path)) + r".*re-measured"):
        assert _load_cached(path) is None


def test_profile_saves_and_loads_back(tmp_path):
    saved = Profile("cpu | threads=1", DEVICE_TYPES["cpu"], {"a": {"forward": [[1, 4, 0.5], [2, 4, 0.75]]}})
    path = tmp_path / "nested" / "profile.json"  # the directory is created
    saved.save(path)
    assert Profile.load(path) == saved
    assert os.listdir(path.parent) == ["profile.json"]


def write_json_atomically(path, data) -> None:
    """JSON streamed through :func:`write_atomically`, so a failure can stop it half-way through the file."""

    def write(file) -> None:
        text = io.TextIOWrapper(file, encoding="utf-8")
        json.dump(data, text)
        text.flush()
        text.detach()  # leave the binary file open for write_atomically

    write_atomically(path, write)


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "data.json"
    write_json_atomically(path, {"a": 1})
    write_json_atomically(path, {"a": 2, "b": [1.5, None]})
    assert json.loads(path.read_text()) == {"a": 2, "b": [1.5, None]}
    assert os.listdir(tmp_path) == ["data.json"]
    # Created with the umask applied, like an ordinary write (not mkstemp's 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_atomic_write_that_fails_midway_keeps_the_previous_file(tmp_path):
    path = tmp_path / "data.json"
    write_json_atomically(path, {"a": 1})
    before = path.read_bytes()
    # json encodes "a" and its list before it meets the object: the temporary file holds a partial document.
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomically(path, {"a": [1, 2, 3], "b": object()})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["data.json"]

    # No previous file: none is created.
    with pytest.raises(TypeError):
        write_json_atomically(tmp_path / "new.json", {"b": object()})
    assert os.listdir(tmp_path) == ["data.json"]


def test_atomic_write_that_fails_to_replace_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "data.json"
    write_json_atomically(path, {"a": 1})

    def fail(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk gone"):
        write_json_atomically(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["data.json"]
