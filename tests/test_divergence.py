"""The guard against non-finite updates: a NaN or infinite loss or gradient norm skips that optimizer update, and
``ppo.max_consecutive_skipped_updates`` skips in a row stop the run with a ``DivergenceError``."""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import run_ranks
from lightning.pytorch.loggers import CSVLogger

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.engine.update_guard import (
    GRAD_NORM,
    DivergenceError,
    divergence_message,
    first_nonfinite,
    record_update,
)
from lightning_app_rlhf.engine.update_loop import SKIPPED_UPDATES
from lightning_app_rlhf.parallel.placed_roles import PlacedRoles
from lightning_app_rlhf.parallel.wrappers import WRAPPERS, DDPWrapper, is_available
from lightning_app_rlhf.parallel.wrappers.base import SkippedUpdates

NAN, INF = math.nan, math.inf


def _module(tokenizer, config: dict[str, Any], algorithm: str, ppo: PPOConfig, **kwargs: Any) -> RLHFModule:
    pl.seed_everything(0)
    samples = 1 if algorithm == "ppo" else 2
    return RLHFModule(actor={"config": config}, tokenizer=tokenizer, reward_fn=demo.topic_reward, algorithm=algorithm,
                      generation=GenerationConfig(max_new_tokens=8, num_samples=samples), ppo=ppo, **kwargs)


