"""The compiled static decoder on the CPU with the attention on SDPA's flash kernel or on its math backend.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/decode_attention.py --presets tiny small llama-small

One sampling call of ``generation.backend: static`` with ``compile: true`` on random-init models of ``bench decode``
(32 rows, prompts of 8 to 16 tokens, 32 new tokens, no stop token), one thread, float32. ``flash``: the decode step
as compiled before this change, whose attention Inductor calls as the CPU flash-attention kernel; ``math``: the
decoder now, whose compiled step runs SDPA's math backend, which Inductor fuses (see ``generation/static.py``,
``_decode_step_with_math_attention``). Each form decodes with its own copy of the model (its own compiled graph);
they take turns call by call (each first in half the pairs), and the table gives the median milliseconds per call, the median of the per-pair
ratios (the machine's noise moves both calls of a pair alike), and whether both sample the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from lightning_app_rlhf.bench.decode import build_model, prompts
from lightning_app_rlhf.core.config import GenerationConfig
from lightning_app_rlhf.generation import generate, sample_keys, static

ROWS, PROMPT, NEW_TOKENS = 32, 16, 32


def measure(preset: str, repeats: int) -> dict[str, float | bool]:
    flash_model = build_model(preset, "cpu", torch.float32)
    math_model = build_model(preset, "cpu", torch.float32)  # seeded: the same weights
    ids, mask = prompts(ROWS, PROMPT, flash_model.config.vocab_size, "cpu")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, backend="static", compile=True)
    keys = sample_keys(0, 0, torch.arange(ROWS))
    flash_step = mock.patch.object(static, "_step_function", lambda *args: static._decode_step)
    seconds: dict[str, list[float]] = {"flash": [], "math": []}
    rollouts = {}
    for repeat in range(repeats + 2):  # the first two pairs compile and warm up
        order = (("flash", flash_model), ("math", math_model))
        for name, model in order if repeat % 2 else order[::-1]:  # each goes first in half the pairs
            with flash_step if name == "flash" else contextlib.nullcontext():
                start = time.perf_counter()
                rollout = generate(model, ids, mask, config, keys, eos_token_id=[], pad_token_id=0,
                                   inference_mode=True)
                elapsed = time.perf_counter() - start
            rollouts[name] = rollout
            if repeat >= 2:
                seconds[name].append(elapsed)
    flash, math = seconds["flash"], seconds["math"]
    return {"flash_ms": 1000 * statistics.median(flash), "math_ms": 1000 * statistics.median(math),
            "ratio": statistics.median(m / f for m, f in zip(math, flash)),
            "same_tokens": torch.equal(rollouts["flash"].sequences, rollouts["math"].sequences),
            "logprob_gap": (rollouts["flash"].logprobs - rollouts["math"].logprobs).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small", "llama-small"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | flash ms | math ms | math / flash (median of pairs) | same tokens | largest log-prob gap |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for preset in args.presets:
        row = measure(preset, args.repeats)
        print(f"| {preset} | {row['flash_ms']:.1f} | {row['math_ms']:.1f} | {row['ratio']:.3f} | "
              f"{'yes' if row['same_tokens'] else 'NO'} | {row['logprob_gap']:.1e} |")


if __name__ == "__main__":
    main()
