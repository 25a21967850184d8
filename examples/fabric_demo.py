"""The demo task under Lightning Fabric with a placement strategy.

    python examples/fabric_demo.py --strategy rlhf_interleaving --devices 4 --steps 50

Fabric runs the same RLHFModule as the Trainer: `fabric.strategy.setup_rlhf` builds the roles this rank holds
and wraps each trainable role on its own group; one `training_step` is one PPO iteration.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

import lightning_app_rlhf  # noqa: F401  (registers the rlhf_* strategies with Fabric)
from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="rlhf_flattening",
                        choices=["rlhf_flattening", "rlhf_interleaving", "rlhf_separation"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="PPO iterations")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy,
                    loggers=CSVLogger(args.log_dir, name=f"fabric_{args.strategy}"))
    fabric.launch()
    fabric.seed_everything(0)
    tokenizer = demo.build_tokenizer()
    module = RLHFModule(
        actor={"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
                          "n_positions": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}},
        tokenizer=tokenizer,
        reward_fn=demo.topic_reward,
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_coef=0.01),
        actor_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        critic_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    module = fabric.strategy.setup_rlhf(fabric, module)
    data = PromptDataModule(demo.prompts(), tokenizer, batch_size=32)
    data.setup("fit")
    rewards = []
    while module.iteration < args.steps:
        for batch in data.train_dataloader():  # every rank reads the same global batch
            module.training_step(fabric.to_device(batch), module.iteration)
            rewards.append(float(fabric.logger.experiment.metrics[-1]["reward/mean"]) if fabric.is_global_zero else 0.0)
            if module.iteration >= args.steps:
                break
    fabric.logger.finalize("success")
    if fabric.is_global_zero:
        window = min(10, len(rewards) // 2 or 1)
        start, end = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        print(f"{args.strategy} on {args.devices} processes, {module.iteration} PPO iterations: "
              f"reward/mean {start:.3f} -> {end:.3f} (means of first/last {window})")


if __name__ == "__main__":
    main()
