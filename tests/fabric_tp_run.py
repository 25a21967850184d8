"""Fabric on 4 processes with a Llama-style actor: ``tp`` runs generation and the critic's forward on TP=2 copies,
``flat`` is Flattening. Prints rank 0's metrics of 3 iterations (``ROWS <json>``). Run by
tests/test_tensor_parallel.py: python fabric_tp_run.py {tp,flat} LOG_DIR"""
import json
import sys

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan
from lightning_app_rlhf.strategies import FabricPlacementStrategy

tp = sys.argv[1] == "tp"
base = flattening_plan(4)
plan = PlacementPlan(4, base.calls, dict(base.wrappers), name="tp" if tp else "flat",
                     tp={"actor.generate": 2, "critic.forward": 2} if tp else {})
fabric = Fabric(accelerator="cpu", devices=4, strategy=FabricPlacementStrategy(plan=plan),
                loggers=CSVLogger(sys.argv[2], name=sys.argv[1]))
fabric.launch()
fabric.seed_everything(0)
tokenizer = demo.build_tokenizer()
llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
module = RLHFModule(actor={"config": llama}, tokenizer=tokenizer, reward_fn=demo.topic_reward,
                    generation=GenerationConfig(max_new_tokens=12), ppo=PPOConfig(kl_coef=0.01),
                    actor_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                    critic_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
module = fabric.strategy.setup_rlhf(fabric, module)
data = PromptDataModule(demo.prompts(), tokenizer, batch_size=16)
data.setup("fit")
rows = []
for batch in data.train_dataloader():
    module.training_step(fabric.to_device(batch), module.iteration)
    if fabric.is_global_zero:
        m = fabric.logger.experiment.metrics[-1]
        rows.append({k: float(m[k]) for k in ("reward/mean", "kl/mean", "policy/loss", "value/loss") if k in m})
    if module.iteration >= 3:
        break
if fabric.is_global_zero:
    print("ROWS", json.dumps(rows))
