"""The peer: TRL 1.12.0's ``trl.experimental.ppo.PPOTrainer`` on the same models, prompts and settings.

Run as ``python -m lightning_app_rlhf.bench.trl_peer SETTINGS_JSON OUT_JSON`` (the harness does this in a fresh
process). TRL is not a dependency of the package: the harness's set-up installs the ``bench`` extra.
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
from lightning_app_rlhf.bench.turns import TurnClient
from lightning_app_rlhf.demo import build_tokenizer, prompts

TRL_VERSION = "1.12.0"


def run_trl(settings: RunSettings, out_path: Path) -> None:
    import datasets
    import transformers
    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"The peer is TRL {TRL_VERSION} (the last with PPO); found {trl.__version__}. "
                           f"Install it with `pip install trl=={TRL_VERSION}` or `pip install -e '.[bench]'`.")
    torch.set_num_threads(settings.threads)
    tokenizer = build_tokenizer()
    rows = [tokenizer(p)["input_ids"] for p in prompts()]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})
    policy, reference, value_model, reward_model = peer_models(settings, tokenizer.pad_token_id)

    timer = _IterationTimer()
    generate = ppo_trainer.batch_generation

    def timed_generation(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = generate(*args, **kwargs)
        timer.generation_s.append(time.perf_counter() - start)
        return result

    ppo_trainer.batch_generation = timed_generation
    steps = settings.warmup + settings.iterations
    with tempfile.TemporaryDirectory() as output_dir:
        args = PPOConfig(
            output_dir=output_dir, per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=1,
            num_mini_batches=settings.num_minibatches, num_ppo_epochs=settings.ppo_epochs,
            response_length=settings.new_tokens, local_rollout_forward_batch_size=settings.batch_size,
            total_episodes=settings.batch_size * steps, stop_token="eos", temperature=1.0, kl_coef=0.05,
            learning_rate=1e-5, use_cpu=not torch.cuda.is_available(), bf16=settings.precision == "bf16-mixed",
            fp16=False, report_to="none", save_strategy="no",
            logging_steps=1, num_sample_generations=0, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=reference,
                             reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                             eval_dataset=dataset.select(range(8)), callbacks=[timer])
        trainer.train()
    iterations = [{"wall_s": wall, "time/generate_s": gen} for wall, gen in zip(timer.wall_s, timer.generation_s)]
    record = {"rank": 0, "iterations": iterations, **peak_memory(),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__}}
    out_path.write_text(json.dumps(record))


def peer_models(settings: RunSettings, pad_token_id: int) -> tuple[torch.nn.Module, ...]:
    """Policy, reference, value model and reward model as a TRL user builds them: stock ``transformers`` classes
    (GPT-2's own ``gelu_new``), with the weights of our roles (same configs, same seeds)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    def build(auto_class: Any, seed: int, **overrides: Any) -> torch.nn.Module:
        fields = {**settings.model_config(), **overrides}
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return auto_class.from_config(config)

    reward = build(AutoModelForSequenceClassification, 1, num_labels=1, pad_token_id=pad_token_id)
    # TRL's critic is a one-label sequence classifier that it trains; TRL wants a separate reference object.
    value = build(AutoModelForSequenceClassification, 0, num_labels=1, pad_token_id=pad_token_id)
    return build(AutoModelForCausalLM, 0), build(AutoModelForCausalLM, 0), value, reward.requires_grad_(False)


class _IterationTimer:
    """A ``transformers.TrainerCallback``-shaped timer: wall seconds between successive PPO updates. Started by the
    bench's turn server (:func:`~lightning_app_rlhf.bench.turns.run_in_turns`), it runs each update only in its
    turn, and the wait for a turn is not counted (as :class:`~lightning_app_rlhf.bench.timer.IterationTimer`)."""

    def __init__(self) -> None:
        self.wall_s: list[float] = []
        self.generation_s: list[float] = []
        self._last = 0.0
        self._turns: TurnClient | None = None

    def __getattr__(self, name: str) -> Any:  # every other TrainerCallback event: do nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self._turns = TurnClient.from_env()
        if self._turns is not None and not self._turns.wait():
            raise RuntimeError("The bench's turn server ended the run before the peer's first step.")
        self._last = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        self.wall_s.append(now - self._last)
        if self._turns is not None:
            self._turns.done()
            self._turns.wait()  # False after the last step (the harness checks the peer's step count)
            now = time.perf_counter()
        self._last = now


if __name__ == "__main__":
    run_trl(RunSettings(**json.loads(sys.argv[1])), Path(sys.argv[2]))
