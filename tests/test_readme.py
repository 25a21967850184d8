"""The README's "Your own task" section runs as printed: its JSONL line, its reward file and its command, in a
fresh folder (with the repository's ``examples/`` beside them, as in a clone)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, one_thread_env, output_tail


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_your_own_task_runs_as_the_readme_prints_it(tmp_path):
    section = _section("Your own task")
    (line,) = [b.strip() for b in _blocks(section, "json")]
    (reward,) = _blocks(section, "python")
    (command,) = _blocks(section, "bash")
    (tmp_path / "prompts.jsonl").write_text((line + "\n") * 8)  # a batch of rows, as the section asks
    (tmp_path / "my_reward.py").write_text(reward)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    command = command.replace("python3 ", f"{sys.executable} ", 1)
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=one_thread_env())
    assert result.returncode == 0, output_tail(result)
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("reward/mean")]
    assert len(rows) == 20
    assert all(0.0 <= float(row["reward/mean"]) <= 1.0 for row in rows)  # the reward's own scale: it was called
