"""A Trainer run a Lightning user would write, on any placement: fit with validation, a LearningRateMonitor and a
CSV logger, then ``trainer.predict``. Each rank writes what it got to ``--out``. Launched by
tests/test_lightning_native.py; Lightning starts the other ranks itself."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from helpers import TINY_GPT2
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.demo import build_tokenizer, prompts, val_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pl.seed_everything(0)
    tokenizer = build_tokenizer()
    module = RLHFModule(
        actor={"config": TINY_GPT2}, tokenizer=tokenizer, reward_fn="lightning_app_rlhf.demo.topic_reward",
        generation=GenerationConfig(max_new_tokens=8), ppo=PPOConfig(num_minibatches=2),
        actor_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        actor_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
    )
    data = PromptDataModule(prompts(16), tokenizer, batch_size=8, val_prompts=val_prompts(6),
                            predict_prompts=val_prompts(5))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_steps=4, log_every_n_steps=1,
        logger=CSVLogger(args.out, name="run"), callbacks=[LearningRateMonitor()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, check_val_every_n_epoch=1,
    )
    trainer.fit(module, datamodule=data)
    predictions = trainer.predict(module, datamodule=data)
    rank = trainer.global_rank
    rows = [row for batch in predictions for row in batch]
    (args.out / f"predict_rank{rank}.json").write_text(json.dumps(rows))
    (args.out / f"callbacks_rank{rank}.json").write_text(json.dumps([type(c).__name__ for c in trainer.callbacks]))


if __name__ == "__main__":
    main()
