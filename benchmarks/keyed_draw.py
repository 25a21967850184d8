"""One eager CPU step's keyed draw: the sum tree that ``next_token`` descends now against the exponential race it
replaced.

    PYTHONPATH=$PWD python benchmarks/keyed_draw.py                    # B 32 and 64, V 49152, 1 and 2 threads
    PYTHONPATH=$PWD python benchmarks/keyed_draw.py --vocab 8192       # bench grpo's ``small`` preset

Both draws take the same [B, V] float32 log-probabilities (random logits, spread like a language model's) and the
rows' keyed seeds at one response column: ``race`` is ``keyed_uniforms`` for every token (B x V int64 hashes) and
``exponential_race`` (two logarithms and an argmax), ``tree`` is ``keyed_uniforms`` for the ``ceil(log2 V)`` levels
and ``sum_tree_draw`` (one exponential pass, the pairwise sums, the descent). ``log_softmax`` is the pass every
sampled step makes before either, for scale. The three take turns call by call; the table gives the median
milliseconds per call (a busy machine moves all three alike). Not a test: it only checks that the tree's tokens of
the batch are those of each row alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_app_rlhf.generation.sampling import (
    exponential_race,
    keyed_seeds,
    keyed_uniforms,
    sum_tree_draw,
    tree_depth,
)


def measure(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(rows)
    logits = 3.0 * torch.randn(rows, vocab, generator=generator)
    log_probs = F.log_softmax(logits, dim=-1)
    seeds, column = keyed_seeds(torch.arange(rows)), torch.tensor([7])
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "log_softmax": lambda: F.log_softmax(logits, dim=-1),
        "race": lambda: exponential_race(log_probs, keyed_uniforms(seeds, column, vocab)),
        "tree": lambda: sum_tree_draw(log_probs, keyed_uniforms(seeds, column, tree_depth(vocab))),
    }
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(repeats + 3):  # three rounds of warm-up
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if repeat >= 3:
                seconds[name].append(elapsed)
    tokens = calls["tree"]()
    uniforms = keyed_uniforms(seeds, column, tree_depth(vocab))
    alone = torch.cat([sum_tree_draw(log_probs[row : row + 1], uniforms[row : row + 1]) for row in range(rows)])
    if not torch.equal(tokens, alone):
        raise AssertionError("the tree's tokens of the batch differ from those of its rows alone")
    return {name: 1000 * statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"V = {args.vocab}, median ms per call over {args.repeats} rounds")
    print("| threads | B | log_softmax | race | tree | race / tree |")
    print("|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            ms = measure(rows, args.vocab, args.repeats)
            print(f"| {threads} | {rows} | {ms['log_softmax']:.2f} | {ms['race']:.1f} | {ms['tree']:.2f} | "
                  f"{ms['race'] / ms['tree']:.0f}x |")


if __name__ == "__main__":
    main()
