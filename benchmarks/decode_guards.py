"""The compiled static decoder on the CPU with and without Dynamo's guards re-checked at every token.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/decode_guards.py --presets tiny small

One sampling call of ``generation.backend: static`` with ``compile: true`` on the harness's random-init GPT-2 presets
(``bench grpo``'s shape: 32 rows, prompts of 8 to 16 tokens, 32 new tokens, no stop token), one thread, float32.
``every step``: each step's call of the compiled step evaluates all of Dynamo's guards (the decoder before this
change); ``first step``: the decoder now, where the steps after the first skip the guards that cannot fail
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, see ``generation/static.py``). The two take turns call
by call; the table gives the median milliseconds per call and the median of the per-pair ratios (the machine's
noise moves both calls of a pair alike), and checks that both sample the same tokens.
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
    model = build_model(preset, "cpu", torch.float32)
    ids, mask = prompts(ROWS, PROMPT, model.config.vocab_size, "cpu")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, backend="static", compile=True)
    keys = sample_keys(0, 0, torch.arange(ROWS))
    every_step = mock.patch.object(static, "_guards_checked_by_the_first_step", contextlib.nullcontext)
    seconds: dict[str, list[float]] = {"every step": [], "first step": []}
    sequences = {}
    with torch.no_grad():
        for repeat in range(repeats + 2):  # the first two pairs compile and warm up
            for name in seconds:
                with every_step if name == "every step" else contextlib.nullcontext():
                    start = time.perf_counter()
                    rollout = generate(model, ids, mask, config, keys, eos_token_id=[], pad_token_id=0)
                    elapsed = time.perf_counter() - start
                sequences[name] = rollout.sequences
                if repeat >= 2:
                    seconds[name].append(elapsed)
    every, first = seconds["every step"], seconds["first step"]
    return {"every_ms": 1000 * statistics.median(every), "first_ms": 1000 * statistics.median(first),
            "ratio": statistics.median(f / e for f, e in zip(first, every)),
            "same_tokens": torch.equal(sequences["every step"], sequences["first step"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| preset | guards every step ms | guards first step ms | first / every (median of pairs) | same tokens |")
    print("| --- | ---: | ---: | ---: | --- |")
    for preset in args.presets:
        row = measure(preset, args.repeats)
        print(f"| {preset} | {row['every_ms']:.1f} | {row['first_ms']:.1f} | {row['ratio']:.3f} | "
              f"{'yes' if row['same_tokens'] else 'NO'} |")


if __name__ == "__main__":
    main()
