"""``ppo.padding_free`` against the padded forwards: one training step of the actor (forward, log-probabilities,
backward, AdamW) and one reference scoring forward, on the benchmark's presets, for two shapes of batch.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/padding_free.py --presets tiny small

Each batch is 32 rows: prompts of 5 to 14 tokens (left-padded to 14), responses of up to 32 tokens (right-padded).

- ``uneven``: response lengths drawn from a geometric distribution (mean about 8), one row of the full 32: a group of
  completions where most end early, the case packing is for;
- ``full``: every response 32 tokens (the random-init presets of ``bench grpo``, whose responses rarely end before
  ``max_new_tokens``): nothing to remove but the prompts' left padding.

Prints a markdown table of median milliseconds over ``--repeats`` timed steps (after 3 warm-up steps) and the packed
shape ("not packed": the batch keeps its padded forward, ``PACKING_PAYS_BELOW``); also checks that the two
give the same log-probabilities (within 1e-4).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from lightning_app_rlhf.bench.presets import MODEL_PRESETS, SPECIAL_TOKENS
from lightning_app_rlhf.models.calls import Experience, Rollout, policy_logprobs, reference_forward
from lightning_app_rlhf.models.packing import pack_rows
from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm

ROWS, PROMPT, RESPONSE = 32, 14, 32


def batch(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, PROMPT + 1, (ROWS,), generator=generator)
    if kind == "uneven":
        uniforms = torch.rand(ROWS, generator=generator)
        responses = (torch.log1p(-uniforms) / torch.log1p(torch.tensor(-0.12))).long().clamp(0, RESPONSE - 1) + 1
        responses[0] = RESPONSE
    else:
        responses = torch.full((ROWS,), RESPONSE)
    sequences = torch.randint(3, 512, (ROWS, PROMPT + RESPONSE), generator=generator)
    mask = torch.zeros_like(sequences)
    for row in range(ROWS):
        mask[row, PROMPT - prompts[row] : PROMPT + responses[row]] = 1
    return sequences * mask, mask


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, experience: Experience,
               padding_free: bool) -> None:
    """The actor's update on one batch: log-probabilities, a mean-over-valid-tokens loss, backward, AdamW."""
    valid = experience.response_mask.bool()
    logprobs, _ = policy_logprobs(model, experience, 1.0, entropy_grad=False, padding_free=padding_free)
    (-(logprobs * valid).sum() / valid.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def median_ms(step: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| preset | batch | real tokens / padded | packed rows x length | step padded ms | step padding-free ms "
          "| speed-up | reference padded ms | reference padding-free ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for preset in args.presets:
        config = {**MODEL_PRESETS[preset], "n_positions": 128 + RESPONSE, **SPECIAL_TOKENS}
        model = build_causal_lm(ModelSpec(config=config, init_seed=0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for kind in ("uneven", "full"):
            sequences, mask = batch(kind)
            zeros = torch.zeros(ROWS, RESPONSE)
            experience = Experience(sequences=sequences, attention_mask=mask, response_mask=mask[:, PROMPT:],
                                    logprobs=zeros, values=None, advantages=zeros, returns=None,
                                    prompt_length=PROMPT, iteration=0)
            rollout = Rollout(sequences, mask, mask[:, PROMPT:], zeros, PROMPT)
            valid = mask[:, PROMPT:].bool()

            with torch.no_grad():
                padded_lp = policy_logprobs(model, experience, 1.0, padding_free=False)[0]
                free_lp = policy_logprobs(model, experience, 1.0, padding_free=True)[0]
            assert torch.allclose(padded_lp * valid, free_lp * valid, atol=1e-4), "padding-free changed the numbers"
            step = {free: median_ms(functools.partial(train_step, model, optimizer, experience, free), args.repeats)
                    for free in (False, True)}
            scoring = {free: median_ms(functools.partial(reference_forward, model, rollout, 1.0, padding_free=free),
                                       args.repeats) for free in (False, True)}
            packed = pack_rows(sequences, mask, PROMPT)
            layout = "not packed" if packed is None else "{} x {}".format(*packed.input_ids.shape)
            print(f"| {preset} | {kind} | {int(mask.sum())} / {mask.numel()} | {layout} | {step[False]:.1f} "
                  f"| {step[True]:.1f} | {step[False] / step[True]:.2f}x | {scoring[False]:.1f} "
                  f"| {scoring[True]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
