"""The demo task under Lightning Fabric with a placement strategy.

    python examples/fabric_demo.py --strategy rlhf_interleaving --devices 4 --steps 50 --save last.ckpt
    python examples/fabric_demo.py --strategy rlhf_interleaving --devices 4 --steps 80 --resume last.ckpt

Fabric runs the same RLHFModule as the Trainer: `fabric.strategy.setup_rlhf` builds the roles this rank holds
and wraps each trainable role on its own group; one `training_step` is one PPO iteration.
`fabric.save(path, {"model": module})` writes what a Trainer checkpoint holds (every role's weights, optimizer and
scheduler state, taken from the ranks that hold them, and the iteration); `fabric.load` resumes from it.
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
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per iteration")
    parser.add_argument("--log-dir", default="runs")
    parser.add_argument("--flush-logs-every", type=int, default=100,
                        help="write the CSV log to disk every this many iterations (and at the end)")
    parser.add_argument("--save", help="write a checkpoint here after the last iteration")
    parser.add_argument("--resume", help="continue from this checkpoint (saved with the same --strategy, --devices)")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy,
                    loggers=CSVLogger(args.log_dir, name=f"fabric_{args.strategy}",
                                      flush_logs_every_n_steps=args.flush_logs_every))
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
    if args.resume:
        fabric.load(args.resume, {"model": module})
    data = PromptDataModule(demo.prompts(), tokenizer, batch_size=args.batch_size)
    data.setup("fit")
    loader = data.train_dataloader()
    loader.sampler.start_batch = module.iteration  # a resumed run reads the prompts the saved run would have read
    rewards = []
    while module.iteration < args.steps:
        for batch in loader:  # every rank reads the same global batch; each pass is the next epoch
            module.training_step(fabric.to_device(batch), module.iteration)
            # The iteration's raw scores, which every rank holds (reward/mean as logged). Not the CSV logger's
            # list of metrics: it empties that list each time it writes to disk (every 100 steps).
            scores = [row["reward"] for row in module.latest_completions()]
            rewards.append(sum(scores) / len(scores))
            if module.iteration >= args.steps:
                break
    if args.save:
        fabric.save(args.save, {"model": module})
    fabric.logger.finalize("success")
    if fabric.is_global_zero:
        window = min(10, len(rewards) // 2 or 1)
        start, end = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
        print(f"{args.strategy} on {args.devices} processes, {module.iteration} PPO iterations: "
              f"reward/mean {start:.3f} -> {end:.3f} (means of first/last {window})")


if __name__ == "__main__":
    main()
