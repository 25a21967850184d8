"""The checkpoint-memory harness: the callback's measurement on a fake save, then one real 2-process run.

Memory growth is never asserted against a budget here; the harness measures it (``python -m
lightning_app_rlhf.bench checkpoint``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_app_rlhf.bench.checkpoint_memory import CheckpointMemory, read_records, reset_peak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
BLOCK = 64 * 2**20


class FakeTrainer:
    """Just what the callback touches: the rank, the step, and a save that holds ``BLOCK`` bytes for a while."""

    global_rank = 0
    global_step = 3

    def save_checkpoint(self, filepath: str, weights_only: bool | None = None, storage_options: Any = None) -> None:
        block = bytearray(BLOCK)  # zero-filled: every page is touched, so all of it is resident
        time.sleep(0.05)  # long enough for the 2 ms sampler
        Path(filepath).write_bytes(b"x" * 1000)
        del block


@pytest.mark.parametrize("force_sampling", [False, True], ids=["clear_refs", "sampling"])
def test_callback_sees_the_peak_inside_the_save(tmp_path, force_sampling):
    if not force_sampling and not reset_peak():
        pytest.skip("/proc/self/clear_refs cannot reset VmHWM here")
    callback, trainer = CheckpointMemory(str(tmp_path / "memory"), force_sampling=force_sampling), FakeTrainer()
    callback.on_train_start(trainer, None)
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"), False)
    callback.teardown(trainer, None, "fit")
    assert "save_checkpoint" not in vars(trainer)  # the class's method again

    (record,) = read_records(tmp_path / "memory")
    assert record["method"] == ("sampling" if force_sampling else "clear_refs")
    (save,) = record["saves"]
    assert save["rank"] == 0 and save["step"] == 3 and save["file_bytes"] == 1000
    assert save["peak_rss_bytes"] - save["steady_rss_bytes"] > 0.9 * BLOCK
    assert 0.05 <= save["seconds"] < 5


@pytest.mark.slow  # a benchmark entry's smoke run, like the TRL one
def test_checkpoint_subcommand_records_every_save_on_every_rank(tmp_path, monkeypatch):
    from lightning_app_rlhf.bench.__main__ import checkpoint_memory

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "out"
    (row,) = checkpoint_memory(presets=["tiny"], devices=[2], strategies=["rlhf_flattening"], steps=2, every=1,
                               batch_size=8, new_tokens=4, keep_checkpoints=True, out=str(out))
    assert row["settings"]["placement"] == "flattening" and row["strategy"] == "rlhf_flattening"

    records = row["records"]
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert [save["step"] for save in record["saves"]] == [1, 2]  # one record per rank per save
        for save in record["saves"]:
            assert save["steady_rss_bytes"] > 2**20
            assert save["peak_rss_bytes"] >= 0.9 * save["steady_rss_bytes"]
            assert save["seconds"] > 0
    for save in records[0]["saves"]:  # rank 0 wrote the file and measured it
        assert save["file_bytes"] > 0 and save["file_bytes"] == os.path.getsize(save["path"])
    assert all("file_bytes" not in save for save in records[1]["saves"])
    assert [c["bytes"] for c in row["checkpoints"]] == [s["file_bytes"] for s in records[0]["saves"]]

    summary = row["ranks"]
    assert [rank["rank"] for rank in summary] == [0, 1] and all(rank["saves"] == 2 for rank in summary)
    for rank, record in zip(summary, records):
        ratios = [s["peak_rss_bytes"] / s["steady_rss_bytes"] for s in record["saves"]]
        assert rank["peak_over_steady"] == pytest.approx(max(ratios))
        assert rank["peak_over_steady"] == pytest.approx(rank["peak_rss_bytes"] / rank["steady_rss_bytes"])
    assert summary[0]["file_bytes"] == records[0]["saves"][-1]["file_bytes"]

    saved = json.loads((out / "checkpoint.json").read_text())
    assert {"cpu", "cores", "torch"} <= set(saved["machine"]) and len(saved["checkpoint"]) == 1
    table = (out / "checkpoint.md").read_text()
    assert "| preset | processes | placement | rank | steady MiB | peak during save MiB |" in table
    rows = [line for line in table.splitlines() if line.startswith("| tiny | 2 | flattening |")]
    assert [line.split("|")[4].strip() for line in rows] == ["0", "1"]  # a row per rank


def test_unknown_strategy_names_the_choices(tmp_path):
    from lightning_app_rlhf.bench.__main__ import checkpoint_memory

    with pytest.raises(ValueError, match="rlhf_interleaving"):
        checkpoint_memory(strategies=["rlhf_sharding"], out=str(tmp_path))
    with pytest.raises(ValueError, match="every"):
        checkpoint_memory(steps=2, every=3, out=str(tmp_path))