def _fit(
    tmp_path: Path, module: RLHFModule, tokenizer, max_steps: int, callbacks: tuple[pl.Callback, ...] = ()
) -> tuple[list[str], DivergenceError | None]:
    """Fit for ``max_steps`` iterations with a CSV log: the skip warnings it raised, and its divergence error."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(tmp_path, name="run"),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=list(callbacks))
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, PromptDataModule(demo.prompts(16), tokenizer, batch_size=4))
        except DivergenceError as raised:
            error = raised
    return [str(w.message) for w in caught if str(w.message).startswith("Skipped the ")], error


def _skipped_per_iteration(tmp_path: Path) -> list[float]:
    (path,) = tmp_path.rglob("metrics.csv")
    return [float(row[SKIPPED_UPDATES]) for row in csv.DictReader(path.open()) if row.get("reward/mean")]


# ---- a genuine divergence ----


def test_a_diverging_learning_rate_stops_after_exactly_k_skipped_updates(tmp_path, tokenizer, tiny_gpt2_config):
    """AdamW at lr=1e4 blows the actor's weights up within a few iterations, until its gradients are NaN. Every
    such update is skipped (the weights stay finite) and warned about, across iterations, and the third in a row
    stops the run with an error naming the role, the iteration and what was not finite."""
    module = _module(tokenizer, tiny_gpt2_config, "rloo", PPOConfig(num_minibatches=1),
                     actor_optimizer=lambda params: torch.optim.AdamW(params, lr=1e4))
    skips, error = _fit(tmp_path, module, tokenizer, max_steps=12)
    assert error is not None, "the run did not diverge"
    logged = _skipped_per_iteration(tmp_path)  # the iteration that raised is not logged
    first = logged.index(1.0)
    assert logged == [0.0] * first + [1.0, 1.0]  # one skip per iteration (one minibatch), counted across them
    message = str(error)
    assert message.startswith(f"The actor diverged: 3 updates in a row were skipped (ppo.max_consecutive_skipped_"
                              f"updates=3), the last at iteration {first + 2} (epoch 0, minibatch 0), where its ")
    assert "Last finite values: policy loss" in message and "Lower the actor's learning rate" in message
    assert [s.split(":")[0] for s in skips] == [f"Skipped the actor's update at iteration {i} (epoch 0, minibatch 0)"
                                               for i in range(first, first + 3)]
    assert all(torch.isfinite(p).all() for p in module.actor.parameters())  # it never stepped on NaN


# ---- one bad minibatch ----


def test_a_single_nan_loss_minibatch_is_skipped_and_training_continues(tmp_path, tokenizer, tiny_gpt2_config):
    """The actor's loss is NaN on one minibatch (iteration 1, minibatch 1 of 2): that update leaves the weights and
    the optimizer state exactly as they were, the next one steps, and only that iteration logs a skipped update."""
    module = _module(tokenizer, tiny_gpt2_config, "ppo", PPOConfig(num_minibatches=2))
    loss = module.algorithm.policy_loss
    actor_calls, poisoned_call = [0], 4  # iteration 1, minibatch 1
    before: dict[str, Any] = {}
    after: list[dict[str, Any]] = []

    def snapshot() -> dict[str, Any]:
        optimizer = module.placed_roles.wrappers["actor"].optimizer
        return {"weights": [p.detach().clone() for p in module.actor.parameters()],
                "optimizer": copy.deepcopy(optimizer.state_dict())}

    def nan_once(logprobs, entropy, batch, scale):  # the actor's loss only: the critic's is value_loss
        total, stats = loss(logprobs, entropy, batch, scale)
        actor_calls[0] += 1
        if actor_calls[0] == poisoned_call:
            before.update(snapshot())
            return total * NAN, {**stats, "policy/loss": stats["policy/loss"] * NAN}
        return total, stats

    module.algorithm.policy_loss = nan_once

    class CheckStep(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            wrapper = pl_module.placed_roles.wrappers["actor"]
            step = wrapper.step

            def checked(skip: bool = False):
                result = step(skip)
                if before and not after:
                    after.append({**snapshot(), "result": result})
                return result

            wrapper.step = checked

    skips, error = _fit(tmp_path, module, tokenizer, max_steps=3, callbacks=(CheckStep(),))
    assert error is None
    (skipped,) = after
    assert skipped["result"].stepped is False and math.isnan(skipped["result"].grad_norm)
    for a, b in zip(before["weights"], skipped["weights"]):
        assert torch.equal(a, b)
    assert _states_equal(before["optimizer"], skipped["optimizer"])
    assert _skipped_per_iteration(tmp_path) == [0.0, 1.0, 0.0]
    (warning,) = skips
    assert warning.startswith("Skipped the actor's update at iteration 1 (epoch 0, minibatch 1): its policy loss is "
                              "nan.")
    assert module.placed_roles.wrappers["actor"].skipped.in_a_row == 0  # reset by the next update, which stepped
    assert module.placed_roles.wrappers["actor"].optimizer.state_dict()["state"][0]["step"] == 5  # 6 minibatches, 1 skipped


def _states_equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- the decision, by hand ----


def test_the_first_nonfinite_value_names_the_reason():
    assert first_nonfinite({"policy loss": 0.5, "total loss": 0.4, GRAD_NORM: 3.0}) is None
    assert first_nonfinite({"policy loss": NAN, "total loss": NAN, GRAD_NORM: NAN}) == "policy loss"
    assert first_nonfinite({"value loss": 1.0, "total loss": -INF, GRAD_NORM: NAN}) == "total loss"
    assert first_nonfinite({"kl loss": 0.1, "total loss": 0.2, GRAD_NORM: INF}) == GRAD_NORM
    assert first_nonfinite({}) is None


def test_skips_count_in_a_row_until_a_step_resets_them():
    record = SkippedUpdates()
    fine, bad = {"policy loss": 0.25, GRAD_NORM: 2.0}, {"policy loss": NAN, GRAD_NORM: NAN}
    assert not record_update(record, fine, "iteration 0", None, stepped=True, limit=3)
    assert not record_update(record, bad, "iteration 1", "policy loss", stepped=False, limit=3)
    assert not record_update(record, bad, "iteration 2", "policy loss", stepped=False, limit=3)
    assert record.in_a_row == 2
    assert not record_update(record, {"policy loss": 0.5, GRAD_NORM: 4.0}, "iteration 3", None, stepped=True, limit=3)
    assert record.in_a_row == 0 and record.last_step == "iteration 3"
    stops = [record_update(record, {"policy loss": 0.75, GRAD_NORM: INF}, f"iteration {i}", GRAD_NORM, False, 3)
             for i in (4, 5, 6)]
    assert stops == [False, False, True] and record.in_a_row == 3
    assert record.last_finite == {"policy loss": 0.75, GRAD_NORM: 4.0}  # the last finite value of each
    # A non-finite update that a wrapper applied anyway stops at once.
    assert record_update(SkippedUpdates(), bad, "iteration 0", "policy loss", stepped=True, limit=3)


def test_the_error_says_what_diverged_where_and_the_fix():
    record = SkippedUpdates(in_a_row=3, last_finite={"value loss": 0.5, GRAD_NORM: 12.0}, last_step="iteration 4")
    message = divergence_message("critic", "value loss", INF, "iteration 7 (epoch 1, minibatch 0)", record, 3, None)
    assert message == (
        "The critic diverged: 3 updates in a row were skipped (ppo.max_consecutive_skipped_updates=3), the last at "
        "iteration 7 (epoch 1, minibatch 0), where its value loss was inf. Last finite values: value loss 0.5, "
        "gradient norm 12; the last update that stepped was at iteration 4. Lower the critic's learning rate "
        "(critic_optimizer), clip harder (a smaller ppo.max_grad_norm), or check the rewards for huge or non-finite "
        "scores (ppo.reward_clip, ppo.reward_norm).")
    applied = divergence_message("actor", GRAD_NORM, NAN, "iteration 0", SkippedUpdates(), 3, "zero2")
    assert "its wrapper 'zero2' applied that update" in applied and "no update stepped yet" in applied


def test_max_consecutive_skipped_updates_must_be_a_positive_integer():
    assert PPOConfig().max_consecutive_skipped_updates == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"ppo.max_consecutive_skipped_updates must be an integer >= 1"):
            PPOConfig(max_consecutive_skipped_updates=bad)


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_a_wrapper_skips_a_nonfinite_gradient_norm_and_clips_a_finite_one(max_grad_norm):
    """A NaN gradient takes no step (the weights and AdamW's state stay, the gradients are zeroed); a finite one
    steps and reports its norm before clipping, also without clipping."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    wrapper = DDPWrapper(layer, None, 1, 0, torch.device("cpu"))
    wrapper.wrap()
    wrapper.attach_optimizer(torch.optim.AdamW(layer.parameters(), lr=0.1), max_grad_norm)
    (layer(torch.ones(1, 3)) * 100).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm().item()
    result = wrapper.step()
    assert result.stepped and result.grad_norm == pytest.approx(expected)
    weights, state = [p.detach().clone() for p in layer.parameters()], copy.deepcopy(wrapper.optimizer.state_dict())
    (layer(torch.full((1, 3), NAN))).sum().backward()
    result = wrapper.step()
    assert not result.stepped and math.isnan(result.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(weights, layer.parameters()))
    assert _states_equal(state, wrapper.optimizer.state_dict())
    assert all(p.grad is None for p in layer.parameters())
    result = wrapper.step(skip=True)  # the group found a non-finite loss: no norm, no step
    assert not result.stepped and _states_equal(state, wrapper.optimizer.state_dict())


# ---- two ranks of one train group ----


def _two_ranks(rank: int, port: int, out: str, wrappers: list[str], tiny_gpt2: dict[str, Any]) -> None:
    """One rank of a 2-rank actor train group: rank 1 alone sees a NaN loss (with finite gradients) on the first of
    two minibatches. Writes what each rank did to ``out/rank{rank}.json``."""
    import torch.distributed as dist

    from lightning_app_rlhf.algorithms import build_algorithm
    from lightning_app_rlhf.engine.engine import RLHFEngine
    from lightning_app_rlhf.models.calls import Experience
    from lightning_app_rlhf.models.roles import as_model_spec, build_causal_lm
    from lightning_app_rlhf.parallel.placement import Placement
    from lightning_app_rlhf.parallel.plan import flattening_plan

    if "deepspeed" in __import__("sys").modules:  # imported by the parent for another device: its CPU one here
        from deepspeed.accelerator import set_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # DeepSpeed reads them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    config, generation = PPOConfig(num_minibatches=2), GenerationConfig(max_new_tokens=4, num_samples=2)
    algorithm = build_algorithm("rloo", config, generation)
    calls = []

    def nan_on_rank_1(logprobs, entropy, batch, scale):
        total, stats = type(algorithm).policy_loss(algorithm, logprobs, entropy, batch, scale)
        calls.append(len(calls))
        if rank == 1 and len(calls) == 1:  # the value only: the gradients stay finite, so only the flag tells
            return total + (NAN - total.detach()), stats
        return total, stats

    algorithm.policy_loss = nan_on_rank_1
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(3, 512, (8, 10), generator=generator)
    experience = Experience(sequences, torch.ones_like(sequences), torch.ones(8, 4, dtype=torch.long),
                            torch.zeros(8, 4), None, torch.randn(8, 4, generator=generator), None, prompt_length=6,
                            iteration=0)
    results = {}
    for name in wrappers:
        plan = flattening_plan(2, wrapper=name, roles=algorithm.roles)
        group = dist.new_group([0, 1])
        placement = Placement(plan, rank, torch.device("cpu"), {call: group for call in plan.calls})
        actor = build_causal_lm(as_model_spec({"config": tiny_gpt2}))
        initial = [p.detach().clone() for p in actor.parameters()]
        wrapper = WRAPPERS[name](actor, group, 2, rank, torch.device("cpu"))
        wrapper.wrap()
        wrapper.attach_optimizer(torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-3), 1.0)
        engine = RLHFEngine(PlacedRoles(placement, {"actor": wrapper}), algorithm, generation, config, None, None,
                            lambda role: None, None, seed=0)
        calls.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = engine.updates.broadcast_stats("actor", engine.updates.update("actor", experience, wrapper))
        trained = torch.cat([p.detach().flatten().clone() for bucket in wrapper.full_parameter_buckets()
                             for p in bucket])
        results[name] = {
            "skipped": float(stats[SKIPPED_UPDATES]), "in_a_row": wrapper.skipped.in_a_row,
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("Skipped")],
            "moved": not torch.equal(trained, torch.cat([p.flatten() for p in initial])),
            "checksum": trained.sum().item(),
        }
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def test_a_nan_loss_on_one_rank_makes_every_rank_of_the_group_skip(tmp_path, tiny_gpt2_config):
    """Rank 1's loss alone is NaN on the first minibatch, with finite gradients: both ranks skip that update (one
    warning, from the group's first rank) and step on the second, so they stay in sync, under DDP and FSDP2 (and
    ZeRO 1-3 when DeepSpeed is installed: their backward turns the NaN loss into NaN gradients, which DeepSpeed
    skips). Every wrapper ends at the same weights: none of them touched the optimizer state on the skip."""
    wrappers = [name for name in WRAPPERS if is_available(name)]
    run_ranks(_two_ranks, 2, str(tmp_path), wrappers, tiny_gpt2_config, timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in wrappers:
        mine, theirs = ranks[0][name], ranks[1][name]
        assert mine["skipped"] == theirs["skipped"] == 1.0, name
        assert mine["moved"] and theirs["moved"], name  # the second minibatch stepped
        assert mine["in_a_row"] == theirs["in_a_row"] == 0, name
        assert mine["checksum"] == theirs["checksum"] == ranks[0]["ddp"]["checksum"], name  # full parameters
        (warning,) = mine["warnings"]  # one per group, from its first rank
        assert warning.startswith("Skipped the actor's update at iteration 0 (epoch 0, minibatch 0): its total loss "
                                  "is nan.") and not theirs["warnings"], name
