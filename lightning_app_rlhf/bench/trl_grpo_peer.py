"""The GRPO peer: TRL 1.16.0's ``GRPOTrainer`` on the same policy, prompts, reward and settings.

Run as ``python -m lightning_app_rlhf.bench.trl_grpo_peer SETTINGS_JSON OUT_JSON`` with the interpreter of the peer's
own environment (:func:`lightning_app_rlhf.bench.peer_env.peer_python` with
:data:`~lightning_app_rlhf.bench.peer_env.GRPO_PEER`: TRL 1.16 cannot share the main environment's TRL 1.12) and
``PYTHONPATH`` set to the repository root: our package is not installed there, and everything it imports here
(``demo``, ``bench.presets``, ``bench.timer``, ``bench.trl_peer`` and the package's ``__init__``) is in that
environment.

``SETTINGS_JSON`` is a :class:`RunSettings` dict with ``algorithm: grpo``: its ``num_samples`` is TRL's
``num_generations`` (G) and its ``beta`` TRL's (0: TRL builds no reference model).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_app_rlhf.bench.presets import RunSettings
from lightning_app_rlhf.bench.timer import peak_memory
from lightning_app_rlhf.bench.trl_peer import _IterationTimer
from lightning_app_rlhf.demo import build_tokenizer, prompts, topic_reward

TRL_VERSION = "1.16.0"


def parse_settings(raw: dict[str, Any]) -> RunSettings:
    """The settings JSON as :class:`RunSettings`, checked for what this peer runs."""
    settings = RunSettings(**raw)
    if settings.algorithm != "grpo":
        raise ValueError(f"The GRPO peer runs algorithm 'grpo'; the settings ask for {settings.algorithm!r}.")
    if settings.ppo_epochs != 1 or settings.num_minibatches != 1:
        raise ValueError(f"The GRPO peer makes one update per batch (num_iterations=1, one minibatch); got "
                         f"ppo_epochs={settings.ppo_epochs}, num_minibatches={settings.num_minibatches}.")
    return settings


def run_trl_grpo(settings: RunSettings, out_path: Path, profile_path: Path | None = None) -> None:
    """Train ``settings.warmup + settings.iterations`` GRPO steps; write per-step wall and generation seconds. With
    ``profile_path``: also torch.profiler's op table of the first measured step (generation included), as
    :func:`~lightning_app_rlhf.bench.profile.profile_iteration` gives ours."""
    num_generations, beta = settings.num_samples, settings.beta
    import datasets
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(
            f"The GRPO peer is TRL {TRL_VERSION}; found {trl.__version__} in {sys.executable}. Run it with the peer "
            f"environment's python: `python -m lightning_app_rlhf.bench.peer_env` builds it and prints its path."
        )
    torch.set_num_threads(settings.threads)
    tokenizer = build_tokenizer()
    dataset = datasets.Dataset.from_dict({"prompt": prompts()})
    policy = peer_policy(settings)
    completions_per_step = settings.completions
    steps = settings.warmup + settings.iterations
    timer = _IterationTimer()
    generated: list[int] = []

    with tempfile.TemporaryDirectory() as output_dir:
        if beta != 0.0:
            # TRL builds its reference with from_pretrained(policy.config._name_or_path), which is empty for a model
            # made from a config: save the initial policy and point there, so the reference has its weights.
            initial = Path(output_dir) / "initial_policy"
            policy.save_pretrained(initial)
            policy.config._name_or_path = str(initial)
        # TRL counts completions, not prompts: per_device_train_batch_size is completions per micro-batch and
        # generation_batch_size (= per_device_train_batch_size * processes * steps_per_generation) completions per
        # generation. batch_size * G completions per micro-batch, one micro-batch per optimizer step
        # (gradient_accumulation_steps=1) and one step per generation (steps_per_generation=1): each optimizer
        # step generates and consumes exactly batch_size prompts x G completions, as our iteration does. With
        # num_iterations=1 too, TRL skips the extra "old log-probs" forward (the ratio is 1 on the one update).
        args = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=completions_per_step, gradient_accumulation_steps=1,
            steps_per_generation=1, num_generations=num_generations, num_iterations=1, max_steps=steps,
            max_completion_length=settings.new_tokens, temperature=1.0, beta=beta, learning_rate=1e-5,
            use_cpu=not torch.cuda.is_available(), bf16=settings.precision == "bf16-mixed", fp16=False,
            # TRL 1.16 turns activation (gradient) checkpointing on by default; neither we nor the PPO peer
            # recompute activations. transformers 5.24's name for it (``gradient_checkpointing`` is deprecated).
            activation_checkpointing=False,
            # As ours and TRL's PPOTrainer: dropout off (GPT-2 configs default to 0.1), same function at both ends.
            disable_dropout=True,
            use_vllm=False, report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
            dataloader_num_workers=0,
        )
        profiler = _StepProfiler(settings.warmup, profile_path) if profile_path is not None else None
        trainer = GRPOTrainer(model=policy, reward_funcs=demo_reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer, *([profiler] if profiler else [])])
        generate = trainer._generate_single_turn  # the sampling itself, as trl_peer times batch_generation

        def timed_generation(prompt_ids: list[list[int]], *rest: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = generate(prompt_ids, *rest, **kwargs)
            timer.generation_s.append(time.perf_counter() - start)
            generated.append(len(result[0]))
            return result

        trainer._generate_single_turn = timed_generation
        trainer.train()

    if len(timer.wall_s) != steps or len(timer.generation_s) != steps or set(generated) != {completions_per_step}:
        raise RuntimeError(f"Expected {steps} steps of one generation of {completions_per_step} completions each; "
                           f"timed {len(timer.wall_s)} steps and {len(timer.generation_s)} generations of {generated}.")
    iterations = [{"wall_s": wall, "time/generate_s": gen} for wall, gen in zip(timer.wall_s, timer.generation_s)]
    record = {"rank": 0, "iterations": iterations, **peak_memory(),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__},
              "completions_per_step": completions_per_step, "num_generations": num_generations, "beta": beta}
    out_path.write_text(json.dumps(record))


def peer_policy(settings: RunSettings) -> torch.nn.Module:
    """The policy as :func:`~lightning_app_rlhf.bench.trl_peer.peer_models` builds it: a stock ``transformers``
    causal LM from the preset's config, seed 0 (the same weights as our actor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = settings.model_config()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)


def demo_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """:func:`lightning_app_rlhf.demo.topic_reward` in TRL's reward-function signature (text prompts and
    completions; TRL's other keyword arguments are ignored)."""
    return topic_reward(prompts, completions)


class _StepProfiler(_IterationTimer):
    """torch.profiler around one optimizer step (``step``, 0-based), written as ``{"step": summary}``."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__()
        self.step, self.path, self._profile, self._start = step, path, None, 0.0

    def on_step_begin(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU])
            self._profile.__enter__()
            self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        if self._profile is None:
            return
        wall = time.perf_counter() - self._start
        self._profile.__exit__(None, None, None)
        from lightning_app_rlhf.bench.profile import summarize_ops

        summary = summarize_ops(self._profile.key_averages(), wall)
        self.path.write_text(json.dumps({"step": summary}))
        self._profile = None


def main(argv: list[str]) -> None:
    """``SETTINGS_JSON OUT_JSON [PROFILE_JSON]``: run the peer and write its record (and a step's profile)."""
    if len(argv) not in (2, 3):
        raise SystemExit("usage: python -m lightning_app_rlhf.bench.trl_grpo_peer SETTINGS_JSON OUT_JSON "
                         "[PROFILE_JSON]")
    run_trl_grpo(parse_settings(json.loads(argv[0])), Path(argv[1]), Path(argv[2]) if len(argv) == 3 else None)


if __name__ == "__main__":
    main(sys.argv[1:])
